"""The EAGLE-3 draft network (Li et al. 2025): the target's features from three depths, one decoder layer, its own
output layer over a reduced vocabulary.

Inputs per position t: the target's outputs of decoder layers 2, N/2 and N-3 (specdec_tools/train/depth_features.py)
fused by `fc` (3H -> H), and the embedding of token t+1. The layer's attention reads both, concatenated (2H), and its
residual stream starts from the fused features; its output, normed, gives the logits of the draft for token t+2 over
the reduced vocabulary. Drafting deeper feeds the layer's own output back in place of the fused features, with the
token drafted from it: the k-th draft after position t sits at rotary position t + k.

Training-time test (`ttt_step`): step 0 runs every position's pair causally; step k feeds each position's step k-1
output with the token k places further on, and its query attends the real pairs up to its position plus its own
chain's earlier steps (a diagonal per step). So step k at position t computes what the drafter computes when it
drafts k tokens after a real prefix ending at t (tests/test_eagle3.py checks it).

The embedding is the target's own, frozen and never saved. The output layer starts as the target's rows for the
reduced vocabulary, its norm as a new one, and both are trained; or (`frozen_head`) both are the target's (its rows
and its final norm), kept, never saved, and rebuilt from the target on load.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from transformers import DynamicCache

from .artifacts import EAGLE3, load_artifact
from .eagle_net import CachedDraftLayer
from .quant import quantize_linears
from .runner import BatchCache
from .vocab import ReducedVocab


def feature_layers(num_layers: int) -> tuple[int, int, int]:
    """The target's hidden states EAGLE-3 reads (index i: decoder layer i's output, counted from 1): low, middle
    and high, layers 2, N/2 and N-3 of N as SpecForge takes them (a two-layer test model: 2, 1 and 1)."""
    return min(2, num_layers), max(num_layers // 2, 1), max(num_layers - 3, 1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [B, heads, T, d] with cos, sin [B, T, d] (halves rotated, as Llama and Qwen do)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class Eagle3Net(CachedDraftLayer):
    """fc over three depths' features; one decoder layer reading [token embedding ; features]; norm; output layer.
    Served by the EAGLE drafter (drafters/eagle.py): `feed` takes the target's three depths concatenated [.., 3H]
    and fuses them; `feed_pending` takes the layer's own outputs."""

    HEAD_KEYS = ("lm_head.weight", "norm.weight")  # a frozen output layer's: the target's, never saved

    def __init__(self, target: nn.Module, vocab: ReducedVocab, intermediate_size: int | None = None,
                 frozen_head: bool = False):
        super().__init__()
        config = copy.deepcopy(target.config)
        hidden = config.hidden_size
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.heads
        inner = intermediate_size or config.intermediate_size
        eps = config.rms_norm_eps
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.embed_norm, self.hidden_norm = nn.RMSNorm(hidden, eps=eps), nn.RMSNorm(hidden, eps=eps)
        self.q_proj = nn.Linear(2 * hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.mlp_norm, self.norm = nn.RMSNorm(hidden, eps=eps), nn.RMSNorm(hidden, eps=eps)
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.lm_head = nn.Linear(hidden, vocab.size, bias=False)
        decoder = target.get_decoder()
        with torch.no_grad():
            self.lm_head.weight.copy_(vocab.head(target.get_output_embeddings()).weight.float())
            if frozen_head:
                self.norm.weight.copy_(decoder.norm.weight.float())
        self.frozen_head = frozen_head
        self.lm_head.requires_grad_(not frozen_head)
        self.norm.requires_grad_(not frozen_head)
        self.rotary = type(decoder.rotary_emb)(config=config)
        self._frozen = {"embed": decoder.embed_tokens}  # the target's: out of the module tree, never saved or trained
        self.vocab = vocab
        self.hidden_size, self.intermediate_size = hidden, inner
        self.feature_layers = feature_layers(config.num_hidden_layers)

    def fuse(self, low: torch.Tensor, middle: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        """The fused features [..., H] of the target's three depths [..., H] each."""
        return self.fc(torch.cat([low, middle, high], dim=-1).to(self.dtype))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., V'] over the reduced vocabulary from the layer's output [..., H]."""
        return self.lm_head(self.norm(hidden)).float()

    def full_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's token ids of reduced-vocabulary indices `ids`."""
        return self.vocab.ids.to(ids.device)[ids]

    def keys_values(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries [B, heads, T, d], keys and values [B, kv_heads, T, d] of pairs (hidden [B, T, H],
        tokens [B, T]) at rotary `positions` [B, T]."""
        embeds = self._frozen["embed"](tokens).detach().to(hidden.dtype)  # frozen: no gradient into the target's table
        both = torch.cat([self.embed_norm(embeds), self.hidden_norm(hidden)], dim=-1)
        batch, length = tokens.shape
        q = self.q_proj(both).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(both).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(both).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(hidden, positions)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                kv: DynamicCache | None = None) -> torch.Tensor:
        """The layer's output [B, T, H] for pairs (hidden, tokens) at `positions`, attending `kv`'s keys and values
        then their own, as `mask` [B, T, past + T] (bool: query attends key) allows; the pairs' keys and values
        are appended to `kv`."""
        q, k, v = self.keys_values(hidden, tokens, positions)
        if kv is not None:
            k, v = kv.update(k, v, 0)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
        batch, length = tokens.shape
        out = hidden + self.o_proj(attended.transpose(1, 2).reshape(batch, length, -1))
        normed = self.mlp_norm(out)
        return out + self.down_proj(F.silu(self.gate_proj(normed)) * self.up_proj(normed))

    def feed(self, cache: BatchCache, features: torch.Tensor, tokens: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """CachedDraftLayer.feed over the target's three depths, concatenated (features [B, k, 3H])."""
        return super().feed(cache, self.fuse(*features.chunk(3, dim=-1)), tokens, keep)


def ttt_masks(valid: torch.Tensor, step: int) -> torch.Tensor:
    """[B, T, (step + 1) T]: step `step`'s queries attend the real pairs up to their position (where `valid` [B, T]
    marks real ones) and, per earlier step and their own, the same position only; a padded query sees itself."""
    length = valid.shape[1]
    eye = torch.eye(length, dtype=torch.bool, device=valid.device)
    causal = torch.ones(length, length, dtype=torch.bool, device=valid.device).tril() & valid[:, None, :]
    if step == 0:
        return causal | eye
    return torch.cat([causal, *[eye.expand_as(causal)] * step], dim=2)


def ttt_step(net: Eagle3Net, hidden: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, step: int,
             kv: DynamicCache) -> torch.Tensor:
    """Training-time test's step `step` (module notes): inputs `hidden` [B, T, H] (step 0: the fused features;
    later: the previous step's output) with `tokens` [B, T] (token t+1+step at slot t), attending `kv` (the
    earlier steps' keys and values, to which this step's are appended). Returns the output."""
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens) + step
    return net(hidden, tokens, positions, ttt_masks(valid, step), kv)


def load_eagle3(name_or_path: str | Path, target: nn.Module, target_name: str, precision: str | None,
                dtype: torch.dtype | None = None) -> Eagle3Net:
    """The trained EAGLE-3 drafter `name_or_path` for `target`, in `dtype` (default: the target's), its linear
    layers at `precision` (one of quant.QUANTIZED; None: as trained); MissingArtifactError naming the command that
    trains it."""
    output = target.get_output_embeddings()
    artifact = load_artifact(EAGLE3, name_or_path, target_name, hidden_size=target.config.hidden_size,
                             full_vocab_size=output.out_features, device=str(next(target.parameters()).device))
    if artifact.vocab is None:
        raise ValueError(f"{artifact.directory} has no draft vocabulary: not an EAGLE-3 drafter")
    frozen_head = artifact.meta.get("train", {}).get("frozen_head", False)
    net = Eagle3Net(target, artifact.vocab, artifact.meta["intermediate_size"], frozen_head)
    missing, unexpected = net.load_state_dict(artifact.tensors, strict=False)
    if unexpected or set(missing) != (set(Eagle3Net.HEAD_KEYS) if frozen_head else set()):
        raise ValueError(f"{artifact.directory} does not hold an EAGLE-3 drafter's tensors: missing {missing}, "
                         f"unexpected {unexpected}")
    net = net.to(dtype or next(target.parameters()).dtype).eval().requires_grad_(False)
    # Rotary frequencies in fp32, as trained: rounded to bf16 they drift by 0.5 rad over 400 positions.
    net.rotary = type(net.rotary)(config=target.config).to(net.fc.weight.device)
    if precision is not None:
        quantize_linears(net, precision)
    return net

"""The EAGLE draft network (Li et al. 2024, EAGLE-1/2): it predicts the target's next feature.

A feature is the target's final-normed last hidden state, what its lm_head reads. The draft
reads pairs (feature_t, token_{t+1}): fc([feature_t ; embed(token_{t+1})]) -> H, then one decoder
layer of the target's own architecture (its config with one layer), whose output is its guess
of feature_{t+1}; the target's frozen lm_head turns that into a draft for token_{t+2}. Drafting
deeper feeds the draft's own predicted feature back with the token drafted from it. The pair at
feature index t sits at rotary position t.

The embedding and the lm_head are the target's own, frozen and never saved. The output layer may
be the lm_head's rows for a reduced vocabulary (specdec_core/models/vocab.py): the draft then predicts
only over those ids, and exactness is untouched (the target verifies over all of them).

The network keeps its own `BatchCache` (shared slots, a per-row valid mask), so its rows roll
back exactly as the target's do: the bookkeeping is the cache's own.

Trained weights are an artifact (artifacts.py): ``<cache root>/eagle/<name>/``, ``eagle.safetensors``
(fc, the layer, and ``vocab_ids`` when the vocabulary is reduced) and ``eagle.json`` (architecture
and what it was trained on).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from .artifacts import EAGLE, load_artifact, save_artifact
from .runner import BatchCache, additive_mask
from .vocab import ReducedVocab


class CachedDraftLayer(nn.Module):
    """A draft network of one decoder layer over pairs (feature, token) kept in its own `BatchCache`: EAGLE's and
    EAGLE-3's. A subclass's forward(features, tokens, positions, mask, kv) returns its output [B, k, H], what the
    pairs predict; the cache's keys and values of the pairs are appended to `kv` (a DynamicCache) when given."""

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype: its first float parameter's (a quantized layer keeps integer weights)."""
        return next(p.dtype for p in self.parameters() if p.is_floating_point())

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @torch.no_grad()
    def feed(self, cache: BatchCache, features: torch.Tensor, tokens: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Append pairs [B, k] causally after each row's valid slots and keep those where `keep` [B, k];
        returns the predicted features [B, k, H]. There must be no pending (tree) slots."""
        batch, k = tokens.shape
        device = cache.device
        cache.reserve(batch, 0)
        causal = torch.ones(k, k, dtype=torch.bool, device=device).tril().expand(batch, k, k)
        mask = torch.cat([cache.valid[:, None, :].expand(batch, k, cache.slots), causal], dim=2)
        positions = cache.lengths[:, None] + torch.arange(k, device=device)
        predicted = self(features, tokens, positions, mask, cache.kv)
        cache.valid = torch.cat([cache.valid, torch.zeros(batch, k, dtype=torch.bool, device=device)], dim=1)
        cache.commit(keep)
        return predicted

    @torch.no_grad()
    def feed_pending(
        self, cache: BatchCache, features: torch.Tensor, tokens: torch.Tensor, depth: int, pending_mask: torch.Tensor
    ) -> torch.Tensor:
        """Tree nodes [B, k] at `depth` (1: children of the row's last token) as pending slots after earlier ones:
        each attends its row's valid slots, the pending slots `pending_mask` [B, k, P] allows, and itself.
        Drop them with `cache.drop_pending()`. Returns the predicted features [B, k, H]."""
        batch, k = tokens.shape
        self_mask = torch.eye(k, dtype=torch.bool, device=tokens.device).expand(batch, k, k)
        mask = torch.cat([cache.valid[:, None, :].expand(batch, k, cache.slots), pending_mask, self_mask], dim=2)
        positions = (cache.lengths + depth - 1)[:, None].expand(batch, k)
        return self(features, tokens, positions, mask, cache.kv)


class EagleNet(CachedDraftLayer):
    """fc over [feature ; token embedding], one decoder layer of the target's kind; frozen embed and head."""

    feature_layers = (-1,)  # of the target's hidden states: its final-normed last one

    def __init__(self, target: nn.Module, vocab: ReducedVocab | None = None):
        super().__init__()
        config = copy.deepcopy(target.config)
        config.num_hidden_layers = 1
        config._attn_implementation = "sdpa"
        decoder = target.get_decoder()
        hidden = config.hidden_size
        dtype = next(target.parameters()).dtype
        device = next(target.parameters()).device
        self.fc = nn.Linear(2 * hidden, hidden, bias=True, dtype=dtype, device=device)
        self.layer = type(decoder.layers[0])(config, layer_idx=0).to(dtype=dtype, device=device)
        self.rotary = type(decoder.rotary_emb)(config=config).to(device)
        # Frozen and shared with the target, kept out of the module tree so they are never saved or trained.
        head = target.get_output_embeddings()
        self._frozen = {"embed": decoder.embed_tokens, "head": vocab.head(head) if vocab else head}
        self.vocab = vocab
        self.hidden_size = hidden

    @property
    def embed(self) -> nn.Module:
        return self._frozen["embed"]

    @property
    def head(self) -> nn.Module:
        return self._frozen["head"]

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., V'] from (predicted) features [..., H]; V' is the reduced vocabulary when there is one."""
        return self.head(features).float()

    def full_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids of the output layer's rows `ids`, as the target's vocabulary numbers them."""
        return self.vocab.ids.to(ids.device)[ids] if self.vocab is not None else ids

    def forward(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        kv=None,
    ) -> torch.Tensor:
        """Predicted next features [B, k, H] of pairs (features [B, k, H], tokens [B, k]) at rotary `positions`
        [B, k]; `mask` [B, k, past + k] (bool: query attends key) covers `kv`'s slots then the new pairs,
        whose keys and values are appended to `kv` (a DynamicCache) when one is given."""
        hidden = self.fc(torch.cat([features.to(self.fc.weight.dtype), self.embed(tokens)], dim=-1))
        rotary = self.rotary(hidden, positions)
        return self.layer(
            hidden, attention_mask=additive_mask(mask, hidden.dtype)[:, None], position_ids=positions, cache=kv,
            use_cache=kv is not None, position_embeddings=rotary,
        )

    # -- saving and loading ----------------------------------------------------

    def save(self, directory: str | Path, meta: dict) -> dict:
        """Save what training changes (fc and the layer) and `meta` (plus the architecture) as the artifact
        `directory`; the JSON's dict."""
        tensors = {key: value.detach().contiguous() for key, value in self.state_dict().items()}
        return save_artifact(EAGLE, directory, tensors, {**meta, "hidden_size": self.hidden_size}, self.vocab)


def load_eagle(name_or_path: str | Path, target: nn.Module, target_name: str) -> EagleNet:
    """The trained EAGLE network `name_or_path` for `target`; MissingArtifactError naming the command that trains it."""
    output = target.get_output_embeddings()
    artifact = load_artifact(EAGLE, name_or_path, target_name, hidden_size=target.config.hidden_size,
                             full_vocab_size=output.out_features, device=str(next(target.parameters()).device))
    net = EagleNet(target, artifact.vocab)
    net.load_state_dict(artifact.tensors)
    return net.eval().requires_grad_(False)

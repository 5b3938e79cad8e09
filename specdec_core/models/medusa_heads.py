"""Medusa heads (Cai et al. 2024): K small residual blocks on the target's last hidden state.

`features` are the target's final-normed last hidden states at position t (what its lm_head
consumes): lm_head(features) predicts the token at t+1, and head i (0-based) predicts the token
at t+i+2 through lm_head(heads(features)[..., i, :]). Each head is `num_layers` residual blocks
x + SiLU(Linear(x)) with the Linear zero-initialised, so an untrained head is the identity and
predicts what the target predicts for t+1: training starts from a sensible draft.

The output layer is the target's own frozen lm_head, or its rows for a reduced vocabulary (the
N most frequent tokens, specdec_core/models/vocab.py) to cut the cost of 151k-row products on a CPU.
Only the reduced vocabulary's token ids are stored with the heads; the rows themselves are cut
from the target's lm_head when the heads are loaded.

Trained heads are an artifact (artifacts.py): ``<cache root>/heads/<name>/``, ``heads.safetensors``
(the blocks, plus ``vocab_ids`` when the vocabulary is reduced) and ``heads.json`` (what they were
trained on).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .artifacts import HEADS, load_artifact, save_artifact
from .vocab import ReducedVocab


class ResidualBlock(nn.Module):
    """x + SiLU(Linear(x)), the Linear zero-initialised: the identity until trained."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """K heads of `num_layers` residual blocks each; forward maps features [..., H] to [..., K, H]."""

    def __init__(self, hidden_size: int, num_heads: int, num_layers: int = 1):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_layers = num_layers
        self.heads = nn.ModuleList(
            nn.Sequential(*(ResidualBlock(hidden_size) for _ in range(num_layers))) for _ in range(num_heads)
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Each head's block output, stacked before the hidden dimension: [..., K, H]."""
        return torch.stack([head(features) for head in self.heads], dim=-2)


def output_layer(lm_head: nn.Module, vocab: ReducedVocab | None) -> nn.Module:
    """The heads' output layer: the target's lm_head itself, or a frozen copy of its rows for `vocab`."""
    return vocab.head(lm_head) if vocab is not None else lm_head


def head_logits(heads: MedusaHeads, features: torch.Tensor, output_layer: nn.Module) -> torch.Tensor:
    """Logits [..., K, V_out] of every head at every position of `features` [..., H].

    V_out is the output layer's size: the full vocabulary, or the reduced one (map its argmax /
    top-k ids back with `full_ids`, or its logits with `ReducedVocab.expand`).
    """
    blocks = heads(features.to(_weight_dtype(heads, features.dtype)))
    return output_layer(blocks.to(_weight_dtype(output_layer, features.dtype)))


def full_ids(ids: torch.Tensor, vocab: ReducedVocab | None) -> torch.Tensor:
    """Token ids of the target's vocabulary for output-layer ids `ids` (unchanged without a reduced vocabulary)."""
    return ids if vocab is None else vocab.ids.to(ids.device)[ids]


def _weight_dtype(module: nn.Module, fallback: torch.dtype) -> torch.dtype:
    """The dtype a module's float weights compute in; a quantized layer (packed buffers only) computes in `fallback`."""
    return next((p.dtype for p in module.parameters()), fallback)


def save_heads(heads: MedusaHeads, directory: str | Path, meta: dict, vocab: ReducedVocab | None = None) -> dict:
    """Save the heads (and reduced vocabulary) as the artifact `directory`; the JSON's dict.

    `meta` says what the heads were trained on (target, data, tokens, epochs, per-head agreement,
    time); the architecture (hidden size, heads, layers, vocabulary) is added here.
    """
    tensors = {key: value.detach().float().contiguous() for key, value in heads.state_dict().items()}
    architecture = {"hidden_size": heads.hidden_size, "num_heads": heads.num_heads, "num_layers": heads.num_layers}
    return save_artifact(HEADS, directory, tensors, {**meta, **architecture}, vocab)


def load_heads(
    name_or_path: str | Path, target_name: str, config_path: str | None = None
) -> tuple[MedusaHeads, dict, ReducedVocab | None]:
    """The heads saved under `name_or_path` (a name under the cache root, or a directory) for `target_name`.

    Returns the heads (fp32, eval mode), their ``heads.json`` and their reduced vocabulary (None
    when they predict over the full one). Raises MissingArtifactError, naming the exact training
    command (with `config_path` when given), when the heads are missing or belong to another target.
    """
    artifact = load_artifact(HEADS, name_or_path, target_name, config_path=config_path)
    meta = artifact.meta
    heads = MedusaHeads(meta["hidden_size"], meta["num_heads"], meta["num_layers"])
    heads.load_state_dict(artifact.tensors)
    return heads.eval().requires_grad_(False), meta, artifact.vocab

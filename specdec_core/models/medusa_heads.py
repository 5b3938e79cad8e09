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

Trained heads live in ``<cache root>/heads/<name>/``: ``heads.safetensors`` (the blocks, plus
``vocab_ids`` when the vocabulary is reduced) and ``heads.json`` (what they were trained on).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .paths import cache_dir
from .vocab import ReducedVocab

WEIGHTS_FILE = "heads.safetensors"
META_FILE = "heads.json"
VOCAB_KEY = "vocab_ids"


class MissingHeadsError(FileNotFoundError):
    """Heads a config names have not been trained (or were trained for another target)."""


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


def default_heads_name(target: str) -> str:
    """The name `specdec train medusa` saves heads under when --out is not given."""
    return f"{target}-medusa"


def heads_dir(name_or_path: str | Path) -> Path:
    """An existing directory as given, else ``<cache root>/heads/<name>``."""
    path = Path(name_or_path)
    return path if path.is_dir() else cache_dir() / "heads" / str(name_or_path)


def save_heads(heads: MedusaHeads, directory: str | Path, meta: dict, vocab: ReducedVocab | None = None) -> dict:
    """Write the heads' weights (and reduced vocabulary ids) and ``heads.json`` into `directory`; the JSON's dict.

    `meta` says what the heads were trained on (target, data, tokens, epochs, per-head agreement,
    time); the architecture (hidden size, heads, layers, vocabulary) is added here. The JSON is
    written last, so a directory with it is complete.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {key: value.detach().float().contiguous() for key, value in heads.state_dict().items()}
    if vocab is not None:
        tensors[VOCAB_KEY] = vocab.ids.cpu().contiguous()
    save_file(tensors, str(directory / WEIGHTS_FILE))
    architecture = {
        "hidden_size": heads.hidden_size,
        "num_heads": heads.num_heads,
        "num_layers": heads.num_layers,
        "vocab_size": None if vocab is None else vocab.size,
        "full_vocab_size": None if vocab is None else vocab.full_size,
    }
    meta = {**meta, **architecture}
    (directory / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def train_command(target_name: str, name: str, config_path: str | None = None) -> str:
    """The command that trains heads `name` for `target_name`."""
    config = config_path or f"<a config whose model.target is {target_name}>"
    return f"specdec train medusa --config {config} --out {name}"


def load_heads(
    name_or_path: str | Path, target_name: str, config_path: str | None = None
) -> tuple[MedusaHeads, dict, ReducedVocab | None]:
    """The heads saved under `name_or_path` (a name under the cache root, or a directory) for `target_name`.

    Returns the heads (fp32, eval mode), their ``heads.json`` and their reduced vocabulary (None
    when they predict over the full one). Raises MissingHeadsError, naming the exact training
    command (with `config_path` when given), when the heads are missing or belong to another target.
    """
    directory = heads_dir(name_or_path)
    name = Path(name_or_path).name
    meta_path = directory / META_FILE
    if not meta_path.is_file():
        raise MissingHeadsError(
            f"Medusa heads {str(name_or_path)!r} for {target_name} are not trained (no {meta_path}); "
            f"train them with: {train_command(target_name, name, config_path)}"
        )
    meta = json.loads(meta_path.read_text())
    if meta.get("target") != target_name:
        raise MissingHeadsError(
            f"Medusa heads {str(name_or_path)!r} were trained for {meta.get('target')!r}, not {target_name!r}; "
            f"train heads for it with: {train_command(target_name, name, config_path)}"
        )
    tensors = load_file(str(directory / WEIGHTS_FILE))
    vocab_ids = tensors.pop(VOCAB_KEY, None)
    heads = MedusaHeads(meta["hidden_size"], meta["num_heads"], meta["num_layers"])
    heads.load_state_dict(tensors)
    vocab = None if vocab_ids is None else ReducedVocab(vocab_ids.long(), meta["full_vocab_size"])
    return heads.eval().requires_grad_(False), meta, vocab

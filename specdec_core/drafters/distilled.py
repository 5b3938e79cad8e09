"""Distilled students: a frozen trunk, then a small trained adapter, then a frozen output layer.

Two trunks (`specdec train distill --student ...`, train/distill.py):

- layer-skip:K: the target's first k layers and the target's output layer (`DistilledDrafter`);
- draft-model: the same-family draft model and its own output layer (`DistilledDraftModelDrafter`):
  the draft-model drafter with the adapter in front of its output layer.

For the layer-skip student, the trained piece sits between the k-th layer's final-normed hidden
state z and the output layer:

    adapter(z) = gain * (z + down(SiLU(up(z))))

`down` starts at zero and `gain` at one, so an untrained student is exactly the layer-skip draft
with the same k: distillation (`specdec train distill`, train/distill.py) starts from it and can
only be judged against it. `gain` scales the final norm's weight per channel, so the norm is
trained too. The adapter reads one position at a time and keeps no state, so the frozen layers
still draft from the target's own cache exactly as layer skip does (no second cache, no rollback),
and the draft model keeps its own cache exactly as the draft-model drafter does.

Trained students live in ``<cache root>/students/<name>/``: ``student.safetensors`` (the adapter,
plus ``vocab_ids`` when it predicts over a reduced vocabulary) and ``student.json`` (the trunk, the adapter's
width, and how it was trained). The output layer is never stored: it is the target's (or the draft
model's) own, cut to the reduced vocabulary when there is one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..models.paths import cache_dir
from ..models.runner import ModelRunner
from ..models.vocab import ReducedVocab
from .draft_model import DraftModelDrafter
from .layer_skip import LayerSkipDrafter

WEIGHTS_FILE = "student.safetensors"
META_FILE = "student.json"
VOCAB_KEY = "vocab_ids"


class MissingStudentError(FileNotFoundError):
    """A student a config names has not been trained (or was trained for another target)."""


class Adapter(nn.Module):
    """gain * (z + down(SiLU(up(z)))) on final-normed hidden states [..., H]: the identity until trained."""

    def __init__(self, hidden_size: int, width: int):
        super().__init__()
        self.hidden_size = hidden_size
        self.width = width
        self.up = nn.Linear(hidden_size, width)
        self.down = nn.Linear(width, hidden_size)
        nn.init.zeros_(self.down.weight)
        nn.init.zeros_(self.down.bias)
        self.gain = nn.Parameter(torch.ones(hidden_size))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.gain * (z + self.down(nn.functional.silu(self.up(z))))


class AdaptedOutput(nn.Module):
    """An output layer behind a trained adapter: the adapter runs in float32, as it was trained, the output
    layer in the activations' dtype."""

    def __init__(self, adapter: Adapter, head: nn.Module):
        super().__init__()
        self.adapter = adapter.float().eval().requires_grad_(False)
        self.head = head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.adapter(hidden.float()).to(hidden.dtype))


class DistilledDrafter(LayerSkipDrafter):
    """Layer skip whose k-th layer's output passes through a trained adapter before the output layer."""

    name = "distilled"

    def __init__(self, target: ModelRunner, adapter: Adapter, k: int, vocab: ReducedVocab | None = None,
                 early_exit: float = 0.0):
        super().__init__(target, k, vocab, early_exit)
        self.head = AdaptedOutput(adapter.to(target.device), self.head)


class DistilledDraftModelDrafter(DraftModelDrafter):
    """The draft-model drafter over a draft whose output layer is an `AdaptedOutput`."""

    name = "distilled"


def default_student_name(target: str, draft_model: str | None = None) -> str:
    """The name `specdec train distill` saves a student under when --out is not given."""
    return f"{target}-distilled-draft" if draft_model else f"{target}-distilled"


def student_dir(name_or_path: str | Path) -> Path:
    """An existing directory as given, else ``<cache root>/students/<name>``."""
    path = Path(name_or_path)
    return path if path.is_dir() else cache_dir() / "students" / str(name_or_path)


def save_student(adapter: Adapter, directory: Path, meta: dict, vocab: ReducedVocab | None) -> dict:
    """Write the adapter (and reduced vocabulary ids) and ``student.json``, last, into `directory`; the JSON's dict."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {key: value.detach().float().contiguous() for key, value in adapter.state_dict().items()}
    if vocab is not None:
        tensors[VOCAB_KEY] = vocab.ids.cpu().contiguous()
    save_file(tensors, str(directory / WEIGHTS_FILE))
    meta = {**meta, "hidden_size": adapter.hidden_size, "width": adapter.width,
            "vocab_size": None if vocab is None else vocab.size,
            "full_vocab_size": None if vocab is None else vocab.full_size}
    (directory / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def load_student(name_or_path: str | Path, target_name: str) -> tuple[Adapter, dict, ReducedVocab | None]:
    """The student saved as `name_or_path` for `target_name`: its adapter, ``student.json`` and reduced vocabulary
    (None: the full one). Raises MissingStudentError naming the training command when it is missing or another target's."""
    directory = student_dir(name_or_path)
    name = Path(name_or_path).name
    command = f"specdec train distill --config <a config whose model.target is {target_name}> --out {name}"
    meta_path = directory / META_FILE
    if not meta_path.is_file():
        raise MissingStudentError(f"distilled student {str(name_or_path)!r} for {target_name} is not trained "
                                  f"(no {meta_path}); train it with: {command}")
    meta = json.loads(meta_path.read_text())
    if meta.get("target") != target_name:
        raise MissingStudentError(f"distilled student {str(name_or_path)!r} was trained for {meta.get('target')!r}, "
                                  f"not {target_name!r}; train one for it with: {command}")
    tensors = load_file(str(directory / WEIGHTS_FILE))
    vocab_ids = tensors.pop(VOCAB_KEY, None)
    adapter = Adapter(meta["hidden_size"], meta["width"])
    adapter.load_state_dict(tensors)
    vocab = None if vocab_ids is None else ReducedVocab(vocab_ids.long(), meta["full_vocab_size"])
    return adapter.eval().requires_grad_(False), meta, vocab

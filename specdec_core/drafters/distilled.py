"""Distilled students: a frozen trunk, then a small trained adapter, then a frozen output layer.

Two trunks (`specdec train distill --student ...`, train/distill.py):

- layer-skip:K: the target's first k layers and the target's output layer (`DistilledDrafter`);
- draft-model: the same-family draft model and its own output layer: the draft-model drafter
  (`DraftModelDrafter`) over a draft whose output layer has the adapter in front (`AdaptedOutput`).

For the layer-skip student, the trained piece sits between the k-th layer's final-normed hidden
state z and the output layer:

    adapter(z) = gain * (z + down(SiLU(up(z))))

`down` starts at zero and `gain` at one, so an untrained student is exactly the layer-skip draft
with the same k: distillation (`specdec train distill`, train/distill.py) starts from it and can
only be judged against it. `gain` scales the final norm's weight per channel, so the norm is
trained too. The adapter reads one position at a time and keeps no state, so the frozen layers
still draft from the target's own cache exactly as layer skip does (no second cache, no rollback),
and the draft model keeps its own cache exactly as the draft-model drafter does.

Trained students are an artifact (models/artifacts.py): ``<cache root>/students/<name>/``,
``student.safetensors`` (the adapter, plus ``vocab_ids`` when it predicts over a reduced vocabulary)
and ``student.json`` (the trunk, the adapter's width, and how it was trained). The output layer is
never stored: it is the target's (or the draft model's) own, cut to the reduced vocabulary when
there is one.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..models.artifacts import STUDENT, load_artifact, save_artifact
from ..models.loading import draft_runner, reducible
from ..models.runner import ModelRunner
from ..models.vocab import ReducedVocab
from .base import DrafterBuilder
from .draft_model import DraftModelDrafter
from .layer_skip import LayerSkipDrafter

if TYPE_CHECKING:
    from ..config import Config


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

    def __init__(self, target: ModelRunner, adapter: Adapter, k: int, vocab: ReducedVocab | None = None,
                 early_exit: float = 0.0):
        super().__init__(target, k, vocab, early_exit)
        self.head = AdaptedOutput(adapter.to(target.device), self.head)


def default_student_name(target: str, draft_model: str | None = None) -> str:
    """The name `specdec train distill` saves a student under when --out is not given."""
    name = STUDENT.default_name(target)
    return f"{name}-draft" if draft_model else name


def save_student(adapter: Adapter, directory: str | Path, meta: dict, vocab: ReducedVocab | None) -> dict:
    """Save the adapter (and reduced vocabulary) and `meta` (plus the adapter's shape) as the artifact `directory`;
    the JSON's dict."""
    tensors = {key: value.detach().float().contiguous() for key, value in adapter.state_dict().items()}
    shape = {"hidden_size": adapter.hidden_size, "width": adapter.width}
    return save_artifact(STUDENT, directory, tensors, {**meta, **shape}, vocab)


def load_student(name_or_path: str | Path, target_name: str) -> tuple[Adapter, dict, ReducedVocab | None]:
    """The student saved as `name_or_path` for `target_name`: its adapter, ``student.json`` and reduced vocabulary
    (None: the full one). Raises MissingArtifactError naming the training command when it is missing or another
    target's."""
    artifact = load_artifact(STUDENT, name_or_path, target_name)
    adapter = Adapter(artifact.meta["hidden_size"], artifact.meta["width"])
    adapter.load_state_dict(artifact.tensors)
    return adapter.eval().requires_grad_(False), artifact.meta, artifact.vocab


def from_config(config: Config, target: ModelRunner, build: DrafterBuilder) -> DistilledDrafter | DraftModelDrafter:
    """speculation.distilled's student over `target`, on the trunk it was trained with; one not trained yet raises
    MissingArtifactError, which names the command that trains it."""
    spec = config.speculation
    name = spec.distilled.student or default_student_name(config.model.target)
    adapter, meta, vocab = load_student(name, config.model.target)
    student = meta["student"]
    if student["kind"] == "layer-skip":
        return DistilledDrafter(target, adapter, student["k"], reducible(vocab, target.model), spec.early_exit)
    draft, vocab = draft_runner(config.model, target, student["model"], vocab)
    draft.model.set_output_embeddings(AdaptedOutput(adapter.to(draft.device), draft.model.get_output_embeddings()))
    return DraftModelDrafter(draft, target.vocab_size, vocab, spec.early_exit)

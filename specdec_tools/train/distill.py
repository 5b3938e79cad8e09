"""Knowledge distillation of a student (drafters/distilled.py) toward the frozen target.

Data: the feature cache of train/data.py (never Spec-Bench). The target's distribution at a
position is lm_head(hidden) of the cached final-normed hidden state. The student is a frozen trunk,
a trained adapter, and a frozen output layer; its input at a position is the trunk's final-normed
hidden state there, computed once from the cached tokens and cached next to the features, one file
per feature shard (so an interrupted computation resumes at the shard it was in):

- layer-skip:K: the target's first k layers (the same `forward_layers` pass the drafter runs, so
  training sees exactly what drafting sees) and the target's output layer; ``layers<k>-<shard>``.
- draft-model: the same-family draft model whole, and its own output layer (cut to the reduced
  vocabulary when there is one); ``final-<draft>-<shard>``. Only the adapter is trained: fully
  fine-tuning the 0.5B does not fit this CPU (measured: one AdamW step over 256 positions took
  17.5 s in float32, about 65 min for the 2 epochs over 29k positions that the adapter trains in 4).

Loss: T^2 * KL(p_T || q_T), p_T the target's softmax at temperature T, q_T the student's (Hinton et
al. 2015; T^2 keeps the gradient's scale independent of T). Over the reduced vocabulary when there
is one (both distributions restricted to it). AdamW with a cosine schedule, resumable from the
checkpoint beside the student (train/loop.py, shared with Medusa), epochs over the cached positions.

Held-out report, untrained (plain layer skip with the same k, or the plain draft model) and trained: the KL at T, top-1
agreement with the target's argmax (the greedy acceptance rate of one draft token), and
sum_x min(p(x), q(x)) at temperature 1 (the acceptance rate of one sampled draft token).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from tqdm import tqdm

from specdec_core.drafters.distilled import Adapter, save_student
from specdec_core.models.artifacts import (
    STUDENT,
    artifact_dir,
    checkpoint_path,
    save_tensors,
)
from specdec_core.models.medusa_heads import full_ids, output_layer
from specdec_core.models.runner import ModelRunner
from specdec_core.models.vocab import ReducedVocab

from .data import Features
from .loop import fit
from .settings import DistillSettings

EVAL_BATCH = 256


@dataclass
class StudentInputs:
    """The student trunk's final-normed hidden states at every cached position, per split."""

    train: torch.Tensor  # [N_train, H]
    heldout: torch.Tensor  # [N_heldout, H]


@torch.no_grad()
def first_layers(runner: ModelRunner, ids: list[int], k: int) -> torch.Tensor:
    """[len(ids), H]: what the layer-skip draft's output layer reads at each position of `ids`."""
    cache, _, _ = runner.prefill([])  # an empty one-row cache
    return runner.forward_layers(cache, torch.tensor([ids], device=runner.device), k)[0].cpu()


@torch.no_grad()
def final_hidden(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """[len(ids), H]: what `runner`'s output layer reads at each position of `ids` (a draft model's student input)."""
    return runner.prefill(ids, features=(-1,))[2].cpu()


def student_inputs(data: Features, trunk: Callable[[list[int]], torch.Tensor], prefix: str,
                   progress: bool = True) -> StudentInputs:
    """The student's inputs for `data`: `trunk` of each sequence, computed for the shards not cached as `prefix`-<shard>."""
    files = data.meta["files"]
    splits = {}
    with tqdm(total=sum(data.meta["positions"].values()), desc=f"student inputs ({prefix})", unit="tok",
              disable=not progress) as bar:
        for split in ("train", "heldout"):
            parts = []
            for name in files[split]:
                path = data.directory / f"{prefix}-{name}"
                if not path.is_file():
                    shard = load_file(str(data.directory / name))
                    sequences = shard["tokens"].split(shard["lengths"].tolist())
                    save_tensors({"hidden": torch.cat([trunk(ids.tolist()) for ids in sequences])}, path)
                parts.append(load_file(str(path))["hidden"])
                bar.update(len(parts[-1]))
            splits[split] = torch.cat(parts)
    return StudentInputs(**splits)


def distill_loss(student_logits: torch.Tensor, target_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 * mean over positions of KL(p_T || q_T)."""
    target = F.log_softmax(target_logits / temperature, dim=-1)
    student = F.log_softmax(student_logits / temperature, dim=-1)
    return F.kl_div(student, target, log_target=True, reduction="batchmean") * temperature**2


@torch.no_grad()
def heldout_report(adapter: Adapter, student_out: nn.Module, target_out: nn.Module, vocab: ReducedVocab | None,
                   inputs: torch.Tensor, data: Features, temperature: float) -> dict[str, float]:
    """The student against the target on the held-out positions: KL at T, top-1 agreement, sampled acceptance."""
    kl, top1, accept = 0.0, 0.0, 0.0
    for start in range(0, len(inputs), EVAL_BATCH):
        student = student_out(adapter(inputs[start : start + EVAL_BATCH].float()))
        target = target_out(data.heldout.hidden[start : start + EVAL_BATCH].float())
        kl += float(distill_loss(student, target, temperature)) / temperature**2 * len(student)
        top1 += float((full_ids(student.argmax(-1), vocab) == data.heldout.predicted[start : start + EVAL_BATCH]).sum())
        accept += float(torch.minimum(student.softmax(-1), target.softmax(-1)).sum())
    n = max(len(inputs), 1)
    return {"kl": round(kl / n, 4), "top1": round(top1 / n, 4), "accept_t1": round(accept / n, 4)}


def frozen_output(runner: ModelRunner, vocab: ReducedVocab | None) -> nn.Module:
    # In float32: on this CPU float32 products beat bfloat16 ones.
    return output_layer(runner.model.get_output_embeddings(), vocab).float().requires_grad_(False)


def train_distill(runner: ModelRunner, data: Features, settings: DistillSettings, out: str,
                  vocab: ReducedVocab | None = None, resume: bool = False, progress: bool = True,
                  draft: ModelRunner | None = None) -> dict:
    """Distill a student toward `runner` on `data` and save it as `out`; its JSON's dict. The student is `draft`
    (the same-family draft model) when given, else `runner`'s first `settings.k` layers."""
    torch.manual_seed(settings.seed)
    directory = artifact_dir(STUDENT, out)
    if draft is None:
        student = {"kind": "layer-skip", "k": settings.k}
        trunk, prefix = (lambda ids: first_layers(runner, ids, settings.k)), f"layers{settings.k}"
    else:
        student = {"kind": "draft-model", "model": draft.name}
        trunk, prefix = (lambda ids: final_hidden(draft, ids)), f"final-{draft.name}"
    start = time.perf_counter()
    inputs = student_inputs(data, trunk, prefix, progress)
    layers_s = time.perf_counter() - start
    # Only now: a full-vocabulary output layer goes float32 in place, and a tied one takes the embedding with it.
    target_out = frozen_output(runner, vocab)
    student_out = target_out if draft is None else frozen_output(draft, vocab)
    adapter = Adapter(inputs.train.shape[1], settings.width)
    untrained = heldout_report(adapter, student_out, target_out, vocab, inputs.heldout, data, settings.temperature)

    def loss_of(batch: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target_logits = target_out(data.train.hidden[batch].float())
        return distill_loss(student_out(adapter(inputs.train[batch].float())), target_logits, settings.temperature)

    identity = {"settings": dataclasses.asdict(settings), "student": student, "data": str(data.directory),
                "vocab_size": None if vocab is None else vocab.size}
    checkpoint = checkpoint_path(directory)
    start = time.perf_counter()
    epoch_losses = fit(adapter, len(inputs.train), loss_of, settings, checkpoint, identity, resume,
                       f"train distill ({out})", progress)
    train_s = time.perf_counter() - start

    meta = {
        "target": data.meta["target"],
        "student": student,
        "data": {"features": str(data.directory), **data.meta["settings"], "sources": data.meta.get("sources")},
        "tokens": {"train": len(data.train), "heldout": len(data.heldout)},
        "train": dataclasses.asdict(settings),
        "epoch_loss": epoch_losses,  # mean training loss of each epoch (a resumed epoch: its resumed part)
        "heldout": {"untrained": untrained, "trained": heldout_report(adapter, student_out, target_out, vocab,
                                                                      inputs.heldout, data, settings.temperature)},
        "extract_s": data.meta["extract_s"],
        "layers_s": round(layers_s, 1),  # computing (or loading) the student's inputs
        "train_s": round(train_s, 1),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    meta = save_student(adapter, directory, meta, vocab)
    checkpoint.unlink()  # the run is complete: student.json says so
    return meta

"""Medusa-1 self-distillation: train the heads on the frozen target's cached features.

Labels are the target's own predictions, not the text: head i at position t learns the target's
argmax next token at position t+i+1 (``predicted[t+i+1]`` in the feature cache), the token the
target would emit at t+i+2 on this text, so the heads learn the target's behaviour. Loss: cross-
entropy per head weighted by ``head_decay ** i`` (Medusa's 0.8^i: later heads are harder and
matter less, since a draft only reaches them through the earlier ones). The loop (train/loop.py):
AdamW with a cosine schedule, epochs over the cache (the target never runs again), a checkpoint
every ``checkpoint_every`` steps and at each epoch's end, which ``resume`` continues from.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from specdec_core.models.artifacts import HEADS, artifact_dir, checkpoint_path
from specdec_core.models.medusa_heads import (
    MedusaHeads,
    full_ids,
    head_logits,
    output_layer,
    save_heads,
)
from specdec_core.models.vocab import ReducedVocab

from .data import Features, FeatureSplit
from .loop import fit
from .settings import TrainSettings

log = logging.getLogger("specdec")

IGNORE = -100  # no label: past the sequence's end, or outside the reduced vocabulary
TOP_K = 5


def head_labels(split: FeatureSplit, num_heads: int) -> torch.Tensor:
    """[N, K] full-vocabulary labels: column i is the target's prediction at t+i+1, IGNORE past a sequence's end."""
    remaining = split.remaining()
    labels = torch.full((len(split), num_heads), IGNORE, dtype=torch.long)
    for i in range(num_heads):
        valid = (remaining >= i + 1).nonzero().squeeze(1)
        labels[valid, i] = split.predicted[valid + i + 1]
    return labels


def output_labels(labels: torch.Tensor, vocab: ReducedVocab | None) -> torch.Tensor:
    """Full-vocabulary labels as output-layer indices; IGNORE for tokens outside a reduced vocabulary."""
    if vocab is None:
        return labels
    index = torch.full((vocab.full_size,), IGNORE, dtype=torch.long)
    index[vocab.ids] = torch.arange(vocab.size)
    return torch.where(labels == IGNORE, IGNORE, index[labels.clamp(min=0)])


def weighted_loss(logits: torch.Tensor, labels: torch.Tensor, decay: float) -> torch.Tensor:
    """Sum over heads of decay**i x the mean cross-entropy of head i's labelled positions."""
    losses = [
        F.cross_entropy(logits[:, i], labels[:, i], ignore_index=IGNORE, reduction="sum") / (labels[:, i] != IGNORE).sum().clamp(min=1)
        for i in range(labels.shape[1])
    ]
    return sum(decay**i * loss for i, loss in enumerate(losses))


@torch.no_grad()
def agreement(heads: MedusaHeads, out: nn.Module, vocab: ReducedVocab | None, split: FeatureSplit,
              batch_size: int = 256) -> list[dict[str, float]]:
    """Per head: how often its top-1 is the target's prediction, and how often that is in its top-5 (held-out positions)."""
    labels = head_labels(split, heads.num_heads)
    hits = torch.zeros(heads.num_heads, 2)
    for start in range(0, len(split), batch_size):
        logits = head_logits(heads, split.hidden[start : start + batch_size].float(), out)
        top = full_ids(logits.topk(TOP_K, dim=-1).indices, vocab)  # [b, K, 5]
        target = labels[start : start + batch_size, :, None]
        hits[:, 0] += (top[..., :1] == target).any(-1).sum(0)
        hits[:, 1] += (top == target).any(-1).sum(0)
    counts = (labels != IGNORE).sum(0).clamp(min=1)
    return [{"top1": round(float(h[0] / n), 4), "top5": round(float(h[1] / n), 4)} for h, n in zip(hits, counts)]


def train_medusa(
    lm_head: nn.Module,
    data: Features,
    settings: TrainSettings,
    out: str,
    vocab: ReducedVocab | None = None,
    resume: bool = False,
    progress: bool = True,
) -> dict:
    """Train heads on `data` through the frozen `lm_head` (cut to `vocab` when given), save them as `out`; heads.json's dict.

    The output layer is used in float32 (on this CPU float32 products beat bfloat16 ones).
    """
    torch.manual_seed(settings.seed)
    directory = artifact_dir(HEADS, out)
    heads = MedusaHeads(data.meta["hidden_size"], settings.num_heads, settings.num_layers)
    out_layer = output_layer(lm_head, vocab).float().requires_grad_(False)
    train_labels = output_labels(head_labels(data.train, settings.num_heads), vocab)
    positions = (train_labels != IGNORE).any(dim=1).nonzero().squeeze(1)  # positions with at least one label
    # A checkpoint only continues the run that made it: same settings, data and vocabulary.
    identity = {"settings": dataclasses.asdict(settings), "data": str(data.directory),
                "vocab_size": None if vocab is None else vocab.size}
    untrained = agreement(MedusaHeads(heads.hidden_size, heads.num_heads, heads.num_layers), out_layer, vocab, data.heldout)

    def loss_of(batch: torch.Tensor) -> torch.Tensor:
        chosen = positions[batch]
        logits = head_logits(heads, data.train.hidden[chosen].float(), out_layer)
        return weighted_loss(logits, train_labels[chosen], settings.head_decay)

    checkpoint = checkpoint_path(directory)
    start = time.perf_counter()
    epoch_losses = fit(heads, len(positions), loss_of, settings, checkpoint, identity, resume,
                       f"train medusa ({out})", progress)
    train_s = time.perf_counter() - start

    meta = {
        "target": data.meta["target"],
        "data": {"features": str(data.directory), **data.meta["settings"], "sources": data.meta["sources"]},
        "tokens": {"train": len(data.train), "heldout": len(data.heldout)},
        "epochs": settings.epochs,
        "train": dataclasses.asdict(settings),
        "epoch_loss": epoch_losses,  # mean training loss of each epoch (a resumed epoch: its resumed part)
        "agreement": agreement(heads, out_layer, vocab, data.heldout),
        "agreement_untrained": untrained,  # identity heads: the target's own next-token prediction
        "extract_s": data.meta["extract_s"],
        "train_s": round(train_s, 1),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    meta = save_heads(heads, directory, meta, vocab)
    checkpoint.unlink()  # the run is complete: heads.json says so
    return meta

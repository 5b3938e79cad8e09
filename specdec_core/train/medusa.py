"""Medusa-1 self-distillation: train the heads on the frozen target's cached features.

Labels are the target's own predictions, not the text: head i at position t learns the target's
argmax next token at position t+i+1 (``predicted[t+i+1]`` in the feature cache), the token the
target would emit at t+i+2 on this text, so the heads learn the target's behaviour. Loss: cross-
entropy per head weighted by ``head_decay ** i`` (Medusa's 0.8^i: later heads are harder and
matter less, since a draft only reaches them through the earlier ones). AdamW with a cosine
schedule, epochs over the cache (the target never runs again), a checkpoint every
``checkpoint_every`` steps and at each epoch's end, which ``resume`` continues from.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from ..models.medusa_heads import MedusaHeads, full_ids, head_logits, heads_dir, output_layer, save_heads
from ..vocab import ReducedVocab
from .data import Features, FeatureSplit
from .settings import TrainSettings

log = logging.getLogger("specdec")

CHECKPOINT_FILE = "checkpoint.pt"
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


def _step(loss: torch.Tensor, optimizer: torch.optim.Optimizer, scheduler) -> float:
    """One optimizer (and schedule) step on `loss`; its value."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    scheduler.step()
    return loss.item()


def _checkpoint(path: Path, heads: MedusaHeads, optimizer, scheduler, step: int, losses: list[float], identity: dict) -> None:
    tmp = path.with_name(f"{path.name}.partial")
    torch.save({"heads": heads.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "step": step, "epoch_losses": losses, "identity": identity}, tmp)
    tmp.replace(path)


def _restore(path: Path, identity: dict, heads: MedusaHeads, optimizer, scheduler) -> tuple[int, list[float]]:
    """Load a checkpoint into the objects; its step and finished epochs' losses."""
    state = torch.load(path, weights_only=True)
    if state["identity"] != identity:
        raise ValueError(f"{path} was made with other settings or data ({state['identity']}); drop --resume to start afresh")
    heads.load_state_dict(state["heads"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return state["step"], state["epoch_losses"]


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
    directory = heads_dir(out)
    directory.mkdir(parents=True, exist_ok=True)
    heads = MedusaHeads(data.meta["hidden_size"], settings.num_heads, settings.num_layers)
    out_layer = output_layer(lm_head, vocab).float().requires_grad_(False)
    train_labels = output_labels(head_labels(data.train, settings.num_heads), vocab)
    positions = (train_labels != IGNORE).any(dim=1).nonzero().squeeze(1)  # positions with at least one label
    steps_per_epoch = -(-len(positions) // settings.batch_size)
    total_steps = steps_per_epoch * settings.epochs
    optimizer = torch.optim.AdamW(heads.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)

    # A checkpoint only continues the run that made it: same settings, data and vocabulary.
    identity = {"settings": dataclasses.asdict(settings), "data": str(data.directory),
                "vocab_size": None if vocab is None else vocab.size}
    checkpoint = directory / CHECKPOINT_FILE
    step, epoch_losses = _restore(checkpoint, identity, heads, optimizer, scheduler) if resume and checkpoint.is_file() else (0, [])
    if resume and step:
        log.info("resuming from %s at step %d of %d", checkpoint, step, total_steps)
    untrained = agreement(MedusaHeads(heads.hidden_size, heads.num_heads, heads.num_layers), out_layer, vocab, data.heldout)

    start = time.perf_counter()
    with tqdm(total=total_steps, initial=step, desc=f"train medusa ({out})", unit="step", disable=not progress) as bar:
        while step < total_steps:
            epoch, offset = divmod(step, steps_per_epoch)
            # The epoch's order comes from its seed, so a resumed epoch skips exactly the batches already done.
            order = positions[torch.randperm(len(positions), generator=torch.Generator().manual_seed(settings.seed + epoch))]
            running, batches = 0.0, 0
            for first in range(offset * settings.batch_size, len(order), settings.batch_size):
                batch = order[first : first + settings.batch_size]
                logits = head_logits(heads, data.train.hidden[batch].float(), out_layer)
                running += _step(weighted_loss(logits, train_labels[batch], settings.head_decay), optimizer, scheduler)
                step, batches = step + 1, batches + 1
                bar.update(1)
                bar.set_postfix(epoch=epoch + 1, loss=f"{running / batches:.3f}")
                if step % settings.checkpoint_every == 0:
                    _checkpoint(checkpoint, heads, optimizer, scheduler, step, epoch_losses, identity)
            epoch_losses.append(round(running / max(batches, 1), 4))
            _checkpoint(checkpoint, heads, optimizer, scheduler, step, epoch_losses, identity)
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

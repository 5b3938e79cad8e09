"""The training loop the self-distillation trainers share: AdamW with a cosine schedule, seeded epochs,
checkpoints that a resumed run continues from exactly."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from .settings import DistillSettings, TrainSettings

log = logging.getLogger("specdec")

def _step(loss: torch.Tensor, optimizer: torch.optim.Optimizer, scheduler) -> float:
    """One optimizer (and schedule) step on `loss`; its value."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    scheduler.step()
    return loss.item()


class CheckpointMismatch(ValueError):
    """A checkpoint was made by another run (other settings, data or vocabulary) than the one resuming it."""


def save_checkpoint(path: Path, module: nn.Module, optimizer, scheduler, step: int, losses: list[float], identity: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.partial")
    torch.save({"module": module.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "step": step, "epoch_losses": losses, "identity": identity}, tmp)
    tmp.replace(path)


def restore_checkpoint(path: Path, identity: dict, module: nn.Module, optimizer, scheduler) -> tuple[int, list[float]]:
    """Load a checkpoint into the objects; its step and finished epochs' losses."""
    state = torch.load(path, weights_only=True)
    if state["identity"] != identity:
        raise CheckpointMismatch(f"{path} was made with other settings or data ({state['identity']}); drop --resume to start afresh")
    module.load_state_dict(state["module"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return state["step"], state["epoch_losses"]


def fit(module: nn.Module, count: int, loss_of: Callable[[torch.Tensor], torch.Tensor],
        settings: TrainSettings | DistillSettings, checkpoint: Path, identity: dict, resume: bool, desc: str,
        progress: bool = True) -> list[float]:
    """Train `module` with AdamW and a cosine schedule over `settings.epochs` seeded passes of `count` positions in
    batches of `settings.batch_size`, `loss_of(batch)` the loss of a batch of position indices; checkpointed every
    `checkpoint_every` steps and at each epoch's end, continued from `checkpoint` when `resume`. The mean loss per
    epoch. A checkpoint only continues the run that made it (`identity`: settings, data, vocabulary)."""
    steps_per_epoch = -(-count // settings.batch_size)
    total_steps = steps_per_epoch * settings.epochs
    optimizer = torch.optim.AdamW(module.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    step, epoch_losses = restore_checkpoint(checkpoint, identity, module, optimizer, scheduler) if resume and checkpoint.is_file() else (0, [])
    if step:
        log.info("resuming from %s at step %d of %d", checkpoint, step, total_steps)
    with tqdm(total=total_steps, initial=step, desc=desc, unit="step", disable=not progress) as bar:
        while step < total_steps:
            epoch, offset = divmod(step, steps_per_epoch)
            # The epoch's order comes from its seed, so a resumed epoch skips exactly the batches already done.
            order = torch.randperm(count, generator=torch.Generator().manual_seed(settings.seed + epoch))
            losses = []
            for batch in order[offset * settings.batch_size :].split(settings.batch_size):
                losses.append(_step(loss_of(batch), optimizer, scheduler))
                step += 1
                bar.update(1)
                bar.set_postfix(epoch=epoch + 1, loss=f"{sum(losses) / len(losses):.4f}")
                if step % settings.checkpoint_every == 0:
                    save_checkpoint(checkpoint, module, optimizer, scheduler, step, epoch_losses, identity)
            epoch_losses.append(round(sum(losses) / max(len(losses), 1), 4))
            save_checkpoint(checkpoint, module, optimizer, scheduler, step, epoch_losses, identity)
    return epoch_losses

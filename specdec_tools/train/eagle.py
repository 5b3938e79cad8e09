"""Self-distillation of the EAGLE network (models/eagle_net.py) on the frozen target's cached features.

Data: the feature cache of train/data.py (never Spec-Bench). Each cached sequence gives pairs
(hidden[t], tokens[t+1]) whose targets are hidden[t+1] and predicted[t+1], the target's own
argmax after token t+1. Teacher-forced, as EAGLE-1 trains: the network sees the real features.

Loss (as EAGLE): smooth L1 between the predicted and the real next feature, plus `token_weight`
times the cross-entropy of lm_head(predicted feature) against the target's own next token (over
the reduced vocabulary when there is one: targets outside it are skipped).

Training is resumable: ``<name>.checkpoint.pt`` beside the output directory holds the network, the
optimizer and how many batches are done, written every `save_every` batches and at each epoch's
end; the batch order is a function of the seed and the epoch, so a resumed run continues exactly.

Held-out figures: top-1 agreement (the draft's argmax of token t+2 from the real features equals
the target's), and the mean acceptance length of a greedy chain of `depth` drafts started at every
held-out position, the draft feeding back its own features. A chain can only be judged while the
text's next token is the target's argmax (the cache holds no target features for other
continuations), so on text the target did not write it is a lower bound.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional as F
from tqdm import tqdm
from transformers import DynamicCache

from specdec_core.models.artifacts import EAGLE, artifact_dir, checkpoint_path
from specdec_core.models.eagle_net import EagleNet
from specdec_core.models.runner import ModelRunner
from specdec_core.models.vocab import ReducedVocab

from .data import Features, FeatureSplit
from .settings import EagleSettings

log = logging.getLogger("specdec")


@dataclass
class Pairs:
    """A batch of padded sequences' training pairs: inputs at t, targets at t+1."""

    features: torch.Tensor  # [B, T, H] hidden[t]
    tokens: torch.Tensor  # [B, T] tokens[t+1]
    next_features: torch.Tensor  # [B, T, H] hidden[t+1]
    labels: torch.Tensor  # [B, T] output-layer index of predicted[t+1]; -100 where there is none
    mask: torch.Tensor  # [B, T] a real pair
    chain_ok: torch.Tensor  # [B, T] tokens[t+2] == predicted[t+1]: the text continues as the target would


def sequences(split: FeatureSplit) -> list[tuple[torch.Tensor, ...]]:
    """Each sequence's (hidden, tokens, predicted), those of at least two positions."""
    parts = zip(*(x.split(split.lengths.tolist()) for x in (split.hidden, split.tokens, split.predicted)))
    return [part for part in parts if len(part[1]) > 1]


def output_index(ids: torch.Tensor, vocab: ReducedVocab | None) -> torch.Tensor:
    """Rows of the output layer for target token ids; -100 (cross-entropy's ignore) outside a reduced vocabulary."""
    if vocab is None:
        return ids
    lookup = torch.full((vocab.full_size,), -100, dtype=torch.long)
    lookup[vocab.ids] = torch.arange(vocab.size)
    return lookup[ids]


def make_pairs(batch: list[tuple[torch.Tensor, ...]], vocab: ReducedVocab | None) -> Pairs:
    """Pad `batch` (hidden, tokens, predicted per sequence) into pairs; a sequence of n positions gives n-1."""
    width = max(len(tokens) for _, tokens, _ in batch) - 1
    hidden_size = batch[0][0].shape[1]
    out = Pairs(
        torch.zeros(len(batch), width, hidden_size), torch.zeros(len(batch), width, dtype=torch.long),
        torch.zeros(len(batch), width, hidden_size), torch.full((len(batch), width), -100, dtype=torch.long),
        torch.zeros(len(batch), width, dtype=torch.bool), torch.zeros(len(batch), width, dtype=torch.bool),
    )
    for i, (hidden, tokens, predicted) in enumerate(batch):
        n = len(tokens) - 1
        out.features[i, :n] = hidden[:-1].float()
        out.tokens[i, :n] = tokens[1:]
        out.next_features[i, :n] = hidden[1:].float()
        out.labels[i, :n] = output_index(predicted[1:], vocab)
        out.mask[i, :n] = True
        out.chain_ok[i, : n - 1] = tokens[2:] == predicted[1:-1]
    return out


def causal_mask(pairs: Pairs) -> torch.Tensor:
    """[B, T, T]: each pair sees the real pairs up to itself (a padded query sees itself, so no row is empty)."""
    width = pairs.tokens.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    return (causal & pairs.mask[:, None, :]) | torch.eye(width, dtype=torch.bool)


def positions(pairs: Pairs) -> torch.Tensor:
    return torch.arange(pairs.tokens.shape[1]).expand_as(pairs.tokens)


def loss(net: EagleNet, pairs: Pairs, token_weight: float) -> tuple[torch.Tensor, dict[str, float]]:
    """EAGLE's loss over the real pairs of a batch, and its parts."""
    predicted = net(pairs.features, pairs.tokens, positions(pairs), causal_mask(pairs))
    real = pairs.mask
    feature_loss = F.smooth_l1_loss(predicted[real], pairs.next_features[real])
    logits = net.logits(predicted[real])
    token_loss = F.cross_entropy(logits, pairs.labels[real], ignore_index=-100)
    total = feature_loss + token_weight * token_loss
    return total, {"loss": total.item(), "feature": feature_loss.item(), "token": token_loss.item()}


@torch.no_grad()
def heldout_figures(net: EagleNet, data: list[tuple[torch.Tensor, ...]], depth: int) -> dict[str, float]:
    """Top-1 agreement and mean greedy-chain acceptance length (see the module notes) over held-out sequences."""
    kept = torch.cat([chain_lengths(net, make_pairs([sequence], net.vocab), depth) for sequence in data])
    # A chain's first draft is kept exactly when the draft's top-1 agrees with the target.
    return {"top1_agreement": float((kept > 0).float().mean()), "acceptance_length": 1 + float(kept.float().mean())}


def chain_lengths(net: EagleNet, pairs: Pairs, depth: int) -> torch.Tensor:
    """For each start t of one sequence: how many of `depth` greedy chain drafts the target keeps.

    The chains run together, one level per forward: chain t's nodes attend the real pairs up to t
    and the chain's own earlier nodes, at positions t + 1, t + 2, ... Draft j is judged against
    predicted[t+1+j], and a chain goes on only while the text's token equals the draft (chain_ok)."""
    labels, ok = pairs.labels[0], pairs.chain_ok[0]
    width = len(labels)
    kv = DynamicCache()
    seen = causal_mask(pairs)[0]  # [T, past]: the slots each chain's next node attends
    features = net(pairs.features, pairs.tokens, positions(pairs), seen[None], kv)[0]
    start = torch.arange(width)
    alive = torch.ones(width, dtype=torch.bool)
    kept = torch.zeros(width, dtype=torch.long)
    for j in range(depth):
        at = (start + j).clamp(max=width - 1)
        draft = net.logits(features).argmax(-1)
        alive &= (start + j < width) & (draft == labels[at])
        kept += alive
        alive &= ok[at]
        if j == depth - 1 or not alive.any():
            break
        seen = torch.cat([seen, torch.eye(width, dtype=torch.bool)], dim=1)
        features = net(features[None], net.full_ids(draft)[None], (start + j + 1)[None], seen[None], kv)[0]
    return kept


def train(
    runner: ModelRunner, data: Features, out: str | Path, settings: EagleSettings, vocab: ReducedVocab | None = None,
    resume: bool = False, progress: bool = True,
) -> dict:
    """Train an EAGLE network for `runner`'s target on `data`, save it as `out` (a name under <cache>/eagle, or a
    directory); returns what eagle.json says."""
    directory = artifact_dir(EAGLE, out)
    checkpoint = checkpoint_path(directory)
    torch.manual_seed(settings.seed)
    net = EagleNet(runner.model, vocab).float().train()
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=settings.lr)
    train_data, heldout = sequences(data.train), sequences(data.heldout)
    batches_per_epoch = -(-len(train_data) // settings.batch_sequences)
    total = settings.epochs * batches_per_epoch
    done = _resume(net, optimizer, checkpoint) if resume else 0
    start = time.perf_counter()
    history: list[dict[str, float]] = []
    with tqdm(total=total, initial=done, desc="train eagle", unit="batch", disable=not progress) as bar:
        for step in range(done, total):
            epoch, index = divmod(step, batches_per_epoch)
            order = torch.randperm(len(train_data), generator=torch.Generator().manual_seed(settings.seed + epoch))
            chosen = order[index * settings.batch_sequences : (index + 1) * settings.batch_sequences]
            pairs = make_pairs([train_data[i] for i in chosen.tolist()], vocab)
            value, parts = loss(net, pairs, settings.token_weight)
            optimizer.zero_grad()
            value.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            optimizer.step()
            history.append(parts)
            bar.update(1)
            bar.set_postfix(loss=f"{parts['loss']:.3f}", token=f"{parts['token']:.2f}")
            if (step + 1) % settings.save_every == 0 or index == batches_per_epoch - 1:
                _checkpoint(net, optimizer, checkpoint, step + 1)
    net.eval()
    figures = heldout_figures(net, heldout, settings.depth)
    meta = {
        "target": runner.name,
        "data": {"directory": str(data.directory), "settings": data.meta["settings"], "positions": data.meta["positions"]},
        "train": dataclasses.asdict(settings),
        "batches": total,
        "first_loss": history[0] if history else None,
        "last_loss": history[-1] if history else None,
        "heldout": figures,
        "train_s": round(time.perf_counter() - start, 1),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return net.save(directory, meta)


def _checkpoint(net: EagleNet, optimizer: torch.optim.Optimizer, path: Path, done: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.partial")
    torch.save({"net": net.state_dict(), "optimizer": optimizer.state_dict(), "done": done}, tmp)
    tmp.replace(path)


def _resume(net: EagleNet, optimizer: torch.optim.Optimizer, path: Path) -> int:
    """Load the checkpoint `path` if there is one; the batches it had done (0 without one)."""
    if not path.is_file():
        log.info("no checkpoint at %s: training from the start", path)
        return 0
    state = torch.load(path)
    net.load_state_dict(state["net"])
    optimizer.load_state_dict(state["optimizer"])
    return state["done"]

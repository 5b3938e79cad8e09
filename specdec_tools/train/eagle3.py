"""Training EAGLE-3's drafter (models/eagle3_net.py) on the depth features of the target's own answers
(depth_features.py), with the training-time test.

Per sequence (a prompt and the target's greedy answer), step k of the test feeds slot t the token t+1+k and
scores the output against the target's distribution at position t+1+k, over the draft vocabulary (its rows of the
target's output layer applied to the stored last hidden state, renormalized there, as SpecForge does). A slot
counts where the token it drafts lies in the answer and in the draft vocabulary; the loss is the soft
cross-entropy, step k weighted by decay ** k. Accuracy at step k: the draft's argmax is the answer's token (the
target's own argmax, the answer being greedy), given the real tokens before it: about the chance that draft k is
kept when drafts 1..k-1 were. The expected accepted length of a chain of `steps` drafts is then
1 + sum over k of the product of the accuracies up to k.

The draft vocabulary is the `vocab_size` most frequent tokens of the answers trained on (EOS always among them).

Shards are read one at a time (24 GB at 2M positions do not fit in memory): an epoch visits the shards in a seeded
order and each shard's training sequences in a seeded order, `batch_sequences` a batch of similar lengths. A
checkpoint beside the output (the network, the optimizer, the batches done) is written every `save_every` batches;
a resumed run recomputes the order and skips the batches done (whole shards unread), so it continues exactly.

Held out: the prompts whose id is heldout_every // 2 modulo heldout_every. The held-out figures read those of the
first `heldout_shards` features shards, whatever a run trained on, so that runs on more or fewer shards compare on
one set (`evaluate` scores a saved drafter on it again: the learning curve's points).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch.nn import functional as F
from tqdm import tqdm
from transformers import DynamicCache

from specdec_core.models.artifacts import EAGLE3, MissingArtifactError, artifact_dir, checkpoint_path, save_artifact
from specdec_core.models.fetch import sha256_file
from specdec_core.models.eagle3_net import Eagle3Net, load_eagle3, ttt_step
from specdec_core.models.runner import ModelRunner
from specdec_core.models.vocab import ReducedVocab

from ..cpu import cpu_info
from . import loop
from .depth_features import ALL, extract
from .settings import Eagle3Settings

Example = dict[str, torch.Tensor]  # one sequence's low, middle, high, last [T, H]; tokens [T]; answer_start []


def draft_vocab(files: list[Path], full_size: int, always: set[int], settings: Eagle3Settings) -> ReducedVocab:
    """The `settings.vocab_size` most frequent tokens of the training answers in features shards `files` (prompts
    and held-out answers not counted), `always` among them."""
    counts = torch.zeros(full_size)
    for path in files:
        with safe_open(str(path), "pt") as shard:
            tokens, lengths, starts, ids = (shard.get_tensor(key) for key in ("tokens", "lengths", "answer_starts", "ids"))
        for sequence, start, heldout in zip(tokens.split(lengths.tolist()), starts.tolist(), held_out(ids, settings).tolist()):
            if not heldout:
                counts += torch.bincount(sequence[start:], minlength=full_size)[:full_size]
    return ReducedVocab.most_frequent(counts, min(settings.vocab_size, full_size), always)


def shard_sequences(path: Path, heldout: bool, settings: Eagle3Settings) -> list[Example]:
    """The training (or held-out) sequences of one features shard."""
    data = load_file(str(path))
    lengths = data["lengths"].tolist()
    parts = {key: data[key].split(lengths) for key in ("low", "middle", "high", "last", "tokens")}
    keep = (held_out(data["ids"], settings) == heldout).nonzero().squeeze(1).tolist()
    return [{**{key: parts[key][i] for key in parts}, "answer_start": data["answer_starts"][i]} for i in keep]


@dataclasses.dataclass
class Batch:
    """Padded sequences: features and tokens per slot, and what each step scores."""

    low: torch.Tensor  # [B, T, H] (and middle, high)
    middle: torch.Tensor
    high: torch.Tensor
    tokens: torch.Tensor  # [B, T + steps + 1]: the sequence's tokens, then padding
    valid: torch.Tensor  # [B, T] a real position
    probs: torch.Tensor  # [B, T + steps + 1, V']: the target's distribution over the draft vocabulary at each position
    labels: torch.Tensor  # [B, T + steps + 1]: draft-vocabulary index of the token after each position; -1 not scored


def make_batch(sequences: list[Example], vocab: ReducedVocab, head: torch.nn.Linear, steps: int) -> Batch:
    """`sequences` padded together; `head`: the target's output rows for the draft vocabulary."""
    width = max(len(s["tokens"]) for s in sequences)
    hidden = sequences[0]["low"].shape[1]
    index = torch.full((vocab.full_size,), -1, dtype=torch.long)
    index[vocab.ids] = torch.arange(vocab.size)
    batch = len(sequences)
    out = {key: torch.zeros(batch, width, hidden) for key in ("low", "middle", "high")}
    tokens = torch.zeros(batch, width + steps + 1, dtype=torch.long)
    valid = torch.zeros(batch, width, dtype=torch.bool)
    last = torch.zeros(batch, width + steps + 1, hidden)
    labels = torch.full((batch, width + steps + 1), -1, dtype=torch.long)
    for row, s in enumerate(sequences):
        n = len(s["tokens"])
        for key in out:
            out[key][row, :n] = s[key].float()
        tokens[row, :n] = s["tokens"]
        valid[row, :n] = True
        last[row, :n] = s["last"].float()
        # Position p is scored by the token p + 1 the target answered with (its argmax: the answers are greedy).
        first = max(int(s["answer_start"]), 1)
        labels[row, first - 1 : n - 1] = index[s["tokens"][first:]]
    with torch.no_grad():
        probs = F.softmax(head(last), dim=-1)
    return Batch(out["low"], out["middle"], out["high"], tokens, valid, probs, labels)


def add_noise(batch: Batch, std: float, seed: int) -> None:
    """Gaussian noise of `std` on the batch's real positions' features, drawn from `seed` (a resumed run draws the
    same)."""
    generator = torch.Generator().manual_seed(seed)
    for features in (batch.low, batch.middle, batch.high):
        features += std * torch.randn(features.shape, generator=generator) * batch.valid[..., None]


def ttt_loss(net: Eagle3Net, batch: Batch, settings: Eagle3Settings) -> tuple[torch.Tensor, list[float], list[int]]:
    """The training-time test's weighted loss over `settings.steps` steps, and per step the accuracy and the slots
    scored."""
    width = batch.valid.shape[1]
    hidden, kv = net.fuse(batch.low, batch.middle, batch.high), DynamicCache()
    total = torch.zeros(())
    accuracy, counted = [], []
    for step in range(settings.steps):
        hidden = ttt_step(net, hidden, batch.tokens[:, 1 + step : 1 + step + width], batch.valid, step, kv)
        at = slice(1 + step, 1 + step + width)  # slot t drafts the token after position t + 1 + step
        labels = batch.labels[:, at]
        scored = (labels >= 0) & batch.valid
        logits = net.logits(hidden[scored])  # the output layer is about half a step's work: unscored slots skip it
        if scored.any():
            total = total + settings.decay ** step * -(batch.probs[:, at][scored] * F.log_softmax(logits, -1)).sum(-1).mean()
        accuracy.append(float((logits.argmax(-1) == labels[scored]).float().mean()) if scored.any() else math.nan)
        counted.append(int(scored.sum()))
    return total, accuracy, counted


def expected_length(accuracy: list[float]) -> float:
    """1 + the sum over k of the product of the step accuracies up to k: a chain's expected accepted length."""
    length, kept = 1.0, 1.0
    for value in accuracy:
        kept *= value
        length += kept
    return length


def run_features(runner: ModelRunner, answers: Path, shards: slice, settings: Eagle3Settings) -> Path:
    """The depth features a run on answers shards `shards` reads, made where the cache lacks them: those shards whole,
    and the held-out prompts alone of the first `settings.heldout_shards` (the held-out set). Their directory."""
    return extract(runner, answers, shards=shards, held_out=functools.partial(held_out, settings=settings),
                   heldout_shards=settings.heldout_shards)


def lr_factor(done: int, total: int, settings: Eagle3Settings) -> float:
    """The learning rate over its peak for batch `done` (from 0) of `total`: a linear warmup reaching the peak at
    batch `settings.warmup` - 1, then a cosine from the peak toward `settings.lr_floor`, which it reaches after the
    last batch (with neither, torch's CosineAnnealingLR, as the earlier runs trained)."""
    if done < settings.warmup:
        return (done + 1) / settings.warmup
    progress = (done - settings.warmup) / max(total - settings.warmup, 1)
    return settings.lr_floor + (1 - settings.lr_floor) * 0.5 * (1 + math.cos(math.pi * progress))


def batches(files: list[Path], epoch: int, settings: Eagle3Settings, skip: int = 0) -> Iterator[list[Example]]:
    """An epoch's training batches after its first `skip`: shards in a seeded order; in each, its sequences in a
    seeded order, sorted by length within windows of `length_window` batches and cut into batches, the batches in a
    seeded order (a shard whose batches are all skipped is not read)."""
    generator = torch.Generator().manual_seed(settings.seed + epoch)
    size = settings.batch_sequences
    for shard in torch.randperm(len(files), generator=generator).tolist():
        count = _training_count(files[shard], settings)
        order = torch.randperm(count, generator=generator).tolist()
        turns = torch.randperm(-(-count // size), generator=generator).tolist()
        if skip >= len(turns):
            skip -= len(turns)
            continue
        sequences = shard_sequences(files[shard], False, settings)
        grouped = []
        window = settings.length_window * size
        for start in range(0, count, window):
            grouped += sorted(order[start : start + window], key=lambda i: len(sequences[i]["tokens"]))
        for turn in turns[skip:]:
            yield [sequences[i] for i in grouped[turn * size : (turn + 1) * size]]
        skip = 0


def _training_count(path: Path, settings: Eagle3Settings) -> int:
    """A features shard's training sequences, from its prompt ids alone (safetensors reads one tensor)."""
    with safe_open(str(path), "pt") as shard:
        ids = shard.get_tensor("ids")
    return int((~held_out(ids, settings)).sum())


def held_out(ids: torch.Tensor, settings: Eagle3Settings) -> torch.Tensor:
    """Which of the prompts `ids` are held out: one in heldout_every, by id."""
    return ids % settings.heldout_every == settings.heldout_every // 2


def batches_per_epoch(files: list[Path], settings: Eagle3Settings) -> int:
    """How many batches an epoch has."""
    return sum(-(-_training_count(path, settings) // settings.batch_sequences) for path in files)


@torch.no_grad()
def heldout_figures(net: Eagle3Net, files: list[Path], vocab: ReducedVocab, head: torch.nn.Linear,
                    settings: Eagle3Settings) -> dict:
    """Per-step accuracy over the held-out sequences (weighted by slots scored) and the expected accepted length."""
    right, counted = [0.0] * settings.steps, [0] * settings.steps
    for path in files:
        sequences = shard_sequences(path, True, settings)
        for start in range(0, len(sequences), settings.batch_sequences):
            batch = make_batch(sequences[start : start + settings.batch_sequences], vocab, head, settings.steps)
            _, accuracy, scored = ttt_loss(net, batch, settings)
            for k, (a, n) in enumerate(zip(accuracy, scored)):
                right[k] += 0.0 if n == 0 else a * n
                counted[k] += n
    accuracy = [r / n if n else math.nan for r, n in zip(right, counted)]
    return {"step_accuracy": [round(a, 4) for a in accuracy], "expected_length": round(expected_length(accuracy), 3),
            "slots": counted, "shards": len(files)}


def heldout_files(features: Path, settings: Eagle3Settings) -> list[Path]:
    """The features shards whose held-out prompts the held-out figures read: the first `heldout_shards`."""
    names = sorted(json.loads((features / "meta.json").read_text())["shards"])[: settings.heldout_shards]
    return [features / f"{name}.safetensors" for name in names]


class InitMismatch(ValueError):
    """The drafter a run starts from (`--init`) is not the shape the run's settings train."""


def check_init(init: str | Path, settings: Eagle3Settings) -> dict:
    """The JSON of the drafter `init` a run starts from; InitMismatch where its MLP width or frozen output layer
    differ from `settings`' (MissingArtifactError where it is not there)."""
    meta = artifact_meta(init)
    theirs = (meta["intermediate_size"], meta["train"].get("frozen_head", False))
    if theirs != (settings.intermediate_size, settings.frozen_head):
        raise InitMismatch(f"{init} has MLP width {theirs[0]} and frozen_head {theirs[1]}: train with the same "
                           f"(--intermediate-size, --frozen-head)")
    return meta


def artifact_meta(name: str | Path) -> dict:
    """What the saved drafter `name`'s JSON says (MissingArtifactError where it has none)."""
    path = artifact_dir(EAGLE3, name) / EAGLE3.meta_file
    if not path.is_file():
        raise MissingArtifactError(f"no EAGLE-3 drafter at {path.parent}: name a saved drafter or a snapshot's folder")
    return json.loads(path.read_text())


def evaluate(runner: ModelRunner, name: str | Path) -> dict:
    """The held-out figures of the saved drafter `name` (trained for `runner`'s target), on the set its training
    would read today (its features directory's first heldout_shards shards; held out as it held out)."""
    net = load_eagle3(name, runner.model, runner.name, None, torch.float32)  # as training scores it
    meta = artifact_meta(name)
    recipe = meta["train"]
    settings = Eagle3Settings(steps=recipe["steps"], decay=recipe["decay"], heldout_every=recipe["heldout_every"])
    head = net.vocab.head(runner.model.get_output_embeddings()).float()
    return heldout_figures(net, heldout_files(Path(meta["data"]["features"]), settings), net.vocab, head, settings)


def train(runner: ModelRunner, features: Path, out: str | Path, settings: Eagle3Settings, resume: bool = False,
          progress: bool = True, shards: list[str] | None = None, init: str | Path | None = None) -> dict:
    """Train EAGLE-3's drafter for `runner`'s target on the depth features in `features` (the whole shards named
    `shards`, default every whole one), save it as `out`; what its JSON says. With `init` (a saved or shipped
    drafter: a snapshot of an earlier piece), start from its weights and vocabulary, with a fresh optimizer."""
    directory = artifact_dir(EAGLE3, out)
    checkpoint = checkpoint_path(directory)
    meta = json.loads((features / "meta.json").read_text())
    whole = sorted(name for name, entry in meta["shards"].items() if entry.get("prompts", ALL) == ALL)
    missing = sorted(set(shards or ()) - set(whole))
    if missing:
        raise FileNotFoundError(f"no whole features shards {', '.join(missing)} in {features}: run `specdec train features`")
    meta["shards"] = {name: meta["shards"][name] for name in (shards or whole)}
    files = [features / f"{name}.safetensors" for name in meta["shards"]]
    torch.manual_seed(settings.seed)
    # A snapshot's weights as it stores them (int8 rows, when committed): a piece starts from what the repository has.
    init_meta = None if init is None else check_init(init, settings)
    start_from = None if init is None else load_eagle3(init, runner.model, runner.name, None, torch.float32)
    if start_from is not None:
        vocab = start_from.vocab
    else:
        eos = runner.tokenizer.eos_token_id if runner.tokenizer is not None else None
        vocab = draft_vocab(files, runner.model.get_output_embeddings().out_features, set() if eos is None else {eos}, settings)
    net = Eagle3Net(runner.model, vocab, settings.intermediate_size, settings.frozen_head).float().train()
    if start_from is not None:
        net.load_state_dict(start_from.state_dict())
    head = vocab.head(runner.model.get_output_embeddings()).float()
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=settings.lr)
    per_epoch = batches_per_epoch(files, settings)
    total = settings.epochs * per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: lr_factor(done, total, settings))
    # A checkpoint continues only the run that made it: the same settings over the same shards, the same vocabulary.
    began_from = None if init_meta is None else {
        "from": str(init), "weights_sha256": sha256_file(artifact_dir(EAGLE3, init) / EAGLE3.weights_file),
        "heldout": init_meta["heldout"], "total_batches": init_meta.get("total_batches", init_meta["batches"]),
        "total_positions_seen": init_meta.get("total_positions_seen",
                                              init_meta["data"]["positions"] * init_meta["train"]["epochs"])}
    identity = {"settings": dataclasses.asdict(settings), "shards": meta["shards"],
                "vocab_sha256": hashlib.sha256(vocab.ids.numpy().tobytes()).hexdigest(),
                "init": None if began_from is None else began_from["weights_sha256"]}
    done = 0
    if resume and checkpoint.is_file():
        done, _ = loop.restore_checkpoint(checkpoint, identity, net, optimizer, scheduler)
    start, first, last, step = time.perf_counter(), None, None, done
    with tqdm(total=total, initial=done, desc="train eagle3", unit="batch", disable=not progress) as bar:
        for epoch in range(settings.epochs):
            # The order is the seed's: a resumed run skips exactly the batches done.
            for chosen in batches(files, epoch, settings, skip=max(0, done - epoch * per_epoch)):
                step += 1
                batch = make_batch(chosen, vocab, head, settings.steps)  # outside autocast: the target's probabilities in fp32
                if settings.noise:
                    add_noise(batch, settings.noise, settings.seed + step)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bf16):
                    loss, accuracy, _ = ttt_loss(net, batch, settings)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
                optimizer.step()
                scheduler.step()
                last = {"loss": round(loss.item(), 4), "step_accuracy": [round(a, 3) for a in accuracy]}
                first = first or last
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}", first=f"{accuracy[0]:.2f}")
                if step % settings.save_every == 0 or step == total:
                    loop.save_checkpoint(checkpoint, net, optimizer, scheduler, step, [], identity)
    net.eval()
    figures = heldout_figures(net, heldout_files(features, settings), vocab, head, settings)
    positions = sum(entry["positions"] for entry in meta["shards"].values())
    before = began_from or {"total_batches": 0, "total_positions_seen": 0}  # the pieces this one continues
    record = {
        "target": runner.name, "architecture": "eagle3", "depths": meta["depths"],
        "hidden_size": net.hidden_size, "intermediate_size": net.intermediate_size,
        "data": {"features": str(features), "positions": positions, "shards": len(files),
                 "answers_sha256": {name: entry["answers_sha256"] for name, entry in meta["shards"].items()}},
        "train": dataclasses.asdict(settings), "init": began_from, "batches": total,
        "total_batches": before["total_batches"] + total,  # with the pieces before this one's
        "total_positions_seen": before["total_positions_seen"] + positions * settings.epochs,
        "first_batch": first, "last_batch": last, "heldout": figures,
        "train_s": round(time.perf_counter() - start, 1), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": cpu_info(),
    }
    tensors = {key: value.detach().contiguous() for key, value in net.state_dict().items()
               if not (settings.frozen_head and key in Eagle3Net.HEAD_KEYS)}
    return save_artifact(EAGLE3, directory, tensors, record, vocab)

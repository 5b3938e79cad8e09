"""Training data for self-distilled drafters: the frozen target's features, computed once and cached.

Text (never the Spec-Bench questions, which must not tune a drafter):

- answers: the prompts in ``prompts.txt`` (written for this project) through the target's chat
  template, each followed by the target's own answer, generated with the engine (plain decoding);
- corpus: Python's standard library sources and pydoc topics (``specdec_core.models.vocab.corpus``),
  cut at line ends into pieces of about one sequence, drawn in a seeded random order until they
  fill the token budget the answers leave.

Every sequence (one answer, or one corpus chunk of at most ``seq_len`` tokens) is run through the
frozen target teacher-forced once. Per position the cache keeps what any drafter trainer needs.

Cache format (``features_dir(target, dtype, settings)``: ``<cache root>/features/<target>/<key>/``,
the key a hash of the target's dtype, the data settings and the prompts; ``.lock`` makes concurrent
builders of one cache wait for each other)::

    plan.safetensors          tokens [N] int64, lengths [S] int64, heldout [S] bool: the sequences,
                              saved before extraction so that an interrupted run reuses the answers
    train-NNNNN.safetensors   per shard, positions of consecutive whole sequences:
    heldout-NNNNN.safetensors   hidden [n, H]: the target's final-normed last hidden state (model dtype),
                                tokens [n] int64: the token at each position,
                                predicted [n] int64: the target's argmax next token at each position,
                                lengths [m] int64: the shard's sequence lengths (they sum to n)
    meta.json                 format, target, settings, counts, shards; written last: its presence
                              means the cache is complete

The target's distribution at a position is lm_head(hidden) (soft labels need no extra storage);
``predicted`` is its argmax, kept because a 151k-row product per position is costly to redo.
EAGLE-style trainers pair hidden[t] with tokens[t+1]; Medusa head i learns predicted[t+i+1].
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from specdec_core.models.artifacts import save_tensors
from specdec_core.models.paths import cache_dir, held_alone
from specdec_core.models.runner import ModelRunner
from specdec_core.models.vocab import corpus

from .settings import DataSettings

log = logging.getLogger("specdec")

FORMAT = "specdec-features-2"
SHARD_POSITIONS = 4096  # positions per shard file: an interrupted extraction loses at most one shard
CHARS_PER_TOKEN = 4  # corpus pieces of seq_len x this many characters fill about one sequence each
GENERATION_BATCH = 16  # prompts answered together: the rows of a step share its reads of the weights


@dataclass
class FeatureSplit:
    """The cached positions of one split, flat over its sequences."""

    hidden: torch.Tensor  # [N, H]
    tokens: torch.Tensor  # [N]
    predicted: torch.Tensor  # [N]
    lengths: torch.Tensor  # [S]

    def __len__(self) -> int:
        return len(self.tokens)

    def remaining(self) -> torch.Tensor:
        """[N]: how many later positions each position's sequence still has (0 at a sequence's last)."""
        ends = self.lengths.cumsum(0).repeat_interleave(self.lengths)
        return ends - torch.arange(len(self)) - 1


@dataclass
class Features:
    """A complete feature cache: its directory, meta.json, and the two splits."""

    directory: Path
    meta: dict
    train: FeatureSplit
    heldout: FeatureSplit


def prompts() -> list[str]:
    """The training prompts (``prompts.txt``: one a line, ``#`` comments skipped)."""
    text = resources.files(__package__).joinpath("prompts.txt").read_text()
    return [line for line in text.splitlines() if line.strip() and not line.startswith("#")]


def answered_prompts(settings: DataSettings) -> list[str]:
    """The prompts the target answers for `settings`: the first `settings.prompts` (all when None)."""
    return prompts()[: settings.prompts]


def features_dir(target: str, dtype: str, settings: DataSettings) -> Path:
    """Where the features of `target` run in `dtype` (e.g. "bfloat16") for `settings` are cached."""
    # The dtype is part of the target's identity: a bf16 and an fp32 pass differ in features and predictions.
    identity = {"format": FORMAT, "dtype": dtype, **dataclasses.asdict(settings), "prompts": prompts()}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "features" / target.replace("/", "--") / key


def _dtype_name(runner: ModelRunner) -> str:
    return str(runner.dtype).removeprefix("torch.")


def chat_prompt_ids(runner: ModelRunner, prompt: str) -> list[int]:
    """The prompt as the target's chat template frames it (raw text for models without one)."""
    tokenizer = runner.tokenizer
    if not tokenizer.chat_template:
        return tokenizer.encode(prompt)
    messages = [{"role": "user", "content": prompt}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def answer_prompts(runner: ModelRunner, texts: list[str], settings: DataSettings, progress: bool = True) -> list[list[int]]:
    """Each prompt (chat-framed) followed by the target's own answer, decoded plainly in batches."""
    from specdec_core.control import Controller
    from specdec_core.engine import Engine
    from specdec_core.models.loading import eos_ids
    from specdec_core.sampling import SamplingParams
    from specdec_core.sequence import Sequence

    engine = Engine(runner, None, Controller(gamma_max=1), eos_ids(runner))
    answered = []
    # Counted in tokens: an answer's unused budget is counted when it stops, so the bar ends full.
    with tqdm(total=len(texts) * settings.answer_tokens, desc="answer prompts", unit="tok", disable=not progress) as bar:
        for start in range(0, len(texts), GENERATION_BATCH):
            batch = [
                Sequence(f"train-{start + i}", chat_prompt_ids(runner, text),
                         SamplingParams(temperature=settings.temperature, seed=settings.seed + start + i),
                         settings.answer_tokens)
                for i, text in enumerate(texts[start : start + GENERATION_BATCH])
            ]
            counted = 0
            for _ in engine.generate(batch):
                done = sum(len(seq.output_ids) + seq.remaining * seq.finished for seq in batch)
                bar.update(done - counted)
                counted = done
            bar.update(len(batch) * settings.answer_tokens - counted)  # answers a first token finished never step
            answered += [seq.tokens for seq in batch]
    return answered


def corpus_pieces(chars: int) -> list[str]:
    """The offline corpus cut at line ends into pieces of about `chars` characters."""
    pieces = []
    for text in corpus():
        current = ""
        for line in text.splitlines(keepends=True):
            current += line
            if len(current) >= chars:
                pieces.append(current)
                current = ""
        pieces += [current] if current else []
    return pieces


def corpus_chunks(runner: ModelRunner, settings: DataSettings) -> Iterator[list[int]]:
    """Token chunks of at most `seq_len` from the whole corpus in a seeded random order, tokenized as drawn."""
    pieces = corpus_pieces(CHARS_PER_TOKEN * settings.seq_len)
    for index in torch.randperm(len(pieces), generator=torch.Generator().manual_seed(settings.seed)).tolist():
        ids = runner.tokenizer.encode(pieces[index], add_special_tokens=False)[: settings.seq_len]
        if len(ids) > 1:  # a one-token chunk teaches nothing
            yield ids


def plan_sequences(runner: ModelRunner, settings: DataSettings, progress: bool = True) -> list[list[int]]:
    """The sequences to extract: the answered prompts, then corpus chunks up to `settings.tokens` positions."""
    texts = answered_prompts(settings)
    sequences = [ids[: settings.seq_len] for ids in answer_prompts(runner, texts, settings, progress)]
    budget = settings.tokens - sum(map(len, sequences))
    for chunk in corpus_chunks(runner, settings):
        if budget <= 1:
            break
        sequences.append(chunk[:budget])
        budget -= len(sequences[-1])
    return sequences


def _load_or_make_plan(
    runner: ModelRunner, settings: DataSettings, path: Path, progress: bool
) -> tuple[list[list[int]], list[bool]]:
    """The sequences and which are held out: from `path`, else planned (answers generated) and saved there."""
    if not path.is_file():
        sequences = plan_sequences(runner, settings, progress)
        lengths = torch.tensor([len(ids) for ids in sequences])
        # Counted per source from the middle of each run of `heldout_every`, so that even a few answers lend one.
        answered = len(answered_prompts(settings))
        index = torch.cat([torch.arange(answered), torch.arange(len(sequences) - answered)])
        heldout = index % settings.heldout_every == settings.heldout_every // 2
        tokens = torch.tensor([t for ids in sequences for t in ids])
        save_tensors({"tokens": tokens, "lengths": lengths, "heldout": heldout}, path)
    plan = load_file(str(path))
    return [ids.tolist() for ids in plan["tokens"].split(plan["lengths"].tolist())], plan["heldout"].tolist()


@torch.no_grad()
def target_features(runner: ModelRunner, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One teacher-forced pass over `ids`: final-normed last hidden states [n, H] and argmax next tokens [n]."""
    input_ids = torch.tensor([ids], device=runner.device)
    hidden = runner.model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state[0]
    predicted = runner.model.get_output_embeddings()(hidden).argmax(dim=-1)
    return hidden.cpu(), predicted.cpu()


def _shards(sequences: list[list[int]]) -> list[list[list[int]]]:
    """`sequences` grouped, in order, into shards of about SHARD_POSITIONS positions."""
    shards, current, size = [], [], 0
    for ids in sequences:
        current.append(ids)
        size += len(ids)
        if size >= SHARD_POSITIONS:
            shards.append(current)
            current, size = [], 0
    return shards + ([current] if current else [])


def extract(runner: ModelRunner, settings: DataSettings, progress: bool = True) -> Path:
    """Build the feature cache of `runner`'s target for `settings` (resuming an interrupted build); its directory."""
    directory = features_dir(runner.name, _dtype_name(runner), settings)
    directory.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    sequences, heldout = _load_or_make_plan(runner, settings, directory / "plan.safetensors", progress)
    files: dict[str, list[str]] = {}
    positions: dict[str, int] = {}
    with tqdm(total=sum(map(len, sequences)), desc=f"target features ({runner.name})", unit="tok",
              disable=not progress) as bar:
        for split, flag in (("train", False), ("heldout", True)):
            members = [ids for ids, held in zip(sequences, heldout) if held == flag]
            shards = _shards(members)
            files[split] = [f"{split}-{number:05d}.safetensors" for number in range(len(shards))]
            positions[split] = sum(map(len, members))
            for name, shard in zip(files[split], shards):
                if (directory / name).is_file():
                    bar.update(sum(map(len, shard)))
                else:
                    save_tensors(_shard_tensors(runner, shard, bar), directory / name)
    meta = {
        "format": FORMAT,
        "target": runner.name,
        "settings": dataclasses.asdict(settings),
        "hidden_size": runner.config.hidden_size,
        "dtype": _dtype_name(runner),
        "sequences": {"train": heldout.count(False), "heldout": heldout.count(True)},
        "positions": positions,
        "sources": _sources(sequences, settings),
        "files": files,
        "extract_s": round(time.perf_counter() - start, 1),  # of the run that completed the cache
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (directory / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return directory


def _sources(sequences: list[list[int]], settings: DataSettings) -> dict:
    """How many positions came from the target's answers (the plan's first sequences) and from the corpus."""
    answered = len(answered_prompts(settings))
    answers = sum(map(len, sequences[:answered]))
    return {"answers": {"prompts": answered, "positions": answers},
            "corpus": {"text": "Python stdlib sources and pydoc topics", "positions": sum(map(len, sequences)) - answers}}


def _shard_tensors(runner: ModelRunner, sequences: list[list[int]], bar: tqdm) -> dict[str, torch.Tensor]:
    hidden, predicted = [], []
    for ids in sequences:
        h, p = target_features(runner, ids)
        hidden.append(h)
        predicted.append(p)
        bar.update(len(ids))
    return {
        "hidden": torch.cat(hidden).contiguous(),
        "tokens": torch.tensor([t for ids in sequences for t in ids]),
        "predicted": torch.cat(predicted),
        "lengths": torch.tensor([len(ids) for ids in sequences]),
    }


def load_split(directory: Path, names: list[str]) -> FeatureSplit:
    """The shards `names` of one split, concatenated."""
    shards = [load_file(str(directory / name)) for name in names]
    return FeatureSplit(*(torch.cat([shard[key] for shard in shards]) for key in ("hidden", "tokens", "predicted", "lengths")))


def features(runner: ModelRunner, settings: DataSettings, progress: bool = True) -> Features:
    """The cached features of `runner`'s target for `settings`, extracted first if not cached yet."""
    directory = features_dir(runner.name, _dtype_name(runner), settings)
    with held_alone(directory):
        if (directory / "meta.json").is_file():
            log.info("reusing cached target features at %s", directory)
        else:
            extract(runner, settings, progress)
    meta = json.loads((directory / "meta.json").read_text())
    return Features(directory, meta, load_split(directory, meta["files"]["train"]), load_split(directory, meta["files"]["heldout"]))

"""The data engine's second stage: the target's hidden states at three depths over its own answers (EAGLE-3's
inputs), and its final-normed last hidden state (what its output layer reads: the labels), per answers shard.

EAGLE-3 (Li et al. 2025) feeds its drafter the target's features from a low, a middle and a high layer: the
outputs of decoder layers 2, N/2 and N-3 of N (counted from 1), as SpecForge takes them. Each answers shard
(answers.py) gives one features shard, every sequence run through the target teacher-forced once:

    <cache root>/depth-features/<target>/<key>/
        features-NNNNN.safetensors   low, middle, high, last [n, H] (the model's dtype), tokens [n] int64,
                                     lengths [S] int64 (the shard's sequences, prompt and answer),
                                     answer_starts [S] int64 (where each sequence's answer begins),
                                     ids [S] int64 (the prompts' ids)
        meta.json                    target, dtype, depths, per shard: its answers shard's sha256, positions,
                                     seconds, and which prompts it holds (all, or the held-out ones alone)

At bf16 that is 12 KB a position: 2M positions take 24 GB, so the features stay in the local cache (the
committed answers remake them) and a run stops and resumes by shard. The key is a hash of the target's dtype
and the depths; a features shard is remade when its answers shard changes, and made when one is added.

A training run reads the held-out prompts of the first shards whatever it trains on (one held-out set for every
run), so a run that trains on later shards makes only those prompts' features of the first ones: a twentieth of
their cost. A shard so made is made whole when a run trains on it.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from specdec_core.models.artifacts import save_tensors
from specdec_core.models.eagle3_net import feature_layers
from specdec_core.models.paths import cache_dir, held_alone
from specdec_core.models.runner import ModelRunner

from .answers import Shard, file_sha256

FORMAT = "specdec-depth-features-1"
ALL, HELD_OUT = "all", "held-out"  # which prompts of its answers shard a features shard holds


def features_dir(runner: ModelRunner) -> Path:
    """Where `runner`'s depth features are cached."""
    identity = json.dumps([FORMAT, str(runner.dtype), feature_layers(runner.config.num_hidden_layers)]).encode()
    return cache_dir() / "depth-features" / runner.name.replace("/", "--") / hashlib.sha256(identity).hexdigest()[:16]


@torch.no_grad()
def sequence_features(runner: ModelRunner, ids: list[int]) -> dict[str, torch.Tensor]:
    """One teacher-forced pass over `ids`: the outputs of the three depths and the final-normed last hidden state."""
    out = runner.model.get_decoder()(input_ids=torch.tensor([ids], device=runner.device), use_cache=False,
                                     output_hidden_states=True)
    hidden = out.hidden_states  # [0] the embeddings, [i] layer i's output
    low, middle, high = feature_layers(runner.config.num_hidden_layers)
    return {"low": hidden[low][0], "middle": hidden[middle][0], "high": hidden[high][0], "last": out.last_hidden_state[0]}


def shard_features(runner: ModelRunner, shard: Shard, bar: tqdm) -> dict[str, torch.Tensor]:
    """The features of every sequence of `shard`, concatenated, with their tokens, lengths, answer starts and ids."""
    parts: dict[str, list[torch.Tensor]] = {"low": [], "middle": [], "high": [], "last": []}
    for prompt, answer in zip(shard.prompts, shard.answers):
        for key, value in sequence_features(runner, prompt + answer).items():
            parts[key].append(value.cpu())
        bar.update(len(prompt) + len(answer))
    return {
        **{key: torch.cat(values).contiguous() for key, values in parts.items()},
        "tokens": torch.tensor([t for p, a in zip(shard.prompts, shard.answers) for t in p + a]),
        "lengths": torch.tensor([len(p) + len(a) for p, a in zip(shard.prompts, shard.answers)]),
        "answer_starts": torch.tensor([len(p) for p in shard.prompts]),
        "ids": torch.tensor(shard.ids),
    }


def features_name(answers_shard: Path) -> str:
    """The features shard's name of an answers shard (shard-00012.npz: features-00012)."""
    return answers_shard.stem.replace("shard", "features")


def answers_shards(answers: Path, shards: slice = slice(None)) -> list[Path]:
    """The answers shards `shards` of `answers`, in order; FileNotFoundError saying what to run when none is there."""
    chosen = sorted(answers.glob("shard-*.npz"))[shards]
    if not chosen:
        raise FileNotFoundError(f"no answers shards {shards.start or 0}:{'' if shards.stop is None else shards.stop} in "
                                f"{answers}: run `specdec train answers` first")
    return chosen


def held_out_part(shard: Shard, held_out: Callable[[torch.Tensor], torch.Tensor]) -> Shard:
    """`shard`'s held-out prompts (by `held_out` of their ids) and their answers alone."""
    keep = held_out(torch.tensor(shard.ids)).nonzero().squeeze(1).tolist()
    return Shard([shard.ids[i] for i in keep], [shard.prompts[i] for i in keep], [shard.answers[i] for i in keep])


def extract(runner: ModelRunner, answers: Path, progress: bool = True, shards: slice = slice(None),
            held_out: Callable[[torch.Tensor], torch.Tensor] | None = None, heldout_shards: int = 0) -> Path:
    """The depth features of the answers shards `shards` in `answers` (default all) and, with `held_out` (a rule
    on prompt ids), those of the held-out prompts of the first `heldout_shards`; what is cached already skipped.
    Their directory."""
    directory = features_dir(runner)
    wanted = {path: ALL for path in answers_shards(answers, shards)}
    if held_out is not None:
        for path in sorted(answers.glob("shard-*.npz"))[:heldout_shards]:
            wanted.setdefault(path, HELD_OUT)
    with held_alone(directory):
        meta_path = directory / "meta.json"
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {
            "format": FORMAT, "target": runner.name, "dtype": str(runner.dtype).removeprefix("torch."),
            "depths": feature_layers(runner.config.num_hidden_layers), "shards": {}}
        digests = {path: file_sha256(path) for path in wanted}

        def cached(path: Path) -> bool:  # a whole shard serves a request for its held-out part too
            entry = meta["shards"].get(features_name(path), {})
            return entry.get("answers_sha256") == digests[path] and (wanted[path] == HELD_OUT or entry.get("prompts", ALL) == ALL)

        loaded = {path: Shard.load(path) for path in wanted if not cached(path)}
        loaded = {path: held_out_part(shard, held_out) if wanted[path] == HELD_OUT else shard for path, shard in loaded.items()}
        total = sum(len(p) + len(a) for shard in loaded.values() for p, a in zip(shard.prompts, shard.answers))
        with tqdm(total=total, desc=f"depth features ({runner.name})", unit="pos", disable=not progress) as bar:
            for path, shard in loaded.items():
                began = time.perf_counter()
                name = features_name(path)
                tensors = shard_features(runner, shard, bar)
                save_tensors(tensors, directory / f"{name}.safetensors")
                seconds = time.perf_counter() - began
                meta["shards"][name] = {"answers_sha256": digests[path], "prompts": wanted[path],
                                        "positions": len(tensors["tokens"]), "seconds": round(seconds, 3),
                                        "positions_per_s": round(len(tensors["tokens"]) / seconds, 1)}
                partial = directory / "meta.json.partial"
                partial.write_text(json.dumps(meta, indent=1) + "\n")
                partial.replace(meta_path)
    return directory


def load_features(directory: Path) -> list[dict[str, torch.Tensor]]:
    """Every features shard `directory`'s meta.json lists, in order."""
    meta = json.loads((directory / "meta.json").read_text())
    return [load_file(str(directory / f"{name}.safetensors")) for name in sorted(meta["shards"])]

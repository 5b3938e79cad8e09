"""The data engine's first stage: the target's own greedy answers to the task prompts (task_prompts.py), in
shards that a stopped run resumes.

A run answers the prompts of ``data/train/prompts.jsonl.gz`` in order, `shard_prompts` at a time, with the
engine in continuous batches of `batch` rows (plain decoding: at that batch speculation does not pay). Each
shard is written whole, atomically, and a run skips the shards already on disk, so a stop loses at most the
shard under way. The shards are small (token ids, compressed) and committed, so no one generates them twice:
2M answer tokens take hours on these machines.

Every kernel family computes the same bits for a row (row invariance, tests/test_quant.py), so greedy answers
do not depend on the CPU: a shard records the family and CPU it was made on, and another machine resumes the
run. What does change the answers is refused: another target file, other prompts, other settings.

Directory (``data/train/answers/<target>/``)::

    manifest.json       target, its GGUF's sha256, the prompts file's sha256, the settings, and per shard:
                        its prompts, answer tokens, seconds, kernel family, CPU, date
    shard-NNNNN.npz     tokens [N] uint32 (each prompt's chat-framed ids then its answer, sequence after
                        sequence), prompt_lengths [S], answer_lengths [S], ids [S] (the prompts' ids)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections import deque
from pathlib import Path

import numpy as np
from tqdm import tqdm

from specdec_core.build import build_engine
from specdec_core.config import Config
from specdec_core.drafters.registry import NO_DRAFTER
from specdec_core.engine import Engine
from specdec_core.models import vnni
from specdec_core.models.catalogue import RegistryError, get_entry
from specdec_core.sampling import SamplingParams
from specdec_core.sequence import Sequence
from specdec_tools.cpu import cpu_info

from .data import chat_prompt_ids
from .settings import AnswerSettings
from .task_prompts import read_prompts

FORMAT = "specdec-answers-1"
ANSWERS_DIR = Path("data/train/answers")


class MismatchedRun(ValueError):
    """A directory's manifest was made for another target, other prompts or other settings."""


@dataclasses.dataclass
class Shard:
    """One shard's sequences: each prompt's chat-framed ids followed by the target's answer."""

    ids: list[int]
    prompts: list[list[int]]
    answers: list[list[int]]

    def save(self, path: Path) -> None:
        partial = path.with_name(path.name + ".partial.npz")
        np.savez_compressed(
            partial,
            tokens=np.array([t for p, a in zip(self.prompts, self.answers) for t in p + a], dtype=np.uint32),
            prompt_lengths=np.array([len(p) for p in self.prompts], dtype=np.int32),
            answer_lengths=np.array([len(a) for a in self.answers], dtype=np.int32),
            ids=np.array(self.ids, dtype=np.int32),
        )
        partial.replace(path)

    @classmethod
    def load(cls, path: Path) -> Shard:
        with np.load(path) as data:
            sequences = np.split(data["tokens"].astype(np.int64), np.cumsum(data["prompt_lengths"] + data["answer_lengths"])[:-1])
            prompts, answers = [], []
            for sequence, length in zip(sequences, data["prompt_lengths"]):
                prompts.append(sequence[:length].tolist())
                answers.append(sequence[length:].tolist())
            return cls(data["ids"].tolist(), prompts, answers)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def identity(target: str, prompts_path: Path, settings: AnswerSettings) -> dict:
    """What the answers depend on; a run resumes only a directory made with the same."""
    try:
        gguf_sha256 = get_entry(target).gguf_sha256
    except RegistryError:
        gguf_sha256 = None  # a model outside the registry (tests' tiny random one)
    return {"format": FORMAT, "target": target, "gguf_sha256": gguf_sha256, "prompts_sha256": file_sha256(prompts_path),
            "settings": dataclasses.asdict(settings)}


def _manifest(directory: Path, expected: dict) -> dict:
    path = directory / "manifest.json"
    if not path.is_file():
        return {**expected, "shards": []}
    manifest = json.loads(path.read_text())
    changed = [key for key in expected if manifest.get(key) != expected[key]]
    if changed:
        raise MismatchedRun(f"{directory} holds answers made with another {', '.join(changed)} "
                            f"({ {key: manifest.get(key) for key in changed} }); answer into a new --out directory")
    return manifest


def _write_manifest(directory: Path, manifest: dict) -> None:
    partial = directory / "manifest.json.partial"
    partial.write_text(json.dumps(manifest, indent=1) + "\n")
    partial.replace(directory / "manifest.json")


def answer_shard(engine: Engine, prompts: list[dict], settings: AnswerSettings, bar: tqdm) -> Shard:
    """The target's greedy answers to `prompts`, `settings.batch` rows at a time, a finished row's place taken by
    the next prompt (continuous batching); `bar` counts answer tokens, a row's unused budget when it stops."""
    waiting = deque(prompts)
    running: list[tuple[dict, Sequence]] = []
    done: dict[int, Sequence] = {}
    counted = 0
    while waiting or running:
        while waiting and len(running) < settings.batch:
            prompt = waiting.popleft()
            seq = Sequence(f"answer-{prompt['id']}", chat_prompt_ids(engine.target, prompt["text"]),
                           SamplingParams(temperature=0.0), settings.answer_tokens)
            engine.add(seq)
            running.append((prompt, seq))
        if engine.seqs:
            engine.step()
        for prompt, seq in [entry for entry in running if entry[1].finished]:
            if seq.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"prompt {prompt['id']} failed: {seq.finish_reason}")
            done[prompt["id"]] = seq
            running.remove((prompt, seq))
        decoded = sum(len(seq.output_ids) for _, seq in running) + sum(
            settings.answer_tokens for seq in done.values())
        bar.update(decoded - counted)
        counted = decoded
    ordered = [done[prompt["id"]] for prompt in prompts]
    return Shard([prompt["id"] for prompt in prompts], [seq.prompt_ids for seq in ordered], [seq.output_ids for seq in ordered])


def answer(config: Config, directory: Path, prompts_path: Path, count: int | None, settings: AnswerSettings,
           progress: bool = True) -> dict:
    """Answer the first `count` prompts of `prompts_path` (all when None) into `directory`, resuming what is there;
    the manifest."""
    prompts = read_prompts(prompts_path)[:count]
    target = config.model.target
    directory.mkdir(parents=True, exist_ok=True)
    manifest = _manifest(directory, identity(target, prompts_path, settings))
    starts = range(0, len(prompts), settings.shard_prompts)
    # A shard counts once the manifest lists it: one saved just before a stop, unlisted, is made again.
    listed = {entry["file"] for entry in manifest["shards"]}
    todo = [start for start in starts if _shard_name(start, settings) not in listed]
    if not todo:
        return manifest
    engine = build_engine(config, drafter=NO_DRAFTER)
    total = sum(len(prompts[start : start + settings.shard_prompts]) for start in todo) * settings.answer_tokens
    with tqdm(total=total, desc=f"answers ({target}, {len(todo)} of {len(starts)} shards to go)", unit="tok",
              disable=not progress) as bar:
        for start in todo:
            began = time.perf_counter()
            shard = answer_shard(engine, prompts[start : start + settings.shard_prompts], settings, bar)
            seconds = time.perf_counter() - began
            name = _shard_name(start, settings)
            shard.save(directory / name)
            answer_tokens = sum(map(len, shard.answers))
            positions = answer_tokens + sum(map(len, shard.prompts))
            manifest["shards"] = sorted(
                [entry for entry in manifest["shards"] if entry["file"] != name] + [{
                    "file": name, "prompts": [start, start + len(shard.ids)], "answer_tokens": answer_tokens,
                    "positions": positions, "seconds": round(seconds, 3),
                    "answer_tokens_per_s": round(answer_tokens / seconds, 1), "kernel": vnni.family(),
                    "cpu": cpu_info()["cpu"], "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                }], key=lambda entry: entry["file"])
            manifest["totals"] = {key: sum(entry[key] for entry in manifest["shards"])
                                  for key in ("answer_tokens", "positions", "seconds")}
            _write_manifest(directory, manifest)
    return manifest


def _shard_name(start: int, settings: AnswerSettings) -> str:
    return f"shard-{start // settings.shard_prompts:05d}.npz"

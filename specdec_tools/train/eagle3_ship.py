"""Shipping a trained EAGLE-3 drafter in the repository (`specdec train eagle3-ship`): its matrices as int8 rows
(the server quantizes them to its serving precision at load), beside a manifest of what made it, under
specdec_core/shipped/<target>-eagle3/, where a config that names no drafter weights finds it."""

from __future__ import annotations

import json
import time
from pathlib import Path

from specdec_core.models.artifacts import EAGLE3, INT8_ROWS, load_artifact, save_artifact, target_gguf_sha256, to_int8_rows

from .answers import ANSWERS_DIR

MAX_BYTES = 64 << 20  # what the repository takes per shipped drafter


def training_command(meta: dict, name: str, config_path: str) -> str:
    """The `specdec train eagle3` command that trains the drafter `meta` describes again, as `name` (from the
    snapshot it started from, if any)."""
    train = meta["train"]
    train = {"length_window": 1, **train}  # before the setting, batches were cut at random
    options = [f"--{key.replace('_', '-')} {train[key]}"
               for key in ("steps", "epochs", "lr", "warmup", "lr_floor", "vocab_size", "intermediate_size",
                           "batch_sequences", "noise", "length_window") if key in train]
    numbers = sorted(int(shard.rsplit("-", 1)[1]) for shard in meta["data"]["answers_sha256"])
    options.append(f"--shards {numbers[-1] + 1}" if numbers[0] == 0 else f"--shards {numbers[0]}:{numbers[-1] + 1}")
    if train.get("frozen_head"):
        options.append("--frozen-head")
    if meta.get("init"):
        options.append(f"--init {meta['init']['from']}")
    options.append(f"--precision {'bf16' if train.get('bf16', False) else 'fp32'}")
    return f"specdec train eagle3 --config {config_path} --out {name} {' '.join(options)}"


def ship(name: str, target: str, config_path: str, out: Path | None = None) -> dict:
    """Ship the trained drafter `name` for `target` (to `out`, default the target's shipped place); its manifest.
    Raises ValueError when the file would pass MAX_BYTES."""
    artifact = load_artifact(EAGLE3, name, target, config_path=config_path)
    meta = artifact.meta
    answers = ANSWERS_DIR / target / "manifest.json"
    prompts_sha256 = json.loads(answers.read_text())["prompts_sha256"] if answers.is_file() else None
    manifest = {
        "what": "EAGLE-3 drafter", "target": target, "gguf_sha256": target_gguf_sha256(target), "stored": INT8_ROWS,
        "data": {"prompts": "data/train/prompts.jsonl.gz", "prompts_sha256": prompts_sha256,
                 "answers": str(answers), "positions": meta["data"]["positions"],
                 "answers_sha256": meta["data"].get("answers_sha256")},
        "heldout": meta["heldout"],
        "commands": [f"specdec train answers --config {config_path}",  # train eagle3 makes the features it reads
                     training_command(meta, Path(name).name, config_path),
                     f"specdec train eagle3-ship {Path(name).name} --config {config_path}"],
        "shipped": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    stored = to_int8_rows(artifact.tensors)
    size = sum(tensor.numel() * tensor.element_size() for tensor in stored.values())
    if size > MAX_BYTES:
        raise ValueError(f"{name}: {size / 2**20:.1f} MiB stored, more than the {MAX_BYTES >> 20} MiB the repository "
                         f"takes: train a narrower drafter (--intermediate-size) or a smaller --vocab-size")
    directory = out or EAGLE3.shipped(target)
    save_artifact(EAGLE3, directory, stored, {**meta, "stored": INT8_ROWS}, artifact.vocab, manifest=manifest)
    return json.loads((directory / "manifest.json").read_text())

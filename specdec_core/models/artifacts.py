"""Trained drafters on disk: one store for Medusa heads, EAGLE networks and distilled students.

An artifact is a directory, ``<cache root>/<folder>/<name>/`` or one given as a path, of two files:
``<file>.safetensors``, the trained weights (plus ``vocab_ids`` when it predicts over a reduced
vocabulary), and ``<file>.json``, what it is and what it was trained on, the target among them::

    heads/<name>/      heads.safetensors    heads.json      specdec train medusa
    eagle/<name>/      eagle.safetensors    eagle.json      specdec train eagle
    eagle3/<name>/     eagle3.safetensors   eagle3.json     specdec train eagle3
    students/<name>/   student.safetensors  student.json    specdec train distill

Saving writes a new directory beside the old one and renames it into place, so a reader finds the
previous artifact or the whole new one, never a mix. Loading checks that the artifact was trained
for the target it is loaded for. An artifact missing, or trained for another target, raises
`MissingArtifactError`, whose message is the command that trains it. A training run keeps its
checkpoint beside the directory (`checkpoint_path`), where saving does not touch it.

A shipped artifact (committed in the repository, specdec_core/shipped/) also holds ``manifest.json``: its
weights file's sha256 and the sha256 of the target's GGUF file it was trained on, both checked before it
loads, and what made it (data, commands). Its matrices may be stored as int8 rows (`int8_rows`) to keep
the file small; loading gives them back as float.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .catalogue import RegistryError, get_entry
from .fetch import sha256_file
from .paths import cache_dir
from .vocab import ReducedVocab

VOCAB_KEY = "vocab_ids"
MANIFEST = "manifest.json"
INT8_ROWS = "int8-rows"  # meta["stored"]: each matrix as int8 codes and a bf16 scale per row (key + SCALE_SUFFIX)
SCALE_SUFFIX = ".row_scale"
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "shipped"  # specdec_core/shipped: committed, trained drafters
LEGACY_CHECKPOINT = "checkpoint.pt"  # where trainers kept their checkpoint, inside the directory, before it moved beside


class MissingArtifactError(FileNotFoundError):
    """A trained drafter that a config names is not there, or was trained for another target."""


@dataclass(frozen=True)
class ArtifactKind:
    what: str  # as messages name it
    folder: str  # under the cache root
    file: str  # the files' stem
    trainer: str  # `specdec train <trainer>` makes it
    suffix: str  # of the default name, <target>-<suffix>

    @property
    def weights_file(self) -> str:
        return f"{self.file}.safetensors"

    @property
    def meta_file(self) -> str:
        return f"{self.file}.json"

    def default_name(self, target: str) -> str:
        """The name the trainer saves under when --out is not given."""
        return f"{target}-{self.suffix}"

    def shipped(self, target: str) -> Path:
        """Where the repository ships this kind's artifact for `target` (it may ship none)."""
        return SHIPPED_DIR / self.default_name(target)

    def default(self, target: str) -> str | Path:
        """What a config that names no artifact loads: the one shipped for `target`, else the default name."""
        shipped = self.shipped(target)
        return shipped if (shipped / self.meta_file).is_file() else self.default_name(target)

    def train_command(self, target: str, name: str, config_path: str | None = None) -> str:
        """The command that trains the artifact `name` for `target` (with `config_path` when given)."""
        config = config_path or f"<a config whose model.target is {target}>"
        return f"specdec train {self.trainer} --config {config} --out {name}"


HEADS = ArtifactKind("Medusa heads", "heads", "heads", "medusa", "medusa")
EAGLE = ArtifactKind("EAGLE network", "eagle", "eagle", "eagle", "eagle")
EAGLE3 = ArtifactKind("EAGLE-3 drafter", "eagle3", "eagle3", "eagle3", "eagle3")
STUDENT = ArtifactKind("distilled student", "students", "student", "distill", "distilled")


@dataclass
class Artifact:
    """A loaded artifact: its directory, its JSON, its tensors (the vocabulary's ids taken out) and vocabulary."""

    directory: Path
    meta: dict
    tensors: dict[str, torch.Tensor]
    vocab: ReducedVocab | None  # None: the full vocabulary


def artifact_dir(kind: ArtifactKind, name_or_path: str | Path) -> Path:
    """An existing directory as given, else ``<cache root>/<kind's folder>/<name>``."""
    path = Path(name_or_path)
    return path if path.is_dir() else cache_dir() / kind.folder / path


def checkpoint_path(directory: Path) -> Path:
    """Where a training run into `directory` keeps its checkpoint: beside it, ``<name>.checkpoint.pt``."""
    return directory.with_name(f"{directory.name}.checkpoint.pt")


def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write `tensors` to `path` through ``<path>.partial``, renamed into place: a reader never sees half a file."""
    partial = path.with_name(f"{path.name}.partial")
    save_file(tensors, str(partial))
    partial.replace(path)


def save_artifact(kind: ArtifactKind, directory: str | Path, tensors: dict[str, torch.Tensor], meta: dict,
                  vocab: ReducedVocab | None = None, manifest: dict | None = None) -> dict:
    """Save `tensors` (and `vocab`'s ids) and `meta` (and the vocabulary's sizes) as the artifact `directory`,
    replacing what was there; the JSON's dict. With `manifest`, a shipped artifact's manifest too (plus the
    weights file's sha256 and size). Refuses a directory holding files of something else."""
    directory = Path(directory).absolute()  # "." too has a name to put the new directory beside
    if vocab is not None:
        tensors = {**tensors, VOCAB_KEY: vocab.ids.cpu().contiguous()}
    meta = {**meta, "vocab_size": None if vocab is None else vocab.size,
            "full_vocab_size": None if vocab is None else vocab.full_size}
    ours = {kind.weights_file, kind.meta_file, MANIFEST, LEGACY_CHECKPOINT}
    others = sorted(p.name for p in directory.iterdir() if p.name not in ours) if directory.is_dir() else []
    if others:
        raise ValueError(f"{directory} holds other files than a {kind.what} ({', '.join(others[:3])}); "
                         f"save it elsewhere")
    new = directory.with_name(f"{directory.name}.partial-{os.getpid()}")
    shutil.rmtree(new, ignore_errors=True)
    new.mkdir(parents=True)
    save_file(tensors, str(new / kind.weights_file))
    (new / kind.meta_file).write_text(json.dumps(meta, indent=2) + "\n")
    if manifest is not None:
        weights = new / kind.weights_file
        manifest = {**manifest, "file": kind.weights_file, "sha256": sha256_file(weights), "bytes": weights.stat().st_size}
        (new / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    # rename(2) cannot replace a directory that is not empty: the old one steps aside first, then goes.
    old = new.with_name(f"{new.name}.old")
    if directory.exists():
        os.replace(directory, old)
    os.replace(new, directory)
    shutil.rmtree(old, ignore_errors=True)
    return meta


def load_artifact(kind: ArtifactKind, name_or_path: str | Path, target: str, *, config_path: str | None = None,
                  hidden_size: int | None = None, full_vocab_size: int | None = None, device: str = "cpu") -> Artifact:
    """The artifact `name_or_path` (a name under the cache root, or a directory) trained for `target` (and its
    `hidden_size`, when given), its tensors on `device`. Raises MissingArtifactError naming the command that
    trains it (with `config_path` when given) when it is missing or another target's. `full_vocab_size`: the
    target's vocabulary, for artifacts that did not record it (EAGLE's before this store)."""
    directory = artifact_dir(kind, name_or_path)
    label = str(name_or_path)
    command = kind.train_command(target, label, config_path)
    meta_path = directory / kind.meta_file
    if not meta_path.is_file():
        raise MissingArtifactError(f"{kind.what} {label!r} for {target} is not trained (no {meta_path}); "
                                   f"train it with: {command}")
    meta = json.loads(meta_path.read_text())
    if meta.get("target") != target or hidden_size not in (None, meta.get("hidden_size")):
        mine = "" if hidden_size is None else f" (hidden size {hidden_size})"
        raise MissingArtifactError(
            f"{kind.what} {label!r} was trained for {meta.get('target')!r} (hidden size {meta.get('hidden_size')}), "
            f"not {target!r}{mine}; train one for it with: {command}"
        )
    if (directory / MANIFEST).is_file():
        check_manifest(kind, directory, target, command)
    tensors = load_file(str(directory / kind.weights_file), device=device)
    if meta.get("stored") == INT8_ROWS:
        tensors = from_int8_rows(tensors)
    ids = tensors.pop(VOCAB_KEY, None)
    vocab = None if ids is None else ReducedVocab(ids.long(), meta.get("full_vocab_size") or full_vocab_size)
    return Artifact(directory, meta, tensors, vocab)


def target_gguf_sha256(target: str) -> str | None:
    """The pinned sha256 of `target`'s GGUF file; None for a model outside the registry (tests' tiny ones)."""
    try:
        return get_entry(target).gguf_sha256
    except RegistryError:
        return None


def check_manifest(kind: ArtifactKind, directory: Path, target: str, command: str) -> None:
    """Refuse a shipped artifact whose weights are not the file its manifest names, or that was trained on
    another GGUF file of `target` than the one the registry pins (MissingArtifactError, with `command`)."""
    manifest = json.loads((directory / MANIFEST).read_text())
    actual = sha256_file(directory / kind.weights_file)
    if actual != manifest.get("sha256"):
        raise MissingArtifactError(
            f"{directory / kind.weights_file} is not the file its manifest names (sha256 {actual}, manifest "
            f"{manifest.get('sha256')}): restore it (git checkout -- {directory}) or train one with: {command}")
    pinned = target_gguf_sha256(target)
    if manifest.get("gguf_sha256") != pinned:
        raise MissingArtifactError(
            f"{kind.what} in {directory} was trained on another GGUF file of {target} (sha256 "
            f"{manifest.get('gguf_sha256')}, this server's is {pinned}); train one for it with: {command}")


def to_int8_rows(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Float matrices as int8 codes with a bf16 scale per row (symmetric: w ~ code * scale); vectors as bf16;
    other tensors (the vocabulary's ids) as they are."""
    stored = {}
    for key, value in tensors.items():
        if not value.is_floating_point():
            stored[key] = value
        elif value.dim() == 2:
            scale = (value.float().abs().amax(dim=1) / 127).clamp(min=1e-12).bfloat16()
            stored[key] = (value.float() / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
            stored[key + SCALE_SUFFIX] = scale
        else:
            stored[key] = value.bfloat16()
    return stored


def from_int8_rows(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What `to_int8_rows` stored, as float32."""
    tensors = {}
    for key, value in stored.items():
        if key.endswith(SCALE_SUFFIX):
            continue
        scale = stored.get(key + SCALE_SUFFIX)
        tensors[key] = value.float() * scale.float()[:, None] if scale is not None else (
            value.float() if value.is_floating_point() else value)
    return tensors

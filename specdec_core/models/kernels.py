"""Building our C++ kernels (quant_avx512.cpp, quant_avx2.cpp, attention.cpp) with torch's extension builder, once per machine.

The builds live under specdec's cache, so that an image built with its weights has the kernels too;
torch rebuilds one when its source or flags change, and skips the build (quietly) when they have not.
They need g++ and ninja; a kernel that cannot be built is None, and its caller says what it does
instead.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("specdec")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags /proc/cpuinfo gives this CPU (empty where it cannot be read), read once: a read costs tens of
    microseconds (Linux samples every core's clock for it), and the attention kernel's lookup asks once a layer."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.split(":", 1)[-1].split())


def build(name: str, source: Path, flags: list[str], what: str) -> ModuleType | None:
    """The extension `name` compiled from `source` with `flags`, or None (logged) when it cannot be built."""
    from .paths import cache_dir

    # -fopenmp: at::parallel_for is inline OpenMP; without it a kernel runs on one thread. The
    # extension then shares the libgomp torch has loaded (same soname).
    build_dir = cache_dir() / "kernels" / f"{name}-torch{torch.__version__}"
    built = build_dir / f"{name}.so"
    if built.exists() and built.stat().st_mtime >= source.stat().st_mtime:
        log.info("kernels: loading %s built in %s", what, build_dir)
    else:
        log.info("kernels: building %s in %s (once per machine, about a minute)", what, build_dir)
    try:
        return load_alone(build_dir, name=name, sources=[str(source)], extra_cflags=["-O3", "-fopenmp", *flags],
                          extra_ldflags=["-fopenmp"])
    except (RuntimeError, OSError, ImportError) as error:
        log.warning("kernels: could not build %s (%s); it needs g++ and ninja (`pip install ninja`)", what, error)
        return None


def load_alone(build_dir: Path, **load_args) -> ModuleType:
    """torch's extension `load(**load_args)` into `build_dir` (made if missing), one process at a time, by an flock
    that the OS releases when its holder dies. torch's own lock is a file (`lock`) that a process killed while it
    builds or loads leaves behind, and every later load then waited for it forever (a server stopped in its first
    start's build hung every start after it); holding the flock, no process of ours is in the builder here, so such
    a file is stale and goes."""
    from torch.utils.cpp_extension import load

    from .paths import held_alone

    with held_alone(build_dir):
        (build_dir / "lock").unlink(missing_ok=True)
        return load(build_directory=str(build_dir), **load_args)


def traceable(kernel: Callable, fake: Callable) -> Callable:
    """`kernel` (a type-annotated call into an extension) as torch.compile can trace it: the custom op
    specdec::<its name>, with `fake` giving its output's shape. Eager callers call it directly."""
    op = torch.library.custom_op(f"specdec::{kernel.__name__}", kernel, mutates_args=())
    op.register_fake(fake)

    def call(*args):
        return op(*args) if torch.compiler.is_compiling() else kernel(*args)

    return call

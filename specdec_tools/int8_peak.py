"""The CPU's int8 multiply-add peak per instruction family, measured here (int8_peak.cpp): what a pass's
multiply-adds a second are set against (step_costs). Each family's chains are timed on the passes' threads for
about `seconds`; where the CPU lacks a family, it is left out.

    python -m specdec_tools.int8_peak [--threads 2]
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from types import ModuleType

import torch

from specdec_core.models.kernels import build, cpu_flags

# Per family: the CPU flags it needs and the multiply-adds one iteration of a thread's chains does (12 chains of
# 64 byte products on a zmm register, 32 on ymm; AMX: 4 tiles of 16 x 16 int32, each over 64 bytes).
FAMILIES = {
    "avx512_vnni": (("avx512f", "avx512bw", "avx512_vnni"), 12 * 64),
    "avx_vnni": (("avx2", "avx_vnni"), 12 * 32),
    "avx2": (("avx2",), 12 * 32),
    "amx_int8": (("amx_tile", "amx_int8"), 4 * 16 * 16 * 64),
}
# Our kernel family's (vnni.family()) products, on its own instructions: what its passes' rates are set against.
KERNEL_FAMILY_PEAK = {"avx512": "avx512_vnni", "avxvnni": "avx_vnni", "avx2": "avx2"}


@functools.cache
def extension() -> ModuleType | None:
    """The probe, built once per machine (None, logged, where it cannot be)."""
    return build("specdec_int8_peak", Path(__file__).with_name("int8_peak.cpp"), [], "the int8 peak probe")


def families() -> list[str]:
    """The families this CPU runs (AMX where Linux also grants the tile state)."""
    runs = [name for name, (flags, _) in FAMILIES.items() if set(flags) <= cpu_flags()]
    if "amx_int8" in runs and not extension().request_tiles():
        runs.remove("amx_int8")
    return runs


def chains(family: str, iterations: int, threads: int) -> tuple[float, int]:
    """`iterations` of `family`'s chains on each of `threads` threads: seconds, and the threads' checksums summed."""
    return getattr(extension(), family)(iterations, threads)


def peak(family: str, threads: int, seconds: float = 0.3) -> float:
    """`family`'s multiply-adds a second on `threads` threads, G/s: the best of three runs of about `seconds`."""
    per_iteration = FAMILIES[family][1]
    iterations = 1000
    while (elapsed := chains(family, iterations, threads)[0]) < seconds / 10:  # size a run to about `seconds`
        iterations *= 10
    iterations = max(int(iterations * seconds / elapsed), 1)
    best = min(chains(family, iterations, threads)[0] for _ in range(3))
    return per_iteration * iterations * threads / best / 1e9


def peaks(threads: int | None = None, seconds: float = 0.3) -> dict:
    """Every family this CPU runs: its int8 multiply-adds a second (G/s) on `threads` threads (torch's)."""
    threads = threads or torch.get_num_threads()
    if extension() is None:
        return {}
    return {"threads": threads, "label": "G int8 multiply-adds a second, register-resident chains (specdec_tools/int8_peak.cpp)",
            "g_macs_per_s": {family: round(peak(family, threads, seconds), 1) for family in families()}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, help="threads (default: torch's)")
    parser.add_argument("--seconds", type=float, default=0.3, help="about how long each timed run takes (default: %(default)s)")
    args = parser.parse_args(argv)
    print(json.dumps(peaks(args.threads, args.seconds), indent=1))


if __name__ == "__main__":
    main()

"""The CPU a measurement ran on, as every run file records it: light, so that the load tester needs no torch."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_info() -> dict:
    """The CPU's name and the flags that place it among the project's CPU kinds (docs/BENCHMARKS.md)."""
    cpu, flags = platform.processor() or "unknown", []
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                cpu = value.strip()
            elif key.strip() == "flags" and not flags:
                # The ones that decide bf16 speed on CPU (MODELS.md): AVX-512 bf16 and AMX tiles.
                flags = [f for f in ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in value.split()]
    return {"cpu": cpu, "cpu_flags": flags}

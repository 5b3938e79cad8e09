"""A pytest plugin that runs the kernel's tests on a CPU without AVX-512, AMX or AVX-VNNI: it builds
quant_avx512.cpp and quant_avx2.cpp's AVX-VNNI variant against tests/kernel_emulation.h (SIMDe's portable
AVX-512 and a scalar model of the AMX tiles) and serves those builds as the avx512 and avxvnni families'
kernels, with the CPU flags they want (the AVX2 family runs natively on any x86 CPU). It checks the
kernels' logic (layouts, tile shapes, the order of the float epilogue), not their speed, and is not loaded
by default:

    pip install simde-py
    python -m pytest -p tests.emulated_kernel tests/test_quant.py
"""

from __future__ import annotations

from pathlib import Path

import simde_py
import torch

from specdec_core.models import vnni
from specdec_core.models.kernels import load_alone
from specdec_core.models.paths import cache_dir

EMULATED = ("avx512", "avxvnni")


def _emulated(family: str):
    """`family`'s kernel file built on SIMDe with its own defines, for any CPU with AVX2."""
    build_dir = cache_dir() / "kernels" / f"{family}-emulated-torch{torch.__version__}"
    defines = [flag for flag in vnni.FAMILIES[family].compile_flags if flag.startswith("-D")]
    return load_alone(build_dir, name=f"specdec_{family}_emulated", sources=[str(vnni.FAMILIES[family].source)],
                      extra_cflags=["-O2", "-fopenmp", "-mavx2", "-mfma", "-mf16c", "-DSPECDEC_KERNEL_EMULATION", *defines,
                                    *vnni.NO_CONTRACTION, f"-I{simde_py.get_include()}", f"-I{Path(__file__).parent}"],
                      extra_ldflags=["-fopenmp"])


_kernels = {family: _emulated(family) for family in EMULATED}
_real_flags, _real_family_kernel = vnni._cpu_flags, vnni.family_kernel
vnni.family_kernel = lambda name: _kernels.get(name) or _real_family_kernel(name)
vnni._cpu_flags = lambda: _real_flags() | {flag for family in EMULATED for flag in vnni.FAMILIES[family].cpu_flags} | set(vnni.AMX_FLAGS)
# The start's timings (register blocks, the far prefetch, AMX tiles or not) would time emulated passes over copies
# 1.5x this CPU's last-level cache, minutes on a large one, to choose by a speed that means nothing here: every
# variant times level, so each choice takes its default (the tests run the others explicitly).
vnni._pass_ms = lambda kernel, rows, variants: dict.fromkeys(variants, 1.0)

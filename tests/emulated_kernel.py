"""A pytest plugin that runs the kernel's tests on a CPU without AVX-512 or AMX: it builds
quant_avx512.cpp against tests/kernel_emulation.h (SIMDe's portable AVX-512 and a scalar model of the
AMX tiles) and serves that build as the avx512 family's kernel, with the CPU flags it wants (the AVX2
family runs natively on any x86 CPU). It checks the kernel's
logic (layouts, tile shapes, the order of the float epilogue), not its speed, and is not loaded by
default:

    pip install simde-py
    python -m pytest -p tests.emulated_kernel tests/test_quant.py
"""

from __future__ import annotations

from pathlib import Path

import simde_py
import torch
from torch.utils.cpp_extension import load

from specdec_core.models import vnni
from specdec_core.models.paths import cache_dir

_build_dir = cache_dir() / "kernels" / f"vnni-emulated-torch{torch.__version__}"
_build_dir.mkdir(parents=True, exist_ok=True)
_kernel = load(name="specdec_vnni_emulated", sources=[str(vnni.FAMILIES["avx512"].source)], build_directory=str(_build_dir),
               extra_cflags=["-O2", "-fopenmp", "-mavx2", "-mfma", "-mf16c", "-DSPECDEC_KERNEL_EMULATION", *vnni.NO_CONTRACTION,
                             f"-I{simde_py.get_include()}", f"-I{Path(__file__).parent}"],
               extra_ldflags=["-fopenmp"])
_real_flags, _real_family_kernel = vnni._cpu_flags, vnni.family_kernel
vnni.family_kernel = lambda name: _kernel if name == "avx512" else _real_family_kernel(name)
vnni._cpu_flags = lambda: _real_flags() | set(vnni.FAMILIES["avx512"].cpu_flags) | set(vnni.AMX_FLAGS)

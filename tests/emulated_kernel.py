"""A pytest plugin that runs the kernel's tests on a CPU without AVX-512 or AMX: it builds vnni.cpp
against tests/kernel_emulation.h (SIMDe's portable AVX-512 and a scalar model of the AMX tiles) and
serves that build as vnni.extension(), with the CPU flags the kernel wants. It checks the kernel's
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
_kernel = load(name="specdec_vnni_emulated", sources=[str(vnni.SOURCE)], build_directory=str(_build_dir),
               extra_cflags=["-O2", "-fopenmp", "-mavx2", "-mfma", "-mf16c", "-DSPECDEC_KERNEL_EMULATION",
                             f"-I{simde_py.get_include()}", f"-I{Path(__file__).parent}"],
               extra_ldflags=["-fopenmp"])
_real_flags = vnni._cpu_flags
vnni.extension = lambda: _kernel
vnni._cpu_flags = lambda: _real_flags() | set(vnni.CPU_FLAGS) | set(vnni.AMX_FLAGS)

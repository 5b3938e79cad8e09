"""The static step's glue between its linear layers, fused (step_ops.cpp): a residual add with the RMSNorm
after it, and the rotary embedding with the cache write, each one call instead of several ATen ops, and
each transformers' numbers bit for bit. Built once per machine like our other kernels; where it cannot
run (a GPU, a pass being compiled, no compiler) the static step calls the modules themselves.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from .kernels import build

SOURCE = Path(__file__).with_name("step_ops.cpp")


@functools.cache
def extension() -> ModuleType | None:
    """The compiled ops, or None where they cannot be built (logged)."""
    return build("specdec_step_ops", SOURCE, [], "the static step's fused ops")


def for_pass(hidden: torch.Tensor) -> ModuleType | None:
    """The fused ops for a pass over `hidden`, or None where the pass calls the modules: off the CPU, while
    torch.compile traces the pass (inductor fuses these chains itself), or without the built ops."""
    if hidden.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    return extension()

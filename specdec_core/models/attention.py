"""Row-invariant attention for decode and verify passes.

Speculation is invisible only if each row of a verify pass computes, bit for bit, what a one-token step
computes at that position; otherwise near-ties flip and greedy text differs from plain decoding's. SDPA's
row i depends on the pass: its kernels block the reductions by the number of query rows, and they run
over the whole slot tensor, whose layout (holes where drafts were refused, other rows' lengths) differs
between a speculative run and a plain one. Our kernel (attention.cpp) takes each query row against its
own slots in token order, in a fixed order of arithmetic, so a row's output is the same whatever the
pass length, the tree or the batch around it.

The linear layers must be row-invariant too: torch's int4 and int8 CPU kernels and ours are (each output
row is its own dot products), float GEMMs are not (`ModelRunner.row_invariant`).

Registered as a transformers attention implementation, `IMPLEMENTATION`: a pass given `row_slots` takes
the kernel, any other (prefill, drafters' passes, transformers' generate) takes SDPA. The kernel is built
once per kernel family (vnni.family(), so SPECDEC_ISA chooses it too), each build with the same bits.
Where the CPU has AMX-BF16 tiles (and SPECDEC_ISA is unset or amx), bf16 passes take the avx512 build's tile
path instead (`tiles`): row-invariant too, but with its own bits (bf16 weights into the weighted sums), so a
process takes it for every pass or for none.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import vnni
from .kernels import build, cpu_flags, log, traceable

IMPLEMENTATION = "specdec"
SOURCE = Path(__file__).with_name("attention.cpp")


@dataclass
class RowSlots:
    """The key slots each query row of a pass attends, in token order: row (b, i)'s are
    slots[offsets[b * k + i] : offsets[b * k + i + 1]]."""

    slots: torch.Tensor  # [attended pairs] long
    offsets: torch.Tensor  # [B * k + 1] long


def row_slots(allowed: torch.Tensor) -> RowSlots:
    """RowSlots from allowed [B, k, S] (query attends slot), computed once per pass for every layer. A
    row's tokens sit in its slots in order (the cache only appends and compacts), so slot order is token
    order."""
    pairs = allowed.flatten(0, 1).nonzero()  # [(row, slot)], sorted by row, then slot
    counts = allowed.sum(-1).flatten()
    return RowSlots(pairs[:, 1].contiguous(), torch.cat([counts.new_zeros(1), counts.cumsum(0)]))


def takes(config, dtype: torch.dtype) -> bool:
    """Whether the kernel can serve a model: float32 or bfloat16, full attention in every layer (no sliding window)."""
    layers = getattr(config, "layer_types", None) or ["full_attention"]
    return dtype in (torch.float32, torch.bfloat16) and set(layers) == {"full_attention"}


# The attention kernel's build per kernel family (vnni.family()), widest first: the avx512 family's takes AVX-512
# registers, the avx2 family's AVX2 ones, with the same bits; with neither, plain C++. Each -m flag names the CPU
# flag it needs.
BUILD_FLAGS = {"avx512": ["-mavx512f", "-mavx2", "-mfma"], "avx2": ["-mavx2", "-mfma"], None: []}


def build_runs_here(family: str | None) -> bool:
    """Whether this CPU runs the instructions of `family`'s build, by its own flags (not vnni's, which tests of
    the emulated kernel stand another CPU in for)."""
    return {flag.removeprefix("-m") for flag in BUILD_FLAGS[family]} <= cpu_flags()


def extension() -> ModuleType | None:
    """The compiled kernel for this process's kernel family, or the next narrower build where this CPU cannot run
    that one (the emulated avx512 kernel's tests on an AVX2 CPU), or None where it cannot be built (then passes
    are not row-invariant)."""
    builds = list(BUILD_FLAGS)
    family = {"avxvnni": "avx2"}.get(vnni.family(), vnni.family())  # its attention has no dot products of bytes
    return family_extension(next(f for f in builds[builds.index(family):] if build_runs_here(f)))


@functools.cache
def family_extension(family: str | None) -> ModuleType | None:
    """The kernel built for `family` (a BUILD_FLAGS key), or None where it cannot be built."""
    name = "specdec_attention" + (f"_{family}" if family else "")
    # No contraction: no build fuses a scalar tail's product and sum into one rounding where another does not.
    return build(name, SOURCE, [*BUILD_FLAGS[family], *vnni.NO_CONTRACTION],
                 f"the row-invariant attention kernel ({family or 'plain C++'})")


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    row_slots: RowSlots | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [B, H, k, d], key and value [B, Hkv, S, d] -> [B, k, H, d]: row by row over `row_slots`
    when given, else SDPA."""
    if row_slots is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    return attend_rows(query, key, value, row_slots.slots, row_slots.offsets, scaling), None


def tiles_granted() -> bool:
    """Whether passes may attend on AMX tiles: the avx512 build is this process's, the CPU has AMX-BF16, Linux
    grants the tile state, and SPECDEC_ISA asks for no path without tiles (avx2, avxvnni, avx512). Settled once
    per kernel family and SPECDEC_ISA (once per process but in tests that force a family): every pass of a
    process must take the same path."""
    return _tiles_granted(vnni.family(), vnni.isa())


@functools.cache
def _tiles_granted(family: str | None, isa: str | None) -> bool:
    """Logged once, where the CPU has the tiles: whether bf16 passes attend on them, and why not."""
    has_tiles = vnni.bf16_tiles()
    granted = (has_tiles and isa in (None, "amx") and extension() is family_extension("avx512") is not None
               and extension().amx_enable())
    if has_tiles:
        why = f"{vnni.ISA_ENV}={isa or 'unset'}" + ("" if granted or isa not in (None, "amx") else ", but no avx512 build or tile state")
        log.info("attention: row-invariant bf16 passes on %s (%s)", "AMX-BF16 tiles" if granted else "AVX registers", why)
    return granted


# Tools that time both paths in one process set this (`without_tiles`); passes never do.
_tiles_off = False


def tiles(query: torch.Tensor) -> bool:
    """Whether a pass attends on AMX tiles (attention.cpp's AMX-BF16 path): bf16 heads of a multiple of 32 up to
    256, where `tiles_granted`. On a Xeon with AMX (Qwen2.5-1.5B's heads, 2 threads) a 128-row chunk over 2,048
    positions took 12.1 ms a layer on the AVX-512 path, 5.1 on the tiles, 2.0 on SDPA; 32 rows over 256 positions
    0.6, 0.13 and 0.15 ms (docs/benchmarks/NOTES.md, issue 30)."""
    return attends_on_tiles(query.dtype, query.shape[-1])


def attends_on_tiles(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether passes of `dtype` over heads of `head_dim` attend on AMX tiles (`tiles`): for what sizes a model's
    passes before any runs (its prefill chunks, build_engine)."""
    return dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= 256 and not _tiles_off and tiles_granted()


@contextlib.contextmanager
def without_tiles() -> Iterator[None]:
    """Passes attend on the AVX paths meanwhile, where they would take the tiles: for tools that time both."""
    global _tiles_off
    _tiles_off = True
    try:
        yield
    finally:
        _tiles_off = False


def _attend_rows(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, offsets: torch.Tensor, scaling: float
) -> torch.Tensor:
    return extension().attend(query, key, value, slots, offsets, scaling, tiles(query))


def _attend_rows_shape(query, key, value, slots, offsets, scaling):
    batch, heads, k, head_dim = query.shape
    return query.new_empty(batch, k, heads, head_dim)


# query [B, H, k, d] against key and value [B, Hkv, S, d] at each row's slots (RowSlots' tensors) -> [B, k, H, d].
attend_rows = traceable(_attend_rows, _attend_rows_shape)


AttentionInterface.register(IMPLEMENTATION, attention)
# Masks built as for SDPA (transformers' generate, 2-D masks), so that every other pass is SDPA's to the bit.
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)

"""Our CPU kernel for quantized linear layers: int4 or int8 weights times int8 activations, one
kernel file per ISA family (quant_avx512.cpp, quant_avx2.cpp, sharing quant_kernel.h), the family
chosen at start from the CPU flags.

torch's CPU int4 kernel converts every weight to a float per token, and its int8 kernel multiplies
in floats too; this one multiplies integer codes, as llama.cpp does: on AVX-512 VNNI with
`vpdpbusd`, on AVX2 with `vpmaddubsw` (or with AVX-VNNI's `vpdpbusd` on ymm where the CPU has it
and lacks AVX-512 VNNI), and passes of AMX_MIN_ROWS to DEQUANTIZE_ROWS - 1 rows (verification,
short prefills) with `tdpbsud` on AMX tiles where the CPU has them and they are faster there (timed at
start; one Xeon's tiles lost to VNNI, another's win from 12 rows; docs/QUANT.md has the costs). Every path
computes bit-identical results, so a row's result never depends on the pass, nor on the CPU.
Weights are group-wise, w = q * scale + min per 32 inputs, in one packed layout for every family
(named after VNNI's operands); a GGUF file's K-quants keep their super-blocks of 256 inputs with integer
sub-scales (the K formats, quant_kernel.h; activations rounded to int8 per 256 inputs for them). A family is
compiled once per machine with torch's extension builder (g++ and ninja; about a minute); where no family runs, `quant.Int4Linear` / `quant.Int8Linear` keep
torch's kernels.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from .kernels import build, cpu_flags, traceable

log = logging.getLogger("specdec")

GROUP_SIZE = 32  # inputs per scale and min; fixed by the kernel
ROWS = 16  # output rows per block: one AVX-512 register of int32 sums
SUPER_BLOCK = 256  # a GGUF K-quant's inputs per float scale: a K format's block along the inputs (quant_kernel.h)
# packed.size(2) of each format: our group formats' code widths, and the K formats' 64-byte lines per super-block.
FORMATS = {4: "int4", 6: "int6", 8: "int8", 35: "q4_k", 52: "q6_k"}


@dataclass(frozen=True)
class KernelFamily:
    """One ISA family's kernel file, the CPU flags it needs and the flags it is compiled with."""

    name: str
    title: str
    source: Path
    cpu_flags: tuple[str, ...]
    compile_flags: tuple[str, ...]


_HERE = Path(__file__).parent
# GCC fuses a * b + c into one rounding where -mfma allows; the step's ops (step_ops.h) round as torch does.
NO_CONTRACTION = ("-ffp-contract=off",)
# Widest first: where SPECDEC_ISA is unset, the first the CPU runs.
FAMILIES = {
    "avx512": KernelFamily("specdec_avx512", "AVX-512 VNNI", _HERE / "quant_avx512.cpp",
                           ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma"),
                           ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma", *NO_CONTRACTION)),
    # quant_avx2.cpp again, on AVX-VNNI's vpdpbusd (ymm): CPUs with it but without AVX-512 VNNI.
    "avxvnni": KernelFamily("specdec_avxvnni", "AVX-VNNI", _HERE / "quant_avx2.cpp", ("avx2", "fma", "f16c", "avx_vnni"),
                            ("-mavx2", "-mfma", "-mf16c", "-mavxvnni", "-DSPECDEC_AVX_VNNI", *NO_CONTRACTION)),
    "avx2": KernelFamily("specdec_avx2", "AVX2", _HERE / "quant_avx2.cpp", ("avx2", "fma", "f16c"),
                         ("-mavx2", "-mfma", "-mf16c", *NO_CONTRACTION)),
}
AMX_FLAGS = ("amx_tile", "amx_int8")
# SPECDEC_ISA forces the path of the integer passes: "avx2", "avxvnni" or "avx512" (every pass on that family's dot
# products), or "amx" (the avx512 family, with passes of AMX_MIN_ROWS rows or more on AMX-INT8 tiles where
# the CPU has them). Unset, the widest family the CPU runs, and the tiles where they run and pass TILES_ROWS rows
# faster than VNNI does (`tiles_faster`, timed at start): on one Xeon with AMX they lost at every length (a tile
# store and a float epilogue per group of 32 inputs; docs/QUANT.md, "AMX, measured"), on another they win from 12
# rows ("AMX tiles for verify passes").
ISA_ENV = "SPECDEC_ISA"
ISAS = ("avx2", "avxvnni", "avx512", "amx")
# Where the CPU multiplies bf16 on AMX tiles (`dequantizes_long_passes`), from this many rows (a long prompt's
# prefill) dequantizing the weights to bf16 and multiplying on the tiles beats the VNNI dot products: on a Xeon
# with AMX, VNNI with 8 rows per register block: 12.8 ms against 17.4 at 128 rows, level at 256, 51 against 26 at
# 512; AMX-INT8 tiles no faster (docs/QUANT.md).
DEQUANTIZE_ROWS = 128
# Where the bf16 weights are kept (quant.keep_dequantized: a prefill's chunks) the product costs no dequantization,
# and on AMX (oneDNN's bf16 matmul on tiles, the weights prepacked: kept_weights) it wins sooner: the 1.5B's whole
# pass on a Xeon with AMX, 2 threads, the kernel's time 0.93x the product's at 32 rows, 1.06x at 48, 1.20x at 64,
# 1.41x at 96 (docs/QUANT.md).
DEQUANTIZE_ROWS_KEPT_AMX = 48
# Set through `row_invariant` while a pass must compute each row as the single steps it stands for do (a verify
# pass): it takes the kernel at any number of rows, since the bf16 GEMM past DEQUANTIZE_ROWS rounds otherwise.
# A module global, not a context variable, so that a compiled step's guards see it.
row_invariant_pass = False
# Where the tiles are chosen, from this many rows a pass runs on them: on a Xeon with AMX (2 threads) a pass of the
# 1.5B's layers took 1.12-1.15x VNNI's time at 8 rows, 0.89-1.04x at 12, 0.81-0.90x at 16 (docs/QUANT.md).
AMX_MIN_ROWS = 12
# The rows of the pass tiles_faster times: where the tiles win at all, they win here.
TILES_ROWS = 16


_cpu_flags = cpu_flags  # a module attribute, so that tests can stand in another CPU


def isa() -> str | None:
    """The kernel path SPECDEC_ISA asks for (one of ISAS), or None when it is unset."""
    chosen = os.environ.get(ISA_ENV)
    if chosen is not None and chosen not in ISAS:
        raise ValueError(f"{ISA_ENV}={chosen!r} is not one of {', '.join(ISAS)}")
    return chosen


def runs_here(family: str) -> bool:
    """Whether this CPU has every instruction `family` (a FAMILIES key) is built with."""
    return all(flag in _cpu_flags() for flag in FAMILIES[family].cpu_flags)


@functools.cache
def family() -> str | None:
    """The family this process's passes run on: SPECDEC_ISA's where this CPU runs it, else the widest it
    runs; None where it runs none (then torch's kernels). Logged once."""
    asked = {"amx": "avx512"}.get(isa(), isa())
    usable = [name for name in FAMILIES if runs_here(name)]
    if asked is not None and asked not in usable:
        log.warning("quantize: %s=%s, but this CPU lacks %s", ISA_ENV, isa(),
                    ", ".join(flag for flag in FAMILIES[asked].cpu_flags if flag not in _cpu_flags()))
    chosen = asked if asked in usable else next(iter(usable), None)
    if chosen is None:
        log.info("quantize: this CPU lacks AVX2 (%s); using torch's int4 / int8 kernels", ", ".join(FAMILIES["avx2"].cpu_flags))
    return chosen


@functools.cache
def family_kernel(name: str) -> ModuleType | None:
    """Family `name`'s compiled kernel, or None where it cannot be built (logged)."""
    chosen = FAMILIES[name]
    kernel = build(chosen.name, chosen.source, list(chosen.compile_flags), f"the {chosen.title} kernel")
    if kernel is None:
        log.warning("quantize: using torch's int4 / int8 kernels, which are slower")
    else:
        if hasattr(kernel, "set_register_blocks"):
            kernel.set_register_blocks(register_blocks(kernel))
        kernel.set_far_prefetch(far_prefetch(kernel))
    return kernel


# Groups of weights (24 KB of int4 a weight stream) the kernels also prefetch into L2, where far_prefetch finds it
# faster: on a Xeon with AMX, 2 threads, the static step of the 1.5B in one interleaved run took 0.96x the time at
# 1 and 4 tokens, 0.95x at 8, 0.98x and 0.96x at 16 and 32 (48 groups: 0.95-0.98x; 192: 0.96-0.99x; docs/QUANT.md).
FAR_PREFETCH_GROUPS = 96
# What register_blocks, far_prefetch and tiles_faster time: passes of a gate/up-sized int4 layer, over copies that
# outgrow the CPU's last-level cache (a decode step reads its weights from memory; 1.5x the cache, at least 8 copies,
# at most 1 GiB), interleaved round by round. On a Xeon whose VM reports 480 MB of L3, 8 copies (69 MB) passed from
# cache, 0.17 ms a pass against 0.31-0.34 ms from memory, where register blocks of 1 and 2 timed level (0.167 /
# 0.166 ms), so the start chose either, though from memory 2 is faster (0.316 against 0.337).
BLOCKS_LAYER, BLOCKS_MIN_COPIES, BLOCKS_MOST_BYTES, BLOCKS_ROUNDS = (8960, 1536), 8, 2**30, 15


def last_level_cache_bytes() -> int:
    """The largest cache Linux reports for the first CPU (sysfs), 0 where it reports none."""
    sizes = [0]
    for size in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = size.read_text().strip()
        if text[:-1].isdigit() and text[-1] in "KMG":
            sizes.append(int(text[:-1]) << {"K": 10, "M": 20, "G": 30}[text[-1]])
    return max(sizes)


def timing_copies(layer_bytes: int, cache_bytes: int) -> tuple[int, int]:
    """How many copies of a layer of `layer_bytes` the start's timings pass over, and in how many rounds: enough
    copies to outgrow a cache of `cache_bytes`, and fewer rounds the more copies (about as many passes as 8 copies
    in 15 rounds make, at least 5 rounds)."""
    wanted = math.ceil(1.5 * cache_bytes / layer_bytes)
    copies = max(BLOCKS_MIN_COPIES, min(wanted, BLOCKS_MOST_BYTES // layer_bytes))
    return copies, max(5, BLOCKS_ROUNDS * BLOCKS_MIN_COPIES // copies)


@functools.cache
def _timing_layer() -> tuple[torch.Tensor, torch.Tensor]:
    """BLOCKS_LAYER packed from random int4 codes, once per process: packing takes about half a second, and a host
    times two or three things with it (register_blocks, far_prefetch, tiles_faster)."""
    generator = torch.Generator().manual_seed(0)
    n, k = BLOCKS_LAYER
    codes = torch.randint(0, 16, (n, k), generator=generator)
    scales = torch.rand(n, k // GROUP_SIZE, generator=generator) / 16
    return pack(codes, scales, -8 * scales, bits=4)


def _pass_ms(kernel: ModuleType, rows: int, variants: dict[object, Callable[[], None]]) -> dict[object, float]:
    """Each variant's median time (ms) for a pass of `rows` rows through BLOCKS_LAYER on `kernel`, with tiles where
    the variant's setup returns True; the variants interleaved round by round."""
    packed, scale_min = _timing_layer()
    copies, rounds = timing_copies(packed.nbytes + scale_min.nbytes, last_level_cache_bytes())
    layers = [(packed.clone(), scale_min.clone()) for _ in range(copies)]
    x = torch.randn(rows, BLOCKS_LAYER[1], generator=torch.Generator().manual_seed(1))
    seconds: dict[object, list[float]] = {variant: [] for variant in variants}
    for _ in range(rounds):
        for variant, setup in variants.items():
            tiles = bool(setup())
            start = time.perf_counter()
            for weights, scale_and_min in layers:
                kernel.mm(x, weights, scale_and_min, tiles)
            seconds[variant].append(time.perf_counter() - start)
    return {variant: 1e3 * statistics.median(times) / copies for variant, times in seconds.items()}


def register_blocks(kernel: ModuleType) -> int:
    """The AVX-512 kernel's 16-row blocks per register block in short passes, 1 or 2, whichever passes one row
    faster on this CPU (timed here, logged): on a Xeon 2 (two weight streams in flight), on an AMD EPYC (Zen 4) 1,
    where 2 took 1.5x the time of a 8960 x 1536 layer (docs/QUANT.md). The same bits either way."""
    ms = _pass_ms(kernel, 1, {blocks: functools.partial(kernel.set_register_blocks, blocks) for blocks in (1, 2)})
    chosen = min(ms, key=ms.get)
    log.info("quantize: short passes in register blocks of %d x 16 rows (one row of %d x %d: %.3f ms against %.3f ms)",
             chosen, *BLOCKS_LAYER, ms[chosen], ms[3 - chosen])
    return chosen


def far_prefetch(kernel: ModuleType) -> int:
    """Groups of weights the kernel prefetches into L2 beyond its near prefetch: FAR_PREFETCH_GROUPS or none,
    whichever passes one row faster on this CPU (timed here, logged). The same bits either way."""
    ms = _pass_ms(kernel, 1, {groups: functools.partial(kernel.set_far_prefetch, groups) for groups in (0, FAR_PREFETCH_GROUPS)})
    chosen = min(ms, key=ms.get)
    log.info("quantize: weights prefetched into L2 %s (one row of %d x %d: %.3f ms, %.3f ms %s)",
             f"{chosen} groups ahead" if chosen else "by the CPU alone", *BLOCKS_LAYER, ms[chosen],
             ms[FAR_PREFETCH_GROUPS - chosen], "without" if chosen else f"{FAR_PREFETCH_GROUPS} groups ahead")
    return chosen


def tiles_faster(kernel: ModuleType) -> bool:
    """Whether AMX tiles pass TILES_ROWS rows faster than VNNI on this CPU (timed here, logged). The same bits
    either way; only the speed differs between Xeons (docs/QUANT.md)."""
    ms = _pass_ms(kernel, TILES_ROWS, {tiles: (lambda tiles=tiles: tiles) for tiles in (False, True)})
    log.info("quantize: %d rows of %d x %d: %.3f ms on AMX tiles, %.3f ms on VNNI", TILES_ROWS, *BLOCKS_LAYER, ms[True], ms[False])
    return ms[True] < ms[False]


def extension() -> ModuleType | None:
    """The compiled kernel of this process's family, or None where no family runs or builds."""
    return None if family() is None else family_kernel(family())


@functools.cache
def amx_missing() -> str | None:
    """Why AMX tiles cannot run here, or None where they can: the CPU has AMX-INT8 and Linux grants the tile state."""
    if not runs_here("avx512") or family_kernel("avx512") is None:
        return "no AVX-512 VNNI kernel"
    missing = [flag for flag in AMX_FLAGS if flag not in _cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    if not family_kernel("avx512").amx_enable():
        return "Linux refused the tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
    return None


@functools.cache
def _tiles_chosen() -> bool:
    """Whether passes of AMX_MIN_ROWS rows or more run on AMX tiles: where they can run, SPECDEC_ISA=amx or, with
    SPECDEC_ISA unset, where they are faster here. Logged once."""
    tiles_run = family() == "avx512" and amx_missing() is None
    if tiles_run and isa() == "amx":
        chosen, reason = True, f"{ISA_ENV}=amx"
    elif tiles_run and isa() is None:
        chosen = tiles_faster(extension())
        reason = f"{ISA_ENV} unset, {'faster' if chosen else 'AMX tiles slower'} here"
    else:
        chosen, reason = False, f"{ISA_ENV}=amx, but {amx_missing()}" if isa() == "amx" else f"{ISA_ENV}={isa() or 'unset'}"
    if chosen:
        log.info("quantize: passes of %d rows or more on AMX-INT8 tiles (%s), shorter ones on AVX-512 VNNI; from %d "
                 "rows, passes that need not be exact take the bf16 product", AMX_MIN_ROWS, reason, DEQUANTIZE_ROWS)
    elif family() is not None:
        log.info("quantize: %s on %s (%s)", f"passes below {DEQUANTIZE_ROWS} rows" if dequantizes_long_passes() else "every pass",
                 FAMILIES[family()].title, reason)
    return chosen


def choose_anew() -> None:
    """Forget the path chosen, so that the next pass chooses again from SPECDEC_ISA and the CPU (tools, tests)."""
    for cached in (family, amx_missing, _tiles_chosen):
        cached.cache_clear()


@torch.compiler.assume_constant_result  # settled once per process: a compiled pass takes it as a constant
def amx() -> bool:
    """Whether passes of AMX_MIN_ROWS rows or more run on AMX tiles."""
    return _tiles_chosen()


def format_name(packed: torch.Tensor) -> str:
    """The packed weights' format: int4, int6 or int8 (per 32 inputs), or q4_k or q6_k (a GGUF file's super-blocks)."""
    return FORMATS[packed.shape[2]]


def inputs_per_block(packed: torch.Tensor) -> int:
    """The inputs one block of `packed` spans along dim 1: 32, or a K format's 256."""
    return SUPER_BLOCK if format_name(packed).startswith("q") else GROUP_SIZE


def supports(out_features: int, in_features: int, group_size: int, device: torch.device) -> bool:
    return (device.type == "cpu" and group_size == GROUP_SIZE and out_features % ROWS == 0
            and in_features % GROUP_SIZE == 0 and extension() is not None)


def pack(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes q [N, K] in 0..2^bits - 1 with scales and mins [N, K / 32] (w = q * scale + min) in the
    kernel's layout: packed [N/16, K/32, bits, 64] uint8 and scale_min [N/16, K/32, 2, 16] float16."""
    return _pack_codes(q, bits), _per_block(scales, mins)


def pack_super(q: torch.Tensor, sub_scales: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor | None, bits: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF K-quant in the kernel's K format (quant_kernel.h): codes q [N, K] (4 bits: Q4_K, 6: Q6_K), the file's
    sub-scale bytes [N, K / 256 * e] (Q4_K's 12 bytes of 6-bit scales and mins, Q6_K's 16 int8 scales), and float16 d
    and dmin [N, K / 256] (w = d * sc * q - dmin * m; Q6_K: None, its dmin 32 d): packed [N/16, K/256, 35 or 52, 64]
    uint8 and scale_min [N/16, K/256, 2 (Q6_K: 1), 16] float16."""
    n, k = q.shape
    supers = k // SUPER_BLOCK
    codes = _pack_codes(q, bits).reshape(n // ROWS, supers, -1)
    # Byte b of 16 rows side by side: [N, S * e] -> [N/16, S, e * 16].
    subs = sub_scales.contiguous().view(torch.uint8).reshape(n // ROWS, ROWS, supers, -1).permute(0, 2, 3, 1)
    packed = torch.cat([codes, subs.reshape(n // ROWS, supers, -1)], dim=2)
    return packed.reshape(n // ROWS, supers, -1, 64).contiguous(), _per_block(d, *([] if dmin is None else [dmin]))


def _per_block(*fields: torch.Tensor) -> torch.Tensor:
    """Float16 fields [N, B] (one per row and block of inputs: scales and mins, or a Q6_K's d alone) as
    [N/16, B, fields, 16]."""
    n, blocks = fields[0].shape
    per_group = torch.stack([field.half() for field in fields]).view(len(fields), n // ROWS, ROWS, blocks)
    return per_group.permute(1, 3, 0, 2).contiguous()


def _pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes q [N, K] as [N/16, K/32, bits, 64] uint8: 8 operands a group (quant_kernel.h)."""
    n, k = q.shape
    # Operand i of a group holds inputs 4i..4i+3 of 16 rows, row-major (quant_kernel.h).
    operands = q.to(torch.uint8).view(n // ROWS, ROWS, k // GROUP_SIZE, 8, 4).permute(0, 2, 3, 1, 4)
    if bits in (4, 6):  # operands 2c and 2c + 1 share chunk c: low and high nibbles
        nibbles = operands & 0x0F
        chunks = [nibbles[:, :, 0::2] | nibbles[:, :, 1::2] << 4]
        if bits == 6:  # then operands 4c..4c + 3's top two bits share chunk 4 + c, 2 bits each from the bottom
            tops = operands >> 4
            chunks.append(tops[:, :, 0::4] | tops[:, :, 1::4] << 2 | tops[:, :, 2::4] << 4 | tops[:, :, 3::4] << 6)
        operands = torch.cat(chunks, dim=2)
    return operands.reshape(n // ROWS, k // GROUP_SIZE, bits, 64).contiguous()


def _vnni_dequantize_t(packed: torch.Tensor, scale_min: torch.Tensor) -> torch.Tensor:
    return extension().dequantize_t(packed, scale_min)


def dequantize_exact(packed: torch.Tensor, scale_min: torch.Tensor) -> torch.Tensor:
    """The weights [N, K] in float32, each its exact value rounded once (as the gguf package gives a GGUF tensor's)."""
    return extension().dequantize_t(packed, scale_min, float32=True).T


def _vnni_mm(x: torch.Tensor, packed: torch.Tensor, scale_min: torch.Tensor, tiles: bool) -> torch.Tensor:
    return extension().mm(x, packed, scale_min, tiles)


# The weights, transposed: [K, N] bf16.
dequantize_t = traceable(
    _vnni_dequantize_t,
    lambda packed, scale_min: packed.new_empty(packed.shape[1] * inputs_per_block(packed), packed.shape[0] * ROWS, dtype=torch.bfloat16),
)
_mm = traceable(_vnni_mm, lambda x, packed, scale_min, tiles: x.new_empty(x.shape[0], packed.shape[0] * ROWS))


@contextmanager
def row_invariant(on: bool) -> Iterator[None]:
    """Passes inside take the kernel whatever their rows, where `on`."""
    global row_invariant_pass
    saved, row_invariant_pass = row_invariant_pass, on
    try:
        yield
    finally:
        row_invariant_pass = saved


def dequantizes(rows: int, kept: bool = False) -> bool:
    """Whether a pass of `rows` rows multiplies by dequantized bf16 weights instead of the kernel; `kept`: the
    layer keeps its bf16 weights."""
    return rows >= dequantize_rows(kept) and not row_invariant_pass


def dequantize_rows(kept: bool) -> float:
    """From how many rows a pass takes the bf16 product: sooner where the weights are kept and the CPU has AMX
    (never later than DEQUANTIZE_ROWS, which tools lower to force the product); never where long passes stay on
    the kernel (`dequantizes_long_passes`)."""
    if not dequantizes_long_passes():
        return math.inf
    return min(DEQUANTIZE_ROWS, DEQUANTIZE_ROWS_KEPT_AMX) if kept and bf16_tiles() else DEQUANTIZE_ROWS


def dequantizes_long_passes() -> bool:
    """Whether long passes (prefills) take the bf16 product at all: where the CPU multiplies bf16 on AMX tiles.
    Elsewhere the kernel wins at every length: on an AMD EPYC (Zen 4: AVX-512 VNNI and bf16, no AMX), 2 threads,
    the 1.5B's whole pass took 0.45-0.76x the kept bf16 product's time at 32-512 tokens, and the AVX2 family's
    layers were level with that product at 128-512 rows, where an AVX2-only CPU's product has no bf16
    instructions at all (docs/QUANT.md). There a prefill computes every row as decoding does."""
    return bf16_tiles()


@functools.cache
def bf16_tiles() -> bool:
    """Whether this CPU multiplies bf16 on AMX tiles (torch's bf16 GEMM takes them where it does)."""
    return "amx_bf16" in _cpu_flags()


def mm(x: torch.Tensor, packed: torch.Tensor, scale_min: torch.Tensor, dequantized: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (contiguous) @ dequant(weights).T, in x's dtype. Below `dequantize_rows` rows x is rounded
    to int8 per 32 inputs, and each row's result is the same whatever the number of rows and whichever
    path (AVX2, VNNI or AMX) takes it (a verify pass computes what single steps do); from there on the
    weights are dequantized to bf16, or `dequantized` (`kept_weights`') is taken, unless the pass must be
    row-invariant (`row_invariant`)."""
    rows = x.shape[0]
    if dequantizes(rows, dequantized is not None):
        if dequantized is not None and dequantized.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x.to(dequantized.dtype), dequantized, None, "none", [None], "").to(x.dtype)
        weights = dequantize_t(packed, scale_min) if dequantized is None else dequantized
        return torch.mm(x, weights.to(x.dtype))
    tiles = rows >= AMX_MIN_ROWS and amx()
    if x.dtype not in (torch.float32, torch.bfloat16):  # the kernel reads and writes these two
        return _mm(x.float(), packed, scale_min, tiles).to(x.dtype)
    return _mm(x, packed, scale_min, tiles)


def kept_weights(packed: torch.Tensor, scale_min: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dequantized weights a layer keeps for its long passes (quant.keep_dequantized): `dequantize_t`'s [K, N],
    or, for bf16 passes on a CPU that multiplies bf16 on AMX tiles, those prepacked once for oneDNN's matmul
    ([N, K] in its blocked layout): torch.mm reorders them on every call, and took 1.1-1.8x the prepacked
    product's time per layer of the 1.5B at 96-192 rows (docs/QUANT.md)."""
    weights = dequantize_t(packed, scale_min)
    if dtype != torch.bfloat16 or not bf16_tiles():
        return weights
    return torch.ops.mkldnn._reorder_linear_weight(weights.to(dtype).T.contiguous(), DEQUANTIZE_ROWS)  # rows: a hint


def group_sums(x: torch.Tensor, packed: torch.Tensor, scale_min: torch.Tensor, tiles: bool) -> torch.Tensor:
    """The int32 sums [M, K/32, N] per row of x, group of 32 inputs and output, from this process's
    family, on AMX tiles where `tiles` asks (which needs amx_missing() to be None): for tests."""
    return extension().group_sums(x, packed, scale_min, tiles)

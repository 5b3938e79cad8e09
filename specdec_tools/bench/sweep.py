"""The batch sweep: plain and speculative decoding of B different prompts together, for growing B.

Large batches make the target's pass compute-bound, and then speculation only
adds work; the sweep shows at which B that happens on this machine. It stops
before a batch size that would not fit in memory or in the time limit, and
says so.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec_core.drafters.draft_model import DraftModelDrafter
from specdec_core.models.runner import ModelRunner

from .prompts import Prompt
from .runner import Bench, Method, Run, run_block

MEMORY_SHARE = 0.5  # use at most this share of free memory: the estimate below ignores transient copies


@dataclass
class SweepResult:
    runs: list[Run] = field(default_factory=list)
    completed: list[int] = field(default_factory=list)
    stopped: str | None = None


def kv_bytes_per_token(runner: ModelRunner) -> int:
    """Keys and values of one token over all layers."""
    cfg = runner.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * heads * head_dim * runner.dtype.itemsize


def batch_bytes(bench: Bench, batch: int, slots: int) -> int:
    """Rough peak memory of one batch: both models' KV caches plus float32 logits of a full verify pass."""
    drafts = {id(e.drafter.runner): e.drafter.runner for e in bench.engines.values() if isinstance(e.drafter, DraftModelDrafter)}
    runners = [bench.target, *drafts.values()]
    width = max(bench.config.speculation.gamma_max, *(c.fixed_gamma or 0 for c in bench.controllers.values())) + 1
    kv = sum(kv_bytes_per_token(r) for r in runners) * batch * slots
    # Logits, their softmax, and the draft's q: a few float32 copies of [batch, width, vocab].
    return kv + 3 * batch * width * bench.target.vocab_size * 4


def free_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    meminfo = Path("/proc/meminfo")
    if not meminfo.is_file():
        return None
    line = next(line for line in meminfo.read_text().splitlines() if line.startswith("MemAvailable"))
    return int(line.split()[1]) * 1024


def run_sweep(
    bench: Bench,
    methods: Sequence[Method],
    pool: Sequence[Prompt],
    sizes: Sequence[int],
    max_tokens: int,
    rows: int,
    plain_every: int,
    time_limit_s: float,
    on_run: Callable[[Run], None],
    on_block: Callable[[list[Run]], None],
) -> SweepResult:
    """Each size in turn: ceil(rows / B) batches of B prompts from `pool`, every method per batch."""
    result = SweepResult()
    spent, previous = 0.0, None  # previous: (size, seconds it took)
    for size in sizes:
        slots = max(len(bench.prompt_ids(p)) for p in pool) + max_tokens + bench.config.speculation.gamma_max + 1
        need, free = batch_bytes(bench, size, slots), free_bytes(bench.target.device)
        if free is not None and need > MEMORY_SHARE * free:
            result.stopped = (
                f"before batch {size}: it needs about {need / 2**30:.1f} GiB, "
                f"over {MEMORY_SHARE:.0%} of the {free / 2**30:.1f} GiB free"
            )
            break
        if previous:
            # Time per batch grows at most linearly with B (it is sublinear while memory-bound).
            projected = previous[1] * size / previous[0]
            if spent + projected > time_limit_s:
                result.stopped = (
                    f"before batch {size}: {spent / 60:.1f} min spent plus {projected / 60:.1f} min projected for it "
                    f"(batch {previous[0]} took {previous[1] / 60:.1f} min, scaled by {size}/{previous[0]}) would pass "
                    f"the {time_limit_s / 60:.1f} min of --sweep-time-limit"
                )
                break
        start = time.perf_counter()
        for block in range(blocks_at(size, rows)):
            prompts = [pool[(block * size + k) % len(pool)] for k in range(size)]
            runs = run_block(bench, methods, prompts, max_tokens, block, plain_every, on_run)
            result.runs += runs
            on_block(runs)
        elapsed = time.perf_counter() - start
        spent += elapsed
        previous = (size, elapsed)
        result.completed.append(size)
    return result


def blocks_at(size: int, rows: int) -> int:
    """How many batches the sweep decodes at batch size `size`."""
    return math.ceil(rows / size)

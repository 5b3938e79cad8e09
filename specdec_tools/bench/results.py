"""From runs to the records of results.json: one per (method, batch size, category or "all")."""

from __future__ import annotations

import os
import statistics
import platform
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import transformers

from ..cpu import cpu_info
from .prompts import Prompt
from .runner import Run
from .stats import PLAIN, share, summary

ALL = "all"
CONTROLLER_TOLERANCE = 0.05  # adaptive gamma should be within 5% of the best fixed choice


def record(method: str, batch_size: int, category: str, runs: Sequence[Run]) -> dict:
    """Pooled figures of a group of runs; speedups summarise the per-block ratios."""
    chosen = [g for run in runs for g in run.chosen_gammas]
    speculative = [g for g in chosen if g]
    matches = [m for run in runs for m in (run.matches_plain or [])]
    sampled = any(run.sampled for run in runs)
    engine_runs = [run for run in runs if run.prefill_s is not None]
    drafted = _sum_lists([run.drafted_per_position for run in runs])
    accepted = _sum_lists([run.accepted_per_position for run in runs])
    decode_s = sum(run.decode_s for run in engine_runs)
    return {
        "method": method,
        "batch_size": batch_size,
        "category": category,
        "prompts": len({p.id for run in runs for p in run.prompts}),
        "runs": len(runs),
        "new_tokens": sum(run.new_tokens for run in runs),
        "tokens_per_s": share(sum(run.new_tokens for run in runs), sum(run.wall_s for run in runs)),
        "decoded_tokens": sum(run.decoded_tokens for run in engine_runs) if engine_runs else None,
        "decode_tokens_per_s": share(sum(run.decoded_tokens for run in engine_runs), decode_s) if engine_runs else None,
        "speedup_vs_plain": summary([run.ratio for run in runs]),
        "decode_speedup_vs_plain": summary([run.decode_ratio for run in runs]),
        "acceptance_rate": share(sum(r.accepted_tokens for r in runs), sum(r.draft_tokens for r in runs)),
        "mean_accepted_length": share(sum(r.emitted_in_verify for r in runs), sum(r.verify_steps for r in runs)),
        "mean_gamma": share(sum(r.gamma_sum for r in runs), sum(r.verify_steps for r in runs)),
        "speculative_step_fraction": share(len(speculative), len(chosen)),
        "controller_mean_gamma": share(sum(speculative), len(speculative)),
        "greedy_match_rate": None if sampled else share(sum(matches), len(matches)),
        "seeded_match_rate": share(sum(matches), len(matches)) if sampled else None,
        "steps": sum(run.steps for run in engine_runs) if engine_runs else None,
        "wall_s": sum(run.wall_s for run in runs),
        "prefill_s": sum(run.prefill_s for run in engine_runs) if engine_runs else None,
        "first_token_s": _median([run.first_token_s for run in engine_runs if run.first_token_s is not None]),
        "cached_tokens": _sum_reported([run.cached_tokens for run in runs]),
        "draft_s": sum(run.draft_s for run in engine_runs) if engine_runs else None,
        "draft_positions": sum(run.draft_positions for run in engine_runs) if engine_runs else None,
        "verify_s": sum(run.verify_s for run in engine_runs) if engine_runs else None,
        "acceptance_by_position": [share(a, d) for a, d in zip(accepted, drafted)],
        "drafted_by_position": drafted,
    }


def decoded_tokens(rec: dict) -> int:
    """The tokens a record's decode passes made. Records from before a prompt's first token came from its
    prefill (stop 54) have no count of their own: every token of theirs came from a pass."""
    return rec.get("decoded_tokens", rec["new_tokens"])


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _sum_reported(values: list[int | None]) -> int | None:
    """The sum of what was reported; None where nothing was."""
    reported = [v for v in values if v is not None]
    return sum(reported) if reported else None


def _sum_lists(lists: Sequence[list[int]]) -> list[int]:
    width = max((len(x) for x in lists), default=0)
    return [sum(x[j] for x in lists if j < len(x)) for j in range(width)]


def records(runs: Sequence[Run], methods: Sequence[str]) -> list[dict]:
    """Records in method order: at batch 1 per category and "all"; at larger batches "all" only.

    A batch mixes categories, so only batch 1 can be split by category.
    """
    out = []
    for batch_size in sorted({run.batch_size for run in runs}):
        at_size = [run for run in runs if run.batch_size == batch_size]
        categories = list(dict.fromkeys(p.category for run in at_size for p in run.prompts)) if batch_size == 1 else []
        for method in methods:
            mine = [run for run in at_size if run.method == method]
            if not mine:
                continue
            out.append(record(method, batch_size, ALL, mine))
            for category in categories:
                grouped = [run for run in mine if run.prompts[0].category == category]
                out.append(record(method, batch_size, category, grouped))
    add_cost_ratios(out)
    return out


def add_cost_ratios(recs: Sequence[dict]) -> None:
    """Set each record's `cost_ratio` c: its seconds of drafting per draft position over the seconds of one
    plain step in the plain record of the same batch size and category (None where either is missing).

    Measured, not assumed: for a drafter that sometimes proposes nothing (n-gram, hybrid) it is the mean over
    the positions it did draft; the time of steps that drafted nothing is in the numerator too.
    """
    plain_step_s = {
        (r["batch_size"], r["category"]): share(r["verify_s"], r["steps"])
        for r in recs if r["method"] == PLAIN and r["steps"]
    }
    for r in recs:
        per_position = share(r["draft_s"], r["draft_positions"]) if r["draft_positions"] else None
        step_s = plain_step_s.get((r["batch_size"], r["category"]))
        r["cost_ratio"] = per_position / step_s if per_position is not None and step_s else None


def controller_checks(recs: Sequence[dict], methods: Sequence) -> list[dict]:
    """At each batch size: what each adaptive method chose, and whether it kept up with the best alternative.

    The alternatives are plain decoding (1.0 by definition) and every fixed-gamma
    method of the same drafter. Decode-only speedups are compared because the
    controller governs decoding, not prefill.
    """
    by_key = {(r["method"], r["batch_size"]): r for r in recs if r["category"] == ALL}
    checks = []
    for batch_size in sorted({r["batch_size"] for r in recs}):
        for method in (m for m in methods if m.adaptive):
            mine = by_key.get((method.label, batch_size))
            if not mine or not mine["decode_speedup_vs_plain"]:
                continue
            options = {PLAIN: 1.0}
            for other in methods:
                theirs = by_key.get((other.label, batch_size))
                if other.drafter == method.drafter and other.fixed_gamma and theirs and theirs["decode_speedup_vs_plain"]:
                    options[other.label] = theirs["decode_speedup_vs_plain"]["median"]
            best = max(options, key=options.get)
            speedup = mine["decode_speedup_vs_plain"]["median"]
            checks.append({
                "batch_size": batch_size,
                "method": method.label,
                "speculative_step_fraction": mine["speculative_step_fraction"],
                "controller_mean_gamma": mine["controller_mean_gamma"],
                "decode_speedup": speedup,
                "best_alternative": best,
                "best_alternative_speedup": options[best],
                "within_tolerance": speedup >= (1 - CONTROLLER_TOLERANCE) * options[best],
            })
    return checks


def run_rows(runs: Sequence[Run]) -> list[dict]:
    """The raw measurements, one row per run, for re-analysis."""
    return [
        {
            "method": run.method,
            "batch_size": run.batch_size,
            "block": run.block,
            "prompt_ids": [p.id for p in run.prompts],
            "categories": [p.category for p in run.prompts],
            "new_tokens": run.new_tokens,
            "wall_s": run.wall_s,
            "prefill_s": run.prefill_s,
            "first_token_s": run.first_token_s,
            "cached_tokens": run.cached_tokens,
            "draft_s": run.draft_s,
            "verify_s": run.verify_s,
            "steps": run.steps,
            "ratio": run.ratio,
            "decode_ratio": run.decode_ratio,
            "matches_plain": run.matches_plain,
        }
        for run in runs
    ]


def plain_sequences(runs: Sequence[Run], prompt_ids: Callable[[Prompt], list[int]]) -> list[dict]:
    """Plain decoding's tokens for each prompt run alone, context and answer: greedy, they are every exact
    drafter's too, so a drafter's acceptance can be replayed offline (specdec_tools.ngram_sweep)."""
    seen: dict[str, dict] = {}
    for run in (r for r in runs if r.method == PLAIN and r.batch_size == 1):
        for prompt, output in zip(run.prompts, run.outputs):
            seen.setdefault(prompt.id, {"id": prompt.id, "category": prompt.category,
                                        "prompt_ids": prompt_ids(prompt), "output_ids": output})
    return list(seen.values())


def machine(dtype: str, device: str) -> dict:
    """What the figures were measured on: they mean nothing without it."""
    memory_gib = None
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        total_kib = next(int(line.split()[1]) for line in meminfo.read_text().splitlines() if line.startswith("MemTotal"))
        memory_gib = round(total_kib / 2**20, 1)
    return {
        **cpu_info(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": memory_gib,
        "device": device,
        "dtype": dtype,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def machine_line(info: dict) -> str:
    flags = f" ({', '.join(info['cpu_flags'])})" if info["cpu_flags"] else ""
    return (
        f"{info['cpu']}{flags}, {info['cores']} cores, {info['torch_threads']} torch threads, "
        f"{info['memory_gib']} GiB, {info['device']}, {info['dtype']}, torch {info['torch']}, "
        f"transformers {info['transformers']}, Python {info['python']}"
    )

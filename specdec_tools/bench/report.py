"""results.json rendered as report.md: the same figures, as tables."""

from __future__ import annotations

from collections.abc import Callable

from .results import ALL, CONTROLLER_TOLERANCE, decoded_tokens, machine_line


def fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    """A figure, or a dash where there is none (no drafts, no steps)."""
    return "–" if value is None else f"{value:{spec}}{suffix}"


def _speedup(summary: dict | None, key: str = "median") -> str:
    return "–" if summary is None else f"{summary[key]:.2f}x"


def _loads(loads: list[float]) -> str:
    return " / ".join(f"{x:.1f}" for x in loads)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + [""]


def _pick(recs: list[dict], batch_size: int, category: str = ALL) -> list[dict]:
    return [r for r in recs if r["batch_size"] == batch_size and r["category"] == category]


def _summary_rows(recs: list[dict], first: Callable[[dict], str]) -> list[list[str]]:
    """The main figures of each record; `first` names the row (method, or batch size)."""
    return [
        [
            first(r),
            fmt(r["tokens_per_s"]),
            fmt(r["decode_tokens_per_s"]),
            _speedup(r["speedup_vs_plain"]),
            _speedup(r["speedup_vs_plain"], "mean"),
            _speedup(r["decode_speedup_vs_plain"]),
            fmt(r["cost_ratio"], ".3f"),
            fmt(r["acceptance_rate"], ".1%"),
            fmt(r["mean_accepted_length"]),
            fmt(r["mean_gamma"]),
            fmt(r["speculative_step_fraction"], ".0%"),
            fmt(r["controller_mean_gamma"]),
            fmt(r["greedy_match_rate"], ".0%"),
            fmt(r.get("seeded_match_rate"), ".0%"),
            str(r["prompts"]),
            str(r["new_tokens"]),
        ]
        for r in recs
    ]


SUMMARY_HEADER = [
    "tokens/s", "decode tokens/s", "speedup (median)", "speedup (mean)", "decode speedup (median)",
    "cost ratio c", "acceptance", "mean accepted length", "mean gamma", "speculative steps", "chosen gamma",
    "greedy match", "seeded match", "prompts", "new tokens",
]


def _time_rows(recs: list[dict], first: Callable[[dict], str]) -> list[list[str]]:
    """Where each record's seconds went; transformers' generate() does not split them, so it has no row."""
    rows = []
    for r in recs:
        if r["prefill_s"] is None:
            continue
        other = r["wall_s"] - r["prefill_s"] - r["draft_s"] - r["verify_s"]
        rows.append([
            first(r), fmt(r["wall_s"], ".1f"), fmt(r["prefill_s"], ".1f"), fmt(r["draft_s"], ".1f"),
            fmt(r["verify_s"], ".1f"), fmt(other, ".1f"), fmt(r["draft_s"] / r["verify_s"] if r["verify_s"] else None),
            str(r["steps"]), fmt(1000 * r["verify_s"] / r["steps"] if r["steps"] else None, ".0f"),
            fmt(decoded_tokens(r) / r["steps"] if r["steps"] else None), fmt(r.get("first_token_s"), ".2f"),
            fmt(r.get("cached_tokens"), "d"),
        ])
    return rows


TIME_HEADER = [
    "wall", "prefill", "draft", "verify", "other (sampling, bookkeeping)", "draft / verify",
    "steps", "ms per verify pass", "tokens per step", "time to first token (median, s)",
    "prompt tokens from a prefix cache",
]


def _workload_line(workloads: list[dict]) -> str:
    return "- Workloads, each replayed cold (memories of earlier requests emptied) and then warm (filled first by as " \
        "many other sessions): " + "; ".join(
            f"`{w['name']}`: {w['sessions']} session(s), {w['requests']} request(s) ({w['source']})"
            for w in workloads)


def _header_lines(results: dict) -> list[str]:
    header, settings, prompts = results["header"], results["header"]["settings"], results["header"]["prompts"]
    spec = header["config"]["speculation"]
    limit = (
        f" (at most {prompts['max_prompt_tokens']} prompt tokens; no prompt short enough in: "
        f"{', '.join(prompts['left_out']) or 'none'})"
        if prompts["max_prompt_tokens"] else ""
    )
    return [
        "# specdec bench",
        "",
        f"- Date: {header['date']} (finished {header['finished']})",
        f"- Command: `{header['command']}`",
        f"- Machine: {machine_line(header['machine'])}",
        f"- Load average (1, 5, 15 min) at start {_loads(header['load_average']['start'])}, "
        f"at end {_loads(header['load_average']['end'])}",
        f"- Config: `{header['config_path']}` (target `{header['config']['model']['target']}`, "
        f"draft `{spec['draft_model']}`, gamma_max {spec['gamma_max']})",
        _workload_line(header["workloads"]) if header.get("workloads") else
        f"- Prompts at batch 1: {prompts['count']} from `{prompts['source']}`, "
        f"stratified over {', '.join(prompts['categories']) or '-'}{limit}",
        f"- Settings: max tokens {settings['max_tokens']}, temperature {settings['temperature']}, seed {settings['seed']}, "
        f"plain run after every {settings['plain_every']} method(s)",
        *([f"- **Stopped before its end**: {header['stopped']}. The figures are the blocks it finished."]
          if header.get("stopped") else []),
        "",
        "Methods run interleaved with plain decoding over the same prompts, after an uncounted warm-up. "
        "A speedup is a run's tokens/s over that of the nearest plain runs before and after it in time, per prompt "
        "(per batch in the sweep), summarised by median and mean. tokens/s counts prefill and decoding, as a "
        "client waits; decode tokens/s and the decode speedup leave prefill out. Plain's own speedup is each plain "
        "run over the previous one: the noise floor. Greedy match (seeded match, at a temperature above 0) is the "
        "share of prompts whose output equals the block's first plain run with the same seed (for plain: the later "
        "plain runs, a determinism check). Speculative steps and "
        "chosen gamma are the controller's choices; mean gamma is the draft length actually verified. "
        "The cost ratio c is the method's drafting seconds per draft position over the seconds of one plain "
        "step, both measured in this run at the same batch size.",
        "",
    ]


def _batch1_lines(results: dict) -> list[str]:
    recs = results["records"]
    batch1 = _pick(recs, 1)
    if not batch1:
        return []
    lines = ["## Batch 1, all categories", ""]
    lines += _table(["method", *SUMMARY_HEADER], _summary_rows(batch1, lambda r: f"`{r['method']}`"))

    categories = [c for c in results["header"]["prompts"]["categories"] if any(r["category"] == c for r in recs)]
    lines += ["## Speedup by category (batch 1, median; mean accepted length in brackets)", ""]
    rows = []
    for r in batch1:
        cells = []
        for c in categories:
            rec = next(x for x in recs if x["method"] == r["method"] and x["batch_size"] == 1 and x["category"] == c)
            length = f" ({rec['mean_accepted_length']:.2f})" if rec["mean_accepted_length"] else ""
            cells.append(_speedup(rec["speedup_vs_plain"]) + length)
        rows.append([f"`{r['method']}`", *cells, _speedup(r["speedup_vs_plain"])])
    lines += _table(["method", *categories, ALL], rows)

    drafting = [r for r in batch1 if r["acceptance_by_position"]]
    if drafting:
        width = max(len(r["acceptance_by_position"]) for r in drafting)
        lines += ["## Acceptance by draft position (batch 1; drafts verified at that position in brackets)", ""]
        rows = [
            [f"`{r['method']}`"]
            + [f"{fmt(a, '.0%')} ({d})" for a, d in zip(r["acceptance_by_position"], r["drafted_by_position"])]
            + [""] * (width - len(r["acceptance_by_position"]))
            for r in drafting
        ]
        lines += _table(["method", *(str(j + 1) for j in range(width))], rows)

    lines += ["## Where the time goes (batch 1, seconds summed over runs)", ""]
    return lines + _table(["method", *TIME_HEADER], _time_rows(batch1, lambda r: f"`{r['method']}`"))


def _sweep_lines(results: dict) -> list[str]:
    sweep, recs, settings = results["sweep"], results["records"], results["header"]["settings"]
    if not sweep["batch_sizes"]:
        return []
    lines = [
        "## Batch sweep",
        "",
        f"Batches of different prompts (at most {sweep['max_prompt_tokens']} prompt tokens each) decoded together, "
        f"{settings['sweep_max_tokens']} new tokens per row, at least {settings['sweep_rows']} rows per batch size. "
        f"Batch 1 rows, where present, are the batch-1 figures above ({settings['max_tokens']} new tokens). "
        "Fixed-gamma methods speculate at every batch size; adaptive ones keep the config's max_speculative_batch "
        f"({results['header']['config']['speculation']['max_speculative_batch']}).",
        "",
    ]
    if sweep["stopped"]:
        lines += [f"**The sweep stopped:** {sweep['stopped']}", ""]
    sizes = sorted({r["batch_size"] for r in recs})
    for method in dict.fromkeys(r["method"] for r in recs if r["batch_size"] > 1):
        mine = [r for b in sizes for r in _pick(recs, b) if r["method"] == method]
        lines += [f"### `{method}`", ""]
        lines += _table(["batch size", *SUMMARY_HEADER], _summary_rows(mine, lambda r: str(r["batch_size"])))
        lines += _table(["batch size", *TIME_HEADER], _time_rows(mine, lambda r: str(r["batch_size"])))
    return lines


CONTROLLER_INTRO = (
    f"What the adaptive controller chose, and whether its decode speedup came within {CONTROLLER_TOLERANCE:.0%} "
    "of the best of plain and the same drafter's fixed-gamma methods (all medians)."
)


def controller_table(checks: list[dict]) -> list[str]:
    """What each adaptive method chose per batch size, against its best alternative."""
    rows = [
        [
            str(c["batch_size"]), f"`{c['method']}`", fmt(c["speculative_step_fraction"], ".0%"),
            fmt(c["controller_mean_gamma"]), f"{c['decode_speedup']:.2f}x",
            f"`{c['best_alternative']}` {c['best_alternative_speedup']:.2f}x",
            "yes" if c["within_tolerance"] else "**NO: flagged**",
        ]
        for c in checks
    ]
    return _table(
        ["batch size", "method", "speculative steps", "chosen gamma", "decode speedup", "best alternative", "within 5%"], rows
    )


def _controller_lines(results: dict) -> list[str]:
    checks = results["controller"]
    return ["## Adaptive controller", "", CONTROLLER_INTRO, ""] + controller_table(checks) if checks else []


def render(results: dict) -> str:
    """The markdown report of a results.json document."""
    plots = ["## Plots", ""] + [f"![{name}]({name})" for name in results["plots"]] + [""]
    return "\n".join(
        _header_lines(results) + _batch1_lines(results) + _sweep_lines(results) + _controller_lines(results) + plots
    )

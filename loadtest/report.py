"""Percentiles, the Markdown table, and the latency plots of a sweep's levels."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

QUANTILES = (50, 90, 99)


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50/p90/p99 (linear interpolation; with few samples p99 is close to the maximum)."""
    if not values:
        return {f"p{q}": None for q in QUANTILES}
    return {f"p{q}": float(v) for q, v in zip(QUANTILES, np.percentile(values, QUANTILES))}


def ratio_or_none(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def _fmt(value: float | None, scale: float = 1.0, spec: str = ".0f") -> str:
    return "–" if value is None else format(value * scale, spec)


def _triple(p: dict[str, float | None], scale: float, spec: str) -> str:
    return " / ".join(_fmt(p[f"p{q}"], scale, spec) for q in QUANTILES)


def markdown(levels: Sequence[dict], baseline: str | None = None) -> str:
    """One row per level and target; with a baseline, each target's tokens/s relative to it at that level."""
    reference = {lv["level"]: lv["output_tokens_per_s"] for lv in levels if lv["target"] == baseline}
    mode = levels[0]["mode"] if levels else "concurrency"
    header = [
        mode, "target", "ok / sent", "errors", "TTFT p50 / p90 / p99 ms", "ITL p50 / p90 / p99 ms",
        "E2E p50 / p90 / p99 s", "output tok/s", *(["vs " + baseline] if baseline else []),
        "acceptance", "mean batch", "spec. steps",
    ]
    rows = []
    for lv in levels:
        ratio = ratio_or_none(lv["output_tokens_per_s"], reference.get(lv["level"]))
        rows.append([
            f"{lv['level']:g}", lv["target"], f"{lv['ok']} / {lv['sent']}",
            ", ".join(f"{kind} ×{n}" for kind, n in lv["errors"].items()) or "0",
            _triple(lv["ttft_s"], 1e3, ".0f"), _triple(lv["itl_s"], 1e3, ".0f"), _triple(lv["e2e_s"], 1, ".2f"),
            _fmt(lv["output_tokens_per_s"], spec=".1f"), *([_fmt(ratio, spec=".2f") + "×"] if baseline else []),
            _fmt(lv["acceptance_rate"], 100, ".0f") + "%" * (lv["acceptance_rate"] is not None),
            _fmt(lv["mean_batch_size"], spec=".1f"),
            _fmt(lv["speculative_step_share"], 100, ".0f") + "%" * (lv["speculative_step_share"] is not None),
        ])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


def plot(levels: Sequence[dict], path: Path) -> None:
    """TTFT, inter-token and end-to-end latency (p50 solid, p99 dashed) and tokens/s against the level."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt

    panels = [("ttft_s", "TTFT (s)"), ("itl_s", "inter-token latency (s)"), ("e2e_s", "end-to-end latency (s)")]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    targets = list(dict.fromkeys(lv["target"] for lv in levels))
    for color, target in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], targets):
        mine = [lv for lv in levels if lv["target"] == target]
        x = [lv["level"] for lv in mine]
        for ax, (key, _) in zip(axes, panels):
            for q, style in (("p50", "-"), ("p99", "--")):
                y = [np.nan if lv[key][q] is None else lv[key][q] for lv in mine]
                ax.plot(x, y, style, marker="o", color=color, label=f"{target} {q}")
        axes[3].plot(x, [lv["output_tokens_per_s"] for lv in mine], marker="o", color=color, label=target)
    ticks = sorted({lv["level"] for lv in levels})
    for ax, title in zip(axes, [title for _, title in panels] + ["output tokens/s"]):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [f"{v:g}" for v in ticks])
        ax.set_xlabel(levels[0]["mode"] if levels else "")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

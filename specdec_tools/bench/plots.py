"""The report's figures, drawn from the records alone (never edited by hand)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: the bench runs headless
import matplotlib.pyplot as plt
import matplotlib.ticker

from .results import ALL
from .stats import PLAIN


def _break_even(ax) -> None:
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--", label="plain (break-even)")


def speedup_by_category(recs: list[dict], path: Path) -> None:
    batch1 = [r for r in recs if r["batch_size"] == 1 and r["method"] != PLAIN and r["speedup_vs_plain"]]
    methods = list(dict.fromkeys(r["method"] for r in batch1))
    categories = list(dict.fromkeys(r["category"] for r in batch1 if r["category"] != ALL)) + [ALL]
    value = {(r["method"], r["category"]): r["speedup_vs_plain"]["median"] for r in batch1}
    fig, ax = plt.subplots(figsize=(max(8.0, 0.8 * len(categories) + 2), 4.5))
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        xs = [c + (i - (len(methods) - 1) / 2) * width for c in range(len(categories))]
        ax.bar(xs, [value.get((method, c), 0.0) for c in categories], width, label=method)
    _break_even(ax)
    ax.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
    ax.set_ylabel("speedup over plain (median per prompt)")
    ax.set_title("Speedup by method and category, batch 1")
    ax.legend(fontsize="small", ncols=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def acceptance_by_position(recs: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in recs:
        if r["batch_size"] == 1 and r["category"] == ALL and r["acceptance_by_position"]:
            rates = r["acceptance_by_position"]
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=r["method"])
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("draft position (late positions rest on few drafts: see the report's counts)")
    ax.set_ylabel("share of drafted tokens accepted")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by draft position, batch 1, all categories")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def speedup_vs_batch(recs: list[dict], path: Path) -> None:
    rows = [r for r in recs if r["category"] == ALL and r["method"] != PLAIN and r["decode_speedup_vs_plain"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = sorted((r["batch_size"], r["decode_speedup_vs_plain"]["median"]) for r in rows if r["method"] == method)
        ax.plot([b for b, _ in mine], [s for _, s in mine], marker="o", label=method)
    _break_even(ax)
    ax.set_xscale("log", base=2)
    sizes = sorted({r["batch_size"] for r in rows})
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.minorticks_off()
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode speedup over plain (median)")
    ax.set_title("Where speculation stops paying")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw(recs: list[dict], out: Path) -> list[str]:
    """Every figure the records support; returns the file names written."""
    names = []
    batch1 = [r for r in recs if r["batch_size"] == 1]
    if any(r["method"] != PLAIN for r in batch1):
        speedup_by_category(recs, out / "speedup_by_category.png")
        names.append("speedup_by_category.png")
    if any(r["acceptance_by_position"] for r in batch1):
        acceptance_by_position(recs, out / "acceptance_by_position.png")
        names.append("acceptance_by_position.png")
    if len({r["batch_size"] for r in recs}) > 1:
        speedup_vs_batch(recs, out / "speedup_vs_batch.png")
        names.append("speedup_vs_batch.png")
    return names

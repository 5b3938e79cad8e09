"""docs/BENCHMARKS.md, generated from bench runs' results.json and report.md: no figure typed by hand.

    python -m specdec_tools.bench.docs --notes docs/benchmarks/NOTES.md --out docs/BENCHMARKS.md docs/benchmarks/RUN...

The page is: the notes (prose about the runs, without figures), one summary
table of every drafter at batch 1 across the runs, the one-figure tools'
results (`--measurements`: the JSON that specdec_tools.flips, .rules and
.attention_cost write with --out, with the command that made each), the
adaptive controller's checks of every run, then each run's own report with its
command, date and machine line (headings one level down, image paths made
relative to docs/).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from .report import CONTROLLER_INTRO, controller_table, fmt
from .results import ALL
from .stats import PLAIN

HEADING = re.compile(r"^(#+) ", re.MULTILINE)
IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)/]+\.png)\)")


def summary_lines(runs: dict[Path, dict]) -> list[str]:
    """Every drafter at batch 1 in every run: the cost ratio, what it earned, and the speedup it gave."""
    lines = [
        "## Every drafter at batch 1",
        "",
        "From each run's batch-1 records (all categories). c: drafting seconds per draft position over one plain "
        "step, measured in that run; speedup: median over prompts of tokens/s (prefill included) over the "
        "nearest plain runs before and after; greedy (seeded) match: share of prompts whose output equals plain's, greedy (sampled with "
        "the same seed).",
        "",
        "| model | temperature | method | cost ratio c | acceptance | mean accepted length | speedup (median) | "
        "decode speedup (median) | greedy match | seeded match | run |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for path, results in runs.items():
        header = results["header"]
        for r in results["records"]:
            if r["batch_size"] != 1 or r["category"] != ALL or r["method"] == PLAIN:
                continue
            speedup, decode = r["speedup_vs_plain"], r["decode_speedup_vs_plain"]
            lines.append(
                f"| {header['config']['model']['target']} | {header['settings']['temperature']} | `{r['method']}` | "
                f"{fmt(r['cost_ratio'], '.3f')} | {fmt(r['acceptance_rate'], '.1%')} | "
                f"{fmt(r['mean_accepted_length'])} | {fmt(speedup and speedup['median'], '.2f', 'x')} | "
                f"{fmt(decode and decode['median'], '.2f', 'x')} | {fmt(r['greedy_match_rate'], '.0%')} | "
                f"{fmt(r.get('seeded_match_rate'), '.0%')} | "
                f"[{path.name}](benchmarks/{path.name}/report.md) |"
            )
    return lines + [""]


def embedded_report(path: Path) -> list[str]:
    """A run's report.md one heading level down, its images relative to docs/."""
    text = HEADING.sub(lambda m: "#" + m.group(1) + " ", (path / "report.md").read_text())
    text = text.replace("# specdec bench", f"# Run `{path.name}`", 1)
    text = IMAGE.sub(lambda m: f"![{m.group(1)}](benchmarks/{path.name}/{m.group(2)})", text)
    return [text]


def measurement_lines(measurements: dict[Path, dict]) -> list[str]:
    """Each measurement JSON as a table of its figures, under its file name and the command that wrote it."""
    lines = ["## Measurements", ""] if measurements else []
    for path, figures in measurements.items():
        command = figures.pop("command", None)
        lines += [f"### `{path.name}`", ""] + ([f"    {command}", ""] if command else [])
        lines += ["| figure | value |", "|---|---|"]
        for key, value in figures.items():
            shown = json.dumps(value) if isinstance(value, (list, dict)) else fmt(value, ".4g") if isinstance(value, float) else str(value)
            lines.append(f"| {key} | {shown} |")
        lines.append("")
    return lines


def render(notes: str, runs: dict[Path, dict], measurements: dict[Path, dict] | None = None) -> str:
    lines = [notes.rstrip(), ""] + summary_lines(runs) + measurement_lines(measurements or {})
    lines += ["## The adaptive controller, per run", "", CONTROLLER_INTRO, ""]
    for path, results in runs.items():
        if results["controller"]:
            lines += [f"`{path.name}`:", ""] + controller_table(results["controller"])
    for path in runs:
        lines += embedded_report(path)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec_tools.bench.docs", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="bench output directories, in the order to show them")
    parser.add_argument("--notes", type=Path, required=True, help="markdown that opens the page: what was run and why")
    parser.add_argument("--measurements", type=Path, nargs="*", default=[], help="the one-figure tools' JSON files")
    parser.add_argument("--out", type=Path, default=Path("docs/BENCHMARKS.md"))
    args = parser.parse_args(argv)
    runs = {path: json.loads((path / "results.json").read_text()) for path in args.runs}
    measurements = {path: json.loads(path.read_text()) for path in args.measurements}
    args.out.write_text(render(args.notes.read_text(), runs, measurements))
    print(f"wrote {args.out} from {len(runs)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())

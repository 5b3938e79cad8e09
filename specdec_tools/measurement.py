"""What the one-figure measurement tools (flips, rules, attention_cost) share: their common arguments, and
printing the figures as JSON (and writing them, with --out)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

from .bench.prompts import DEFAULT_PROMPTS
from .cpu import cpu_info


def parser(doc: str, prompts: int | None = 10) -> argparse.ArgumentParser:
    """--config and --out, plus --prompts, --limit (default `prompts`) and --max-tokens unless prompts is None."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--out", type=Path, help="also write the figures here, as JSON")
    if prompts is not None:
        parser.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="JSONL with a 'prompt' or 'turns' field per line")
        parser.add_argument("--limit", type=int, default=prompts, help="prompts, stratified over the categories")
        parser.add_argument("--max-tokens", type=int, default=128)
    return parser


def report(result: dict, out: Path | None, tool: str, argv: list[str] | None) -> None:
    """Print the figures; with `out`, also write them there, with the command that made them (`python -m tool`
    with `argv`, default the process's arguments), when, and on which CPU (docs/BENCHMARKS.md places it by that)."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        command = shlex.join(["python", "-m", tool, *(sys.argv[1:] if argv is None else argv)])
        stamp = {"command": command, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": cpu_info()}
        out.write_text(json.dumps({**stamp, **result}, indent=2) + "\n")

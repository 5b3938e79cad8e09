"""What the one-figure measurement tools (flips, rules, attention_cost) share: their common arguments, and
printing the figures as JSON (and writing them, with --out)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .bench.prompts import DEFAULT_PROMPTS


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


def report(result: dict, out: Path | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")

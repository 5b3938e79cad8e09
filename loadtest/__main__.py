"""`python -m loadtest`: sweep concurrency (or arrival rate) against one or more servers on loopback."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from specdec_tools.bench.prompts import DEFAULT_PROMPTS, load_prompts, stratified
from specdec_tools.cpu import cpu_info

from .report import markdown, plot
from .runner import Load, Target, level_prompts, parse_target, sweep

SINGLE_TURN_WORKLOADS = ("code-edit",)  # bench workloads of one request each, sent without a schema


def workload_prompts(name: str) -> list[str]:
    """Every request of a single-turn bench workload, in its order."""
    from specdec_tools.bench.workloads import workloads  # the bench's engine (torch) only for this

    sessions = workloads(DEFAULT_PROMPTS)[name].sessions(10**6)
    return [next(session()).text for session in sessions]


def _numbers(text: str) -> list[float]:
    values = [float(part) for part in text.split(",") if part.strip()]
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give positive numbers separated by commas")
    return values


def _target(text: str) -> Target:
    try:
        return parse_target(text)
    except ValueError as exc:  # argparse shows an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(exc)) from exc


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__)
    p.add_argument("--url", action="append", required=True, type=_target, metavar="[LABEL=]URL",
                   help="a server to load (repeat to compare, e.g. spec=http://127.0.0.1:8000 plain=http://127.0.0.1:8001)")
    p.add_argument("--baseline", help="label whose tokens/s the others are compared with, level by level")
    sweep_kind = p.add_mutually_exclusive_group()
    sweep_kind.add_argument("--concurrency", type=_numbers, help="closed loop: users sending back to back (default 1,2,4,8)")
    sweep_kind.add_argument("--rate", type=_numbers, help="open loop: Poisson arrivals per second")
    p.add_argument("--requests", type=int, default=16, help="requests per level and target (a level with more users than this "
                   "runs only this many)")
    p.add_argument("--duration", type=float, default=300, help="seconds per level after which no request starts")
    p.add_argument("--timeout", type=float, default=300, help="seconds after which a request counts as an error")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    sources = p.add_mutually_exclusive_group()
    sources.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="JSONL with Spec-Bench's 'turns' (first turn used) or 'prompt'")
    sources.add_argument("--workload", choices=SINGLE_TURN_WORKLOADS,
                   help="send this bench workload's requests instead of --prompts' (code-edit: 20 functions to change)")
    p.add_argument("--prompt-offset", type=int, default=0, help="skip this many prompts of the file's round-robin order: "
                   "a second run on the same server sends prompts the first did not (the report names the next offset)")
    p.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' to every target (default: $SPECDEC_API_KEY)")
    p.add_argument("--out", type=Path, default=Path("bench-out/loadtest"), help="where results.json, report.md, latency.png go")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    labels = [t.label for t in args.url]
    if len(set(labels)) != len(labels):
        sys.exit(f"loadtest: labels must differ, got {labels}")
    if args.baseline is not None and args.baseline not in labels:
        sys.exit(f"loadtest: --baseline {args.baseline!r} is none of {labels}")
    mode, values = ("rate", args.rate) if args.rate else ("concurrency", args.concurrency or [1, 2, 4, 8])
    loads = [Load(mode, v, args.requests, args.duration) for v in values]
    if args.prompt_offset < 0:
        sys.exit(f"loadtest: --prompt-offset must be 0 or more, got {args.prompt_offset}")
    # Round-robin over Spec-Bench's categories, so a short level still mixes writing, code, maths, ...
    if args.workload:
        pool = workload_prompts(args.workload)
    else:
        every_prompt = load_prompts(args.prompts)
        pool = [p.text for p in stratified(every_prompt, len(every_prompt))]
    prompts = level_prompts(pool, len(loads), args.requests, args.prompt_offset)

    def progress(level: dict) -> None:
        print(f"{level['target']} {mode}={level['level']:g}: {level['ok']}/{level['sent']} ok, "
              f"{level['output_tokens_per_s']:.1f} tok/s in {level['wall_s']:.0f} s", file=sys.stderr, flush=True)

    started, load_before = time.time(), os.getloadavg()
    levels = asyncio.run(
        sweep(args.url, loads, prompts.per_level, args.max_tokens, args.temperature, args.timeout, args.api_key, progress)
    )
    command = "python -m loadtest " + shlex.join(argv if argv is not None else sys.argv[1:])
    table = markdown(levels, args.baseline) + "\n" + prompts.summary() + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    results = {
        "command": command,
        "started": datetime.fromtimestamp(started, timezone.utc).isoformat(timespec="seconds"),
        # Other work on the machine moves every figure: its load average before and after says how much.
        "machine": {**cpu_info(), "platform": platform.platform(), "cpus": os.cpu_count(),
                    "load_average": [load_before, os.getloadavg()]},
        "targets": {t.label: t.url for t in args.url},
        "baseline": args.baseline,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "prompts": {"source": args.workload or args.prompts, "offset": args.prompt_offset, "next_offset": prompts.next_offset,
                    "repeated": prompts.repeated},
        "levels": levels,
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "report.md").write_text(f"`{command}`\n\n{table}")
    plot(levels, args.out / "latency.png")
    print(table)
    print(f"wrote {args.out}/results.json, report.md, latency.png", file=sys.stderr)
    # Errors are measurements (a 429 under overload is an answer); a level with no success is a failed run.
    return 0 if all(level["ok"] for level in levels) else 1


if __name__ == "__main__":
    sys.exit(main())

"""`specdec bench`: arguments and entry point.

Two phases over one loaded target. Batch 1: every method over a stratified
set of prompts, one prompt at a time, split by category. Batch sweep (any
--batch-sizes above 1): batches of different short prompts decoded together.
Writes DIR/results.json, DIR/report.md and DIR/*.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from specdec_core.drafters.registry import REGISTRY

from .prompts import (
    Prompt,
    add_prompts_argument,
    categories_of,
    load_prompts,
    stratified,
)
from .stats import PLAIN, interleave

if TYPE_CHECKING:
    from specdec_core.config import Config

    from .llama_cpp import LlamaCpp
    from .runner import Bench, Method, Run
    from .workloads import Workload

# specdec_cli/main.py imports this module to build its parser: torch, transformers and
# tqdm are imported only when a bench actually runs, so other commands start fast.

WARMUP_TOKENS = 16
WORKLOAD_SESSIONS = 4  # sessions per workload when --num-prompts is not given


def _list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _sizes(text: str) -> list[int]:
    sizes = sorted({int(item) for item in _list(text)})
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers, got {text!r}")
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="configs/default.yaml", help="YAML config: target, draft model, dtype")
    parser.add_argument(
        "--drafters", type=_list,
        help=f"comma-separated methods: plain or a drafter ({', '.join(REGISTRY)}: "
        "adaptive gamma), optionally with speculation settings and a fixed gamma, as in ngram:g4 or "
        "distilled:distilled.student=NAME:g3; plain is always run, as the reference "
        "(default: plain,ngram and draft-model if the config has one)",
    )
    add_prompts_argument(parser)
    parser.add_argument("--categories", type=_list, help="only these categories (comma-separated)")
    parser.add_argument("--num-prompts", type=int, help="prompts at batch 1, stratified over categories (default: one per category)")
    parser.add_argument("--max-prompt-tokens", type=int, help="only prompts up to this many tokens (chat template included); default: all")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt at batch 1")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy; at any temperature outputs are checked against plain's (sampled: with the same seed)")
    parser.add_argument("--seed", type=int, default=0, help="base of the per-prompt sampling seeds")
    parser.add_argument(
        "--batch-sizes", type=_sizes, default=[1],
        help="comma-separated; 1 runs the prompts one at a time (per category), sizes above 1 the batch sweep",
    )
    parser.add_argument("--sweep-max-tokens", type=int, help="new tokens per row in the sweep (default: --max-tokens)")
    parser.add_argument("--sweep-max-prompt-tokens", type=int, default=256, help="the sweep only uses prompts up to this length")
    parser.add_argument("--sweep-rows", type=int, default=4, help="decode at least this many rows per batch size (several batches when B is smaller)")
    parser.add_argument("--sweep-time-limit", type=float, default=1800.0, help="seconds; the sweep stops before a batch size projected to pass it")
    parser.add_argument("--plain-every", type=int, default=1, help="a plain run after every N methods (1: each method between two plain runs next to it)")
    parser.add_argument("--baseline", choices=["hf-assisted"], help="add transformers' assisted generation and prompt lookup (greedy, batch 1)")
    parser.add_argument(
        "--llama-cpp", type=Path, metavar="DIR",
        help="add llama.cpp's plain and speculative decoding of the registry's GGUF files as reference rows (greedy, "
        "batch 1, the config's threads), and llama-server with its prompt cache (llama.cpp-server); those of them "
        "--drafters names, else all; DIR holds the tools: python -m specdec_tools.bench.llama_cpp build DIR",
    )
    parser.add_argument(
        "--threads", type=int,
        help="torch CPU threads, overriding the config's model.threads (on a shared machine 1 thread "
        "avoids OpenMP spin-waits on descheduled threads, which make 2-thread timings swing tenfold)",
    )
    parser.add_argument(
        "--workload", type=_list,
        help="replay serving workloads instead of single prompts: comma-separated of spec-bench, multi-turn, "
        "code-edit, agentic, chat-ui, json (specdec_tools/bench/workloads.py says what each is); each runs cold, then warm "
        "(memories of earlier requests first filled by other sessions); --num-prompts is sessions per workload",
    )
    parser.add_argument("--out", default="bench-out", help="output directory")


def _methods(args: argparse.Namespace, draft_model: str | None) -> list[Method]:
    from .runner import HF_METHODS, LLAMA_CPP_METHODS, Method, parse_method

    names = args.drafters or ([PLAIN, "ngram"] + (["draft-model"] if draft_model else []))
    try:
        methods = [Method(PLAIN, "none")] + [m for m in map(parse_method, names) if m.label != PLAIN]
    except ValueError as exc:
        raise SystemExit(f"specdec bench: {exc}") from None
    named_llama_cpp = [m.label for m in methods if m.drafter in LLAMA_CPP_METHODS]
    if named_llama_cpp and not args.llama_cpp:
        raise SystemExit(f"specdec bench: {', '.join(named_llama_cpp)} need --llama-cpp DIR")
    methods = [m for m in methods if m.drafter not in LLAMA_CPP_METHODS]
    if not draft_model and any(m.drafter == "draft-model" for m in methods):
        raise SystemExit(f"specdec bench: draft-model needs speculation.draft_model in {args.config}")
    if args.baseline:
        # Assisted generation needs the config's draft model; prompt lookup needs none.
        methods += [Method(name, name) for name in HF_METHODS if draft_model or name != "hf-assisted"]
        if not draft_model:
            print(f"specdec bench: {args.config} has no draft model: hf-assisted left out", file=sys.stderr)
    if args.llama_cpp:
        methods += [Method(name, name) for name in named_llama_cpp or LLAMA_CPP_METHODS
                    if draft_model or name != "llama.cpp-speculative"]
    if len({m.label for m in methods}) != len(methods):
        raise SystemExit(f"specdec bench: a method is named twice in {', '.join(m.label for m in methods)}")
    return methods


def _workloads(args: argparse.Namespace) -> list[Workload]:
    """The workloads asked for, by name; a workload replays at batch 1 only."""
    if not args.workload:
        return []
    from .workloads import workloads

    known = workloads(Path(args.prompts))
    unknown = [name for name in args.workload if name not in known]
    if unknown:
        raise SystemExit(f"specdec bench: no workload {', '.join(unknown)}; choose from {', '.join(known)}")
    if args.batch_sizes != [1]:
        raise SystemExit("specdec bench: --workload replays requests one at a time; leave --batch-sizes at 1")
    args.num_prompts = args.num_prompts or WORKLOAD_SESSIONS
    chosen = [known[name] for name in args.workload]
    for workload in chosen:
        if len(workload.warmup(args.num_prompts)) < args.num_prompts:  # else warm would be barely warmer than cold
            most = len(workload.sessions(1 << 20)) // 2
            raise SystemExit(f"specdec bench: {workload.name} has sessions for --num-prompts {most} at most "
                             "(as many again warm the memory)")
    return chosen


def _load(args: argparse.Namespace) -> list[Prompt]:
    """The prompts of the chosen categories."""
    try:
        prompts = load_prompts(args.prompts)
    except FileNotFoundError as exc:
        raise SystemExit(f"specdec bench: {exc}") from None
    if args.categories:
        unknown = set(args.categories) - set(categories_of(prompts))
        if unknown:
            raise SystemExit(f"specdec bench: no category {', '.join(sorted(unknown))}; the file has {', '.join(categories_of(prompts))}")
        prompts = [p for p in prompts if p.category in args.categories]
    return prompts


def _short(bench: Bench, prompts: list[Prompt], limit: int | None, what: str) -> list[Prompt]:
    """The prompts of at most `limit` tokens (chat template included)."""
    short = [p for p in prompts if limit is None or len(bench.prompt_ids(p)) <= limit]
    if not short:
        raise SystemExit(f"specdec bench: no prompt has at most {limit} tokens for {what}")
    return short


class Progress:
    """A tqdm bar over runs that shows the last run and each method's running median speedup."""

    def __init__(self, total: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True)
        self.ratios: dict[tuple[str, int], list[float]] = defaultdict(list)
        self.finished: list[Run] = []  # every finished block's runs, kept should a later run fail

    def run(self, run: Run) -> None:
        self.bar.update(1)
        medians = " ".join(
            f"{method} {statistics.median(r):.2f}x"
            for (method, size), r in self.ratios.items()
            if method != PLAIN and size == run.batch_size
        )
        self.bar.set_postfix_str(f"B={run.batch_size} {run.method} {run.tokens_per_s:.1f} tok/s | median speedups: {medians}")

    def block(self, runs: list[Run]) -> None:
        self.finished += runs
        for run in runs:
            if run.ratio is not None:
                self.ratios[run.method, run.batch_size].append(run.ratio)


def run_bench(args: argparse.Namespace) -> int:
    import transformers

    from specdec_core.config import Config

    from .plots import draw
    from .report import render
    from .results import controller_checks, plain_sequences, records, run_rows
    from .runner import Bench, run_block
    from .sweep import SweepResult, blocks_at, run_sweep
    from .workloads import PHASES, replay, requests_in

    config = Config.load(args.config)
    if args.threads:
        config.model.threads = args.threads
    methods = _methods(args, config.speculation.draft_model)
    if (args.baseline or args.llama_cpp) and (args.temperature != 0 or 1 not in args.batch_sizes):
        raise SystemExit(
            "specdec bench: --baseline and --llama-cpp run greedy at batch 1; use --temperature 0 and include 1 in --batch-sizes"
        )
    prompts = _load(args)
    chosen_workloads = _workloads(args)
    sweep_sizes = [b for b in args.batch_sizes if b > 1]
    sweep_tokens = args.sweep_max_tokens or args.max_tokens
    engine_methods = [m for m in methods if not m.external]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    transformers.logging.set_verbosity_error()  # generate() warns about flags it ignores; the report is the output

    bench = Bench(config, methods, args.temperature, args.seed,
                  _llama_cpp(args, config, speculative=any(m.label == "llama.cpp-speculative" for m in methods)))
    eligible = _short(bench, prompts, args.max_prompt_tokens, "batch 1")
    # With workloads, their requests replace the single prompts.
    selected = stratified(eligible, args.num_prompts or len(categories_of(eligible))) \
        if 1 in args.batch_sizes and not chosen_workloads else []
    sweep_limit = min(args.sweep_max_prompt_tokens, args.max_prompt_tokens or args.sweep_max_prompt_tokens)
    pool = stratified(_short(bench, prompts, sweep_limit, "the sweep"), max([args.sweep_rows, *sweep_sizes])) if sweep_sizes else []
    labels = [m.label for m in methods]
    requests = {w.name: requests_in(w, args.num_prompts) for w in chosen_workloads}  # per phase
    total = len(methods) + (len(selected) + len(PHASES) * sum(requests.values())) * len(interleave(labels, args.plain_every)) + sum(
        blocks_at(b, args.sweep_rows) * len(interleave([m.label for m in engine_methods], args.plain_every))
        for b in sweep_sizes
    )
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    load_before = os.getloadavg()  # other work on a shared machine slows every method; say how much there was
    progress = Progress(total)
    warmup_prompt = (selected or pool)[:1] or [eligible[0]]
    for method in methods:  # warm-up, not counted: first-call allocations, and the controllers' first costs
        progress.run(bench.run(method, warmup_prompt, min(WARMUP_TOKENS, args.max_tokens), block=-1))
    bench.forget()  # the warm-up prompt is measured again: no drafter may remember it

    def write(runs: list[Run], sweep: SweepResult, stopped: str | None = None) -> int:
        """results.json, report.md and the plots, of `runs`: all of them, or those finished before `stopped`."""
        recs = records(runs, labels)
        header = _header(args, config, bench, prompts, eligible, selected, labels, started, load_before)
        if stopped:
            header["stopped"] = stopped
        if chosen_workloads:
            header["prompts"]["categories"] = list(dict.fromkeys(p.category for run in runs for p in run.prompts))
            header["workloads"] = [
                {"name": w.name, "source": w.source, "sessions": args.num_prompts, "requests": requests[w.name]}
                for w in chosen_workloads
            ]
        results = {
            "header": header,
            "records": recs,
            "controller": controller_checks(recs, methods),
            "sweep": {
                "batch_sizes": sweep_sizes,
                "completed": sweep.completed,
                "stopped": sweep.stopped,
                "max_prompt_tokens": sweep_limit,
                "prompt_ids": [p.id for p in pool],
            },
            "plots": draw(recs, out),
            "runs": run_rows(runs),
            "sequences": plain_sequences(runs, bench.prompt_ids),
        }
        (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        (out / "report.md").write_text(render(results))
        for rec in (r for r in recs if r["category"] == "all"):
            print(_summary_line(rec))
        if sweep.stopped:
            print(f"sweep stopped {sweep.stopped}")
        print(f"wrote {out / 'results.json'}, {out / 'report.md'} and {len(results['plots'])} plots")
        return 0

    runs: list[Run] = []
    try:
        for i, prompt in enumerate(selected):
            block = run_block(bench, methods, [prompt], args.max_tokens, i, args.plain_every, progress.run)
            progress.block(block)
            runs += block
        for workload in chosen_workloads:
            runs += replay(bench, methods, workload, args.num_prompts, args.max_tokens, args.plain_every,
                           1 + max((run.block for run in runs), default=-1), progress.run, progress.block)
        sweep = run_sweep(
            bench, engine_methods, pool, sweep_sizes, sweep_tokens, args.sweep_rows, args.plain_every,
            args.sweep_time_limit, progress.run, progress.block,
        )
    except (Exception, KeyboardInterrupt) as error:
        # Hours of measurement outlive one failed or interrupted run: the blocks finished are written, then the
        # cause stops the bench.
        progress.bar.close()
        write(progress.finished, SweepResult(), f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}")
        raise
    finally:
        if bench.llama_cpp:
            bench.llama_cpp.close()  # llama-server, if it ran
    runs += sweep.runs
    progress.bar.close()
    return write(runs, sweep)


def _llama_cpp(args: argparse.Namespace, config: Config, speculative: bool) -> LlamaCpp | None:
    """llama.cpp's tools on the GGUF files our registry converted the config's models from (the draft model's only
    for a `speculative` row)."""
    if not args.llama_cpp:
        return None
    from .llama_cpp import LlamaCpp, find_tools, registry_gguf

    spec = config.speculation
    try:
        tools = find_tools(args.llama_cpp)
        target = registry_gguf(config.model.target)
        draft = registry_gguf(spec.draft_model) if spec.draft_model and speculative else None
    except (LookupError, FileNotFoundError) as exc:
        raise SystemExit(f"specdec bench: {exc}") from None
    return LlamaCpp(tools, target, draft, threads=config.model.threads or os.cpu_count() or 1, gamma=spec.gamma_max)


def _summary_line(rec: dict) -> str:
    """One record's headline figures: throughput, speedup, and what the drafter cost and earned."""
    from .report import fmt

    speedup = rec["speedup_vs_plain"]["median"] if rec["speedup_vs_plain"] else None
    return (
        f"batch {rec['batch_size']:>3} {rec['method']:<18} {rec['tokens_per_s']:7.2f} tok/s  {fmt(speedup, '5.2f', 'x')}  "
        f"c {fmt(rec['cost_ratio'], '.3f')}  acceptance {fmt(rec['acceptance_rate'], '.1%')}  "
        f"mean accepted length {fmt(rec['mean_accepted_length'])}"
    )


def _header(
    args: argparse.Namespace, config: Config, bench: Bench, prompts: list[Prompt], eligible: list[Prompt],
    selected: list[Prompt], labels: list[str], started: str, load_before: tuple[float, float, float],
) -> dict:
    """What a reader needs to judge and repeat the run: when, how, on what, with which prompts and settings."""
    from .results import machine

    return {
        "date": started,
        "finished": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "specdec " + shlex.join(sys.argv[1:]),
        "machine": machine(config.model.dtype, str(bench.target.device)),
        "load_average": {"start": load_before, "end": os.getloadavg()},
        "config_path": args.config,
        "config": config.model_dump(),
        "prompts": {
            "source": args.prompts,
            "count": len(selected),
            "categories": categories_of(selected),
            "max_prompt_tokens": args.max_prompt_tokens,
            # Categories with no prompt short enough for --max-prompt-tokens.
            "left_out": [c for c in categories_of(prompts) if c not in categories_of(eligible)],
            "ids": [p.id for p in selected],
        },
        "settings": {
            "methods": labels,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "seed": args.seed,
            "plain_every": args.plain_every,
            "batch_sizes": args.batch_sizes,
            "sweep_max_tokens": args.sweep_max_tokens or args.max_tokens,
            "sweep_rows": args.sweep_rows,
            "sweep_time_limit_s": args.sweep_time_limit,
            "warmup_tokens": min(WARMUP_TOKENS, args.max_tokens),
        },
    }

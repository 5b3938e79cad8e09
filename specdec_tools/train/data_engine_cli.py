"""The data engine's subcommands: `specdec train prompts`, `answers` and `features` (task_prompts.py, answers.py,
depth_features.py), importable without torch (the CLI's parser reads their defaults)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from .arguments import shard_range
from .settings import AnswerSettings, Eagle3Settings

DEFAULTS = AnswerSettings()
EAGLE3_DEFAULTS = Eagle3Settings()
PROMPTS_FILE = "data/train/prompts.jsonl.gz"


def add_arguments(trainers) -> None:
    """`prompts`, `answers` and `features` as subcommands of `specdec train` (`trainers`: its subparsers)."""
    p = trainers.add_parser("prompts", help="write the data engine's task prompts (standard-library code, general tasks)")
    p.add_argument("--code", type=int, default=5000, help="code tasks (default: %(default)s)")
    p.add_argument("--general", type=int, default=3000, help="general instructions (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="what draws the functions, tasks and subjects")
    p.add_argument("--out", type=Path, default=Path(PROMPTS_FILE), help="the prompts file (default: %(default)s)")
    p.set_defaults(func=prompts_command)

    p = trainers.add_parser("answers", help="the target's greedy answers to the task prompts, in shards a stopped run resumes")
    p.add_argument("--config", default="configs/default.yaml", help="the config naming the target (default: %(default)s)")
    p.add_argument("--prompts-file", type=Path, default=Path(PROMPTS_FILE), help="the prompts (default: %(default)s)")
    p.add_argument("--count", type=int, help="answer the first N prompts (default: all)")
    p.add_argument("--out", type=Path, help="the answers' directory (default: data/train/answers/<target>)")
    p.add_argument("--answer-tokens", type=int, default=DEFAULTS.answer_tokens, help="longest answer (default: %(default)s)")
    p.add_argument("--batch", type=int, default=DEFAULTS.batch, help="rows decoded together (default: %(default)s)")
    p.add_argument("--shard-prompts", type=int, default=DEFAULTS.shard_prompts, help="prompts a shard (default: %(default)s)")
    p.set_defaults(func=answers_command)

    p = trainers.add_parser("features", help="the target's hidden states at three depths over its answers (EAGLE-3's inputs)")
    p.add_argument("--config", default="configs/default.yaml", help="the config naming the target (default: %(default)s)")
    p.add_argument("--answers", type=Path, help="the answers' directory (default: data/train/answers/<target>)")
    p.add_argument("--shards", type=shard_range, default=slice(None),
                   help="answers shards N (the first N) or A:B, and the held-out prompts of the first "
                        f"{EAGLE3_DEFAULTS.heldout_shards} that EAGLE-3's training scores on (default: every shard)")
    p.set_defaults(func=features_command)


def prompts_command(args) -> int:
    from .task_prompts import build_prompts, write_prompts

    prompts = build_prompts(args.code, args.general, args.seed)
    write_prompts(prompts, args.out)
    print(f"{len(prompts)} prompts written to {args.out}")
    return 0


def answers_command(args) -> int:
    from specdec_core.config import Config

    from .answers import ANSWERS_DIR, MismatchedRun, answer

    logging.basicConfig(level=logging.INFO, format="specdec: %(message)s")
    config = Config.load(args.config)
    out = args.out or ANSWERS_DIR / config.model.target
    settings = AnswerSettings(answer_tokens=args.answer_tokens, batch=args.batch, shard_prompts=args.shard_prompts)
    try:
        manifest = answer(config, out, args.prompts_file, args.count, settings)
    except MismatchedRun as error:
        print(f"specdec train answers: {error}", file=sys.stderr)
        return 2
    totals = manifest.get("totals")
    if totals:
        print(f"{out}: {len(manifest['shards'])} shards, {totals['answer_tokens']:,} answer tokens "
              f"({totals['positions']:,} positions) in {totals['seconds'] / 3600:.2f} h, "
              f"{totals['answer_tokens'] / totals['seconds']:.1f} answer tokens/s")
    return 0


def features_command(args) -> int:
    from specdec_core.config import Config
    from specdec_core.models.loading import load_runner

    from .answers import ANSWERS_DIR
    from .eagle3 import run_features

    logging.basicConfig(level=logging.INFO, format="specdec: %(message)s")
    config = Config.load(args.config)
    runner = load_runner(config.model.target, config.model)
    try:
        directory = run_features(runner, args.answers or ANSWERS_DIR / config.model.target, args.shards, EAGLE3_DEFAULTS)
    except FileNotFoundError as error:
        print(f"specdec train features: {error}", file=sys.stderr)
        return 2
    meta = json.loads((directory / "meta.json").read_text())
    positions = sum(entry["positions"] for entry in meta["shards"].values())
    seconds = sum(entry["seconds"] for entry in meta["shards"].values())
    print(f"{directory}: {len(meta['shards'])} shards, {positions:,} positions, {positions / seconds:.1f} positions/s "
          f"(depths {meta['depths']})")
    return 0

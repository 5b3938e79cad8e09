"""`specdec train medusa`: its arguments and its command. The trainer is train/medusa.py."""

from __future__ import annotations

import argparse
import logging
import sys

from .arguments import add_common_arguments, data_settings
from .settings import TrainSettings

DEFAULTS = TrainSettings()


def add_arguments(trainers) -> None:
    """`medusa` as a subcommand of `specdec train` (`trainers`: the train command's subparsers)."""
    p = trainers.add_parser("medusa", help="Medusa heads by self-distillation (target frozen)")
    add_common_arguments(p, "heads", DEFAULTS.epochs, DEFAULTS.lr)
    p.add_argument("--heads", type=int, default=DEFAULTS.num_heads, help="number of heads K")
    p.add_argument("--layers", type=int, default=DEFAULTS.num_layers, help="residual blocks per head")
    p.add_argument("--batch-size", type=int, default=DEFAULTS.batch_size, help="positions per step")
    p.set_defaults(func=medusa_command)


def medusa_command(args: argparse.Namespace) -> int:
    from specdec_core.config import Config
    from specdec_core.models.artifacts import HEADS, artifact_dir
    from specdec_core.models.loading import load_runner, target_vocab

    from .data import features
    from .medusa import train_medusa

    logging.basicConfig(level=logging.INFO, format="specdec: %(message)s")
    config = Config.load(args.config)
    target = config.model.target
    runner = load_runner(target, config.model)
    data = features(runner, data_settings(args))
    vocab = target_vocab(runner, args.vocab_size)
    settings = TrainSettings(num_heads=args.heads, num_layers=args.layers, epochs=args.epochs,
                             batch_size=args.batch_size, lr=args.lr)
    name = args.out or HEADS.default_name(target)
    meta = train_medusa(runner.model.get_output_embeddings(), data, settings, name, vocab, args.resume)
    print_report(name, meta)
    print(f"saved to {artifact_dir(HEADS, name)}", file=sys.stderr)
    return 0


def print_report(name: str, meta: dict) -> None:
    """Per-head held-out agreement, untrained (identity heads) and trained, and what the run cost."""
    print(f"heads {name!r} for {meta['target']}: {meta['tokens']['train']} training positions "
          f"({meta['tokens']['heldout']} held out), {meta['epochs']} epochs, vocabulary {meta['vocab_size'] or 'full'}")
    print(f"target features: {meta['extract_s']} s to extract (once: runs with the same data settings reuse them); "
          f"training: {meta['train_s']} s; mean loss per epoch: {meta['epoch_loss']}")
    print("head  predicts  top-1 untrained -> trained  top-5 untrained -> trained")
    for i, (before, after) in enumerate(zip(meta["agreement_untrained"], meta["agreement"])):
        print(f"{i:>4}  t+{i + 2:<6}  {before['top1']:>15.1%} -> {after['top1']:<7.1%}  "
              f"{before['top5']:>15.1%} -> {after['top5']:.1%}")

"""`specdec train TRAINER ...`: one subcommand per trainer (medusa now; eagle and distill can join it).

Each trainer adds its own subparser in `add_arguments` and sets `func`, which `server/cli.py` calls.
"""

from __future__ import annotations

import argparse
import logging
import sys

from .settings import DataSettings, TrainSettings

DATA_DEFAULTS = DataSettings()
MEDUSA_DEFAULTS = TrainSettings()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The trainers, as subcommands of `parser`."""
    trainers = parser.add_subparsers(dest="trainer", required=True, metavar="TRAINER")
    p = trainers.add_parser("medusa", help="Medusa heads by self-distillation (target frozen)")
    add_common_arguments(p, "heads", MEDUSA_DEFAULTS.epochs, MEDUSA_DEFAULTS.lr)
    p.add_argument("--heads", type=int, default=MEDUSA_DEFAULTS.num_heads, help="number of heads K")
    p.add_argument("--layers", type=int, default=MEDUSA_DEFAULTS.num_layers, help="residual blocks per head")
    p.add_argument("--batch-size", type=int, default=MEDUSA_DEFAULTS.batch_size, help="positions per step")
    p.set_defaults(func=medusa_command)
    from .distill_cli import add_arguments as distill_arguments

    distill_arguments(trainers)
    from .eagle_cli import add_arguments as eagle_arguments

    eagle_arguments(trainers)


def add_common_arguments(parser: argparse.ArgumentParser, folder: str, epochs: int, lr: float) -> None:
    """What every self-distillation trainer takes: the target's config, the output name, epochs, learning
    rate, reduced vocabulary, resume, and the data settings (which key the feature cache)."""
    parser.add_argument("--config", required=True, help="the config naming the target to train for")
    parser.add_argument("--out", help=f"name of the result, saved under <cache>/{folder}/NAME; default <target>-{parser.prog.split()[-1]}")
    parser.add_argument("--epochs", type=int, default=epochs, help="passes over the cached features (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=lr, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--vocab-size", type=int, help="predict over the target's N most frequent tokens (default: all)")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint of an interrupted run")
    add_data_arguments(parser)


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """The data settings (they key the feature cache, so trainers given the same ones share it)."""
    parser.add_argument("--tokens", type=int, default=DATA_DEFAULTS.tokens, help="positions of target features, held-out included")
    parser.add_argument("--seq-len", type=int, default=DATA_DEFAULTS.seq_len, help="longest sequence run through the target")
    parser.add_argument("--prompts", type=int, help="answer only the first N training prompts (default: all)")
    parser.add_argument("--answer-tokens", type=int, default=DATA_DEFAULTS.answer_tokens, help="longest answer the target generates")


def data_settings(args: argparse.Namespace) -> DataSettings:
    return DataSettings(tokens=args.tokens, seq_len=args.seq_len, prompts=args.prompts, answer_tokens=args.answer_tokens)


def medusa_command(args: argparse.Namespace) -> int:
    from ..build import load_runner, registry_dir
    from ..config import Config
    from ..models.medusa_heads import default_heads_name, heads_dir
    from ..vocab import reduced_vocab
    from .data import features
    from .medusa import train_medusa

    logging.basicConfig(level=logging.INFO, format="specdec: %(message)s")
    config = Config.load(args.config)
    target = config.model.target
    runner = load_runner(target, config.model)
    data = features(runner, data_settings(args))
    vocab = reduced_vocab(runner.tokenizer, runner.vocab_size, args.vocab_size, registry_dir(target))
    settings = TrainSettings(num_heads=args.heads, num_layers=args.layers, epochs=args.epochs,
                             batch_size=args.batch_size, lr=args.lr)
    name = args.out or default_heads_name(target)
    meta = train_medusa(runner.model.get_output_embeddings(), data, settings, name, vocab, args.resume)
    print_report(name, meta)
    print(f"saved to {heads_dir(name)}", file=sys.stderr)
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

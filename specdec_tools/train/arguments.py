"""The arguments every trainer's subcommand shares, and the data settings they give."""

from __future__ import annotations

import argparse

from .settings import DataSettings

DATA_DEFAULTS = DataSettings()


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


def shard_range(text: str) -> slice:
    """`--shards` of the data engine's later stages: N (the first N answers shards) or A:B."""
    first, colon, last = text.partition(":")
    try:
        return slice(int(first), int(last)) if colon else slice(0, int(first))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give N (the first N shards) or A:B") from None

"""`specdec train eagle`: its arguments and entry point, importable without torch (the CLI's parser reads them)."""

from __future__ import annotations

import logging
import sys

from .arguments import add_common_arguments, data_settings
from .settings import EagleSettings

DEFAULTS = EagleSettings()


def add_arguments(trainers) -> None:
    """`eagle` as a subcommand of `specdec train` (`trainers`: the train command's subparsers)."""
    p = trainers.add_parser("eagle", help="the EAGLE draft network by self-distillation (target frozen)")
    add_common_arguments(p, "eagle", DEFAULTS.epochs, DEFAULTS.lr)
    p.add_argument("--batch-sequences", type=int, default=DEFAULTS.batch_sequences, help="sequences per step")
    p.set_defaults(func=eagle_command)


def eagle_command(args) -> int:
    from specdec_core.config import Config
    from specdec_core.models.artifacts import EAGLE, artifact_dir
    from specdec_core.models.loading import load_runner, target_vocab

    from .data import features
    from .eagle import train

    logging.basicConfig(level=logging.INFO, format="specdec: %(message)s")
    config = Config.load(args.config)
    target = config.model.target
    runner = load_runner(target, config.model.model_copy(update={"weights": None}))
    # Features in the served dtype: what the drafter reads when serving, and the cache the other trainers share.
    data = features(runner, data_settings(args))
    # The network trains in float32 (a bf16 backward on a CPU is slow and coarse), so the frozen embedding and
    # output layer it reads become float32 too; the saved weights load into any dtype.
    runner.model.get_input_embeddings().float()
    runner.model.get_output_embeddings().float()
    vocab = target_vocab(runner, args.vocab_size)
    settings = EagleSettings(epochs=args.epochs, batch_sequences=args.batch_sequences, lr=args.lr)
    name = args.out or EAGLE.default_name(target)
    meta = train(runner, data, name, settings, vocab, args.resume)
    positions = meta["data"]["positions"]
    print(f"eagle {name!r} for {target}: {positions['train']} training positions ({positions['heldout']} held out), "
          f"{settings.epochs} epochs, "
          f"vocabulary {meta['vocab_size'] or 'full'}, {meta['train_s']} s; loss {meta['first_loss']['loss']:.3f} -> "
          f"{meta['last_loss']['loss']:.3f}; held out: top-1 agreement {meta['heldout']['top1_agreement']:.1%}, "
          f"chain acceptance length {meta['heldout']['acceptance_length']:.2f} (depth {settings.depth}, a lower bound)")
    print(f"saved to {artifact_dir(EAGLE, name)}", file=sys.stderr)
    return 0

"""`specdec train distill`: its settings (plain data, importable without torch: the CLI's parser reads their
defaults), its arguments and its command. The trainer is train/distill.py."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class DistillSettings:
    k: int  # frozen target layers under the adapter
    width: int = 1024  # the adapter's inner width
    epochs: int = 2
    batch_size: int = 256  # positions per step
    lr: float = 1e-3
    weight_decay: float = 0.01  # AdamW's default
    temperature: float = 1.0  # T of the softened distributions
    checkpoint_every: int = 100  # steps
    seed: int = 0


def add_arguments(trainers) -> None:
    """`distill` as a subcommand of `specdec train` (`trainers`: the train command's subparsers)."""
    from .cli import add_common_arguments

    defaults = DistillSettings(k=0)
    p = trainers.add_parser("distill", help="a layer-skip student distilled toward the target (target frozen)")
    add_common_arguments(p, "students", defaults.epochs, defaults.lr)
    p.add_argument("--student", default="layer-skip",
                   help="layer-skip[:K]: the target's first K layers (default: the config's layer_skip.k, else 3/4 "
                        "of the layers) and a trained adapter")
    p.add_argument("--width", type=int, default=defaults.width, help="the adapter's inner width (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=defaults.temperature, help="softening T (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="positions per step (default: %(default)s)")
    p.set_defaults(func=distill_command)


def student_k(student: str, configured: int | None, num_layers: int) -> int:
    """K of a `--student` value: layer-skip:K, or layer-skip with the config's k (else layer skip's default)."""
    from ..drafters.layer_skip import default_k

    kind, _, k = student.partition(":")
    if kind != "layer-skip":
        raise SystemExit(f"--student {student}: only layer-skip[:K] students are implemented "
                         "(fine-tuning the draft model is not)")
    return int(k) if k else configured or default_k(num_layers)


def distill_command(args: argparse.Namespace) -> int:
    from ..build import load_runner, registry_dir
    from ..config import Config
    from ..drafters.distilled import default_student_name, student_dir
    from ..vocab import reduced_vocab
    from .cli import data_settings
    from .data import features
    from .distill import train_distill

    logging.basicConfig(level=logging.INFO, format="specdec: %(message)s")
    config = Config.load(args.config)
    target = config.model.target
    runner = load_runner(target, config.model)
    k = student_k(args.student, config.speculation.layer_skip.k, runner.num_layers)
    data = features(runner, data_settings(args))
    vocab = reduced_vocab(runner.tokenizer, runner.vocab_size, args.vocab_size, registry_dir(target))
    settings = DistillSettings(k=k, width=args.width, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                               temperature=args.temperature)
    name = args.out or default_student_name(target)
    meta = train_distill(runner, data, settings, name, vocab, args.resume)
    before, after = meta["heldout"]["untrained"], meta["heldout"]["trained"]
    print(f"student {name!r} for {target}: first {k} of {runner.num_layers} layers + adapter (width {settings.width}); "
          f"{meta['tokens']['train']} training positions ({meta['tokens']['heldout']} held out), {settings.epochs} "
          f"epochs, vocabulary {meta['vocab_size'] or 'full'}")
    print(f"target features: {meta['extract_s']} s (once); first {k} layers: {meta['layers_s']} s (once); "
          f"training: {meta['train_s']} s; mean loss per epoch: {meta['epoch_loss']}")
    print("held out         untrained -> distilled")
    for key, label in (("kl", f"KL at T={settings.temperature}"), ("top1", "top-1 agreement"),
                       ("accept_t1", "accept (T=1)")):
        print(f"{label:<16} {before[key]:>9.4f} -> {after[key]:.4f}")
    print(f"saved to {student_dir(name)}", file=sys.stderr)
    return 0

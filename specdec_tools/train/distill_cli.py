"""`specdec train distill`: its arguments and its command. The trainer is train/distill.py."""

from __future__ import annotations

import argparse
import logging
import sys

from .arguments import add_common_arguments, data_settings
from .settings import DistillSettings


def add_arguments(trainers) -> None:
    """`distill` as a subcommand of `specdec train` (`trainers`: the train command's subparsers)."""
    defaults = DistillSettings(k=0)
    p = trainers.add_parser("distill", help="a student drafter distilled toward the target (target frozen)")
    add_common_arguments(p, "students", defaults.epochs, defaults.lr)
    p.add_argument("--student", default="layer-skip",
                   help="layer-skip[:K]: the target's first K layers (default: the config's layer_skip.k, else 3/4 "
                        "of the layers) and a trained adapter; draft-model[:NAME]: the same-family draft model "
                        "(default: the config's speculation.draft_model) and a trained adapter before its output layer")
    p.add_argument("--width", type=int, default=defaults.width, help="the adapter's inner width (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=defaults.temperature, help="softening T (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="positions per step (default: %(default)s)")
    p.set_defaults(func=distill_command)


def parse_student(student: str, config, num_layers: int) -> tuple[int, str | None]:
    """(k, draft model) of a `--student` value: layer-skip[:K] (K defaulting to the config's layer_skip.k, else
    layer skip's default) gives (K, None); draft-model[:NAME] (NAME defaulting to the config's draft model), (0, NAME)."""
    from specdec_core.drafters.layer_skip import default_k

    kind, _, value = student.partition(":")
    if kind == "layer-skip":
        return (int(value) if value else config.speculation.layer_skip.k or default_k(num_layers)), None
    if kind == "draft-model":
        name = value or config.speculation.draft_model
        if not name:
            raise SystemExit("--student draft-model: name the model (draft-model:NAME) or set speculation.draft_model "
                             "in the config")
        return 0, name
    raise SystemExit(f"--student {student}: use layer-skip[:K] or draft-model[:NAME]")


def distill_command(args: argparse.Namespace) -> int:
    from specdec_core.config import Config
    from specdec_core.drafters.distilled import default_student_name
    from specdec_core.models.artifacts import STUDENT, artifact_dir
    from specdec_core.models.loading import draft_runner, load_runner, target_vocab

    from .data import features
    from .distill import train_distill

    logging.basicConfig(level=logging.INFO, format="specdec: %(message)s")
    config = Config.load(args.config)
    target = config.model.target
    runner = load_runner(target, config.model)
    k, draft_name = parse_student(args.student, config, runner.num_layers)
    # The draft's own output layer stays whole here: the trainer cuts a float32 copy to the vocabulary.
    draft = draft_runner(config.model, runner, draft_name, None)[0] if draft_name else None
    data = features(runner, data_settings(args))
    vocab = target_vocab(runner, args.vocab_size)
    settings = DistillSettings(k=k, width=args.width, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                               temperature=args.temperature)
    name = args.out or default_student_name(target, draft_name)
    meta = train_distill(runner, data, settings, name, vocab, args.resume, draft=draft)
    before, after = meta["heldout"]["untrained"], meta["heldout"]["trained"]
    trunk = f"draft model {draft_name}" if draft_name else f"first {k} of {runner.num_layers} layers"
    print(f"student {name!r} for {target}: {trunk} + adapter (width {settings.width}); "
          f"{meta['tokens']['train']} training positions ({meta['tokens']['heldout']} held out), {settings.epochs} "
          f"epochs, vocabulary {meta['vocab_size'] or 'full'}")
    print(f"target features: {meta['extract_s']} s (once); student inputs ({trunk}): {meta['layers_s']} s (once); "
          f"training: {meta['train_s']} s; mean loss per epoch: {meta['epoch_loss']}")
    print("held out         untrained -> distilled")
    for key, label in (("kl", f"KL at T={settings.temperature}"), ("top1", "top-1 agreement"),
                       ("accept_t1", "accept (T=1)")):
        print(f"{label:<16} {before[key]:>9.4f} -> {after[key]:.4f}")
    print(f"saved to {artifact_dir(STUDENT, name)}", file=sys.stderr)
    return 0

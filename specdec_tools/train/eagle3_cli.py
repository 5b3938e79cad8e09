"""`specdec train eagle3`: its arguments and entry point, importable without torch (the CLI's parser reads them)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from .arguments import shard_range
from .settings import Eagle3Settings

DEFAULTS = Eagle3Settings()


def add_arguments(trainers) -> None:
    """`eagle3` as a subcommand of `specdec train` (`trainers`: the train command's subparsers)."""
    p = trainers.add_parser("eagle3", help="EAGLE-3's drafter on the target's depth features (run answers, then features)")
    p.add_argument("--config", default="configs/default.yaml", help="the config naming the target (default: %(default)s)")
    p.add_argument("--out", help="name of the result, saved under <cache>/eagle3/NAME; default <target>-eagle3")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint of an interrupted run")
    p.add_argument("--shards", type=shard_range, default=slice(None),
                   help="train on answers shards N (the first N: a learning-curve point) or A:B (a piece of a long run); "
                        "their depth features are made where missing (default: all)")
    p.add_argument("--init", help="start from this drafter's weights and vocabulary, with a fresh optimizer (a snapshot "
                                  "an earlier piece committed, or a name under <cache>/eagle3)")
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                   help="bf16 autocast or fp32; auto: bf16 where the CPU computes bf16 itself (AVX-512 BF16, AMX), "
                        "else fp32 (default: %(default)s)")
    for field, help_text in (("steps", "training-time test's steps"), ("epochs", "passes over the features"),
                             ("lr", "AdamW's peak learning rate"), ("warmup", "batches of linear warmup"),
                             ("lr_floor", "the cosine's end, a fraction of the peak"), ("vocab_size", "draft vocabulary"),
                             ("intermediate_size", "the layer's MLP width"), ("batch_sequences", "sequences a batch"),
                             ("noise", "std of the noise on the target's features in training"),
                             ("length_window", "batches cut from runs of N batches' sequences sorted by length")):
        default = getattr(DEFAULTS, field)
        p.add_argument(f"--{field.replace('_', '-')}", type=type(default), default=default,
                       help=f"{help_text} (default: %(default)s)")
    p.add_argument("--frozen-head", action="store_true",
                   help="keep the output layer and its norm the target's (rebuilt on load, never saved)")
    p.set_defaults(func=eagle3_command)

    p = trainers.add_parser("eagle3-curve", help="EAGLE-3's learning curve: trained drafters' held-out figures, a table and a plot")
    p.add_argument("names", nargs="+", help="trained drafters (names under <cache>/eagle3, or directories)")
    p.add_argument("--config", default="configs/default.yaml", help="the config naming the target (default: %(default)s)")
    p.add_argument("--out", type=Path, required=True, help="the run folder to write learning-curve.json and .png to")
    p.add_argument("--earlier", type=Path, action="append", default=[],
                   help="a learning-curve.json written before: its points drawn too, as scored there (repeatable)")
    p.set_defaults(func=curve_command)

    p = trainers.add_parser("eagle3-ship", help="ship a trained EAGLE-3 drafter in the repository, with its manifest")
    p.add_argument("name", help="the trained drafter (a name under <cache>/eagle3, or a directory)")
    p.add_argument("--config", default="configs/default.yaml", help="the config naming the target (default: %(default)s)")
    p.add_argument("--out", type=Path, help="where to write it (default: specdec_core/shipped/<target>-eagle3)")
    p.set_defaults(func=ship_command)


def eagle3_command(args) -> int:
    from specdec_core.config import Config
    from specdec_core.models.artifacts import EAGLE3, MissingArtifactError, artifact_dir
    from specdec_core.models.kernels import cpu_flags
    from specdec_core.models.loading import load_runner

    from .answers import ANSWERS_DIR
    from .depth_features import answers_shards, features_name
    from .eagle3 import InitMismatch, check_init, run_features, train
    from .loop import CheckpointMismatch
    from .settings import bf16_native

    logging.basicConfig(level=logging.INFO, format="specdec: %(message)s")
    config = Config.load(args.config)
    target = config.model.target
    bf16 = bf16_native(cpu_flags()) if args.precision == "auto" else args.precision == "bf16"
    settings = Eagle3Settings(steps=args.steps, epochs=args.epochs, lr=args.lr, warmup=args.warmup,
                              lr_floor=args.lr_floor, vocab_size=args.vocab_size,
                              intermediate_size=args.intermediate_size, batch_sequences=args.batch_sequences,
                              noise=args.noise, frozen_head=args.frozen_head, length_window=args.length_window, bf16=bf16)
    try:  # before hours of features: the drafter it starts from is there and of its shape
        if args.init:
            check_init(args.init, settings)
    except (MissingArtifactError, InitMismatch) as error:
        print(f"specdec train eagle3: {error}", file=sys.stderr)
        return 2
    runner = load_runner(target, config.model)
    answers = ANSWERS_DIR / target
    try:  # the features this run reads, made where missing: its shards whole, the held-out set's prompts
        features = run_features(runner, answers, args.shards, settings)
        shards = [features_name(path) for path in answers_shards(answers, args.shards)]
    except FileNotFoundError as error:
        print(f"specdec train eagle3: {error}", file=sys.stderr)
        return 2
    name = args.out or EAGLE3.default_name(target)
    try:
        meta = train(runner, features, name, settings, args.resume, shards=shards, init=args.init)
    except (MissingArtifactError, InitMismatch, CheckpointMismatch) as error:
        print(f"specdec train eagle3: {error}", file=sys.stderr)
        return 2
    heldout = meta["heldout"]
    print(f"eagle3 {name!r} for {target}: {meta['data']['positions']:,} positions, {meta['batches']} batches, "
          f"{meta['train_s']} s; held out: step accuracy {heldout['step_accuracy']}, expected accepted length "
          f"{heldout['expected_length']} over {settings.steps} drafts")
    print(f"saved to {artifact_dir(EAGLE3, name)}", file=sys.stderr)
    return 0


def curve_command(args) -> int:
    from specdec_core.config import Config
    from specdec_core.models.loading import load_runner

    from .eagle3_curve import RECIPE, recipe_label, write_curve

    config = Config.load(args.config)
    runner = load_runner(config.model.target, config.model)
    command = " ".join(["specdec train eagle3-curve", *args.names, "--config", args.config, "--out", str(args.out),
                        *[f"--earlier {path}" for path in args.earlier]])
    for point in write_curve(runner, args.names, args.out, command, args.earlier):
        print(f"{point['name']}: {point['positions']:,} positions x {point['epochs']} epochs ({point['batches']} batches, "
              f"{recipe_label(tuple(point[key] for key in RECIPE))}): "
              f"expected length {point['expected_length']}, step accuracy {point['step_accuracy']}")
    print(f"written to {args.out}", file=sys.stderr)
    return 0


def ship_command(args) -> int:
    from specdec_core.config import Config
    from specdec_core.models.artifacts import MissingArtifactError

    from .eagle3_ship import ship

    target = Config.load(args.config).model.target
    try:
        manifest = ship(args.name, target, args.config, args.out)
    except (MissingArtifactError, ValueError) as error:
        print(f"specdec train eagle3-ship: {error}", file=sys.stderr)
        return 2
    print(f"shipped {args.name!r} for {target}: {manifest['bytes'] / 2**20:.1f} MiB, sha256 {manifest['sha256']}; "
          f"held out: expected accepted length {manifest['heldout']['expected_length']}")
    return 0

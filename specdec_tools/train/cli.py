"""`specdec train TRAINER ...`: one subcommand per trainer, each in its own `*_cli.py`.

Each trainer adds its own subparser in `add_arguments` and sets `func`, which `specdec_cli/main.py` calls.
"""

from __future__ import annotations

import argparse

from . import data_engine_cli, distill_cli, eagle3_cli, eagle_cli, medusa_cli


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The trainers, as subcommands of `parser`."""
    trainers = parser.add_subparsers(dest="trainer", required=True, metavar="TRAINER")
    for trainer in (medusa_cli, distill_cli, eagle_cli, data_engine_cli, eagle3_cli):
        trainer.add_arguments(trainers)

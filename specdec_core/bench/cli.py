"""`specdec bench` (arguments and entry point)."""

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="configs/default.yaml")


def run_bench(args: argparse.Namespace) -> int:
    raise SystemExit("specdec bench is not built yet")

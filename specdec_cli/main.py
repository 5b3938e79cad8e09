"""The `specdec` command: pull, models, plan, generate, serve, bench, calibrate, train."""

from __future__ import annotations

import argparse
import sys
import time

DEFAULT_CONFIG = "configs/default.yaml"


def plan_command(args: argparse.Namespace) -> int:
    from specdec_core import theory

    if args.gamma is not None:
        tokens = theory.expected_tokens(args.alpha, args.gamma)
        print(f"alpha={args.alpha} gamma={args.gamma}: expected tokens per verification step = {tokens:.2f}")
        if args.draft_ms is not None and args.verify_ms is not None:
            ratio = args.draft_ms / args.verify_ms
            print(f"speedup over plain decoding = {theory.speedup(args.alpha, args.gamma, ratio):.2f}x (cost ratio c={ratio:.3f})")
        return 0
    if args.draft_ms is None or args.verify_ms is None:
        print("specdec plan: give --gamma, or --draft-ms and --verify-ms to find the optimal gamma", file=sys.stderr)
        return 2
    ratio = args.draft_ms / args.verify_ms
    gamma, speedup = theory.optimal_gamma(args.alpha, ratio, args.gamma_max)
    print(
        f"alpha={args.alpha} draft={args.draft_ms} ms verify={args.verify_ms} ms (c={ratio:.3f}): "
        f"optimal gamma = {gamma}, expected tokens per step = {theory.expected_tokens(args.alpha, gamma):.2f}, "
        f"speedup over plain decoding = {speedup:.2f}x"
    )
    return 0


def generate_command(args: argparse.Namespace) -> int:
    from specdec_core.build import build_engine
    from specdec_core.config import Config
    from specdec_core.sampling import SamplingParams
    from specdec_core.sequence import Sequence

    engine = build_engine(Config.load(args.config), drafter=args.drafter)
    tokenizer = engine.target.tokenizer
    if args.chat and tokenizer.chat_template:
        prompt_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    seq = Sequence("cli", list(prompt_ids), SamplingParams(temperature=args.temperature, seed=args.seed), args.max_tokens)
    start = time.perf_counter()
    engine.add(seq)
    marked = [tokenizer.decode(seq.output_ids)]  # the first token, drawn from the prefill's last logits
    for report in engine.generate():
        for row in report.rows:
            # Kept draft tokens are shown in [brackets]; the target's own token after them is plain.
            text = [tokenizer.decode([t]) for t in row.new_tokens]
            drafted = "".join(text[: row.accepted])
            marked.append((f"[{drafted}]" if drafted else "") + "".join(text[row.accepted :]))
    elapsed = time.perf_counter() - start
    print("".join(marked))
    usage = seq.stats.as_usage()
    print(
        f"\n-- {len(seq.output_ids)} tokens in {elapsed:.2f} s = {len(seq.output_ids) / elapsed:.2f} tokens/s; "
        f"method {usage['method']}, acceptance {usage['acceptance_rate']:.1%}, "
        f"mean accepted length {usage['mean_accepted_length']:.2f}, mean gamma {usage['mean_gamma']:.2f}, "
        f"finish {seq.finish_reason}",
        file=sys.stderr,
    )
    return 0


def serve_command(args: argparse.Namespace) -> int:
    from server.app import serve

    return serve(args.config, host=args.host, port=args.port, drafter=args.drafter)


def bench_command(args: argparse.Namespace) -> int:
    from specdec_tools.bench.cli import run_bench

    return run_bench(args)


def calibrate_command(args: argparse.Namespace) -> int:
    from specdec_tools.calibrate import run

    return run(args)


def pull_command(args: argparse.Namespace) -> int:
    """Pull each model and print its path; with --weights, also quantize it and cache the packed weights,
    so that a start loads them directly. Exit code 1 on the first error."""
    from specdec_core.models.loading import load_runner
    from specdec_core.config import ModelConfig
    from specdec_core.models.catalogue import RegistryError
    from specdec_core.models.registry import pull

    for name in args.names:
        try:  # gguf weights read the GGUF itself: no bf16 conversion
            print(pull(name, float_weights=args.weights != "gguf"))
        except RegistryError as error:
            print(f"specdec: error: {error}", file=sys.stderr)
            return 1
        if args.weights:
            load_runner(name, ModelConfig(target=name, weights=args.weights))
            print(f"{name}: {args.weights} weights packed and cached")
    return 0


def models_command(args: argparse.Namespace) -> int:
    """The registry as a table."""
    from specdec_core.models.registry import list_models

    rows = [(m["name"], m["family"], m["role"], f"{m['gguf_size'] / 1e6:.0f}", "yes" if m["cached"] else "no")
            for m in list_models()]
    header = ("NAME", "FAMILY", "ROLE", "SIZE MB", "CACHED")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="specdec", description="Speculative-decoding inference server and tools.")
    sub = root.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pull", help="fetch, verify and convert registry models")
    p.add_argument("names", nargs="+", help="registry names (see `specdec models`)")
    p.add_argument("--weights", choices=["gguf", "int4", "int8"], help="also quantize and cache the packed weights (model.weights), "
                   "so that the first start does not")
    p.set_defaults(func=pull_command)

    p = sub.add_parser("models", help="list registry models and whether they are cached")
    p.set_defaults(func=models_command)

    p = sub.add_parser("plan", help="expected tokens, speedup and optimal gamma from closed forms")
    p.add_argument("--alpha", type=float, required=True, help="per-token acceptance rate")
    p.add_argument("--gamma", type=int, help="draft tokens per step")
    p.add_argument("--draft-ms", type=float, help="cost of one draft step")
    p.add_argument("--verify-ms", type=float, help="cost of one target (verify) pass")
    p.add_argument("--gamma-max", type=int, default=32, help="largest gamma considered")
    p.set_defaults(func=plan_command)

    p = sub.add_parser("generate", help="decode one prompt and show what was drafted and accepted")
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--drafter", help="override the config's drafter (none decodes plainly)")
    p.add_argument("--no-chat", dest="chat", action="store_false", help="send the prompt raw, not through the chat template")
    p.set_defaults(func=generate_command)

    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--drafter", help="override the config's drafter (none serves plain decoding)")
    p.set_defaults(func=serve_command)

    p = sub.add_parser("bench", help="Spec-Bench-style measurement of decoding methods")
    from specdec_tools.bench.cli import add_arguments

    add_arguments(p)
    p.set_defaults(func=bench_command)

    p = sub.add_parser("calibrate", help="pick layer skip's k by measurement, or measure drafters against plain decoding")
    from specdec_tools.calibrate import add_arguments as calibrate_arguments

    calibrate_arguments(p)
    p.set_defaults(func=calibrate_command)

    p = sub.add_parser("train", help="train drafter heads on the target's own predictions (self-distillation)")
    from specdec_tools.train.cli import add_arguments as train_arguments

    train_arguments(p)  # one subcommand per trainer (medusa, ...), each setting its own func
    return root


TOOLS_EXTRA = ("matplotlib", "scipy")  # pyproject.toml's tools extra: what bench, calibrate and train need beyond serving


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] not in TOOLS_EXTRA:
            raise
        raise SystemExit(f"specdec {args.command}: needs {error.name}, from the tools extra; install it with "
                         "pip install '.[tools]' -c constraints.txt") from error


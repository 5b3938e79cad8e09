"""What a step costs on each step kind (model.step: eager, static, compiled): ms per plain step, per verify
pass of k tokens and per draft step of the model drafters, interleaved in one run so that every kind sees
the same machine.

Where the real weights cannot go (a GPU machine takes 64 MiB), --shapes builds a registry model's exact
architecture with random weights: a pass costs what its shapes cost, whatever the values. --acceptance
combines the costs with a bench run's measured tokens per step into expected speedups, labelled as that
combination (a tree's pass is taken as wide as it is deep, so trees come out a little better than they are).

    python -m specdec_tools.step_costs --config configs/default.yaml --lengths 1,2,4,8 --reps 10
    python -m specdec_tools.step_costs --shapes qwen2.5-coder-1.5b --draft-shapes qwen2.5-coder-0.5b \\
        --device cuda --weights bf16 --lengths 1,2,4,8,16,32,64 \\
        --acceptance docs/benchmarks/qwen2.5-coder-1.5b-int4-workloads-t0/results.json --out step-costs.json
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM

from specdec_core.config import Config
from specdec_core.models.eagle_net import EagleNet
from specdec_core.models.loading import load_runner
from specdec_core.models.medusa_heads import MedusaHeads, head_logits
from specdec_core.models.quant import DEFAULT_GROUP_SIZE, QUANTIZED, quantize_model
from specdec_core.models.runner import DTYPES, BatchCache, ModelRunner, resolve_device
from specdec_core.models.static_runner import STEPS, on_step
from specdec_core.models.tiny import is_tiny, tiny_model

from . import measurement

# The registry models' architectures (their config.json), for --shapes: what a pass's cost depends on.
QWEN2 = {"model_type": "qwen2", "vocab_size": 151936, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1e6,
         "max_position_embeddings": 32768}
SHAPES = {
    "qwen2.5-coder-1.5b": dict(QWEN2, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                               num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=False),
    "qwen2.5-coder-0.5b": dict(QWEN2, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                               num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=False),
}
TINY_VOCAB = 384
HOST_DRAFTERS = ("ngram", "suffix")  # lookups on the host: their draft time is the bench run's own
WARMUP = 3  # passes of each kind and length before timing: compiling, and recording CUDA graphs


def random_runner(name: str, weights: str | None, dtype: str, device: torch.device) -> ModelRunner:
    """`name`'s architecture (SHAPES, or a tiny-random model) with random weights, quantized to `weights`."""
    if is_tiny(name):
        model = tiny_model(name, TINY_VOCAB)
    elif name in SHAPES:
        shapes = dict(SHAPES[name])
        config = AutoConfig.for_model(shapes.pop("model_type"), **shapes)
        with device:  # initialized where it runs: a 1.5B model's random init on the host takes a while
            model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    else:
        raise SystemExit(f"step_costs: --shapes takes {', '.join(SHAPES)} or tiny-random-<family>, not {name!r}")
    model = model.to(DTYPES[dtype]).to(device).eval()
    runner = ModelRunner(model, None, f"{name} (random weights)")
    if weights in QUANTIZED:
        quantize_model(model, weights, DEFAULT_GROUP_SIZE, None)
    return runner


def timer(device: torch.device) -> Callable[..., float]:
    """Seconds one call takes, the device's queue drained before and after."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(call: Callable[..., object], *args, **kwargs) -> float:
        sync()
        start = time.perf_counter()
        call(*args, **kwargs)
        sync()
        return time.perf_counter() - start

    return timed


def pass_costs(runner: ModelRunner, steps: list[str], lengths: list[int], context: int, reps: int) -> dict:
    """Median ms per pass of each length on each step kind, over one cache per kind holding `context`
    tokens; each pass is rolled back but for its first token, so every context grows alike."""
    timed = timer(runner.device)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, runner.vocab_size, (context,), generator=generator).tolist()
    runners = {step: on_step(runner, step, warm_batch_sizes=(1,)) for step in steps}  # batch 1 only: compile less
    caches = {step: r.prefill(prompt)[0] for step, r in runners.items()}
    times: dict[tuple[str, int], list[float]] = {(step, k): [] for step in steps for k in lengths}
    for rep in tqdm(range(WARMUP + reps), desc="passes"):
        for k in lengths:
            ids = torch.randint(0, runner.vocab_size, (1, k), generator=generator).to(runner.device)
            for step, r in runners.items():
                seconds = timed(r.forward, caches[step], ids, row_invariant=runner.row_invariant)
                caches[step].commit(torch.tensor([[True] + [False] * (k - 1)], device=runner.device))
                if rep >= WARMUP:
                    times[(step, k)].append(seconds)
    return {step: {k: 1e3 * statistics.median(times[(step, k)]) for k in lengths} for step in steps}


def draft_costs(target: ModelRunner, draft: ModelRunner | None, steps: list[str], context: int, reps: int) -> dict:
    """Median ms per draft step: a draft model's one-token pass on each step kind, one level of the EAGLE
    network, one forward of four Medusa heads (both eager: they run on the eager step only)."""
    timed = timer(target.device)
    device, hidden = target.device, target.config.hidden_size
    costs: dict[str, dict[str, float] | float] = {}
    if draft is not None:
        costs["draft-model"] = {step: by_k[1] for step, by_k in pass_costs(draft, steps, [1], context, reps).items()}
    net = EagleNet(target.model).eval()
    heads = MedusaHeads(hidden, num_heads=4).to(device=device, dtype=target.dtype).eval()
    features = torch.randn(1, context, hidden, dtype=target.dtype, device=device)
    tokens = torch.randint(0, target.vocab_size, (1, context), device=device)
    eagle_cache = BatchCache.empty(device)  # the EAGLE network keeps a slot cache of its own
    with torch.no_grad():
        net.feed(eagle_cache, features, tokens, torch.ones(1, context, dtype=torch.bool, device=device))
        one = torch.ones(1, 1, dtype=torch.bool, device=device)

        def eagle_level() -> None:
            predicted = net.feed(eagle_cache, features[:, -1:], tokens[:, -1:], one)
            net.logits(predicted)
            eagle_cache.drop_last([1])

        def medusa() -> None:
            head_logits(heads, features[:, -1:], target.model.get_output_embeddings())

        for name, call in (("eagle", eagle_level), ("medusa", medusa)):
            samples = [timed(call) for _ in range(WARMUP + reps)][WARMUP:]
            costs[name] = 1e3 * statistics.median(samples)
    return costs


def expected_speedups(passes: dict, drafts: dict, results: Path) -> list[dict]:
    """Each batch-1 method of a bench run, its measured tokens per step and draft positions per step, priced
    at these pass costs (interpolated at 1 + draft positions) and draft costs (model drafters: a draft step
    measured here per position; lookups: the host time the run measured): expected speedup over plain
    decoding on each step kind. A model drafter whose draft step is not measured here gets none."""
    run = json.loads(results.read_text())
    rows = []
    for record in run["records"]:
        method, steps = record["method"], record["steps"]
        if record["batch_size"] != 1 or record["category"] != "all" or not steps or method == "plain":
            continue
        tokens_per_step = record["new_tokens"] / steps
        positions = record["draft_positions"] / steps
        row = {"method": method, "tokens_per_step": tokens_per_step, "draft_positions_per_step": positions}
        drafter = method.split(":")[0]
        for step, by_k in passes.items():
            if drafter in HOST_DRAFTERS:
                draft_ms = 1e3 * record["draft_s"] / steps
            elif drafter in drafts:
                per_position = drafts[drafter][step] if isinstance(drafts[drafter], dict) else drafts[drafter]
                draft_ms = positions * per_position
            else:
                row[f"expected_speedup_{step}"] = None  # its draft step is not measured here
                continue
            ks = sorted(by_k)
            verify = float(np.interp(1 + positions, ks, [by_k[k] for k in ks]))
            row[f"expected_speedup_{step}"] = tokens_per_step * by_k[ks[0]] / (verify + draft_ms)
        rows.append(row)
    return rows


def plot(result: dict, path: Path) -> None:
    """ms per pass against its length, one line per step kind."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for step, by_k in result["pass_ms"].items():
        axes.plot(list(by_k), list(by_k.values()), marker="o", label=step)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("tokens in the pass (1: a plain step)")
    axes.set_ylabel("ms per pass (median)")
    name = result.get("shapes") or result.get("target")
    axes.set_title(f"{name}, {result['weights'] or result['dtype']} on {result['device_name']}")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def measure(args) -> dict:
    steps = [s for s in args.steps.split(",") if s]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        raise SystemExit(f"step_costs: --steps takes {', '.join(STEPS)}, not {', '.join(unknown)}")
    lengths = [int(k) for k in args.lengths.split(",")]
    if args.shapes:
        device = resolve_device(args.device)
        target = random_runner(args.shapes, args.weights, args.dtype, device)
        draft = random_runner(args.draft_shapes, args.weights, args.dtype, device) if args.draft_shapes else None
        what = {"shapes": args.shapes, "draft_shapes": args.draft_shapes, "weights": args.weights, "dtype": args.dtype,
                "random_weights": True}
    else:
        config = Config.load(args.config)
        target, draft = load_runner(config.model.target, config.model), None
        what = {"target": config.model.target, "weights": config.model.weights, "dtype": config.model.dtype,
                "random_weights": False}
    start = time.perf_counter()
    passes = pass_costs(target, steps, lengths, args.context, args.reps)
    drafts = draft_costs(target, draft, steps, args.context, args.reps)
    result = {
        **what, "device": str(target.device), "device_name": _device_name(target.device),
        "row_invariant": target.row_invariant, "context": args.context, "reps": args.reps,
        "pass_ms": passes, "draft_step_ms": drafts,
        "verify_over_plain": {step: {k: ms / by_k[lengths[0]] for k, ms in by_k.items()} for step, by_k in passes.items()},
        "eager_over": {step: {k: passes["eager"][k] / ms for k, ms in by_k.items()} for step, by_k in passes.items()}
        if "eager" in passes else None,
    }
    if args.acceptance:
        result["expected"] = {
            "label": "expected speedups: pass and draft costs measured here x tokens per step measured by the bench run "
            f"{args.acceptance} (its machine, its weights)",
            "methods": expected_speedups(passes, drafts, args.acceptance),
        }
    result["measure_s"] = time.perf_counter() - start
    return result


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def main(argv: list[str] | None = None) -> None:
    parser = measurement.parser(__doc__, prompts=None)
    parser.add_argument("--shapes", help="a registry model's architecture with random weights, instead of --config's target")
    parser.add_argument("--draft-shapes", help="with --shapes, a draft model's architecture, for its draft step")
    parser.add_argument("--weights", default=None, choices=[*QUANTIZED, None], help="with --shapes: quantize the linear layers")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="with --shapes")
    parser.add_argument("--device", default="auto", help="with --shapes")
    parser.add_argument("--steps", default=",".join(STEPS), help="comma-separated step kinds (model.step values)")
    parser.add_argument("--lengths", default="1,2,4,8", help="comma-separated pass lengths; the first is the plain step's")
    parser.add_argument("--context", type=int, default=256, help="tokens already in the cache")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--acceptance", type=Path, help="a bench run's results.json: price its methods at these costs")
    args = parser.parse_args(argv)
    result = measure(args)
    measurement.report(result, args.out, __spec__.name, argv)
    if args.out:
        plot(result, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()

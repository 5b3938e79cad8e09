"""Where a step's milliseconds go: the target's pass of k tokens over a cache of --context tokens, under
torch.profiler, split by what runs (each kind of linear layer, the attention kernel, norms, rotary, cache
writes, the output layer, every other aten op) and what no op accounts for (Python between the ops).

The profiler adds its own cost to every op; the table gives each part's share of the profiled pass beside
the pass's unprofiled time, measured in the same run, so the parts can be read as milliseconds of it. Since
that cost falls most on small ops, the pass is also timed against its linear layers alone, unprofiled: the
same products on the same weights, back to back, interleaved with the passes (the floor a pass approaches).

    python -m specdec_tools.step_profile --config configs/default.yaml --lengths 1,8,32 --context 256 \\
        --out docs/benchmarks/qwen2.5-coder-1.5b-int4-step-profile/profile.json
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from specdec_core.config import Config
from specdec_core.models import static_runner, step_ops, vnni
from specdec_core.models.loading import load_runner
from specdec_core.models.quant import VnniLinear, fused_projections
from specdec_core.models.runner import ModelRunner

from . import measurement

PASS = "step_profile.pass"
UNTRACED = "python (no op)"
# Module names (the last part of a submodule's path) whose forward is one part of the table.
MODULE_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj",
                "input_layernorm", "post_attention_layernorm", "norm", "act_fn", "embed_tokens", "lm_head", "rotary_emb")
LINEAR_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj", "lm_head")
FUSED_PARTS = ("qkv_proj", "gate_up_proj")  # the static step's fused projections (quant.fused_projections), per layer
# Functions the static pass calls by name, each one part of the table.
FUNCTION_PARTS = ("apply_rotary_pos_emb", "attend_rows")


@contextlib.contextmanager
def labelled(runner: ModelRunner) -> Iterator[None]:
    """Each of MODULE_PARTS' forwards and FUNCTION_PARTS' calls inside a profiler range of its name."""
    handles = []
    fused = [(name, module) for pair in fused_projections(runner.model) for name, module in zip(FUSED_PARTS, pair) if module]
    for path, module in [*runner.model.named_modules(), *fused]:
        name = path.rpartition(".")[2]
        if name not in MODULE_PARTS:
            continue
        ranges: list[record_function] = []

        def enter(module, args, name=name, ranges=ranges):
            ranges.append(record_function(name).__enter__())

        def leave(module, args, output, ranges=ranges):
            ranges.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    originals = {name: getattr(static_runner, name) for name in FUNCTION_PARTS}
    for name, function in originals.items():
        setattr(static_runner, name, _in_range(name, function))
    for_pass = step_ops.for_pass
    step_ops.for_pass = lambda hidden: _LabelledOps(ops) if (ops := for_pass(hidden)) else None
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for name, function in originals.items():
            setattr(static_runner, name, function)
        step_ops.for_pass = for_pass


class _LabelledOps:
    """The static step's fused ops (step_ops), each call inside a profiler range of the op's name."""

    def __init__(self, ops):
        self.ops = ops

    def __getattr__(self, name: str) -> Callable:
        return _in_range(name, getattr(self.ops, name))


def _in_range(name: str, function: Callable) -> Callable:
    def call(*args, **kwargs):
        with record_function(name):
            return function(*args, **kwargs)

    return call


def parts_of(events) -> dict[str, float]:
    """ms by part, summed over the profiled passes: each pass's direct children by name (a labelled range,
    or an aten op called outside any), and the pass's time that no child covers."""
    parts: dict[str, float] = defaultdict(float)
    for event in events:
        if event.name != PASS:
            continue
        covered = 0.0
        for child in event.cpu_children:
            parts[child.name] += child.cpu_time_total / 1e3
            covered += child.cpu_time_total
        parts[UNTRACED] += (event.cpu_time_total - covered) / 1e3
    return dict(parts)


def linear_layers(runner: ModelRunner) -> list[nn.Module]:
    """The linear layers a static pass multiplies by, in its order: each decoder layer's q/k/v (fused where
    quant.fused_projections fuses them), o_proj, gate/up (likewise) and down_proj, then the output layer."""
    layers = []
    for layer, (qkv, gate_up) in zip(runner.model.get_decoder().layers, fused_projections(runner.model)):
        attention, mlp = layer.self_attn, layer.mlp
        layers += [qkv] if qkv else [attention.q_proj, attention.k_proj, attention.v_proj]
        layers.append(attention.o_proj)
        layers += [gate_up] if gate_up else [mlp.gate_proj, mlp.up_proj]
        layers.append(mlp.down_proj)
    return [*layers, runner.model.get_output_embeddings()]


def profile_lengths(runner: ModelRunner, lengths: list[int], context: int, reps: int) -> dict:
    """Per pass length: the unprofiled ms per pass (median of `reps`), the profiled one, and each part's ms
    of the profiled pass (mean over `reps`)."""
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, runner.vocab_size, (context,), generator=generator).tolist()
    cache = runner.prefill(prompt)[0]
    keep_first = {k: torch.tensor([[True] + [False] * (k - 1)]) for k in lengths}

    def one_pass(k: int) -> None:
        ids = torch.randint(0, runner.vocab_size, (1, k), generator=generator)
        runner.forward(cache, ids, row_invariant=runner.row_invariant)
        cache.commit(keep_first[k])  # the context grows by one token per pass, as plain decoding's does

    layers = linear_layers(runner)
    results = {}
    for k in lengths:
        inputs = [torch.randn(k, layer.in_features, generator=generator).to(runner.dtype) for layer in layers]

        def linears_alone() -> None:
            for layer, x in zip(layers, inputs):
                vnni.mm(x, layer.packed, layer.scale_min) if isinstance(layer, VnniLinear) else layer(x)

        for _ in range(3):
            one_pass(k)  # warm: allocator, caches
        plain, alone = [], []
        for _ in range(reps):  # the pass and its linear layers alone, interleaved
            start = time.perf_counter()
            one_pass(k)
            plain.append(time.perf_counter() - start)
            start = time.perf_counter()
            linears_alone()
            alone.append(time.perf_counter() - start)
        with labelled(runner), profile(activities=[ProfilerActivity.CPU]) as profiler:
            for _ in range(reps):
                with record_function(PASS):
                    one_pass(k)
        events = profiler.events()
        profiled = [e.cpu_time_total / 1e3 for e in events if e.name == PASS]
        parts = {name: ms / reps for name, ms in sorted(parts_of(events).items(), key=lambda item: -item[1])}
        results[k] = {"pass_ms": 1e3 * statistics.median(plain), "linear_layers_alone_ms": 1e3 * statistics.median(alone),
                      "profiled_pass_ms": statistics.mean(profiled), "parts_ms": parts}
    return results


def table(results: dict) -> str:
    """A Markdown table: each part's share of the profiled pass, and that share of the unprofiled pass in ms."""
    lengths = list(results)
    names = sorted({name for r in results.values() for name in r["parts_ms"]},
                   key=lambda name: -max(r["parts_ms"].get(name, 0.0) / r["profiled_pass_ms"] for r in results.values()))
    header = "| part | " + " | ".join(f"k={k}: ms (share)" for k in lengths) + " |"
    lines = [header, "|---|" + "---|" * len(lengths)]
    lines.append("| whole pass, unprofiled | " + " | ".join(f"{results[k]['pass_ms']:.2f}" for k in lengths) + " |")
    lines.append("| its linear layers alone, unprofiled (the pass over them) | " + " | ".join(
        f"{results[k]['linear_layers_alone_ms']:.2f} ({results[k]['pass_ms'] / results[k]['linear_layers_alone_ms']:.2f}x)"
        for k in lengths) + " |")
    linear = {k: sum(results[k]["parts_ms"].get(name, 0.0) for name in LINEAR_PARTS) / results[k]["profiled_pass_ms"] for k in lengths}
    lines.append("| its linear layers in the profiled pass, summed (the pass over them) | " + " | ".join(
        f"{linear[k] * results[k]['pass_ms']:.2f} ({1 / linear[k]:.2f}x)" if linear[k] else "-" for k in lengths) + " |")
    for name in names:
        cells = []
        for k in lengths:
            share = results[k]["parts_ms"].get(name, 0.0) / results[k]["profiled_pass_ms"]
            cells.append(f"{share * results[k]['pass_ms']:.2f} ({100 * share:.1f}%)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = measurement.parser(__doc__, prompts=None)
    parser.add_argument("--lengths", default="1,8,32", help="comma-separated pass lengths")
    parser.add_argument("--context", type=int, default=256, help="tokens already in the cache")
    parser.add_argument("--reps", type=int, default=10, help="passes of each length, timed and then profiled")
    args = parser.parse_args(argv)
    config = Config.load(args.config)
    runner = load_runner(config.model.target, config.model)
    lengths = [int(k) for k in args.lengths.split(",")]
    results = profile_lengths(runner, lengths, args.context, args.reps)
    result = {"target": config.model.target, "weights": config.model.weights, "step": config.model.step,
              "context": args.context, "reps": args.reps, "threads": torch.get_num_threads(), "passes": results,
              "table": table(results)}
    measurement.report(result, args.out, __spec__.name, argv)
    if args.out:
        args.out.with_suffix(".md").write_text(result["table"] + "\n")


if __name__ == "__main__":
    main()

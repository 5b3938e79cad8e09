"""Measurements behind docs/QUANT.md: `python -m specdec_tools.quant_bench {layers,pass-cost,decode,quality}`.

Every comparison runs its alternatives interleaved in one process (round by round), because this
project's machines are shared and absolute timings drift; the tables report medians over rounds
with the spread (min-max), and ratios taken within each round.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import inspect
import json
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
from torch import nn

from specdec_core.build import build_engine
from specdec_core.config import Config, ModelConfig
from specdec_core.engine import Engine
from specdec_core.models import vnni
from specdec_core.models.catalogue import REGISTRY
from specdec_core.models.gguf_blocks import GgufFile
from specdec_core.models.loading import load_runner
from specdec_core.models.paths import gguf_path, model_dir
from specdec_core.models.quant import (
    GGUF,
    DEFAULT_GROUP_SIZE,
    HEAD_WEIGHTS,
    INT4_GROUP_SIZES,
    Int4Linear,
    Int8Linear,
    PRECISIONS,
    QuantLinear,
    VnniLinear,
    cache_file,
    keep_dequantized,
    quantize_model,
)
from specdec_core.models.runner import ModelRunner
from specdec_tools.bench.llama_cpp import find_tools, llama_perplexity, registry_gguf
from specdec_core.sampling import SamplingParams
from specdec_core.sequence import Sequence

# Qwen2.5-Coder-1.5B's linear layers: (name, out_features, in_features).
QWEN_1_5B_LAYERS = [
    ("q_proj / o_proj", 1536, 1536),
    ("k_proj / v_proj", 256, 1536),
    ("gate_proj / up_proj", 8960, 1536),
    ("down_proj", 1536, 8960),
    ("lm_head", 151936, 1536),
]
# Held-out text for perplexity and agreement: library source, nothing from Spec-Bench.
HELD_OUT_MODULE = "argparse"
GENERATION_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a Python generator is, in three sentences.",
    "Write a SQL query that returns the ten most recent orders per customer.",
]


def machine_line() -> str:
    return (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}")


def interleaved(variants: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each variant's figure per round, the variants taking turns within every round."""
    results: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, measure in variants.items():
            results[name].append(measure())
    return results


def spread(values: list[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def ratios(results: dict[str, list[float]], base: str) -> dict[str, list[float]]:
    """Per-round ratio of each variant to `base` (same round, so drift between rounds cancels)."""
    return {name: [v / b for v, b in zip(values, results[base])] for name, values in results.items()}


# -- per-layer cost --------------------------------------------------------------------------------


def _timed_calls(layers: list[nn.Module], x: torch.Tensor, seconds: float) -> Callable[[], float]:
    """A measurement: the 10th percentile of ms per call of layer(x), over about `seconds` of calls,
    each call on the next of `layers` (copies), so that the weights come from memory, not from cache.

    A low percentile, not the mean: on a shared machine a call that loses its core for a
    scheduler slice (several ms) says nothing about the layer, and most of a mean is such calls.
    """

    def measure() -> float:
        times, end = [], time.perf_counter() + seconds
        while (start := time.perf_counter()) < end or len(times) < 10:
            layers[len(times) % len(layers)](x)
            times.append(1000 * (time.perf_counter() - start))
        return statistics.quantiles(times, n=10)[0]

    return measure


def _copies(layer: nn.Module, working_set: int) -> list[nn.Module]:
    """Enough copies of `layer` that cycling through them streams `working_set` bytes (past the L3)."""
    size = sum(t.nbytes for t in [*layer.parameters(), *layer.buffers()])
    return [layer] + [copy.deepcopy(layer) for _ in range(-(-working_set // size) - 1)]


@torch.no_grad()
def bench_layers(tokens: list[int], rounds: int, seconds: float, groups: list[int], working_set: int) -> None:
    print(f"machine: {machine_line()}; each variant cycles through {working_set / 1e6:.0f} MB of copies\n")
    # int8, int4 gN: torch's kernels; int4 / int6 / int8 vnni: ours (g32), where this CPU runs it.
    names = ["int8"] + [f"int4 g{g}" for g in groups] + ([f"{p} vnni" for p in PRECISIONS] if vnni.extension() else [])
    print("| layer (out x in) | tokens | bf16 ms | " + " | ".join(f"{v} ms (x bf16)" for v in names) + " |")
    print("|---" * (3 + len(names)) + "|")
    for name, out_features, in_features in QWEN_1_5B_LAYERS:
        linear = nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16)
        layers = {"bf16": linear, "int8": Int8Linear.from_linear(linear)}
        layers.update({f"int4 g{g}": Int4Linear.from_linear(linear, g) for g in groups})
        if vnni.extension():
            layers.update({f"{p} vnni": VnniLinear.from_linear(linear, p) for p in PRECISIONS})
        copies = {v: _copies(layer, working_set) for v, layer in layers.items()}
        for k in tokens:
            x = torch.randn(k, in_features, dtype=torch.bfloat16)
            for layer in layers.values():
                layer(x)  # warm up: first calls allocate
            results = interleaved({v: _timed_calls(copies[v], x, seconds) for v in layers}, rounds)
            rel = ratios(results, "bf16")
            cells = [spread(results["bf16"], 3)] + [f"{spread(results[v], 3)} ({statistics.median(rel[v]):.2f}x)" for v in names]
            print(f"| {name} ({out_features} x {in_features}) | {k} | " + " | ".join(cells) + " |", flush=True)
        del layers, copies


# -- the cost of a pass of k tokens against one token ---------------------------------------------


KERNEL_PATHS = (*vnni.FAMILIES, "amx", "dequantize")


@contextlib.contextmanager
def kernel_path(path: str) -> Iterator[None]:
    """Passes of any length on `path`: a kernel family ("avx512": vpdpbusd, "avx2": vpmaddubsw) for every
    pass, "amx" (tiles from vnni.AMX_MIN_ROWS rows, one-row passes on AVX-512 VNNI) or "dequantize"
    (passes of 2 rows or more as bf16 weights, dequantized each call or kept where the layer keeps them, and
    torch's matmul; one-row passes on the default family).
    Past vnni.DEQUANTIZE_ROWS too, and on CPUs whose long passes stay on the kernel, so that the switch can be
    placed."""
    saved = vnni.AMX_MIN_ROWS, vnni.DEQUANTIZE_ROWS, vnni.DEQUANTIZE_ROWS_KEPT_AMX
    vnni.AMX_MIN_ROWS = saved[0] if path == "amx" else 10**9
    vnni.DEQUANTIZE_ROWS = vnni.DEQUANTIZE_ROWS_KEPT_AMX = 2 if path == "dequantize" else 10**9
    isa = {} if path == "dequantize" else {vnni.ISA_ENV: path}
    try:
        with mock.patch.dict(os.environ, isa), mock.patch.object(vnni, "dequantizes_long_passes", lambda: True):
            vnni.choose_anew()
            yield
    finally:
        vnni.AMX_MIN_ROWS, vnni.DEQUANTIZE_ROWS, vnni.DEQUANTIZE_ROWS_KEPT_AMX = saved
        vnni.choose_anew()  # chosen again from the environment as it was


def kernel_paths(wanted: list[str]) -> list[str]:
    """The paths of `wanted` that run on this CPU."""
    return [path for path in wanted if (vnni.amx_missing() is None if path == "amx" else path not in vnni.FAMILIES or vnni.runs_here(path))]


def _on_path(path: str, measure: Callable[[], float]) -> Callable[[], float]:
    def measured() -> float:
        with kernel_path(path):
            return measure()

    return measured


@torch.no_grad()
def bench_layer_passes(shapes: list[tuple[str, int, int]], tokens: list[int], paths: list[str], rounds: int, seconds: float,
                       working_set: int) -> dict[str, dict[str, dict[int, list[float]]]]:
    """ms per call of our kernel's layers at each pass length and path, interleaved; prints the table of
    medians and of each pass's cost over the one-token pass of the same path and round. The body's
    layers are int4, the output layer HEAD_WEIGHTS (as served)."""
    print(f"machine: {machine_line()}; each variant cycles through {working_set / 1e6:.0f} MB of copies\n")
    results = {}
    print("| layer (out x in) | weights | tokens | " + " | ".join(f"{p} ms (x 1 token)" for p in paths) + " |")
    print("|---" * (3 + len(paths)) + "|")
    for name, out_features, in_features in shapes:
        precision = HEAD_WEIGHTS if name == "lm_head" else "int4"
        layer = VnniLinear.from_linear(nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16), precision)
        copies = _copies(layer, working_set)
        inputs = {k: torch.randn(k, in_features, dtype=torch.bfloat16) for k in tokens}
        for path in paths:
            with kernel_path(path):
                for x in inputs.values():
                    layer(x)  # warm up: first calls allocate, the first AMX call asks for the tiles
        variants = {(p, k): _on_path(p, _timed_calls(copies, x, seconds)) for k, x in inputs.items() for p in paths}
        measured = interleaved(variants, rounds)
        results[name] = {p: {k: measured[p, k] for k in tokens} for p in paths}
        for k in tokens:
            cells = []
            for p in paths:
                rel = [t / one for t, one in zip(measured[p, k], measured[p, tokens[0]])]
                cells.append(f"{spread(measured[p, k], 3)} ({statistics.median(rel):.2f}x)")
            print(f"| {name} ({out_features} x {in_features}) | {precision} | {k} | " + " | ".join(cells) + " |", flush=True)
        del layer, copies
    return results


class SectionTimer:
    """Seconds a model spends in its quantized linear layers (the output layer apart) while it runs."""

    def __init__(self, model: nn.Module):
        self.seconds = {"linear": 0.0, "head": 0.0}
        head = model.get_output_embeddings()
        for module in model.modules():
            if isinstance(module, QuantLinear):
                module.forward = self._timed(module.forward, "head" if module is head else "linear")

    def _timed(self, forward: Callable[[torch.Tensor], torch.Tensor], section: str) -> Callable[[torch.Tensor], torch.Tensor]:
        def timed(x: torch.Tensor) -> torch.Tensor:
            start = time.perf_counter()
            out = forward(x)
            self.seconds[section] += time.perf_counter() - start
            return out

        return timed

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)


@torch.no_grad()
def bench_model_passes(model: str, context: int, tokens: list[int], paths: list[str], rounds: int,
                       passes: int) -> dict[str, dict[int, list[dict[str, float]]]]:
    """A forward pass over k new tokens against a cache of `context` tokens (batch 1, all k logits, then
    their argmax), against a one-token pass: ms per pass, split into the quantized linear layers, the
    output layer, the argmax and the rest (attention over the cache, norms, rotary, masks, Python).
    Each measurement is the pass with the median total of `passes`; the cache is cut back after each."""
    runner = load_variant(model, Variant("bf16", "int4"))
    keep_dequantized(runner.model, True)  # as a served target's (prefill.keep_bf16_weights): "dequantize" multiplies
    timer = SectionTimer(runner.model)
    ids = runner.tokenizer(inspect.getsource(importlib.import_module(HELD_OUT_MODULE)))["input_ids"]
    cache, _, _ = runner.prefill(ids[:context])
    print(f"machine: {machine_line()}\nmodel: {model} int4 (head {HEAD_WEIGHTS}), batch 1, a context of {context} tokens; "
          f"per measurement the median of {passes} passes\n")

    def measure(k: int) -> Callable[[], dict[str, float]]:
        new = torch.tensor([ids[context : context + k]])

        def one_pass() -> dict[str, float]:
            timer.reset()
            start = time.perf_counter()
            logits, _ = runner.forward(cache, new)
            forward = time.perf_counter() - start
            logits.argmax(dim=-1).tolist()
            total = time.perf_counter() - start
            cache.valid = cache.valid[:, :-k]  # undo the pass: its slots were pending
            cache.drop_pending()
            seconds = {"total": total, **timer.seconds, "argmax": total - forward}
            seconds["rest"] = forward - timer.seconds["linear"] - timer.seconds["head"]
            return {section: 1000 * value for section, value in seconds.items()}

        def median_pass() -> dict[str, float]:
            samples = sorted((one_pass() for _ in range(passes)), key=lambda sample: sample["total"])
            return samples[len(samples) // 2]

        return median_pass

    for path in paths:
        with kernel_path(path):
            for k in tokens:
                measure(k)()  # warm up
    measured = interleaved({(p, k): _on_path(p, measure(k)) for k in tokens for p in paths}, rounds)
    sections = ["linear", "head", "argmax", "rest"]
    print("| path | tokens | pass ms | x 1 token | " + " | ".join(f"{s} ms" for s in sections) + " |")
    print("|---" * (4 + len(sections)) + "|")
    for p in paths:
        for k in tokens:
            totals = [sample["total"] for sample in measured[p, k]]
            rel = [t / one["total"] for t, one in zip(totals, measured[p, tokens[0]])]
            parts = [f"{statistics.median(sample[s] for sample in measured[p, k]):.1f}" for s in sections]
            print(f"| {p} | {k} | {spread(totals, 1)} | {spread(rel)} | " + " | ".join(parts) + " |", flush=True)
    return {p: {k: measured[p, k] for k in tokens} for p in paths}


def plot_pass_costs(layers: dict, model: dict, tokens: list[int], title: str, path: Path) -> None:
    """Pass cost over the one-token pass against the pass length: each layer shape and the whole model, per kernel path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def curve(per_k: dict, value: Callable) -> list[float]:
        return [statistics.median(value(t) / value(one) for t, one in zip(per_k[k], per_k[tokens[0]])) for k in tokens]

    measured = [key for key in KERNEL_PATHS if key != "dequantize" and any(key in per_path for per_path in [model, *layers.values()])]
    figure, axes = plt.subplots(1, len(measured), figsize=(5.5 * len(measured), 4.2), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, key in zip(axes, measured):  # (a dequantize path, if measured, is in the tables)
        for name, per_path in layers.items():
            if key in per_path:
                ax.plot(tokens, curve(per_path[key], float), marker=".", label=name)
        if key in model:
            ax.plot(tokens, curve(model[key], lambda sample: sample["total"]), marker="o", color="black", linewidth=2.5, label="whole model")
        ax.set(title=f"{key.upper()} path", xscale="log", xlabel="tokens in the pass", xticks=tokens, xticklabels=tokens)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("pass cost / one-token pass")
    axes[0].legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def bench_pass_cost(model: str | None, shapes: list[tuple[str, int, int]], tokens: list[int], paths: list[str], rounds: int,
                    seconds: float, working_set: int, context: int, passes: int, out: Path | None, plot: Path | None) -> None:
    paths = kernel_paths(paths)
    layers = bench_layer_passes(shapes, tokens, paths, rounds, seconds, working_set) if shapes else {}
    whole = bench_model_passes(model, context, tokens, paths, rounds, passes) if model else {}
    if out:
        out.write_text(json.dumps({"machine": machine_line(), "tokens": tokens, "layers": layers, "model": whole}))
    if plot:
        title = f"{model or 'layers'}: int4 (head {HEAD_WEIGHTS}), {torch.get_num_threads()} threads, the cost of a pass of k tokens"
        plot_pass_costs(layers, whole, tokens, title, plot)


def parse_shape(text: str) -> tuple[str, int, int]:
    """A layer shape, `OUTxIN` or a name of QWEN_1_5B_LAYERS (`lm_head`, `down_proj`, ...)."""
    for name, out_features, in_features in QWEN_1_5B_LAYERS:
        if text in name.split(" / "):
            return name, out_features, in_features
    out_features, _, in_features = text.partition("x")
    return text, int(out_features), int(in_features)


# -- whole models ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One way to run a model: activation dtype, linear-layer precision, output-layer precision."""

    dtype: str
    weights: str | None = None  # None: unquantized
    head: str = HEAD_WEIGHTS
    group_size: int = DEFAULT_GROUP_SIZE

    @property
    def label(self) -> str:
        if self.weights == FILE_VALUES:
            return "fp32, the file's values"
        if self.weights == GGUF:
            return "gguf (the file's blocks)"
        if not self.weights:
            return self.dtype
        group = f" g{self.group_size}" if self.weights == "int4" else ""
        return f"{self.weights}{group}, head {self.head}"


# A variant of a registry model with every tensor's values from its GGUF file, in float32 (the gguf package's
# dequantization): the reference the quality of the others is measured against.
FILE_VALUES = "file"


def parse_variant(text: str) -> Variant:
    """`bf16`, `fp32`, `file` (fp32, every tensor the GGUF file's values), `gguf` (the file's blocks), `int8`, `int4`,
    `int4:g64`, `int4:head=int4`, `int4:g64:head=bf16` (activations bf16)."""
    name, *options = text.split(":")
    if name in ("bf16", "fp32"):
        return Variant(name)
    if name == FILE_VALUES:
        return Variant("fp32", FILE_VALUES)
    group, head = DEFAULT_GROUP_SIZE, HEAD_WEIGHTS
    for option in options:
        if option.startswith("g"):
            group = int(option[1:])
        elif option.startswith("head="):
            head = option[5:]
        else:
            raise argparse.ArgumentTypeError(f"unknown variant option {option!r} in {text!r}")
    return Variant("bf16", name, head, group)


def load_variant(model: str, variant: Variant) -> ModelRunner:
    """The model at `variant`: loaded as the server loads it, then quantized with the variant's settings
    (through the packed cache, like the server)."""
    if variant.weights == GGUF:
        return load_runner(model, ModelConfig(target=model, dtype=variant.dtype, weights=GGUF))
    runner = load_runner(model, ModelConfig(target=model, dtype=variant.dtype))
    if variant.weights == FILE_VALUES:
        gguf, tied = GgufFile(gguf_path(REGISTRY[model].gguf_file)), bool(runner.model.config.tie_word_embeddings)
        with torch.no_grad():
            for name, parameter in runner.model.named_parameters():
                values = gguf.values(name, tied)
                if values is None:
                    raise LookupError(f"{name} has no tensor in {gguf.path.name}")
                parameter.copy_(values)
        return runner
    if variant.weights:
        cache = cache_file(model_dir(model), variant.weights, variant.group_size, runner.device)
        if variant.head != HEAD_WEIGHTS:  # not the file the server loads: name it apart
            cache = cache.with_stem(f"{cache.stem}-head-{variant.head}")
        quantize_model(runner.model, variant.weights, variant.group_size, cache, head_weights=variant.head)
    return runner


def model_bytes(module: nn.Module) -> int:
    """Bytes of all parameters and buffers, tied tensors counted once. Per tensor, not per storage:
    safetensors may map a whole file as one storage."""
    tensors = {t.data_ptr(): t.nbytes for t in [*module.parameters(), *module.buffers()]}
    return sum(tensors.values())


def chat_ids(runner: ModelRunner, prompt: str) -> list[int]:
    messages = [{"role": "user", "content": prompt}]
    return runner.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def greedy(engine: Engine, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], float]:
    """Plain greedy decode through the engine: (tokens, decode seconds after the prefill)."""
    seq = Sequence("bench", prompt_ids, SamplingParams(temperature=0.0), max_tokens)
    engine.add(seq)
    start = time.perf_counter()
    for _ in engine.generate():
        pass
    return seq.output_ids, time.perf_counter() - start


def bench_decode(model: str, variants: list[Variant], rounds: int, max_tokens: int) -> None:
    print(f"machine: {machine_line()}\nmodel: {model}, batch 1, plain greedy via the engine, {max_tokens} new tokens\n")
    engines = {}
    for variant in variants:
        runner = load_variant(model, variant)
        engines[variant.label] = build_engine(Config(), drafter="none", target=runner)
    prompt = chat_ids(next(iter(engines.values())).target, GENERATION_PROMPTS[0])
    for engine in engines.values():
        greedy(engine, prompt, 4)  # warm up

    def rate(engine: Engine) -> Callable[[], float]:
        def measure() -> float:
            tokens, seconds = greedy(engine, prompt, max_tokens)
            return len(tokens) / seconds

        return measure

    results = interleaved({label: rate(engine) for label, engine in engines.items()}, rounds)
    base = next(iter(results))
    rel = ratios(results, base)
    print(f"| precision | tokens/s | x {base} | model MB |\n|---|---|---|---|")
    for label, engine in engines.items():
        print(f"| {label} | {spread(results[label])} | {spread(rel[label])} | {model_bytes(engine.target.model) / 1e6:.0f} |")


# -- quality ---------------------------------------------------------------------------------------


@torch.no_grad()
def held_out_logits(runner: ModelRunner, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits [len, V] for `ids`, fed `chunk` tokens per forward against the cache."""
    cache, parts = runner.new_cache(), []
    for start in range(0, len(ids), chunk):
        logits, _ = runner.forward(cache, torch.tensor([ids[start : start + chunk]]), commit=True)
        parts.append(logits[0])
    return torch.cat(parts)


@torch.no_grad()
def windowed_perplexity(runner: ModelRunner, ids: list[int], context: int, chunks: int, chunk: int) -> float:
    """llama-perplexity's measure: `chunks` windows of `context` tokens, each a fresh pass, scoring the tokens of its
    second half (from position context / 2 + 1) given all before them in the window."""
    nll, scored = 0.0, 0
    for window in range(chunks):
        ids_in = ids[window * context : (window + 1) * context]
        logits = held_out_logits(runner, ids_in, chunk).float()
        first = context // 2
        nll += torch.nn.functional.cross_entropy(logits[first:-1], torch.tensor(ids_in[first + 1 :]), reduction="sum").item()
        scored += context - first - 1
    return math.exp(nll / scored)


def bench_quality(model: str, variants: list[Variant], tokens: int, chunk: int, gen_tokens: int, llama_cpp: Path | None,
                  context: int, chunks: int) -> None:
    text = inspect.getsource(importlib.import_module(HELD_OUT_MODULE))
    print(f"machine: {machine_line()}\nmodel: {model}; held-out text: the first {tokens} tokens of Lib/{HELD_OUT_MODULE}.py; "
          f"greedy generations: {len(GENERATION_PROMPTS)} chat prompts x {gen_tokens} tokens; windowed: llama-perplexity's "
          f"measure, {chunks} windows of {context} tokens of the same file, each scored on its second half\n")
    reference = None
    print("| precision | perplexity | windowed perplexity | argmax agrees with first row | greedy generations equal to first row (matching prefix) |")
    print("|---|---|---|---|---|")
    for variant in variants:
        runner = load_variant(model, variant)
        all_ids = runner.tokenizer(text)["input_ids"]
        ids = all_ids[:tokens]
        logits = held_out_logits(runner, ids, chunk)
        nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
        windowed = windowed_perplexity(runner, all_ids, context, chunks, chunk)
        engine = build_engine(Config(), drafter="none", target=runner)
        outputs = [greedy(engine, chat_ids(runner, p), gen_tokens)[0] for p in GENERATION_PROMPTS]
        argmax = logits.argmax(dim=-1)
        if reference is None:
            reference = (argmax, outputs)
        agree = (argmax == reference[0]).float().mean().item()
        prefixes = [_common_prefix(a, b) for a, b in zip(outputs, reference[1])]
        equal = sum(a == b for a, b in zip(outputs, reference[1]))
        print(f"| {variant.label} | {nll.exp().item():.3f} | {windowed:.4f} | {agree:.4f} | {equal}/{len(outputs)} "
              f"({', '.join(map(str, prefixes))}) |", flush=True)
        del runner, engine, logits
    if llama_cpp:
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as held_out:
            held_out.write(text)
            held_out.flush()
            ppl = llama_perplexity(find_tools(llama_cpp, ("llama-perplexity",)), registry_gguf(model), Path(held_out.name),
                                   context, chunks, torch.get_num_threads())
        print(f"| llama.cpp, llama-perplexity on the GGUF file | | {ppl:.4f} | | |")


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=None)
    sub = parser.add_subparsers(dest="command", required=True)
    layers = sub.add_parser("layers", help="ms per call of Qwen-1.5B-shaped linear layers")
    layers.add_argument("--tokens", type=int, nargs="+", default=[1, 6])
    layers.add_argument("--rounds", type=int, default=5)
    layers.add_argument("--seconds", type=float, default=0.5, help="per variant per round")
    layers.add_argument("--groups", type=int, nargs="+", default=list(INT4_GROUP_SIZES))
    layers.add_argument("--working-set-mb", type=int, default=1024, help="bytes each variant cycles through")
    passes = sub.add_parser("pass-cost", help="a pass of k tokens over a one-token pass: layers and the whole model, VNNI and AMX")
    passes.add_argument("--model", default="qwen2.5-coder-1.5b", help="'' for the layers alone")
    passes.add_argument("--shapes", type=parse_shape, nargs="*", default=QWEN_1_5B_LAYERS, help="OUTxIN or layer names; none: the model alone")
    passes.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    passes.add_argument("--paths", nargs="+", choices=KERNEL_PATHS, default=["avx512", "avx2", "amx"], help="each only where it runs")
    passes.add_argument("--rounds", type=int, default=3)
    passes.add_argument("--seconds", type=float, default=0.5, help="per layer variant per round")
    passes.add_argument("--working-set-mb", type=int, default=1024, help="bytes each layer variant cycles through")
    passes.add_argument("--context", type=int, default=300, help="tokens in the cache of the whole-model passes")
    passes.add_argument("--passes", type=int, default=9, help="whole-model passes per measurement (their median)")
    passes.add_argument("--json", type=Path, default=None, help="write the measurements here")
    passes.add_argument("--plot", type=Path, default=None, help="write the curve here (PNG)")
    for name, help_text in [("decode", "decode tokens/s per precision"), ("quality", "perplexity and greedy agreement")]:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("model")
        p.add_argument("variants", nargs="+", type=parse_variant, help="file, gguf, bf16, fp32, int8, int4, int4:g64, int4:head=int4")
    sub.choices["decode"].add_argument("--rounds", type=int, default=3)
    sub.choices["decode"].add_argument("--max-tokens", type=int, default=32)
    sub.choices["quality"].add_argument("--tokens", type=int, default=2048)
    # Under vnni.DEQUANTIZE_ROWS, so that the int4 kernel runs as it does when decoding.
    sub.choices["quality"].add_argument("--chunk", type=int, default=64)
    sub.choices["quality"].add_argument("--gen-tokens", type=int, default=48)
    sub.choices["quality"].add_argument("--llama-cpp", type=Path, default=None, help="also llama-perplexity from this build")
    sub.choices["quality"].add_argument("--context", type=int, default=512, help="tokens a window of the windowed perplexity")
    sub.choices["quality"].add_argument("--windows", type=int, default=8, help="windows of the windowed perplexity")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.command == "layers":
        bench_layers(args.tokens, args.rounds, args.seconds, args.groups, args.working_set_mb * 10**6)
    elif args.command == "pass-cost":
        bench_pass_cost(args.model, args.shapes, args.tokens, args.paths, args.rounds, args.seconds, args.working_set_mb * 10**6,
                        args.context, args.passes, args.json, args.plot)
    elif args.command == "decode":
        bench_decode(args.model, args.variants, args.rounds, args.max_tokens)
    else:
        bench_quality(args.model, args.variants, args.tokens, args.chunk, args.gen_tokens, args.llama_cpp, args.context, args.windows)


if __name__ == "__main__":
    main()

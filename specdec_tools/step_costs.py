"""What a step costs on each step kind (model.step: eager, static, compiled): ms per plain step, per verify
pass of k tokens and per draft step of the model drafters, interleaved in one run so that every kind sees
the same machine; with --prefill, tokens/s of whole prefills; with --llama-cpp, llama.cpp's figures for the
same GGUF file and threads from llama-bench, in the same run (after ours); with --chunk-rows, exact prefill
chunks (row-invariant) of each size at each of --chunk-contexts, fitted to what prefill.attention_mac_cost weighs.

Where the real weights cannot go (a GPU machine takes 64 MiB), --shapes builds a registry model's exact
architecture with random weights: a pass costs what its shapes cost, whatever the values. --acceptance
combines the costs with a bench run's measured tokens per step into expected speedups, labelled as that
combination (a tree's pass is taken as wide as it is deep, so trees come out a little better than they are);
--costs prices an earlier run's JSON (a GPU machine's, say) with --acceptance, measuring nothing. On our kernel,
each pass's linear multiply-adds a second are set against the CPU's int8 peak measured in the same run (int8_peak),
and each pass against its bound: its bytes' read time or its multiply-adds at 75% of that peak, the larger.

    python -m specdec_tools.step_costs --config configs/default.yaml --lengths 1,2,4,8 --reps 10
    python -m specdec_tools.step_costs --config configs/default.yaml --steps eager,static \\
        --lengths 1,2,4,8,16,32,64 --prefill 512,2048 --llama-cpp /work/llama-native --out step-costs.json
    python -m specdec_tools.step_costs --config configs/default.yaml --steps static --lengths 1 \\
        --chunk-rows 16,32,48,64,96,128 --chunk-contexts 0,256,1024,2048,3000 --reps 3 --out chunk-costs.json
    python -m specdec_tools.step_costs --shapes qwen2.5-coder-1.5b --draft-shapes qwen2.5-coder-0.5b \\
        --device cuda --lengths 1,2,4,8,16,32,64 \\
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
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from specdec_core.build import build_engine
from specdec_core.config import Config
from specdec_core.drafters.registry import NO_DRAFTER
from specdec_core.models import vnni
from specdec_core.models.eagle3_net import Eagle3Net
from specdec_core.models.eagle_net import EagleNet
from specdec_core.models.loading import load_runner
from specdec_core.models.medusa_heads import MedusaHeads, head_logits
from specdec_core.models.quant import DEFAULT_GROUP_SIZE, QUANTIZED, quantize_linears, quantize_model
from specdec_core.models.runner import DTYPES, BatchCache, ModelRunner, resolve_device
from specdec_core.models.static_runner import STEPS, on_step
from specdec_core.models.tiny import is_tiny, tiny_model
from specdec_core.models.vocab import ReducedVocab
from specdec_core.sampling import SamplingParams
from specdec_core.sequence import Sequence

from . import int8_peak, measurement
from .bench.llama_cpp import find_tools, llama_bench, registry_gguf
from .bench.results import decoded_tokens
from .quant_bench import model_bytes
from .train.settings import Eagle3Settings

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
PREFILL_WARMUP = 1  # prefills of each kind and length before timing: one compiles its shapes (never padded)
LLAMA_CPP_PREFILL = 512  # llama-bench's own prompt length: the prefill figure llama.cpp is usually quoted at
LLAMA_CPP_GENERATED = 64  # tokens of llama-bench's tg test, a token's cost


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


def on_steps(runner: ModelRunner, steps: list[str]) -> dict[str, ModelRunner]:
    """`runner`'s model on each step kind."""
    return {step: on_step(runner, step, warm_batch_sizes=(1,)) for step in steps}  # batch 1 only: compile less


def pass_costs(runners: dict[str, ModelRunner], lengths: list[int], context: int, reps: int) -> dict:
    """Median ms per pass of each length on each step kind (one model's `runners`), over one cache per kind
    holding `context` tokens; each pass is rolled back but for its first token, so every context grows alike."""
    runner = next(iter(runners.values()))
    timed = timer(runner.device)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, runner.vocab_size, (context,), generator=generator).tolist()
    caches = {step: r.prefill(prompt)[0] for step, r in runners.items()}
    times: dict[tuple[str, int], list[float]] = {(step, k): [] for step in runners for k in lengths}
    for rep in tqdm(range(WARMUP + reps), desc="passes"):
        for k in lengths:
            ids = torch.randint(0, runner.vocab_size, (1, k), generator=generator).to(runner.device)
            for step, r in runners.items():
                seconds = timed(r.forward, caches[step], ids, row_invariant=runner.row_invariant)
                caches[step].commit(torch.tensor([[True] + [False] * (k - 1)], device=runner.device))
                if rep >= WARMUP:
                    times[(step, k)].append(seconds)
    return {step: {k: 1e3 * statistics.median(times[(step, k)]) for k in lengths} for step in runners}


def prefill_rates(runners: dict[str, ModelRunner], lengths: list[int], reps: int, config: Config) -> dict:
    """Median tokens/s of a prompt of each length prefilled into an empty batch as the server prefills it, on each
    step kind: an engine of `config` (its chunks, exact where its prefills are; the prefix cache off)."""
    runner = next(iter(runners.values()))
    timed = timer(runner.device)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, runner.vocab_size, (max(lengths),), generator=generator).tolist()
    engines = {}
    for step, r in runners.items():
        served = config.model_copy(deep=True)
        served.model.step, served.prefill.cache = step, False
        engines[step] = build_engine(served, drafter=NO_DRAFTER, target=r)
    times: dict[tuple[str, int], list[float]] = {(step, n): [] for step in runners for n in lengths}
    for rep in tqdm(range(PREFILL_WARMUP + reps), desc="prefills"):
        for n in lengths:
            for step, engine in engines.items():
                seq = Sequence("prefill", prompt[:n], SamplingParams(), 1)
                seconds = timed(engine.add, seq)
                engine.remove([seq])
                if rep >= PREFILL_WARMUP:
                    times[(step, n)].append(seconds)
    return {step: {n: n / statistics.median(times[(step, n)]) for n in lengths} for step in runners}


def chunk_costs(runner: ModelRunner, rows: list[int], contexts: list[int], reps: int) -> dict:
    """Median ms of an exact (row-invariant) prefill chunk of each of `rows` tokens after each of `contexts`, and
    their least-squares fit ms = a n + b n (p + n / 2) + c over n rows at context p: a row's linear layers, its
    attention over its positions, and the pass. At a / b positions a row's attention costs as much as its linear
    layers, so one multiply-add of the attention costs `attention_mac_cost` of the linear layers' (the
    projections' multiply-adds over the attention's per position, over a / b): prefill.attention_mac_cost."""
    timed = timer(runner.device)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, runner.vocab_size, (1, max(contexts) + max(rows)), generator=generator).to(runner.device)
    cache = runner.new_cache()
    cache.reserve(1, ids.shape[1])
    passes = []
    for context in tqdm(sorted(contexts), desc="chunks"):
        for start in range(int(cache.lengths[0]), context, max(rows)):  # the context, prefilled as the engine does
            runner.forward(cache, ids[:, start : min(start + max(rows), context)], commit=True, last_logits_only=True,
                           row_invariant=True)
        for n in rows:
            times = []
            for rep in range(PREFILL_WARMUP + reps):
                seconds = timed(runner.forward, cache, ids[:, context : context + n], last_logits_only=True, row_invariant=True)
                cache.commit(torch.zeros(1, n, dtype=torch.bool, device=runner.device))  # rolled back: the context stays
                if rep >= PREFILL_WARMUP:
                    times.append(seconds)
            passes.append({"rows": n, "context": context, "ms": 1e3 * statistics.median(times)})
    shape = np.array([[c["rows"], c["rows"] * (c["context"] + c["rows"] / 2), 1.0] for c in passes])
    (per_row, per_row_position, per_pass), *_ = np.linalg.lstsq(shape, np.array([c["ms"] for c in passes]), rcond=None)
    parity = per_row / per_row_position
    return {
        "passes": passes,
        "fit": {"ms_per_row": per_row, "ms_per_row_position": per_row_position, "ms_per_pass": per_pass,
                "parity_context": parity, "attention_mac_cost": runner.projection_to_attention_macs() / parity},
    }


def draft_costs(target: ModelRunner, drafts: dict[str, ModelRunner] | None, context: int, reps: int,
                eagle3_widths: tuple[int, ...] = ()) -> dict:
    """Median ms per draft step: a draft model's one-token pass on each step kind (`drafts`, as on_steps makes
    them), one level of the EAGLE network, one forward of four Medusa heads (both eager: they run on the eager
    step only), and a chained step of EAGLE-3's drafter per MLP width in `eagle3_widths` (its linear layers int4
    on our kernel, as it would serve; its output layer over the default draft vocabulary; random weights)."""
    timed = timer(target.device)
    device, hidden = target.device, target.config.hidden_size
    costs: dict[str, dict[str, float] | float] = {}
    if drafts:
        by_step = pass_costs(drafts, [1], context, reps)
        costs["draft-model"] = {step: by_k[1] for step, by_k in by_step.items()}
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

        calls = {"eagle": eagle_level, "medusa": medusa, **{f"eagle3-{width}": eagle3_step(target, width, context)
                                                             for width in eagle3_widths}}
        for name, call in calls.items():
            samples = [timed(call) for _ in range(WARMUP + reps)][WARMUP:]
            costs[name] = 1e3 * statistics.median(samples)
    return costs


def eagle3_step(target: ModelRunner, width: int, context: int) -> Callable[[], None]:
    """One chained EAGLE-3 draft step at MLP width `width`: its layer over one pair attending `context` earlier
    pairs' keys, the output layer, the argmax."""
    vocab = ReducedVocab(torch.arange(min(Eagle3Settings().vocab_size, target.vocab_size)), target.vocab_size)
    net = Eagle3Net(target.model, vocab, width).to(target.dtype).eval()
    quantize_linears(net, "int4")
    past = [torch.randn(1, net.kv_heads, context, net.head_dim, dtype=target.dtype) for _ in range(2)]
    hidden = torch.randn(1, 1, net.hidden_size, dtype=target.dtype)
    token, position = torch.tensor([[1]]), torch.tensor([[context]])
    mask = torch.ones(1, 1, context + 1, dtype=torch.bool)

    def step() -> None:
        kv = DynamicCache()  # the same context each step; appending to it copies it, as a served step's does
        kv.update(*past, 0)
        net.logits(net(hidden, token, position, mask, kv)).argmax(-1)

    return step


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
        tokens_per_step = decoded_tokens(record) / steps
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
    """ms per pass against its length, one line per step kind (and llama.cpp's pp k, its tg token at 1)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for step, by_k in result["pass_ms"].items():
        axes.plot(list(by_k), list(by_k.values()), marker="o", label=step)
    if "llama_cpp" in result:
        llama_cpp = result["llama_cpp"]
        axes.plot(list(llama_cpp["pass_ms"]), list(llama_cpp["pass_ms"].values()), "k--s", label="llama.cpp pp k")
        axes.plot([1], [llama_cpp["token_ms"]], "kx", label=f"llama.cpp tg{LLAMA_CPP_GENERATED}, a token")
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
    prefill_lengths = [int(n) for n in args.prefill.split(",") if n]
    chunk_rows = [int(n) for n in args.chunk_rows.split(",") if n]
    if args.shapes and args.llama_cpp:
        raise SystemExit("step_costs: --llama-cpp runs the GGUF file of --config's target: not with --shapes")
    llama_cpp = None
    if args.shapes:
        device = resolve_device(args.device)
        target = random_runner(args.shapes, args.weights, args.dtype, device)
        draft = random_runner(args.draft_shapes, args.weights, args.dtype, device) if args.draft_shapes else None
        what = {"shapes": args.shapes, "draft_shapes": args.draft_shapes, "weights": args.weights, "dtype": args.dtype,
                "random_weights": True}
        config = Config()  # prefills as the default configuration's
    else:
        config = Config.load(args.config)
        llama_cpp = llama_cpp_inputs(args.llama_cpp, config.model.target) if args.llama_cpp else None  # before loading
        target, draft = load_runner(config.model.target, config.model), None
        what = {"target": config.model.target, "weights": config.model.weights, "dtype": config.model.dtype,
                "random_weights": False}
    start = time.perf_counter()
    runners = on_steps(target, steps)
    target_ready = time.perf_counter()
    draft_runners = on_steps(draft, steps) if draft else None
    # Compiling (and recording CUDA graphs) is most of a GPU run's minutes: each model's share, before timing.
    warm_up_s = {"target": target_ready - start, "draft": time.perf_counter() - target_ready if draft else None}
    passes = pass_costs(runners, lengths, args.context, args.reps)
    widths = tuple(int(w) for w in args.eagle3_widths.split(",") if w)
    drafts = draft_costs(target, draft_runners, args.context, args.reps, widths)
    prefills = prefill_rates(runners, prefill_lengths, args.reps, config) if prefill_lengths else {}
    chunks = chunk_costs(runners[steps[0]], chunk_rows, [int(p) for p in args.chunk_contexts.split(",")], args.reps) if chunk_rows else None
    result = {
        **what, "kernel_family": vnni.family(), "kernel_forced": vnni.isa(), "device": str(target.device), "device_name": _device_name(target.device),
        "row_invariant": target.row_invariant, "context": args.context, "reps": args.reps,
        "pass_ms": passes, "draft_step_ms": drafts,
        "verify_over_plain": {step: {k: ms / by_k[lengths[0]] for k, ms in by_k.items()} for step, by_k in passes.items()},
        "eager_over": {step: {k: passes["eager"][k] / ms for k, ms in by_k.items()} for step, by_k in passes.items()}
        if "eager" in passes else None,
        "prefill_tokens_per_s": prefills, "warm_up_s": warm_up_s, "chunk_costs": chunks,
    }
    if not args.shapes and vnni.extension() is not None:
        result["read"] = read_rate(target, args.reps)
        result["read"]["step_over_read"] = passes[steps[0]][lengths[0]] / result["read"]["ms"]
        result["int8"] = int8_rates(target, passes, result["read"]["ms"])
    if llama_cpp:
        result["llama_cpp"], prefills["llama.cpp"] = llama_cpp_rows(*llama_cpp, lengths, prefill_lengths, args.reps)
    if args.acceptance:
        result["expected"] = {
            "label": "expected speedups: pass and draft costs measured here x tokens per step measured by the bench run "
            f"{args.acceptance} (its machine, its weights)",
            "methods": expected_speedups(passes, drafts, args.acceptance),
        }
    result["measure_s"] = time.perf_counter() - start
    return result


def linear_macs(model: torch.nn.Module) -> int:
    """Multiply-adds a token takes in the model's linear layers (float or ours), the output layer among them."""
    return sum(module.in_features * module.out_features for module in model.modules()
               if isinstance(getattr(module, "in_features", None), int) and isinstance(getattr(module, "out_features", None), int))


# What a pass is bounded by: its bytes' read time, or its multiply-adds at this share of the measured int8 peak.
PEAK_SHARE = 0.75


def int8_rates(target: ModelRunner, passes: dict, read_ms: float) -> dict:
    """Per step kind and pass of k tokens: its linear layers' multiply-adds a second (G/s; the whole pass's time, so
    a floor on the kernel's own rate), that over the int8 peak of the kernel's family measured now (int8_peak), and
    the pass over its bound, the larger of the one-token read time and its multiply-adds at PEAK_SHARE of the peak."""
    peaks = int8_peak.peaks()
    macs = linear_macs(target.model)
    family = int8_peak.KERNEL_FAMILY_PEAK.get(vnni.family())
    peak = peaks.get("g_macs_per_s", {}).get(family)
    rates = {step: {k: macs * k / ms / 1e6 for k, ms in by_k.items()} for step, by_k in passes.items()}
    return {
        "label": f"linear layers' multiply-adds ({macs / 1e9:.3f} G a token) over each pass's time; the bound: max(read, "
                 f"multiply-adds at {PEAK_SHARE:.0%} of the {family} peak)",
        "macs_per_token": macs, "peaks": peaks, "kernel_peak": family, "g_macs_per_s": rates,
        "of_peak": {step: {k: rate / peak for k, rate in by_k.items()} for step, by_k in rates.items()} if peak else None,
        "over_bound": {step: {k: ms / max(read_ms, macs * k / (PEAK_SHARE * peak * 1e6)) for k, ms in by_k.items()}
                       for step, by_k in passes.items()} if peak else None,
    }


def read_rate(target: ModelRunner, reps: int) -> dict:
    """The time to read the bytes of the target's one-token step at this machine's rate: the kernel's read loop
    (vnni.read_all) over a buffer of that many bytes, on the passes' threads, the median of `reps` reads."""
    # Every weight once, but the token embeddings, of which a step reads one row.
    nbytes = (model_bytes(target.model) - model_bytes(target.model.get_input_embeddings())) // 64 * 64
    buffer = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    kernel = vnni.extension()
    kernel.read_all(buffer)  # the pages in
    seconds = []
    for _ in range(max(reps, 3)):
        start = time.perf_counter()
        kernel.read_all(buffer)
        seconds.append(time.perf_counter() - start)
    ms = 1e3 * statistics.median(seconds)
    return {"label": "a 2-thread read of the step's weight bytes, nothing else (vnni.read_all)", "bytes": nbytes, "ms": ms,
            "gb_per_s": nbytes / ms / 1e6}


def priced(costs: Path, acceptance: Path) -> dict:
    """An earlier run's pass and draft costs (`costs`, this script's JSON, from any machine) priced with a bench
    run's tokens per step, without measuring anything."""
    run = json.loads(costs.read_text())
    passes = {step: {int(k): ms for k, ms in by_k.items()} for step, by_k in run["pass_ms"].items()}
    return {
        "costs": str(costs), "device_name": run["device_name"],
        "label": f"expected speedups: pass and draft costs measured by {costs} ({run['device_name']}"
        f"{', random weights' if run.get('random_weights') else ''}) x tokens per step measured by the bench run "
        f"{acceptance} (its machine, its weights)",
        "methods": expected_speedups(passes, run["draft_step_ms"], acceptance),
    }


def llama_cpp_inputs(directory: Path, target: str) -> tuple[Path, Path]:
    """llama-bench in `directory` and the GGUF file the registry converted `target` from; stops with what to do
    when either is missing."""
    try:
        return find_tools(directory, ("llama-bench",)), registry_gguf(target)
    except (LookupError, FileNotFoundError) as exc:
        raise SystemExit(f"step_costs: {exc}") from None


def llama_cpp_rows(
    tools: Path, gguf: Path, lengths: list[int], prefill_lengths: list[int], reps: int
) -> tuple[dict, dict]:
    """llama-bench's ms per pass of each length and per generated token on `gguf`, on our passes' threads and
    `reps` times each; and its tokens/s over a prefill of each of `prefill_lengths` and LLAMA_CPP_PREFILL."""
    threads = torch.get_num_threads()
    prefills = sorted({LLAMA_CPP_PREFILL, *prefill_lengths})
    costs = llama_bench(tools, gguf, threads, sorted({*lengths, *prefills}), LLAMA_CPP_GENERATED, reps)
    rows = {
        "label": f"llama-bench (its medians): pass_ms is its pp k, a pass over an empty cache (ours: over --context "
        f"tokens); token_ms its tg {LLAMA_CPP_GENERATED} per token",
        "build": str(tools.resolve()), "build_commit": costs.build_commit, "cpu_info": costs.cpu_info,
        "gguf": str(gguf), "threads": threads,
        "pass_ms": {k: costs.pass_ms[k] for k in lengths}, "token_ms": costs.token_ms,
    }
    return rows, {n: 1e3 * n / costs.pass_ms[n] for n in prefills}


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
    parser.add_argument("--eagle3-widths", default="", help="comma-separated MLP widths: ms of an EAGLE-3 draft step at each")
    parser.add_argument("--acceptance", type=Path, help="a bench run's results.json: price its methods at these costs")
    parser.add_argument("--prefill", default="", help="comma-separated prompt lengths: tokens/s of a prefill of each")
    parser.add_argument("--chunk-rows", default="", help="comma-separated chunk sizes: ms of an exact prefill chunk of each, at each --chunk-contexts, fitted")
    parser.add_argument("--chunk-contexts", default="0,1024,2048,3000", help="comma-separated tokens already in the cache, for --chunk-rows")
    parser.add_argument(
        "--llama-cpp", type=Path, metavar="DIR",
        help="add llama.cpp's figures from llama-bench in DIR (python -m specdec_tools.bench.llama_cpp build DIR) on "
        f"the GGUF file of --config's target: pp of each length, tg {LLAMA_CPP_GENERATED} and the prefills "
        f"(pp{LLAMA_CPP_PREFILL} always), on the same threads",
    )
    parser.add_argument("--costs", type=Path, help="with --acceptance: price this earlier run's costs (its JSON) instead of measuring")
    args = parser.parse_args(argv)
    if args.costs:
        if not args.acceptance:
            raise SystemExit("step_costs: --costs prices an earlier run's costs with --acceptance's tokens per step: give both")
        measurement.report(priced(args.costs, args.acceptance), args.out, __spec__.name, argv)
        return
    result = measure(args)
    measurement.report(result, args.out, __spec__.name, argv)
    if args.out:
        plot(result, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()

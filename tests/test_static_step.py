"""model.step: the static and compiled steps as a config selects them, what they refuse, and the step-costs
tool (the GPU machine's script) run end to end on the CPU with tiny shapes, so that it cannot rot. The
passes themselves are tested in test_runner.py, their exactness in test_exactness.py and test_invisible.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from specdec_core.build import build_engine
from specdec_core.config import Config, ModelConfig, SpeculationConfig
from specdec_core.control import Controller
from specdec_core.drafters.layer_skip import LayerSkipDrafter
from specdec_core.drafters.ngram import NgramDrafter
from specdec_core.engine import Engine
from specdec_core.models import static_cache, step_ops
from specdec_core.models.catalogue import REGISTRY
from specdec_core.models.loading import eos_ids, load_runner
from specdec_core.models.paths import gguf_path
from specdec_core.models.runner import ModelRunner
from specdec_core.models.static_cache import StaticCache
from specdec_core.models.static_runner import (
    PASS_LENGTHS,
    StaticRunner,
    UnsupportedModel,
)
from specdec_core.sampling import SamplingParams
from specdec_core.sequence import Sequence
from specdec_tools import step_costs

from .helpers import (
    decode,
    greedy_reference,
    single_thread,  # noqa: F401  (autouse: torch on one thread)
    tiny_runner,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs/benchmarks/qwen2.5-coder-1.5b-int4-workloads-t0/results.json"
LLAMA_BENCH_JSON = ROOT / "tests/data/llama_cpp/bench.json"  # what llama-bench -p 1,2,8,512 printed


def config(step: str, drafter: str = "ngram") -> Config:
    return Config(model=ModelConfig(target="tiny-random-llama", dtype="fp32", device="cpu", step=step),
                  speculation=SpeculationConfig(drafter=drafter, gamma=3))


@pytest.mark.parametrize("step", ["static", "compiled"])
def test_a_config_selects_the_step_and_its_text_is_plain_greedy_decodings(step):
    engine = build_engine(config(step))
    assert isinstance(engine.target, StaticRunner) and isinstance(engine.cache, StaticCache)
    assert engine.target.compiled == (step == "compiled")
    tokenizer = engine.target.tokenizer
    prompts = [tokenizer.encode(text) for text in ("def f(x):\n    return x", "[1, 2, 1, 2, 1, 2")]
    seqs = [Sequence(f"r{i}", p, SamplingParams(temperature=0.0), 12) for i, p in enumerate(prompts)]
    decode(engine, seqs[:1], {2: seqs[1:]})  # the second row joins mid-run
    for seq, prompt in zip(seqs, prompts):
        assert seq.output_ids == greedy_reference(engine.target, prompt, 12)
    assert sum(seq.stats.draft_tokens for seq in seqs) > 0


def test_the_eager_step_stays_the_default():
    engine = build_engine(config(ModelConfig().step))
    assert not isinstance(engine.target, StaticRunner)


@pytest.mark.parametrize("drafter", ["layer-skip", "hybrid"])  # the hybrid's model drafter is layer skip
def test_drafters_in_the_targets_slot_cache_are_refused_with_what_to_set(drafter):
    with pytest.raises(UnsupportedModel, match="model.step: eager"):
        build_engine(config("static", drafter))
    with pytest.raises(UnsupportedModel, match="model.step: eager"):
        LayerSkipDrafter(StaticRunner.of(tiny_runner(), compiled=False), k=1)


def test_a_model_of_another_family_is_refused():
    runner = tiny_runner()
    runner.model.config.model_type = "gpt2"
    with pytest.raises(UnsupportedModel, match="llama, qwen2"):
        StaticRunner.of(runner, compiled=False)


def test_padded_passes_cover_every_length_up_to_the_longest():
    """On CUDA a compiled pass is padded to the next of PASS_LENGTHS: each length up to the last has one."""
    runner = StaticRunner.of(tiny_runner(), compiled=False, pad=True)
    cache, _, _ = runner.prefill([1, 2, 3])
    for k in (1, 3, PASS_LENGTHS[-1]):
        logits, hidden = runner.forward(cache, torch.ones(1, k, dtype=torch.long), hidden_states=True)
        assert logits.shape[1] == k and hidden[-1].shape[1] == k
        assert cache.pending == k
        cache.commit(torch.zeros(1, k, dtype=torch.bool))
    assert cache.lengths.tolist() == [3]


def test_a_long_pass_is_padded_to_whole_prefill_rows_and_keeps_its_own_tokens_only():
    """A prefill chunk of 100 tokens runs as a pass of 112 (PREFILL_ROWS: a ragged row count is slower on oneDNN's
    matmul and SDPA); the padding attends itself only and is never committed, so the row holds its 100 tokens
    and decodes plain greedy decoding's text (its first token from the prefill's logits, four one-token steps)."""
    runner = StaticRunner.of(tiny_runner(), compiled=False)
    widths = []
    run = runner._pass
    runner._pass = lambda input_ids, *args: widths.append(input_ids.shape[1]) or run(input_ids, *args)
    prompt = [(3 * j) % 50 + 3 for j in range(100)]
    engine = Engine(runner, None, Controller(), set(), chunk_tokens=256)
    seq = Sequence("p", prompt, SamplingParams(temperature=0.0), 5)
    decode(engine, [seq])
    assert widths[0] == 112 and widths[1:] == [1] * 4
    assert seq.output_ids == greedy_reference(runner, prompt, 5)


def rows_of_many_lengths(tag: str) -> list[Sequence]:
    """Greedy rows whose prompts differ in length (one past a capacity block, so the cache grows) and whose
    answers end at different steps, so rows leave from the front, the middle and the end."""
    prompts = [[(5 * j) % 40 + 3 for j in range(3 + 4 * i)] for i in range(4)]
    prompts.append([(7 * j) % 60 + 3 for j in range(300)])  # over BLOCK (256) tokens
    return [Sequence(f"{tag}{i}", p, SamplingParams(temperature=0.0), 6 + 5 * (i % 3)) for i, p in enumerate(prompts)]


def decode_rows_of_many_lengths(tag: str) -> list[tuple[list[int], list[int]]]:
    runner = StaticRunner.of(tiny_runner(), compiled=False)
    assert not runner.row_invariant  # its batched passes read every row's slots up to the longest row's end
    engine = Engine(runner, NgramDrafter(), Controller(gamma_max=4, fixed_gamma=3), set(), chunk_tokens=16)
    seqs = rows_of_many_lengths(tag)
    decode(engine, seqs[:2], {2: seqs[2:4], 4: seqs[4:]})
    return [(seq.output_ids, greedy_reference(runner, seq.prompt_ids, seq.max_tokens)) for seq in seqs]


def test_cache_memory_no_pass_wrote_is_never_read(monkeypatch):
    """A StaticCache takes its memory untouched (a first touch of a page is slow on our VMs): whatever bits it
    holds (NaN here) are zeroed before a pass reads them, so rows of different lengths joining, leaving and
    growing the capacity decode plain greedy decoding's text. Without the zeroing (the negative control) the
    shorter rows read NaN and their text changes."""
    buffer = static_cache._buffer
    monkeypatch.setattr(static_cache, "_buffer", lambda *args: buffer(*args).fill_(float("nan")))
    for output, reference in decode_rows_of_many_lengths("a"):
        assert output == reference
    monkeypatch.setattr(StaticCache, "make_readable", lambda cache, slots: None)
    assert any(output != reference for output, reference in decode_rows_of_many_lengths("b"))


@pytest.mark.parametrize("running", [0, 2])
def test_a_prompt_joins_the_batch_in_the_memory_it_was_prefilled_in(running):
    """A prompt's row is prefilled after room for the batch's rows, which are copied in before it when it joins:
    its own keys and values, a long prompt's many, stay where they are. With rows running it joins at the call
    after its last chunk, so that they step between the two."""
    runner = StaticRunner.of(tiny_runner(), compiled=False)
    engine = Engine(runner, None, Controller(), set(), chunk_tokens=80)  # 4 chunks: the running rows outlast them
    seqs = rows_of_many_lengths("j")
    for seq in seqs[:running]:
        engine.add(seq)
    admission = engine.begin(seqs[-1])
    calls = 1
    while not engine.advance(admission):
        calls += 1
        if engine.seqs:
            engine.step()
    chunks = -(-len(seqs[-1].prompt_ids) // 80)
    assert calls == chunks + bool(running)
    assert engine.cache.keys[0][running].data_ptr() == admission.row.keys[0].data_ptr()
    assert engine.cache.lengths.tolist()[running] == len(seqs[-1].prompt_ids)


def test_a_compiled_padded_step_compiles_two_graphs_for_every_pass_length():
    """Warmed up as on CUDA (padded to PASS_LENGTHS): one graph for one-token passes, one for every longer pass.
    The cache's head count (2 here) must not tie the pass length to it: that was a third graph, and on an H200 a
    third minute of compiling."""
    runner = StaticRunner.of(tiny_runner(), compiled=True, pad=True)
    assert runner.config.num_key_value_heads == 2
    torch._dynamo.reset()  # graphs an earlier test compiled for this model would be found, not compiled
    counters.clear()
    runner.warm_up((1,))
    assert counters["stats"]["unique_graphs"] == 2


def test_the_compiled_step_serves_grown_joined_and_narrowed_caches_without_compiling_again():
    """The warm-up's graphs serve every cache a server makes: one grown past its first capacity, rows joined
    and rows dropped. (A grown cache's layers had become plain tensors, not views of a buffer, and the first growth
    compiled a second set of graphs: about a minute a graph on an H200's host, while every stream waited.)"""
    runner = StaticRunner.of(tiny_runner(), compiled=True, pad=True)
    torch._dynamo.reset()
    counters.clear()
    runner.warm_up((1, 2))  # as a server warms up: batch 1, and 2 for every larger batch
    warmed = counters["stats"]["unique_graphs"]
    cache = runner.prefill(list(range(1, 60)) * 4 + [1] * 20)[0]  # 256 tokens: the next pass grows the cache
    capacity = cache.capacity
    for k in (1, 3, 8):
        runner.forward(cache, torch.ones(1, k, dtype=torch.long))
        cache.commit(torch.tensor([[True] + [False] * (k - 1)]))
    assert cache.capacity > capacity
    cache.append(runner.prefill(list(range(1, 30)))[0])
    runner.forward(cache, torch.ones(2, 4, dtype=torch.long))
    cache.commit(torch.ones(2, 4, dtype=torch.bool))
    cache.keep_rows([1])
    runner.forward(cache, torch.ones(1, 1, dtype=torch.long))
    assert counters["stats"]["unique_graphs"] == warmed


def test_the_step_costs_script_runs_on_the_cpu_with_tiny_shapes(tmp_path):
    out = tmp_path / "step-costs.json"
    step_costs.main(["--shapes", "tiny-random-qwen2", "--draft-shapes", "tiny-random-llama", "--device", "cpu",
                     "--dtype", "fp32", "--lengths", "1,2,4", "--reps", "2", "--context", "16", "--prefill", "8,32",
                     "--chunk-rows", "4,8", "--chunk-contexts", "0,16,32", "--eagle3-widths", "32,96", "--acceptance", str(RESULTS),
                     "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["random_weights"] and result["command"].startswith("python -m specdec_tools.step_costs")
    for step in ("eager", "static", "compiled"):
        assert set(result["pass_ms"][step]) == {"1", "2", "4"} and all(ms > 0 for ms in result["pass_ms"][step].values())
        assert result["draft_step_ms"]["draft-model"][step] > 0
        assert set(result["prefill_tokens_per_s"][step]) == {"8", "32"}
    assert result["draft_step_ms"]["eagle"] > 0 and result["draft_step_ms"]["medusa"] > 0
    assert result["draft_step_ms"]["eagle3-32"] > 0 and result["draft_step_ms"]["eagle3-96"] > 0
    chunks = result["chunk_costs"]
    assert [(c["rows"], c["context"]) for c in chunks["passes"]] == [(n, p) for p in (0, 16, 32) for n in (4, 8)]
    assert all(c["ms"] > 0 for c in chunks["passes"]) and set(chunks["fit"]) >= {"parity_context", "attention_mac_cost"}
    methods = {row["method"]: row for row in result["expected"]["methods"]}
    assert {"ngram", "suffix"} <= set(methods) and "plain" not in methods
    assert methods["suffix"]["expected_speedup_compiled"] > 0
    assert "bench run" in result["expected"]["label"]
    assert out.with_suffix(".png").stat().st_size > 0


def test_the_step_costs_script_prices_an_earlier_runs_costs(tmp_path):
    """--costs: a GPU machine's JSON priced here with a bench run's tokens per step, measuring nothing. Passes as
    cheap at 8 tokens as at 1 make a lookup drafter's expected speedup its tokens per step, less its host time."""
    costs = tmp_path / "gpu.json"
    costs.write_text(json.dumps({"device_name": "a GPU", "random_weights": True, "pass_ms": {"compiled": {"1": 5.0, "8": 5.0}},
                                 "draft_step_ms": {"eagle": 50.0}}))
    out = tmp_path / "expected.json"
    step_costs.main(["--costs", str(costs), "--acceptance", str(RESULTS), "--out", str(out)])
    result = json.loads(out.read_text())
    assert "a GPU, random weights" in result["label"] and "bench run" in result["label"]
    methods = {row["method"]: row for row in result["methods"]}
    suffix = methods["suffix"]
    assert 0 < suffix["expected_speedup_compiled"] < suffix["tokens_per_step"]
    with pytest.raises(SystemExit, match="give both"):
        step_costs.main(["--costs", str(costs)])


@pytest.mark.parametrize("name, parameters", [
    # Counted in the pulled checkpoints: converted from GGUF, each has an output layer of its own.
    ("qwen2.5-coder-1.5b", 1_777_088_000),
    ("qwen2.5-coder-0.5b", 630_167_424),
])
def test_the_step_costs_shapes_are_the_registry_models_architectures(name, parameters):
    runner = step_costs.random_runner(name, None, "bf16", torch.device("meta"))  # shapes only, no memory
    assert sum(p.numel() for p in runner.model.parameters()) == parameters
    assert runner.config.model_type == "qwen2" and runner.vocab_size == 151_936


def test_the_step_costs_script_refuses_unknown_shapes_and_steps():
    with pytest.raises(SystemExit, match="--shapes takes"):
        step_costs.main(["--shapes", "no-such-model", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--steps takes"):
        step_costs.main(["--shapes", "tiny-random-qwen2", "--steps", "eager,turbo", "--device", "cpu"])


def fake_llama_bench(directory: Path) -> Path:
    """A stand-in for llama-bench that prints what the real one printed (LLAMA_BENCH_JSON) and keeps its
    arguments in directory/args."""
    directory.mkdir()
    tool = directory / "llama-bench"
    tool.write_text(f"#!/bin/sh\necho \"$@\" > '{directory / 'args'}'\ncat '{LLAMA_BENCH_JSON}'\n")
    tool.chmod(0o755)
    return directory


def test_the_step_costs_script_adds_llama_cpps_rows_on_the_targets_gguf(tmp_path, smollm2_dir):
    tools = fake_llama_bench(tmp_path / "llama.cpp")
    out = tmp_path / "step-costs.json"
    step_costs.main(["--config", str(ROOT / "configs/smollm2.yaml"), "--steps", "eager", "--lengths", "1,2",
                     "--reps", "1", "--context", "16", "--prefill", "8", "--llama-cpp", str(tools), "--out", str(out)])
    result = json.loads(out.read_text())
    given = (tools / "args").read_text().split()
    flags = dict(zip(given[::2], given[1::2]))
    # Our passes' lengths, the prefills and pp512, on our threads and reps, on the GGUF smollm2 was converted from.
    assert flags == {"-m": str(gguf_path(REGISTRY["smollm2-135m"].gguf_file)), "-t": str(torch.get_num_threads()),
                     "-p": "1,2,8,512", "-n": str(step_costs.LLAMA_CPP_GENERATED), "-r": "1", "-o": "json"}
    llama_cpp = result["llama_cpp"]
    assert llama_cpp["build"] == str(tools.resolve()) and llama_cpp["build_commit"]  # which build made the rows
    assert set(llama_cpp["pass_ms"]) == {"1", "2"} == set(result["pass_ms"]["eager"]) and llama_cpp["token_ms"] > 0
    assert set(result["prefill_tokens_per_s"]) == {"eager", "llama.cpp"}
    assert set(result["prefill_tokens_per_s"]["llama.cpp"]) == {"8", "512"}
    assert out.with_suffix(".png").stat().st_size > 0


def test_the_step_costs_script_says_what_llama_cpp_rows_need(tmp_path):
    with pytest.raises(SystemExit, match="--llama-cpp runs the GGUF file of --config's target"):
        step_costs.main(["--shapes", "tiny-random-qwen2", "--device", "cpu", "--llama-cpp", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"no llama.cpp tools \(llama-bench\).*specdec_tools.bench.llama_cpp build"):
        step_costs.main(["--config", str(ROOT / "configs/tiny-random.yaml"), "--llama-cpp", str(tmp_path)])
    with pytest.raises(SystemExit, match="needs registry models"):
        step_costs.main(["--config", str(ROOT / "configs/tiny-random.yaml"),
                         "--llama-cpp", str(fake_llama_bench(tmp_path / "llama.cpp"))])


SMOLLM2_INT4 = ModelConfig(target="smollm2-135m", dtype="bf16", weights="int4", device="cpu")
QUESTIONS = ["Write a Python function that checks whether a string is a palindrome, and explain it.",
             "Summarize the causes of the French Revolution in three sentences."]


@pytest.fixture(scope="module")
def smollm2_int4(smollm2_dir) -> ModelRunner:
    """Real weights at the precision served (int4, bf16 activations): its passes are row-invariant, and SDPA's
    numbers there depend on the tensors' very shapes (the tiny model's are too small for that to show)."""
    runner = load_runner(SMOLLM2_INT4.target, SMOLLM2_INT4)
    assert runner.row_invariant
    return runner


def greedy_texts(runner: ModelRunner, drafter: NgramDrafter | None = None) -> list[list[int]]:
    prompts = [runner.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                    return_dict=True)["input_ids"] for q in QUESTIONS]
    seqs = [Sequence(f"q{i}", p, SamplingParams(temperature=0.0), 48) for i, p in enumerate(prompts)]
    engine = Engine(runner, drafter, Controller(gamma_max=4), eos_ids(runner))
    decode(engine, seqs[:1], {5: seqs[1:]})
    return [seq.output_ids for seq in seqs]


def test_on_real_weights_the_static_step_returns_the_eager_steps_text(smollm2_int4):
    eager = greedy_texts(smollm2_int4)
    static = StaticRunner.of(smollm2_int4, compiled=False)
    assert greedy_texts(static) == eager
    assert greedy_texts(static, NgramDrafter()) == eager


def test_negative_control_sdpa_over_the_whole_capacity_changes_the_text(smollm2_int4):
    """The first static step's prefills attended the whole capacity under the mask (as CUDA graphs still do):
    on these weights that alone parts it from the eager step's text, so the test above can fail."""
    assert greedy_texts(StaticRunner.of(smollm2_int4, compiled=False, pad=True)) != greedy_texts(smollm2_int4)


@pytest.mark.parametrize("step,weights,parts", [
    ("eager", "null", {"q_proj", "down_proj", "input_layernorm"}),
    ("static", "null", {"q_proj", "down_proj", "add_rms_norm", "rotate_and_cache"}),
    ("static", "int4", {"qkv_proj", "gate_up_proj", "down_proj", "add_rms_norm", "rotate_and_cache", "act_fn"}),  # KernelLayers
])
def test_the_step_profile_accounts_for_every_part_of_the_pass(step, weights, parts, tmp_path):
    """step_profile splits a pass into its layers' parts (the static step's fused ops among them, and the parts
    of KernelLayers, labelled in C++) and the time no op covers, the parts add up to the profiled pass, and the
    table sums the linear layers and times them alone."""
    from specdec_tools import step_profile

    if weights == "int4" and step_ops.extension() is None:
        pytest.skip("no kernel family here")
    config = tmp_path / "tiny.yaml"
    config.write_text((ROOT / "configs/tiny-random.yaml").read_text().replace(
        "  device: auto", f"  device: auto\n  step: {step}\n  weights: {weights}"))
    out = tmp_path / "profile.json"
    step_profile.main(["--config", str(config), "--lengths", "1,4", "--context", "16", "--reps", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    for k in ("1", "4"):
        passes = result["passes"][k]
        assert {step_profile.UNTRACED} | parts <= set(passes["parts_ms"])
        assert sum(passes["parts_ms"].values()) == pytest.approx(passes["profiled_pass_ms"], rel=1e-6)
        assert passes["linear_layers_alone_ms"] > 0
    table = out.with_suffix(".md").read_text()
    assert table.startswith("| part |") and "| its linear layers in the profiled pass, summed" in table
    assert "| its linear layers alone, unprofiled" in table

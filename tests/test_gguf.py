"""model.weights: gguf, end to end: a registry model served from its GGUF file's own blocks with no float copy of its
weights, every tensor the file's; and speculation over K-quant layers (Q4_K with Q6_K, as the 1.5B's file mixes them)
invisible, on the static step's fused kernel layers too."""

from __future__ import annotations

import os
import shutil
from unittest import mock

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specdec_core.config import ModelConfig
from specdec_core.control import Controller
from specdec_core.drafters.draft_model import DraftModelDrafter
from specdec_core.drafters.ngram import NgramDrafter
from specdec_core.drafters.suffix import SuffixDrafter
from specdec_core.engine import Engine
from specdec_core.models import attention, step_ops, vnni
from specdec_core.models.catalogue import REGISTRY
from specdec_core.models.gguf_blocks import GgufEmbedding, GgufFile, repack
from specdec_core.models.loading import eos_ids, load_runner
from specdec_core.models.paths import gguf_path
from specdec_core.models.quant import FusedLinear, VnniLinear, fused_projections
from specdec_core.models.registry import pull
from specdec_core.models.runner import ModelRunner
from specdec_core.models.static_runner import on_step
from specdec_core.models.tiny import tiny_tokenizer
from specdec_core.sampling import SamplingParams
from specdec_core.sequence import Sequence

from .helpers import decode, gguf_tensor, single_thread  # noqa: F401  (autouse: torch on one thread)

needs_kernel = pytest.mark.skipif(vnni.extension() is None, reason="no AVX2 CPU or no compiler here")
SMOL = "smollm2-135m"
SETTINGS = {"greedy": {"temperature": 0.0}, "seeded-0.7": {"temperature": 0.7, "top_p": 0.95}}


@pytest.mark.real_model
def test_a_pull_for_gguf_weights_converts_no_weights_and_a_later_one_adds_them_keeping_the_packed(smollm2_dir, tmp_path,
                                                                                                  monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    source = smollm2_dir.parent.parent / "gguf" / REGISTRY[SMOL].gguf_file
    gguf_path(source.name).parent.mkdir(parents=True)
    os.link(source, gguf_path(source.name)) if source.stat().st_dev == tmp_path.stat().st_dev else shutil.copy(source, gguf_path(source.name))
    light = pull(SMOL, float_weights=False)
    assert {"config.json", "tokenizer.json", "generation_config.json", "specdec.json"} <= {p.name for p in light.iterdir()}
    assert not list(light.glob("*.safetensors"))
    (light / "packed-gguf-vnni.safetensors").write_bytes(b"kept")
    assert pull(SMOL, float_weights=False) == light and not list(light.glob("model*.safetensors"))
    assert pull(SMOL) == light
    assert (light / "model.safetensors").is_file() and (light / "packed-gguf-vnni.safetensors").read_bytes() == b"kept"


@pytest.fixture(scope="module")
def smol_gguf(smollm2_dir) -> ModelRunner:
    # The float weights must not be read: transformers' loading of them fails here.
    with mock.patch.object(AutoModelForCausalLM, "from_pretrained", side_effect=AssertionError("read the float weights")):
        return load_runner(SMOL, ModelConfig(target=SMOL, weights="gguf", step="static"))


@needs_kernel
@pytest.mark.real_model
def test_every_tensor_of_a_gguf_model_is_the_files(smol_gguf):
    """Its linear layers the file's blocks (every value, from the kernel's own dequantization), its embeddings the
    file's rows, its norms the file's values, each in the model's dtype where they are floats."""
    gguf = GgufFile(gguf_path(REGISTRY[SMOL].gguf_file))
    linears = {name: module for name, module in smol_gguf.model.named_modules() if isinstance(module, VnniLinear)}
    assert len(linears) == 30 * 7 + 1 and not any(isinstance(m, torch.nn.Linear) for m in smol_gguf.model.modules())
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.29.mlp.down_proj", "lm_head"):
        assert torch.equal(vnni.dequantize_exact(linears[name].packed, linears[name].scale_min), gguf.values(f"{name}.weight", True))
    embedding = smol_gguf.model.get_input_embeddings()
    assert isinstance(embedding, GgufEmbedding) and embedding.qtype.name == "Q8_0"
    ids = torch.tensor([[0, 5, 49151]])
    assert torch.equal(embedding(ids)[0], gguf.values("model.embed_tokens.weight")[ids[0]].bfloat16())
    for name, parameter in smol_gguf.model.named_parameters():
        assert torch.equal(parameter, gguf.values(name, True).bfloat16()), name
    assert smol_gguf.row_invariant and smol_gguf.vocab_size == 49152


@needs_kernel
@pytest.mark.real_model
@pytest.mark.parametrize("setting", SETTINGS)
def test_speculation_over_a_gguf_model_gives_plain_decodings_text(smol_gguf, setting):
    prompts = [smol_gguf.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                       tokenize=True, return_dict=False) for text in ("Write a Python function that reverses a list.", "Name three colours.")]
    texts = {}
    for name, drafter in {"plain": None, "ngram": NgramDrafter(), "suffix": SuffixDrafter(10_000, 2.0, 0.0)}.items():
        seqs = [Sequence(f"r{i}", prompt, SamplingParams(**SETTINGS[setting], seed=i), 24) for i, prompt in enumerate(prompts)]
        decode(Engine(smol_gguf, drafter, Controller(fixed_gamma=None if drafter is None else 3), eos_ids(smol_gguf)), seqs)
        texts[name] = [seq.output_ids for seq in seqs]
    assert texts["ngram"] == texts["plain"] and texts["suffix"] == texts["plain"]


def test_gguf_weights_for_a_model_without_a_gguf_file_are_refused_with_what_to_do():
    with pytest.raises(ValueError, match="weights: int4 or int8"):
        load_runner("tiny-random-qwen2", ModelConfig(target="tiny-random-qwen2", weights="gguf"))


# -- a tiny model of K-quant layers ------------------------------------------------------------------------------------

# The 1.5B's mix: q, k, o, gate and up Q4_K; v, down and the output layer Q6_K (so q/k/v fuse by runs).
K_TYPES = {"v_proj": "Q6_K", "down_proj": "Q6_K", "lm_head": "Q6_K"}


def k_quant_runner(seed: int) -> ModelRunner:
    """A two-layer qwen2 of width 256 (a K-quant's super-block) whose linear layers are random GGUF blocks."""
    tokenizer = tiny_tokenizer()
    config = AutoConfig.for_model("qwen2", vocab_size=len(tokenizer) // 16 * 16 + 16, hidden_size=256, intermediate_size=512,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention.IMPLEMENTATION).to(torch.bfloat16).eval()
    for index, (name, linear) in enumerate([(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]):
        qtype = K_TYPES.get(name.rpartition(".")[2], "Q4_K")
        rows, inputs = linear.weight.shape
        layer = VnniLinear(*repack(gguf_tensor(qtype, rows, inputs, seed=seed * 1000 + index, scale=2e-4), qtype, rows, inputs),
                           linear.bias)
        layer.dtype = torch.bfloat16
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
    runner = ModelRunner(model, tokenizer, f"k-quants@{seed}")
    runner.row_invariant = attention.takes(model.config, torch.bfloat16) and attention.extension() is not None
    return runner


def float_copy(target: ModelRunner) -> ModelRunner:
    """The K-quant model's values in bf16 float layers: a draft that agrees with it often, not always."""
    model = k_quant_runner(1).model
    for name, module in list(model.named_modules()):
        if isinstance(module, VnniLinear):
            own = target.model.get_submodule(name)
            linear = torch.nn.Linear(own.in_features, own.out_features, bias=own.bias is not None, dtype=torch.bfloat16)
            with torch.no_grad():
                linear.weight.copy_(vnni.dequantize_exact(own.packed, own.scale_min))
                if own.bias is not None:
                    linear.bias.copy_(own.bias)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, linear)
    model.load_state_dict({k: v for k, v in target.model.state_dict().items() if k in model.state_dict()}, strict=False)
    return ModelRunner(model, target.tokenizer, "k-quants-float")


@pytest.fixture(scope="module")
def k_target() -> ModelRunner:
    if vnni.extension() is None:
        pytest.skip("no AVX2 CPU or no compiler here")
    return on_step(k_quant_runner(1), "static")


@pytest.mark.parametrize("setting", SETTINGS)
def test_speculation_over_k_quant_layers_gives_plain_decodings_text(k_target, setting):
    """Over Q4_K and Q6_K layers on the static step, q/k/v fused by runs into the kernel layers: every drafter's text,
    rows joining mid-run, is plain decoding's."""
    assert isinstance(fused_projections(k_target.model)[0][0], FusedLinear) and step_ops.kernel_layers(k_target.model)
    prompts = [k_target.tokenizer.encode(text) for text in ("def decode(self, s):", "import json\nvalue = ", "class A:")]

    def run(drafter) -> tuple[list[list[int]], int]:
        seqs = [Sequence(f"r{i}", prompt, SamplingParams(**SETTINGS[setting], seed=i), 16 - i) for i, prompt in enumerate(prompts * 2)]
        engine = Engine(k_target, drafter, Controller(gamma_max=4, fixed_gamma=None if drafter is None else 3), eos_ids(k_target))
        decode(engine, seqs[::2], {3: seqs[1::2]})
        return [seq.output_ids for seq in seqs], sum(seq.stats.draft_tokens for seq in seqs)

    plain, _ = run(None)
    for drafter in (NgramDrafter(), DraftModelDrafter(float_copy(k_target), k_target.vocab_size)):
        text, drafted = run(drafter)
        assert text == plain and drafted > 0

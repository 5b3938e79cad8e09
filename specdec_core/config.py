"""Configuration of the runtime: the model and speculation sections of a YAML file, validated here.

Every option has a working default. The server's sections live with the server (server/settings.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .drafters.registry import DRAFTERS, MODEL_DRAFTERS


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(Section):
    target: str = Field("smollm2-135m", description="Registry name, local model directory, hub id, or tiny-random-<family>[@seed]")
    dtype: Literal["bf16", "fp32", "fp16"] = Field("bf16", description="Activation dtype, and the weights' unless `weights` quantizes them")
    device: str = Field("auto", description="auto (CUDA when present, else CPU), cpu, cuda, cuda:N")
    threads: int | None = Field(None, description="CPU threads for torch; null keeps torch's default")
    step: Literal["eager", "static", "compiled"] = Field(
        "eager",
        description="How the target's and a draft model's passes run: eager (transformers' forward over a slot cache), "
        "static (our pass over a preallocated cache addressed by position, models/static_runner.py) or compiled (that "
        "pass compiled by torch.compile: inductor on CPU, CUDA graphs on GPUs; the first passes wait for the compiler). "
        "static and compiled run Llama-family decoders and every drafter but layer-skip",
    )
    weights: Literal["gguf", "int4", "int8", "bf16", "fp32", "fp16"] | None = Field(
        None,
        description="Precision of the linear layers' weights (target and draft model); `dtype` stays the activation "
        "dtype. int4 (group-wise: a scale and a zero per 32 weights) and int8 (a scale per output channel) are "
        "weight-only quantization: the kernels dequantize on the fly and compute in `dtype`, so int4 on CUDA needs "
        "dtype bf16. gguf serves a registry model's GGUF file's own blocks, every value the file's, on our CPU kernel. "
        "Layers a kernel cannot take fall back to the next wider precision (logged). null, or the same "
        "name as `dtype`, keeps the weights unquantized in `dtype`. Embeddings stay in `dtype`. Packed weights of "
        "registry models are cached next to them. Measurements: docs/QUANT.md",
    )

    @model_validator(mode="after")
    def _float_weights_are_the_dtype(self) -> "ModelConfig":
        # Unquantized weights are stored in the activation dtype: there is no mixed float mode.
        if self.weights not in (None, "gguf", "int4", "int8", self.dtype):
            raise ValueError(f"weights {self.weights} with dtype {self.dtype}: float weights are kept in dtype; "
                             f"set dtype: {self.weights} instead, or weights: int8 / int4")
        return self


class NgramConfig(Section):
    # By measurement (`python -m specdec_tools.ngram_sweep` over qwen2.5-coder-1.5b-int4-workloads-t0): 2-4
    # keeps 1.80 tokens per step for 1.45 draft tokens, 1-3 1.92 for 2.92; at that run's verify cost per draft
    # token (+9% of a step) 2-4 yields about 5% more tokens per second of verifying.
    min_n: int = Field(2, ge=1, description="Shortest suffix n-gram to look up")
    max_n: int = Field(4, ge=1, description="Longest suffix n-gram to look up (tried first)")
    max_len: int = Field(8, ge=1, description="Most tokens proposed from one match")
    candidates: int = Field(1, ge=1, description="Latest matches whose continuations are proposed together, as a tree; 1 proposes the latest match's, a chain")
    max_nodes: int = Field(16, ge=1, description="Most nodes of a row's tree when candidates is above 1")


class SuffixConfig(Section):
    max_tokens: int = Field(262_144, ge=1, description="Earlier requests' output tokens the global memory holds (about 120 bytes each); the least recently used requests leave first")
    shared: bool = Field(False, description="Draft every client from every client's earlier outputs; false keeps each client (API key, else address) to its own, since a faster answer can reveal that someone's text is in the memory")
    factor: float = Field(1.0, gt=0, description="Most tree nodes per token of the match (SuffixDecoding's max_spec_factor): longer matches earn larger trees")
    min_probability: float = Field(0.1, ge=0, le=1, description="A node joins the tree when at least this share of the match's occurrences continue through it")
    max_match: int = Field(32, ge=2, description="Longest suffix matched against the memories, in tokens")
    max_nodes: int = Field(16, ge=1, description="Most nodes of a row's tree, whatever its match")


class LayerSkipConfig(Section):
    k: int | None = Field(None, ge=1, description="Target layers the layer-skip draft runs (the first k); null: 3/4 of them, rounded down. Measure with `python -m specdec_tools.calibrate`")


class QuantizedConfig(Section):
    weights: Literal["int8", "int4"] = Field("int4", description="Weight precision of the target's copy that the quantized drafter runs (int4: measured c 0.43 on the 1.5B, int8: 0.63)")


class HybridConfig(Section):
    lookup: Literal["ngram", "suffix"] = Field("ngram", description="What a row whose text repeats takes: ngram (speculation.ngram's proposal) or suffix (speculation.suffix's tree, from its own text and earlier requests' outputs)")
    min_n: int = Field(2, ge=1, description="A row takes the lookup's proposal when its suffix matches for at least this many tokens")
    drafter: Literal[MODEL_DRAFTERS] = Field("layer-skip", description="The model drafter for rows without such a match")


class MedusaConfig(Section):
    heads: str | None = Field(None, description="Trained heads: a name under <cache>/heads (`specdec train medusa --out NAME`) or a directory; null: <model.target>-medusa")
    tree_nodes: int = Field(4, ge=1, description="Most nodes of the candidate tree built each step from the heads' top-k, all verified in one target pass (on this CPU a wider pass costs more than it keeps: 4 nodes beat 8 and 16 on smollm2-135m)")
    top_k: int = Field(2, ge=1, description="Candidates taken from each head: the most children a tree node has (at 4 nodes, 2 beat 1: a chain)")


class EagleConfig(Section):
    weights: str | None = Field(None, description="Trained EAGLE network: a name under <cache>/eagle (`specdec train eagle --out NAME`) or a directory; null: <model.target>-eagle")
    total_tokens: int = Field(8, ge=1, description="Nodes of the draft tree verified each step: the best by cumulative draft probability (EAGLE-2 reranking); on this CPU a verify pass grows with them (13 tokens: ~1.9x a plain step on smollm2-135m)")
    depth: int = Field(4, ge=1, description="Most levels of the draft tree (also capped by gamma)")
    top_k: int = Field(2, ge=1, description="Children per expanded node, and nodes expanded per level")


class Eagle3Config(EagleConfig):
    weights: str | None = Field(None, description="Trained EAGLE-3 drafter: a name under <cache>/eagle3 (`specdec train eagle3 --out NAME`) or a directory; null: the one shipped for model.target (specdec_core/shipped/<target>-eagle3), else <model.target>-eagle3")
    precision: Literal["int4", "int8", "bf16"] = Field("int4", description="Its linear layers: int4 or int8 on our kernel, or bf16 as trained (int4 measured at 0.057-0.068 of a target step on the 1.5B)")
    total_tokens: int = Field(5, ge=1, description="Nodes of the draft tree verified each step; with top_k 1 a chain of this many")
    depth: int = Field(5, ge=1, description="Most levels of the draft tree (also capped by gamma)")
    top_k: int = Field(1, ge=1, description="Children per expanded node, and nodes expanded per level (1: a chain)")


class DistilledConfig(Section):
    student: str | None = Field(None, description="Trained student: a name under <cache>/students (`specdec train distill --out NAME`) or a directory; null: <model.target>-distilled. Its trunk (the target's first k layers, or a draft model) is the one it was trained with")


class SpeculationConfig(Section):
    drafter: Literal[DRAFTERS] = Field("ngram", description="Drafting method; none decodes plainly")
    draft_model: str | None = Field(None, description="The draft-model drafter's model (same tokenizer as the target)")
    gamma_max: int = Field(5, ge=1, le=32, description="Most draft tokens per step")
    gamma: int | None = Field(None, ge=0, description="Fixed gamma; null lets the controller choose from measurements")
    max_speculative_batch: int = Field(16, ge=0, description="Batches larger than this always decode plainly")
    ngram: NgramConfig = Field(default_factory=NgramConfig, description="n-gram / prompt-lookup settings")
    unseeded_rule: Literal["rejection", "gumbel"] = Field("rejection", description="How sampled requests without a seed are verified: rejection (rejection sampling, which keeps more of a sampling draft model's tokens: docs/benchmarks/NOTES.md, Invisible speculation) or gumbel (draws keyed by position). Seeded requests always take gumbel, which returns plain decoding's text for their seed")
    early_exit: float = Field(0.0, ge=0, le=1, description="Model drafters stop a row's draft when their top probability falls under this; 0 never stops early")
    vocab_size: int | None = Field(None, ge=1, description="Model drafters predict over the target's this many most frequent tokens (counted over Python's stdlib); null: all (measured: on chat prompts a reduced set lost more acceptance than it saved)")
    suffix: SuffixConfig = Field(default_factory=SuffixConfig, description="suffix (SuffixDecoding) settings: trees from the request's own text and earlier requests' outputs")
    layer_skip: LayerSkipConfig = Field(default_factory=LayerSkipConfig, description="layer-skip (self-speculative) settings")
    quantized: QuantizedConfig = Field(default_factory=QuantizedConfig, description="quantized-copy drafter settings")
    hybrid: HybridConfig = Field(default_factory=HybridConfig, description="hybrid (n-gram, else a model drafter) settings")
    medusa: MedusaConfig = Field(default_factory=MedusaConfig, description="Medusa heads and their per-step candidate tree (depth: gamma, at most the heads)")
    eagle: EagleConfig = Field(default_factory=EagleConfig, description="EAGLE feature drafter and its dynamic draft tree (depth: at most gamma)")
    eagle3: Eagle3Config = Field(default_factory=Eagle3Config, description="EAGLE-3 drafter (the target's features at three depths), a chain unless top_k > 1")
    distilled: DistilledConfig = Field(default_factory=DistilledConfig, description="Distilled student: the target's first k layers and a trained adapter (early_exit applies)")


class PrefillConfig(Section):
    # By measurement (docs/benchmarks/NOTES.md, "The prefix cache and chunked prefill"; 1.5B int4, 2 threads). Where
    # prefills are exact (the target on our kernel) a chunk of n rows at context p took, without AMX (an AMD EPYC,
    # prefix-cache/chunk-costs-epyc.json), 4.6 ms * n + 2.7 us * n * (p + n / 2) + 18 ms: 0.24 s for 48 rows at the
    # start, 1.67 s for 128 at 3,000 positions; with AMX tiles (a Xeon, prefix-cache/chunk-costs-xeon-amx.json),
    # 3.6 ms * n + 0.6 us * n * (p + n / 2) + 6 ms: 0.18 s for 48 rows at the start, 0.67 s for 128 at 3,000. Each
    # chunk reads every weight once, so smaller chunks prefill slower; 48 on both kinds since a Xeon VM whose
    # running stream stalled 10.6 steps in chunks of 64 (over the goal of 10) and 9.0 in chunks of 48, the prompt's
    # time to first token 30.4 s and 30.7 s. Elsewhere (the bf16 product and SDPA) a
    # running stream's longest gap while a 2,940-token prompt was admitted was 0.45-0.47 s in chunks of 128 (8x the
    # step).
    exact: bool = Field(True, description="Prefill as decoding computes (row-invariant) where the target is on our kernel, so that the prefix cache keeps answers too and a conversation's next turn prefills only what is new; false takes the fastest product for prefills (on CPUs with AMX oneDNN's bf16 product, 1.6-1.8x faster over 512-2,048 cold tokens), whose cache keeps whole prompt chunks only")
    chunk_tokens: int | None = Field(None, ge=16, description="Prompt tokens of a prefill pass: running streams get a step between a long prompt's chunks (smaller bounds the stall, larger prefills faster); null: where prefills are exact (a quantized target on our kernel), 48 at a prompt's start and fewer as the context grows (attention_mac_cost), else 128")
    attention_mac_cost: float | None = Field(None, gt=0, description="Where prefills are exact: what a multiply-add of the row-invariant attention costs against one of the int8 linear kernel (step_costs --chunk-rows), so that chunks hold fewer tokens the more context they attend and none costs more than a prompt's first; null: 5 on AVX registers (measured 4.5-5.2 on an AMD EPYC, AVX-512 and AVX2; 7.3-9.0 before the attention scored 8-16 keys at once), 2.6 on AMX tiles (measured on a Xeon)")
    cache: bool = Field(True, description="Keep prefilled and decoded keys and values (the prefix cache; decoded ones where prefills are exact), so that a prompt that begins as an earlier one did, an earlier answer included, prefills only the rest, with the same text as without")
    cache_block_tokens: int = Field(8, ge=1, description="Tokens a prefix-cache block holds where prefills are exact (a quantized target on our kernel), where answers are cached too (a follow-up prefills again its history's partial last block); elsewhere a block is a whole chunk")
    cache_bytes: int = Field(4 * 2**30, ge=1, description="Most bytes the prefix cache holds (the 1.5B target takes 28 KiB a token); the least recently used blocks leave first")
    keep_bf16_weights: bool = Field(True, description="Quantized models on our kernel keep the bf16 weights their first prefill pass that is not exact dequantizes (passes of 128 tokens and more, 48 prepacked for oneDNN on CPUs with AMX, the only ones whose such passes take the bf16 product): a draft model's (about 1 GB for the 0.5B), a target's where prefill.exact is false (2.6 GB for the 1.5B), so that each prefill chunk does not dequantize every weight again (measured: 0.57 against 0.92 s a 256-token chunk)")

    def chunk_tokens_for(self, exact: bool) -> int:
        """Tokens of a prompt's first chunk: the configured ones, else the default measured for the prefill's kind."""
        return self.chunk_tokens or (48 if exact else 128)

    def attention_mac_cost_for(self, tiles: bool) -> float:
        """The configured attention_mac_cost, else the one measured for the attention's path."""
        return self.attention_mac_cost or (2.6 if tiles else 5.0)


class GrammarConfig(Section):
    compile_timeout_s: float = Field(5.0, gt=0, description="Longest a response_format schema or a request's tools may take to compile into a grammar; past it the request gets a 400 (the compile finishes in the background and is kept)")
    cache_entries: int = Field(256, ge=1, description="Compiled grammars kept, by their schema's hash; the least recently used leave first")
    draft_tokens: int = Field(16, ge=0, description="Most tokens of its grammar's forced continuation (a JSON key, a tool call's opening) a row drafts in a step, before the drafter's, counted apart (usage.speculative.grammar_draft_tokens); 0 drafts none, and so does speculation.drafter none")
    tool_format: Literal["hermes"] | None = Field(None, description="How the model writes tool calls; null: the registry entry's, else hermes (<tool_call> JSON blocks: Qwen2.5, Qwen3, Hermes)")


class Config(Section):
    """The runtime's sections of a config file. The file also holds the server's (server/settings.py), which
    the runtime and the tools leave alone: `specdec serve` validates the whole file, unknown sections too."""

    model_config = ConfigDict(extra="ignore")

    model: ModelConfig = Field(default_factory=ModelConfig, description="The target model")
    speculation: SpeculationConfig = Field(default_factory=SpeculationConfig, description="Drafting and control")
    prefill: PrefillConfig = Field(default_factory=PrefillConfig, description="Chunked prefill and the prefix cache")
    grammar: GrammarConfig = Field(default_factory=GrammarConfig, description="Structured outputs and tool calls: response_format, tools")

    @classmethod
    def load(cls, path: str | Path) -> "Config":
        """Read and validate a YAML config; errors name the file and the bad field."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist (see configs/ for examples)")
        data = yaml.safe_load(path.read_text()) or {}
        try:
            return cls.model_validate(data)
        except Exception as exc:
            raise ValueError(f"invalid config {path}: {exc}") from exc


def with_overrides(config: Config, spec: str) -> Config:
    """`name` or `name:key=value:...` as a config with that drafter; keys are dotted paths under `speculation`,
    or under `model`, `prefill` or `grammar` when they start with that section's name (as in
    suffix:model.step=compiled or suffix:grammar.draft_tokens=0)."""
    name, *pairs = spec.split(":")
    data = config.model_dump()
    data["speculation"]["drafter"] = name
    for pair in pairs:
        key, _, value = pair.partition("=")
        *path, leaf = key.split(".")
        section = path[0] if path[:1] in (["model"], ["prefill"], ["grammar"]) else "speculation"
        path = path[1:] if section != "speculation" else path
        node = data[section]
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node or not value:
            raise ValueError(f"{spec!r}: {pair!r} is not key=value with a key of the speculation section, of model.,"
                             " prefill. or grammar. (as in distilled:distilled.student=NAME, layer-skip:layer_skip.k=8,"
                             " ngram:model.step=compiled, plain:prefill.cache=false or suffix:grammar.draft_tokens=0)")
        node[leaf] = yaml.safe_load(value)
    return type(config).model_validate(data)

"""Executing benchmark runs: one method over one block of prompts, timed.

All engine methods share one loaded target (and one draft model): the bench
builds one engine per drafter and settings (`layer-skip:layer_skip.k=8` is
another engine than `layer-skip`) and swaps in each method's own controller
before its run, so `ngram` (adaptive) and `ngram:g4` (fixed) reuse the same
engine but keep separate cost and acceptance measurements, as two servers
would. A drafter that remembers earlier requests (suffix) is the exception:
each method gets an engine of its own, so that no method drafts from
another's runs of the same prompt.
"""

from __future__ import annotations

import json
import re
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig

from specdec_core.build import build_engine
from specdec_core.config import Config, with_overrides
from specdec_core.control import Controller
from specdec_core.drafters.registry import REGISTRY
from specdec_core.engine import Engine, StepReport
from specdec_core.grammar import Grammars, GrammarSpec, GrammarState
from specdec_core.models.runner import ModelRunner
from specdec_core.sampling import SamplingParams
from specdec_core.sequence import Sequence as Seq

from .llama_cpp import LlamaCpp
from .prompts import Prompt, chat_text, encode
from .stats import PLAIN, interleave, ratios_to_plain

ENGINE_DRAFTERS = tuple(REGISTRY)  # every drafter the engine has
HF_METHODS = ("hf-assisted", "hf-prompt-lookup")  # what --baseline hf-assisted adds
LLAMA_CPP_METHODS = {"llama.cpp": "plain", "llama.cpp-speculative": "speculative", "llama.cpp-lookup": "lookup",
                     "llama.cpp-server": "server"}
# what --llama-cpp DIR adds (those of them --drafters names, else all), and the kind of run each is (LlamaCpp.generate)
_GAMMA = re.compile(r"g(\d+)")


@dataclass(frozen=True)
class Method:
    """A decoding method as named on the command line: a drafter kind, an optional fixed gamma, and optional
    settings of the speculation section for it (`distilled:distilled.student=NAME`)."""

    label: str
    drafter: str  # "none", an engine drafter, or one of HF_METHODS or LLAMA_CPP_METHODS
    fixed_gamma: int | None = None
    settings: str = ""  # key=value pairs joined by ":" (config.with_overrides)

    @property
    def external(self) -> bool:
        return self.drafter in (*HF_METHODS, *LLAMA_CPP_METHODS)

    @property
    def on_engine(self) -> bool:
        """Whether it runs on an engine of its own (plain decoding with settings does: plain:model.step=compiled)."""
        return self.drafter in ENGINE_DRAFTERS or (self.drafter == "none" and bool(self.settings))

    @property
    def adaptive(self) -> bool:
        return self.drafter in ENGINE_DRAFTERS and self.fixed_gamma is None

    @property
    def engine(self) -> str:
        """The engine it runs on: methods differing only in gamma share one."""
        return f"{self.drafter}:{self.settings}" if self.settings else self.drafter


def parse_method(text: str) -> Method:
    """`plain`, or a drafter (`ngram`, `layer-skip`, ...: adaptive gamma), optionally with settings
    (`layer-skip:layer_skip.k=8`, `plain:model.step=compiled`, `suffix:prefill.cache=false`) and then a fixed
    gamma (`ngram:g4`)."""
    if text in HF_METHODS or text in LLAMA_CPP_METHODS:
        return Method(text, text)
    text = text.strip()
    name, *parts = text.split(":")
    gamma = None
    if parts and _GAMMA.fullmatch(parts[-1]):
        gamma = int(parts.pop()[1:])
    if name not in (PLAIN, "none", *ENGINE_DRAFTERS) or any("=" not in part for part in parts):
        raise ValueError(
            f"unknown method {text!r}: use plain or one of {', '.join(ENGINE_DRAFTERS)}, optionally with "
            "speculation settings and then a fixed gamma, as in ngram:g4 or layer-skip:layer_skip.k=8:g3"
        )
    if name in (PLAIN, "none"):
        if gamma is not None or any(not part.startswith(("model.", "prefill.")) for part in parts):
            raise ValueError(f"{text!r}: plain decoding has no gamma or drafter settings, only model. and prefill. ones")
        return Method(PLAIN if not parts else text, "none", None, ":".join(parts))
    if gamma is not None and gamma < 1:
        raise ValueError(f"{text!r}: a fixed gamma must be at least 1 (plain is gamma 0)")
    return Method(text, name, gamma, ":".join(parts))


def _remembers(engine: Engine) -> bool:
    return bool(engine.drafter and engine.drafter.remembers_requests)


def _own_engine(engine: Engine) -> bool:
    """Whether an engine must be one method's alone: it remembers earlier requests, in its drafter or its prefix
    cache (a method would otherwise find the prompts another method prefilled)."""
    return _remembers(engine) or engine.prefix_cache is not None


@dataclass
class RecordingController(Controller):
    """A controller that remembers the gamma it chose at each step, to report what it decided."""

    chosen: list[int] = field(default_factory=list)

    def choose(self, seqs: list[Seq]) -> int:
        gamma = super().choose(seqs)
        self.chosen.append(gamma)
        return gamma


@dataclass
class Run:
    """One method over one block of prompts (a single prompt, or a batch decoded together)."""

    method: str
    batch_size: int
    block: int
    prompts: list[Prompt]
    outputs: list[list[int]]
    wall_s: float  # prefill plus decoding, as a client would wait
    prefill_s: float | None = None  # None for transformers' generate, which does not split it out
    first_token_s: float | None = None  # from the start to the first token, as a client waits for it (ours only)
    cached_tokens: int | None = None  # prompt tokens a prefix cache gave, over the block (None: the tool says not)
    draft_s: float = 0.0
    draft_positions: int = 0  # draft tokens a step's drafting produced for its longest row, summed over steps
    verify_s: float = 0.0
    steps: int = 0
    chosen_gammas: list[int] = field(default_factory=list)  # the adaptive controller's choice per step
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0  # row-steps that verified at least one draft token
    gamma_sum: int = 0
    emitted_in_verify: int = 0
    grammar_draft_tokens: int = 0  # a schema's forced continuations, drafted (counted apart from the drafter's)
    grammar_accepted_tokens: int = 0
    finish_reasons: list[str | None] = field(default_factory=list)  # per row (ours only)
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    ratio: float | None = None  # tokens/s over the adjacent plain run(s)
    decode_ratio: float | None = None
    matches_plain: list[bool] | None = None  # per row: output equals plain's (greedy, or sampled with the same seed)
    sampled: bool = False  # temperature > 0: matches_plain compares seeded outputs

    @property
    def new_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def decoded_tokens(self) -> int:
        """Tokens the decode passes made: each output's first comes from its prompt's prefill (ours and llama.cpp's)."""
        return sum(max(len(o) - 1, 0) for o in self.outputs)

    @property
    def decode_s(self) -> float | None:
        return None if self.prefill_s is None else self.wall_s - self.prefill_s

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s

    @property
    def decode_tokens_per_s(self) -> float | None:
        return self.decoded_tokens / self.decode_s if self.decode_s else None

    def add_step(self, report: StepReport) -> None:
        self.steps += 1
        self.draft_s += report.draft_s
        self.draft_positions += report.gamma
        self.verify_s += report.verify_s
        for totals, counts in ((self.accepted_per_position, report.accepted_per_position),
                               (self.drafted_per_position, report.drafted_per_position)):
            totals.extend([0] * (len(counts) - len(totals)))
            for j, n in enumerate(counts):
                totals[j] += n


class Bench:
    """The loaded models and one engine per drafter kind; runs methods over prompts."""

    def __init__(
        self, config: Config, methods: Sequence[Method], temperature: float, seed: int, llama_cpp: LlamaCpp | None = None
    ):
        self.config = config
        self.llama_cpp = llama_cpp
        self.temperature = temperature
        self.seed = seed
        self.engines: dict[str, Engine] = {PLAIN: build_engine(config, drafter="none")}  # by method label
        built: dict[str, Engine] = {}  # by engine spec: methods that differ only in gamma share one
        for method in methods:
            if not method.on_engine:
                continue
            engine = built.get(method.engine)
            if engine is None or _own_engine(engine):  # a memory of earlier requests is one method's own
                engine = self._engine(method.engine)
                built.setdefault(method.engine, engine)
            self.engines[method.label] = engine
        if "hf-assisted" in {m.drafter for m in methods}:  # its draft model is the assistant
            self.assistant = (built.get("draft-model") or self._engine("draft-model")).drafter.runner.model
        spec = config.speculation
        # Fixed-gamma methods may speculate at any batch size, so the sweep measures what
        # speculation costs there; adaptive ones keep the config's cap, as the server would.
        self.controllers = {
            m.label: RecordingController(
                gamma_max=max(spec.gamma_max, m.fixed_gamma or 0),
                fixed_gamma=m.fixed_gamma,
                max_speculative_batch=spec.max_speculative_batch if m.adaptive else 1 << 30,
            )
            for m in methods
            if m.on_engine
        }
        self._ids: dict[str, list[int]] = {}
        self._grammars: Grammars | None = None  # made at the first prompt with a schema

    @property
    def target(self) -> ModelRunner:
        return self.engines[PLAIN].target

    def _engine(self, name: str) -> Engine:
        return build_engine(with_overrides(self.config, name), target=self.target)

    def remembers(self, method: Method) -> bool:
        """What the method drafts depends on earlier requests (a suffix memory, llama-lookup's cache)."""
        if method.drafter == "llama.cpp-lookup":
            return True
        return not method.external and _remembers(self.engines[method.label])

    def forget(self) -> None:
        """Every memory of earlier requests emptied, as in a server just started."""
        for engine in self.engines.values():
            if engine.drafter:
                engine.drafter.forget()
            if engine.prefix_cache:
                engine.prefix_cache.clear()
        if self.llama_cpp:
            self.llama_cpp.forget()

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        if prompt.id not in self._ids:
            self._ids[prompt.id] = encode(self.target.tokenizer, prompt)
        return self._ids[prompt.id]

    def grammar(self, prompt: Prompt) -> GrammarState | None:
        """A new matcher of the prompt's schema, compiled once (None without one)."""
        if prompt.schema is None:
            return None
        if self._grammars is None:
            target = self.target
            self._grammars = Grammars(target.tokenizer, target.vocab_size, self.engines[PLAIN].eos_token_ids)
        return self._grammars.state(self._grammars.compile(GrammarSpec("json_schema", json.dumps(prompt.schema)), prompt.id))

    def params(self, prompt: Prompt) -> SamplingParams:
        # A per-prompt seed: every method samples a prompt with the same seed, whatever the block.
        return SamplingParams(temperature=self.temperature, seed=self.seed + zlib.crc32(prompt.id.encode()))

    def run(self, method: Method, prompts: list[Prompt], max_tokens: int, block: int) -> Run:
        if not method.on_engine and method.drafter != "none" and any(p.schema for p in prompts):
            raise ValueError(f"{method.label} does not take a schema: prompts with one (the json workload) run on the engine")
        if method.drafter in LLAMA_CPP_METHODS:
            return self._run_llama_cpp(method, prompts, max_tokens, block)
        if method.external:
            return self._run_hf(method, prompts, max_tokens, block)
        return self._run_engine(method, prompts, max_tokens, block)

    def _run_engine(self, method: Method, prompts: list[Prompt], max_tokens: int, block: int) -> Run:
        engine = self.engines[method.label]
        controller = self.controllers.get(method.label)
        if controller is not None:
            engine.controller = controller
            controller.chosen.clear()
        seqs = [Seq(f"{method.label}/{p.id}", self.prompt_ids(p), self.params(p), max_tokens, grammar=self.grammar(p))
                for p in prompts]
        start = time.perf_counter()
        first_token_s = None
        for seq in seqs:
            engine.add(seq)  # which draws the sequence's first token
            if first_token_s is None and seq.output_ids:
                first_token_s = time.perf_counter() - start
        prefill_s = time.perf_counter() - start
        run = Run(method.label, len(prompts), block, prompts, [], 0.0, prefill_s, first_token_s=first_token_s)
        for report in engine.generate():
            run.add_step(report)
        run.wall_s = time.perf_counter() - start
        run.outputs = [list(seq.output_ids) for seq in seqs]
        run.chosen_gammas = list(controller.chosen) if controller else []
        for seq in seqs:
            stats = seq.stats
            run.draft_tokens += stats.draft_tokens
            run.accepted_tokens += stats.accepted_tokens
            run.verify_steps += stats.verify_steps
            run.gamma_sum += stats.gamma_sum
            run.emitted_in_verify += stats.emitted_tokens
            run.grammar_draft_tokens += stats.grammar_draft_tokens
            run.grammar_accepted_tokens += stats.grammar_accepted_tokens
        run.finish_reasons = [seq.finish_reason for seq in seqs]
        run.cached_tokens = sum(seq.cached_tokens for seq in seqs)
        return run

    def _run_hf(self, method: Method, prompts: list[Prompt], max_tokens: int, block: int) -> Run:
        """transformers' own generate() on the same model objects: an outside reference, greedy, batch 1."""
        if len(prompts) != 1:
            raise ValueError("transformers' assisted generation decodes one prompt at a time")
        spec = self.config.speculation
        assistant, options = None, {}
        if method.drafter == "hf-assisted":
            assistant = self.assistant
        else:
            options = {"prompt_lookup_num_tokens": spec.gamma_max, "max_matching_ngram_size": spec.ngram.max_n}
        eos = sorted(self.engines[PLAIN].eos_token_ids)
        # A fresh GenerationConfig: greedy, without penalties a model's saved config might carry.
        generation = GenerationConfig(
            do_sample=False, max_new_tokens=max_tokens, eos_token_id=eos, pad_token_id=eos[0], **options
        )
        ids = torch.tensor([self.prompt_ids(prompts[0])], device=self.target.device)
        start = time.perf_counter()
        with torch.no_grad():
            out = self.target.model.generate(
                ids, attention_mask=torch.ones_like(ids), generation_config=generation, assistant_model=assistant
            )
        wall_s = time.perf_counter() - start
        return Run(method.label, 1, block, prompts, [out[0, ids.shape[1] :].tolist()], wall_s)

    def _run_llama_cpp(self, method: Method, prompts: list[Prompt], max_tokens: int, block: int) -> Run:
        """llama.cpp's own tools on the registry's GGUF of the same model: an outside reference, greedy, batch 1.

        Its clock, not ours: prefill and decode as the tools report them, without their model load.
        The output is counted in our tokenizer (the GGUF carries the same vocabulary).
        """
        if len(prompts) != 1:
            raise ValueError("llama.cpp's tools decode one prompt at a time")
        ids = self.prompt_ids(prompts[0])
        timing = self.llama_cpp.generate(
            chat_text(self.target.tokenizer, prompts[0]), max_tokens, LLAMA_CPP_METHODS[method.drafter],
            context=max(4096, len(ids) + max_tokens + 64),  # 64: drafts past the last token
        )
        # Every token the tools' clock covers (their drafts may overshoot -n), the end-of-turn piece left out.
        eos = self.engines[PLAIN].eos_token_ids
        output = [t for t in self.target.tokenizer.encode(timing.text, add_special_tokens=False) if t not in eos]
        run = Run(method.label, 1, block, prompts, [output], timing.prefill_s + timing.decode_s, timing.prefill_s)
        run.draft_tokens, run.accepted_tokens = timing.drafted or 0, timing.accepted or 0
        run.cached_tokens = timing.cached_tokens
        return run


def run_block(
    bench: Bench,
    methods: Sequence[Method],
    prompts: list[Prompt],
    max_tokens: int,
    block: int,
    plain_every: int,
    on_run: Callable[[Run], None] = lambda run: None,
) -> list[Run]:
    """Every method once over the same prompts, interleaved with plain runs; ratios filled in."""
    by_label = {m.label: m for m in methods}
    order = interleave([m.label for m in methods], plain_every, rotate=block)
    runs = []
    caches = {}  # the prefix caches of the block's engines as they were before its first run on each
    for label in order:
        engine = bench.engines.get(label)
        if engine is not None and engine.prefix_cache is not None:
            # A method run again in a block (plain, between the others) finds the block's prompt only as its
            # first run did: not in the cache its first run filled.
            saved = caches.setdefault(label, engine.prefix_cache.snapshot())
            engine.prefix_cache.restore(saved)
        runs.append(bench.run(by_label[label], prompts, max_tokens, block))
        on_run(runs[-1])
    ratios = ratios_to_plain(order, [r.tokens_per_s for r in runs])
    decode_ratios = ratios_to_plain(order, [r.decode_tokens_per_s for r in runs])
    reference = runs[0].outputs
    for run, ratio, decode_ratio in zip(runs, ratios, decode_ratios):
        run.ratio, run.decode_ratio = ratio, decode_ratio
        # The block's first plain run is the reference; later plain runs check that plain is deterministic.
        # Sampled runs compare too: every method samples a prompt with the same seed (sampling_params).
        if run is not runs[0]:
            run.matches_plain = [a == b for a, b in zip(run.outputs, reference)]
            run.sampled = bench.temperature > 0
    return runs

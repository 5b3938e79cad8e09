"""Compose an engine from a config: load the target, the drafter and the controller."""

from __future__ import annotations

from .config import Config
from .control import Controller
from .drafters.base import Drafter
from .drafters.registry import NO_DRAFTER, factory
from .engine import Engine
from .models.loading import eos_ids, load_runner
from .models.runner import ModelRunner
from .models import attention
from .models.quant import keep_dequantized, on_kernel
from .models.static_runner import on_step
from .prefix_cache import PrefixCache


def build_drafter(config: Config, target: ModelRunner, drafter: str | None = None) -> Drafter | None:
    """The drafter `drafter` (default: the config's) over `target`; None for plain decoding."""
    name = drafter or config.speculation.drafter
    return None if name == NO_DRAFTER else registered_drafter(name, config, target)


def registered_drafter(name: str, config: Config, target: ModelRunner) -> Drafter:
    """The drafter registered as `name`, made for `config` over `target` and named `name`."""
    drafter = factory(name)(config, target, lambda other: registered_drafter(other, config, target))
    drafter.name = name  # the key, not the class: one class serves draft-model, quantized and distilled
    return drafter


def build_engine(config: Config, drafter: str | None = None, target: ModelRunner | None = None) -> Engine:
    """The engine a config describes; `drafter` overrides the config's; `target` reuses a loaded target's model
    (on the config's model.step)."""
    target = on_step(target, config.model.step) if target else load_runner(config.model.target, config.model)
    spec = config.speculation
    controller = Controller(gamma_max=spec.gamma_max, fixed_gamma=spec.gamma, max_speculative_batch=spec.max_speculative_batch)
    chosen = build_drafter(config, target, drafter)
    prefill = config.prefill
    # Prefills computed as decoding computes (row-invariant) wherever the target's linear layers are all on our
    # kernel: a position's keys and values are then the same whichever pass wrote them, so the prefix cache keeps
    # answers too, and a conversation's next turn does not prefill the last answer again. Without AMX that costs
    # little (the kernel is the faster product there; the row-invariant attention took 1.11x SDPA's time); with
    # AMX, where oneDNN's bf16 product and SDPA are faster, cold prompts of 512-2,048 tokens took 1.6-1.8x as long
    # (docs/benchmarks/NOTES.md, issue 31; prefill.exact: false takes the faster product there).
    exact = prefill.exact and target.row_invariant and on_kernel(target.model)
    tiles = exact and attention.attends_on_tiles(target.dtype, target.head_dim)
    for model in [target.model, *(chosen.own_models() if chosen else ())]:
        keep_dequantized(model, prefill.keep_bf16_weights)  # made by a first long pass that is not exact
    chunk_tokens = prefill.chunk_tokens_for(exact)
    cache = None
    if prefill.cache:
        block_tokens = prefill.cache_block_tokens if exact else chunk_tokens
        block_bytes = block_tokens * target.token_bytes(len(chosen.feature_layers) if chosen else 0)
        cache = PrefixCache(block_tokens, prefill.cache_bytes, block_bytes)
    # Exact prefills attend with the row-invariant attention, which costs a chunk more the more context it attends
    # (docs/benchmarks/NOTES.md): there chunks shrink as their context grows, with the attention's multiply-adds
    # weighed against the linear kernel's by measurement.
    context = round(target.projection_to_attention_macs() / prefill.attention_mac_cost_for(tiles)) if exact else None
    return Engine(target, chosen, controller, eos_ids(target), spec.unseeded_rule, chunk_tokens, cache,
                  grammar_draft_tokens=config.grammar.draft_tokens, exact_prefill=exact, chunk_context_tokens=context)

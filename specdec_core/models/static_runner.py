"""The static step: our own pass through a Llama-family decoder over a `StaticCache`, compiled where asked.

transformers' forward re-derives masks and positions, grows a cache by concatenation and crosses Python
for every layer; on a GPU at batch 1 that overhead, not memory, sets the step's time. This pass takes
the model's own modules (norms, projections, MLPs, rotary embedding, output layer) and does the rest
itself: rotary positions from each row's length and its tree depths, keys and values written in place
at each row's next slots, attention over the committed slots and the pass's tree (SDPA reads the slots
up to the longest row's end; CUDA graphs, the whole capacity). Its shapes are set by the batch, the pass length and the capacity alone, so
`torch.compile` (inductor on CPU; CUDA graphs on GPUs, over passes padded to `PASS_LENGTHS`) traces it
a few times, not once per token. Passes longer than the compiled ones run it uncompiled, as do the prefills
of a row-invariant runner (SDPA's; its decode and verify passes take the kernel).

The attention is our row-invariant kernel where the runner's passes are row-invariant (attention.py),
else SDPA; both are ops torch.compile sees through (custom ops), as are the quantized layers (vnni.py).
On the CPU, uncompiled, each residual add with the norm after it, and the rotary embedding with the cache
write, are one fused op each, and a layer whose projections are all on our kernel runs as two calls around
its attention (step_ops.py), with the modules' numbers.
"""

from __future__ import annotations

import functools
import logging
import time

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from . import step_ops, vnni
from .attention import attend_rows, row_slots
from .quant import fused_projections
from .runner import ModelRunner, additive_mask
from .static_cache import StaticCache, blocks

log = logging.getLogger("specdec")

FAMILIES = ("llama", "qwen2")  # decoders whose layers this pass runs: pre-norm attention then a gated MLP
STEPS = ("eager", "static", "compiled")
# Pass lengths a compiled step is padded to on CUDA (one CUDA graph each): decode, then verify passes.
PASS_LENGTHS = (1, 2, 4, 8, 16, 32, 64)
# Longer passes (prefill chunks) are padded to a multiple of this many tokens: on AMX, oneDNN's matmul and SDPA
# took a 125-token chunk 14% longer than a 128-token one (docs/benchmarks/NOTES.md, the prefix cache).
PREFILL_ROWS = 16


class UnsupportedModel(ValueError):
    """A model the static step cannot run (not a Llama-family decoder)."""


def decoder_pass(
    model: PreTrainedModel, projections: list[tuple[nn.Module | None, nn.Module | None]], input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
    keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor | None, attended: torch.Tensor | None,
    offsets: torch.Tensor | None, hidden_states: bool, logits_at: int | None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """One pass of `input_ids` [B, k] at rotary `positions` [B, k], their keys and values written at `slots`
    [B, k] of each layer's `keys` and `values` [B, Hkv, S, d]. They attend the slots `mask` [B, 1, k, W]
    (additive, over the first W slots) allows, or, when `attended` and `offsets` are given
    (attention.RowSlots), those slots row by row on the row-invariant kernel. `projections` holds each layer's
    fused q/k/v and gate/up layers (quant.fused_projections), or None for its own separate ones. Each layer runs
    as two halves around its attention: the extension's KernelLayers where the pass can take them
    (step_ops.takes_kernel_layers), else ModuleLayers, with the same numbers. Returns float32 logits (at the
    pass's token `logits_at` alone, where given: -1 the last), and,
    with `hidden_states`, transformers' hidden states (each layer's input, then the final-normed output)."""
    decoder = model.get_decoder()
    batch, k = input_ids.shape
    hidden = decoder.embed_tokens(input_ids)
    cos, sin = decoder.rotary_emb(hidden, positions)
    ops = step_ops.for_pass(hidden)
    kept = bool(projections) and getattr(projections[0][0], "keeps_dequantized", False)
    kernel = step_ops.kernel_layers(model) if step_ops.takes_kernel_layers(hidden, kept) else None
    layers = kernel or [ModuleLayer(layer, qkv, gate_up, ops) for layer, (qkv, gate_up) in zip(decoder.layers, projections)]
    tiles = kernel is not None and batch * k >= vnni.AMX_MIN_ROWS and vnni.amx()  # as vnni.mm chooses
    scaling = decoder.layers[0].self_attn.scaling
    states = []
    delta = None  # the last layer's MLP output, added to hidden with the next norm
    for layer, layer_keys, layer_values in zip(layers, keys, values):
        hidden, query = layer.attention_in(hidden, delta, cos, sin, layer_keys, layer_values, slots, tiles)
        states.append(hidden)
        if attended is None:
            window = mask.shape[-1]  # the slots SDPA reads: the mask's, a prefix of the capacity
            out = F.scaled_dot_product_attention(
                query, layer_keys[:, :, :window], layer_values[:, :, :window], attn_mask=mask, scale=scaling, enable_gqa=True,
            ).transpose(1, 2)
        else:
            out = attend_rows(query, layer_keys, layer_values, attended, offsets, scaling)
        hidden, delta = layer.mlp(hidden, out, tiles)
    _, hidden = _residual_norm(ops, hidden, delta, decoder.norm)
    logits = model.get_output_embeddings()(hidden if logits_at is None else hidden[:, logits_at:][:, :1]).float()
    return logits, (*states, hidden) if hidden_states else None


class ModuleLayer:
    """A decoder layer's two halves around its attention (as step_ops.h's KernelLayer has them) on the layer's
    own modules: its fused q/k/v and gate/up projections where given, and the fused ops `ops` where given."""

    def __init__(self, layer: nn.Module, qkv: nn.Module | None, gate_up: nn.Module | None, ops):
        self.layer, self.qkv, self.gate_up, self.ops = layer, qkv, gate_up, ops

    def attention_in(self, hidden: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                     keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, tiles: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden + delta, the rotated queries [B, heads, k, D]); k and v written to `keys` and `values` at `slots`."""
        attention = self.layer.self_attn
        hidden, x = _residual_norm(self.ops, hidden, delta, self.layer.input_layernorm)
        shape = (*hidden.shape[:2], -1, attention.head_dim)
        if self.qkv is None:
            query, key, value = attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)
        else:
            query, key, value = self.qkv(x).split(
                [attention.q_proj.out_features, attention.k_proj.out_features, attention.v_proj.out_features], dim=-1)
        if self.ops is not None:
            return hidden, self.ops.rotate_and_cache(query, key, value, cos, sin, keys, values, slots)
        query, key = apply_rotary_pos_emb(query.view(shape).transpose(1, 2), key.view(shape).transpose(1, 2), cos, sin)
        rows = torch.arange(hidden.shape[0], device=hidden.device)[:, None]
        keys[rows, :, slots] = key.transpose(1, 2)
        values[rows, :, slots] = value.view(shape)
        return hidden, query

    def mlp(self, hidden: torch.Tensor, attended: torch.Tensor, tiles: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden + o_proj(attended), the MLP's output) from the attention's output `attended` [B, k, heads, D]."""
        batch, k = hidden.shape[:2]
        o = self.layer.self_attn.o_proj(attended.reshape(batch, k, -1))
        hidden, x = _residual_norm(self.ops, hidden, o, self.layer.post_attention_layernorm)
        mlp = self.layer.mlp
        if self.gate_up is None:
            return hidden, mlp(x)
        gate, up = self.gate_up(x).split([mlp.gate_proj.out_features, mlp.up_proj.out_features], dim=-1)
        return hidden, mlp.down_proj(mlp.act_fn(gate) * up)


def _residual_norm(ops, hidden: torch.Tensor, delta: torch.Tensor | None, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden + delta, norm(hidden + delta)), or (hidden, norm(hidden)) without a delta: on the fused op where
    `ops` (step_ops.for_pass) has it, else the module's own, with the same numbers."""
    if ops is None:
        hidden = hidden if delta is None else hidden + delta
        return hidden, norm(hidden)
    return ops.add_rms_norm(hidden, delta, norm.weight, norm.variance_epsilon)


class StaticRunner(ModelRunner):
    """A `ModelRunner` whose passes are `decoder_pass` over a `StaticCache`; `compiled` compiles the passes
    of up to max(PASS_LENGTHS) tokens; `pad` pads those to PASS_LENGTHS (default: when compiled for CUDA)."""

    def __init__(self, model: PreTrainedModel, tokenizer, name: str = "model", compiled: bool = False, pad: bool | None = None):
        if model.config.model_type not in FAMILIES:
            raise UnsupportedModel(f"model.step static/compiled runs {', '.join(FAMILIES)} decoders, not "
                                   f"{model.config.model_type}; use model.step: eager")
        if set(getattr(model.config, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
            raise UnsupportedModel("model.step static/compiled attends every layer fully: this model has sliding-window "
                                   "layers; use model.step: eager")
        super().__init__(model, tokenizer, name)
        self.compiled = compiled
        self.padded = compiled and self.device.type == "cuda" if pad is None else pad  # CUDA graphs want few shapes
        self._pass = functools.partial(decoder_pass, model, fused_projections(model))
        if compiled:
            # Dynamic shapes: one graph for every batch, pass length and capacity (past 0/1 specializations).
            # CUDA graphs replay fixed shapes, so there the passes are padded and each shape is recorded once.
            # emulate_precision_casts: inductor rounds to bf16 where eager does, not once per fused chain; without
            # it the tiny model's text differs from the eager step's (tests/test_invisible.py). On real weights a
            # difference remains (docs/benchmarks/NOTES.md, "The step"): static is the exact step.
            # triton.cudagraphs is mode="reduce-overhead", which torch.compile takes only without options.
            options = {"emulate_precision_casts": True, "triton.cudagraphs": self.device.type == "cuda"}
            self._compiled_pass = torch.compile(self._pass, dynamic=True, options=options)

    def new_cache(self) -> StaticCache:
        return StaticCache.empty(self.num_layers, self.config.num_key_value_heads, self.head_dim, self.dtype, self.device)

    @torch.no_grad()
    def forward(
        self,
        cache: StaticCache,
        input_ids: torch.Tensor,
        tree_mask: torch.Tensor | None = None,
        depths: torch.Tensor | None = None,
        hidden_states: bool = False,
        commit: bool = False,
        last_logits_only: bool = False,
        row_invariant: bool = False,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """ModelRunner.forward's contract, over a StaticCache."""
        batch, k = input_ids.shape
        tree_mask, depths = self._pass_layout(cache, input_ids, tree_mask, depths)
        device = self.device
        short = k <= PASS_LENGTHS[-1]
        if short:
            width = next(n for n in PASS_LENGTHS if n >= k) if self.padded else k
        else:
            width = k if row_invariant else blocks(k, PREFILL_ROWS)
        input_ids, tree_mask, depths = _padded(input_ids.to(device), tree_mask, depths, width)
        window = (int(cache.lengths.max()) if cache.batch_size else 0) + width
        cache.reserve(batch, window)
        cache.make_readable(cache.capacity if self.padded else window)  # the slots SDPA reads, as the mask below
        allowed = cache.attend_mask(tree_mask)
        mask = attended = offsets = None
        if row_invariant:
            rows = row_slots(allowed)
            attended, offsets = rows.slots, rows.offsets
        else:
            # SDPA reads the slots up to the longest row's new tokens, no further: a one-row prefill then sees
            # the eager step's very tensors, and computes its numbers. CUDA graphs want the fixed capacity.
            allowed = allowed if self.padded else allowed[:, :, :window]
            mask = additive_mask(allowed, self.dtype)[:, None]
        # A row-invariant runner compiles its row-invariant passes (decode, verify) only: its prefills take SDPA,
        # uncompiled, and cost no graphs of their own.
        compiled = self.compiled and short and row_invariant == self.row_invariant
        run = self._compiled_pass if compiled else self._pass
        # A compiled graph takes a fixed index (-1), not one per pass length: there padding takes all the logits.
        logits_at = None if not last_logits_only else -1 if width == k else None if compiled else k - 1
        if compiled:
            for tensor in (*cache.keys, *cache.values):
                # The head count and size are the model's: were they dynamic, dynamo would tie the pass length to
                # whichever equals it (k = 2 kv heads) and compile one more graph (a minute on an H200's host).
                # A cache's rows are a view of a buffer of more rows (StaticCache), whose sizes dynamo sees too.
                for shaped in (tensor, tensor._base) if tensor._base is not None else (tensor,):
                    torch._dynamo.mark_static(shaped, 1)
                    torch._dynamo.mark_static(shaped, 3)
                if device.type == "cuda":
                    # The pass writes the cache in place: CUDA graphs replay such writes only into static addresses.
                    torch._dynamo.mark_static_address(tensor)
        with vnni.row_invariant(row_invariant):
            logits, hidden = run(
                input_ids, cache.lengths[:, None] + depths, cache.write_slots(width), cache.keys, cache.values,
                mask, attended, offsets, hidden_states, logits_at,
            )
        cache.pending = k
        if commit:
            cache.commit(torch.ones(batch, k, dtype=torch.bool, device=device))
        if width != k:
            if logits_at is None:
                logits = logits[:, k - 1 : k] if last_logits_only else logits[:, :k]
            hidden = tuple(h[:, :k] for h in hidden) if hidden else hidden
        return logits, hidden

    def warm_up(self, batch_sizes: tuple[int, ...] = (1, 2)) -> None:
        """Compile the passes serving takes (and on CUDA record their graphs) before a request waits for it: a
        short prefill, then one-token and several-token passes, at each of `batch_sizes` (with dynamic shapes,
        batch 1 and 2 cover every batch and pass length; padded, every one of PASS_LENGTHS)."""
        start = time.perf_counter()
        log.info("model.step compiled: compiling %s's passes (once per process)", self.name)
        for batch in batch_sizes:
            cache = self.new_cache()
            self.forward(cache, torch.zeros(batch, 2, dtype=torch.long, device=self.device), commit=True)
            for k in PASS_LENGTHS if self.padded else (1, 2):
                self.forward(cache, torch.zeros(batch, k, dtype=torch.long, device=self.device), row_invariant=self.row_invariant)
                cache.commit(torch.zeros(batch, k, dtype=torch.bool, device=self.device))
        log.info("model.step compiled: %s compiled in %.0f s", self.name, time.perf_counter() - start)

    def forward_layers(self, cache: StaticCache, input_ids: torch.Tensor, num_layers: int) -> torch.Tensor:
        raise UnsupportedModel("layer-skip drafts in the eager step's slot cache; set model.step: eager")


def _padded(
    input_ids: torch.Tensor, tree_mask: torch.Tensor, depths: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pass padded to `width` tokens: padding attends itself only and sits past the real tokens, so no
    real token sees it and `commit` never keeps it."""
    batch, k = input_ids.shape
    if width == k:
        return input_ids, tree_mask.to(input_ids.device), depths.to(input_ids.device)
    pad = width - k
    device = input_ids.device
    ids = torch.cat([input_ids, input_ids.new_zeros(batch, pad)], dim=1)
    mask = torch.zeros(batch, width, width, dtype=torch.bool, device=device)
    mask[:, :k, :k] = tree_mask
    mask[:, range(k, width), range(k, width)] = True
    padding_depths = torch.arange(k, width, device=device).expand(batch, pad)
    return ids, mask, torch.cat([depths.to(device), padding_depths], dim=1)


def on_step(runner: ModelRunner, step: str, warm_batch_sizes: tuple[int, ...] = (1, 2)) -> ModelRunner:
    """`runner`'s model on the step `step` (STEPS), sharing its weights; a compiled one is warmed up at
    `warm_batch_sizes`."""
    if step not in STEPS:
        raise ValueError(f"model.step {step!r} is not one of {STEPS}")
    already_static = isinstance(runner, StaticRunner)
    compiled = step == "compiled"
    if step == "eager":
        return ModelRunner.of(runner) if already_static else runner
    if already_static and runner.compiled == compiled:
        return runner
    static = StaticRunner.of(runner, compiled=compiled)
    if compiled:
        static.warm_up(warm_batch_sizes)
    return static

"""The model runner: forward passes over new tokens against a batched KV cache
that can be rolled back.

One `BatchCache` holds the keys and values of every row of a batch in shared
slots. Each row owns a boolean slot mask: a row attends only to its own valid
slots, so rows of different lengths share one tensor without padding logic,
rejected draft slots are simply marked invalid, and a token tree is one more
4D mask (see "Ideas" in DESIGN.md). Rotary positions come from each row's own
count of valid tokens, so a slot's place in the tensor never matters.

This wraps transformers' own model classes; it does not fork them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    PreTrainedModel,
)

from . import vnni
from .attention import IMPLEMENTATION, row_slots

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """`auto` is CUDA when present, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_model(path: str, dtype: str = "bf16", device: str = "auto") -> tuple[PreTrainedModel, object]:
    """Load a causal LM and its tokenizer from a local directory (or a hub id)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation=IMPLEMENTATION)
    model.to(resolve_device(device)).eval()
    return model, tokenizer


def set_threads(threads: int | None) -> None:
    """CPU intra-op threads; None keeps torch's default (all cores)."""
    if threads:
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`allowed` (bool, query attends key) as the additive mask attention takes: 0 where allowed, else dtype's min."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def _layers(kv: DynamicCache):
    return [layer for layer in kv.layers if layer.is_initialized]


class _EmptyRows:
    """Zero keys and values shaped like `layer`, for rows that hold no token yet."""

    def __init__(self, layer, rows: int):
        shape = (rows, *layer.keys.shape[1:])
        self.keys = layer.keys.new_zeros(shape)
        self.values = layer.values.new_zeros(shape)


def select_features(hidden: tuple[torch.Tensor, ...], layers: tuple[int, ...]) -> torch.Tensor:
    """A pass's hidden states (each layer's input [B, k, H], then the final-normed output) at indices `layers`,
    concatenated [B, k, len(layers) H]: what a feature drafter reads."""
    return hidden[layers[0]] if len(layers) == 1 else torch.cat([hidden[i] for i in layers], dim=-1)


@dataclass
class BatchCache:
    """KV cache of a batch: shared slots, a per-row mask of valid slots, and the bookkeeping that keeps
    them (join rows, remove rows, commit a pass, roll back); a draft network's cache follows the very
    rules of the target's."""

    kv: DynamicCache
    valid: torch.Tensor  # [B, S] bool: slot s holds a token of row b
    lengths: torch.Tensor  # [B] long: valid tokens per row = next rotary position

    @classmethod
    def empty(cls, device: torch.device) -> BatchCache:
        return cls(
            kv=DynamicCache(),
            valid=torch.zeros(0, 0, dtype=torch.bool, device=device),
            lengths=torch.zeros(0, dtype=torch.long, device=device),
        )

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    @property
    def slots(self) -> int:
        return self.valid.shape[1]

    @property
    def device(self) -> torch.device:
        return self.valid.device

    def reserve(self, rows: int, slots: int, rows_before: int = 0) -> None:
        """An empty cache takes `rows` rows (a pass's batch); slots are added by the passes themselves. Joins
        concatenate (`append`), so `rows_before` (StaticCache's room for a batch to join into) has no use here."""
        if self.batch_size == 0 and rows:
            self.valid = torch.zeros(rows, 0, dtype=torch.bool, device=self.device)
            self.lengths = torch.zeros(rows, dtype=torch.long, device=self.device)

    def append(self, rows: BatchCache) -> None:
        """Join the rows of `rows` (e.g. a fresh prefill) to this cache, padding slots."""
        if self.batch_size == 0:
            self.kv, self.valid, self.lengths = rows.kv, rows.valid, rows.lengths
            return
        slots = max(self.slots, rows.slots)
        self._pad_slots(slots)
        rows._pad_slots(slots)
        mine, theirs = _layers(self.kv), _layers(rows.kv)
        if mine or theirs:
            # A side that never ran a forward (one-token prompts) has no tensors yet: give it empty slots.
            template = mine or theirs
            old = mine or [_EmptyRows(layer, self.batch_size) for layer in template]
            new = theirs or [_EmptyRows(layer, rows.batch_size) for layer in template]
            if not mine:
                self.kv = rows.kv
            for target, a, b in zip(_layers(self.kv), old, new):
                target.keys, target.values = torch.cat([a.keys, b.keys]), torch.cat([a.values, b.values])
        self.valid = torch.cat([self.valid, rows.valid], dim=0)
        self.lengths = torch.cat([self.lengths, rows.lengths], dim=0)

    def _pad_slots(self, slots: int) -> None:
        extra = slots - self.slots
        if extra <= 0:
            return
        for layer in _layers(self.kv):
            pad = layer.keys.new_zeros(*layer.keys.shape[:2], extra, layer.keys.shape[3])
            layer.keys = torch.cat([layer.keys, pad], dim=2)
            layer.values = torch.cat([layer.values, pad.clone()], dim=2)
        self.valid = torch.cat([self.valid, self.valid.new_zeros(self.batch_size, extra)], dim=1)

    def keep_rows(self, keep: list[int]) -> None:
        """Keep only the rows at indices `keep`, in that order."""
        if not keep:
            self.kv, self.valid, self.lengths = DynamicCache(), self.valid[:0, :0], self.lengths[:0]
            return
        index = torch.tensor(keep, device=self.device)
        for layer in _layers(self.kv):
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)
        self.valid = self.valid.index_select(0, index)
        self.lengths = self.lengths.index_select(0, index)
        self.compact(min_waste=0.0)

    def drop_last(self, counts: list[int]) -> None:
        """Invalidate the last counts[i] slots of row i (tokens a drafter appended and the target refused)."""
        for row, count in enumerate(counts):
            if count:
                if not self.valid[row, self.slots - count :].all():
                    raise RuntimeError(f"drop_last: the last {count} slots of row {row} are not all valid")
                self.valid[row, self.slots - count :] = False
        self.lengths = self.lengths - torch.tensor(counts, device=self.device)

    def compact(self, min_waste: float = 0.25) -> None:
        """Drop slots no row uses once they are more than `min_waste` of all slots."""
        if self.slots == 0:
            return
        used = self.valid.any(dim=0)
        if used.all() or (1 - used.float().mean().item()) < min_waste:
            return
        index = used.nonzero().squeeze(1)
        for layer in _layers(self.kv):
            layer.keys = layer.keys.index_select(2, index)
            layer.values = layer.values.index_select(2, index)
        self.valid = self.valid.index_select(1, index)

    def commit(self, keep: torch.Tensor) -> None:
        """Settle the slots of the last forward: `keep` [B, k] says which stay valid.

        This is the rollback: a rejected draft token's slot becomes invalid and
        its row's position count does not advance past it.
        """
        k = keep.shape[1]
        self.valid[:, self.slots - k :] = keep
        self.lengths = self.lengths + keep.sum(dim=1)
        self.compact()

    def read_span(self, start: int, end: int, row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s keys and values at positions start..end-1 (its valid slots, in order: a decoded row's
        refused drafts leave holes), every layer: [L, Hkv, end - start, d] each, copies."""
        slots = self.valid[row].nonzero().squeeze(1)[start:end]
        layers = _layers(self.kv)
        return torch.stack([la.keys[row, :, slots] for la in layers]), torch.stack([la.values[row, :, slots] for la in layers])

    def write_span(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append keys and values [L, Hkv, n, d] (`read_span`'s) to a one-row cache, as a pass over them would."""
        self.reserve(1, 0)
        for layer, (k, v) in enumerate(zip(keys, values)):
            self.kv.update(k[None], v[None], layer)
        n = keys.shape[2]
        self.valid = torch.cat([self.valid, torch.ones(1, n, dtype=torch.bool, device=self.device)], dim=1)
        self.lengths = self.lengths + n

    def drop_pending(self) -> None:
        """Cut every layer back to the cache's slots, undoing what a pass of some layers appended (a view: no copy)."""
        for layer in _layers(self.kv):
            layer.keys, layer.values = layer.keys[:, :, : self.slots], layer.values[:, :, : self.slots]


class ModelRunner:
    """Forward passes of one causal LM over a `BatchCache`."""

    def __init__(self, model: PreTrainedModel, tokenizer, name: str = "model"):
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.config = model.config
        self.vocab_size = model.get_output_embeddings().out_features
        self.num_layers = model.config.num_hidden_layers
        # Whether passes can be row-invariant: every linear layer a quantized CPU kernel and the attention
        # kernel built (loading.py sets it).
        self.row_invariant = False

    @property
    def head_dim(self) -> int:
        return getattr(self.config, "head_dim", None) or self.config.hidden_size // self.config.num_attention_heads

    def projection_to_attention_macs(self) -> float:
        """A token's multiply-adds in the decoder's projections (q, k, v, o and a gated MLP) over those its attention
        does for each position it attends (its score and its share of the weighted sum): the context at which
        the two are equal."""
        c, q, kv = self.config, self.config.num_attention_heads * self.head_dim, self.config.num_key_value_heads * self.head_dim
        return (c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size) / (2 * q)

    def token_bytes(self, features: int) -> int:
        """Bytes one position's keys and values take in every layer, plus `features` of its hidden states."""
        size = torch.finfo(self.dtype).bits // 8
        return size * (2 * self.num_layers * self.config.num_key_value_heads * self.head_dim + features * self.config.hidden_size)

    @classmethod
    def of(cls, runner: ModelRunner, **options) -> ModelRunner:
        """`runner`'s model, tokenizer and row invariance, on this class's passes (`options`: its own)."""
        made = cls(runner.model, runner.tokenizer, runner.name, **options)
        made.row_invariant = runner.row_invariant
        return made

    def new_cache(self) -> BatchCache:
        """An empty cache of the kind this runner's passes take."""
        return BatchCache.empty(self.device)

    # -- forward -----------------------------------------------------------

    @torch.no_grad()
    def forward(
        self,
        cache: BatchCache,
        input_ids: torch.Tensor,
        tree_mask: torch.Tensor | None = None,
        depths: torch.Tensor | None = None,
        hidden_states: bool = False,
        commit: bool = False,
        last_logits_only: bool = False,
        row_invariant: bool = False,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """Run `input_ids` [B, k] against the cache; return logits [B, k, V] (float32).

        tree_mask [B, k, k] (bool, query attends key) defaults to causal; depths
        [B, k] are the new tokens' offsets from each row's length (default
        0..k-1). The new slots are written as pending: call `commit` with the
        slots to keep, or pass commit=True to keep them all. With
        hidden_states=True also returns every layer's hidden states
        (embeddings first, as transformers does). last_logits_only skips the
        output layer for all but the last position (a long prefill's logits
        would cost vocab x length floats).
        """
        batch, k = input_ids.shape
        tree_mask, depths = self._pass_layout(cache, input_ids, tree_mask, depths)
        cache.reserve(batch, 0)
        allowed = torch.cat([cache.valid[:, None, :].expand(batch, k, cache.slots), tree_mask], dim=2)
        with vnni.row_invariant(row_invariant):
            out = self.model(
                input_ids=input_ids.to(self.device),
                attention_mask=additive_mask(allowed, self.dtype)[:, None],
                position_ids=cache.lengths[:, None] + depths,
                cache=cache.kv,
                use_cache=True,
                output_hidden_states=hidden_states,
                logits_to_keep=1 if last_logits_only else 0,
                row_slots=row_slots(allowed) if row_invariant else None,
            )
        cache.valid = torch.cat([cache.valid, torch.zeros(batch, k, dtype=torch.bool, device=self.device)], dim=1)
        if commit:
            cache.commit(torch.ones(batch, k, dtype=torch.bool, device=self.device))
        return out.logits.float(), (out.hidden_states if hidden_states else None)

    def _pass_layout(
        self, cache, input_ids: torch.Tensor, tree_mask: torch.Tensor | None, depths: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A pass's tree mask and depths (default: causal, 0..k-1), once its batch is known to fit the cache's."""
        batch, k = input_ids.shape
        if batch != cache.batch_size and cache.batch_size != 0:
            raise ValueError(f"batch of {batch} rows against a cache of {cache.batch_size}")
        if tree_mask is None:
            tree_mask = torch.ones(k, k, dtype=torch.bool, device=self.device).tril().expand(batch, k, k)
        if depths is None:
            depths = torch.arange(k, device=self.device).expand(batch, k)
        return tree_mask, depths

    @torch.no_grad()
    def forward_layers(self, cache: BatchCache, input_ids: torch.Tensor, num_layers: int) -> torch.Tensor:
        """Final-normed hidden states [B, k, H] of `input_ids` [B, k] through only the first `num_layers` layers.

        For self-speculation (drafters/layer_skip.py). The new tokens attend each
        row's valid slots, then the slots earlier calls appended since the last
        `cache.drop_pending()`, then each other causally. Their keys and values go into
        the first `num_layers` layers only and never into `cache.valid`, so they
        are pending: call `cache.drop_pending()` before the next full forward.
        Llama-style decoders only (Llama, Qwen2): one full-attention mask for every layer.
        """
        decoder = self.model.get_decoder()
        batch, k = input_ids.shape
        layers = _layers(cache.kv)
        pending = layers[0].keys.shape[2] - cache.slots if layers else 0
        allowed = torch.cat(
            [
                cache.valid[:, None, :].expand(batch, k, cache.slots),
                torch.ones(batch, k, pending, dtype=torch.bool, device=self.device),
                torch.ones(k, k, dtype=torch.bool, device=self.device).tril().expand(batch, k, k),
            ],
            dim=2,
        )
        mask = additive_mask(allowed, self.dtype)
        position_ids = cache.lengths[:, None] + pending + torch.arange(k, device=self.device)
        hidden = decoder.embed_tokens(input_ids.to(self.device))
        rotary = decoder.rotary_emb(hidden, position_ids)
        for layer in decoder.layers[:num_layers]:
            hidden = layer(
                hidden, attention_mask=mask[:, None], position_ids=position_ids, cache=cache.kv,
                use_cache=True, position_embeddings=rotary,
            )
        return decoder.norm(hidden)

    def prefill(
        self, token_ids: list[int], all_logits: bool = False, features: tuple[int, ...] = (), row_invariant: bool = False
    ) -> tuple[BatchCache, torch.Tensor, torch.Tensor | None]:
        """A one-row cache holding `token_ids`; their logits ([len, V] with all_logits, else the last [1, V]);
        with `features`, those of their hidden states (`select_features`) [len, F], else None; `row_invariant`:
        computed as decoding computes them (an engine's exact prefill)."""
        cache = self.new_cache()
        if not token_ids:
            cache.reserve(1, 0)
            width = len(features) * self.config.hidden_size
            hidden = torch.zeros(0, width, dtype=self.dtype, device=self.device) if features else None
            return cache, torch.zeros(0, self.vocab_size, device=self.device), hidden
        ids = torch.tensor([token_ids], device=self.device)
        logits, hidden = self.forward(cache, ids, commit=True, last_logits_only=not all_logits,
                                      hidden_states=bool(features), row_invariant=row_invariant)
        return cache, logits[0], select_features(hidden, features)[0] if features else None

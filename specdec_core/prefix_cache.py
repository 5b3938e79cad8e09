"""The prefix cache: the target's keys and values of prompts already prefilled, kept by their tokens so that
a conversation's next turn, an agent's next step or a shared system prompt is not prefilled again.

Blocks of `block_tokens` tokens, counted from position 0, keyed by a hash chain as vLLM's automatic prefix
caching keys its blocks: a block's key hashes its parent's key and its own tokens, and the first block's parent
is the namespace, so equal keys mean equal prefixes within one namespace (an API key and a request's
`cache_salt`). Hashed blocks rather than a radix tree: a lookup is one dictionary probe per block, and eviction
needs no tree surgery.

A block must hold exactly the numbers a cold prefill computes for its positions, so that a request's text is
the same with the cache on or off, bit for bit. How it does depends on the prefill (Engine's `exact_prefill`):
- Where every prefill pass computes each row as decoding does (`prefill.exact`, the default, wherever the target's
  linear layers are on our kernel: the kernel and the row-invariant attention), a position's keys and values are
  the same whichever pass wrote them: blocks are small (`prefill.cache_block_tokens`), and a finished sequence's
  answer enters the cache too (`Engine.keep_decoded`), so that a conversation's next turn does not prefill the
  last answer again.
- Elsewhere (`prefill.exact: false`, or a target off our kernel) a prefill's numbers depend on its pass (the bf16
  product and SDPA), so blocks are whole prefill chunks (`prefill.chunk_tokens`, a prompt always prefilled in
  chunks at the same boundaries), computed by prefill only: keys and values a decode or verify pass wrote never
  enter the cache, nor does a chunk's partial tail.

A drafter with a cache of its own (a draft model) keeps its keys and values of a block with the block
(`OwnPrefix`, `attach_own`), so that a conversation's next turn does not prefill its history on the draft
model either. These need not be a cold prefill's numbers: a draft changes how fast the text comes, never the
text (the acceptance rule), so the draft model prefills what is new in chunk-sized passes, as it does uncached.

A hit copies its blocks into the row's own cache (a 2,000-token prefix of the 1.5B target is 57 MB, a few
ms), so the attention keeps one contiguous cache per row, and a running row never depends on a block:
eviction is least recently used over all blocks, the deepest first.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

log = logging.getLogger("specdec")


KeysValues = tuple[torch.Tensor, torch.Tensor]  # keys and values [L, Hkv, block, d] of every layer


@dataclass
class Block:
    """One block of a prefix: its keys and values [L, Hkv, block, d], for drafters that read the target's
    features its final-normed hidden states [block, H], and for drafters with a cache of their own (a draft
    model) their keys and values of the block, once one has computed them."""

    keys: torch.Tensor
    values: torch.Tensor
    hidden: torch.Tensor | None
    own: KeysValues | None = None

    @property
    def nbytes(self) -> int:
        return _nbytes(self.keys, self.values, self.hidden, *(self.own or ()))


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.nelement() * t.element_size() for t in tensors if t is not None)


@dataclass
class OwnPrefix:
    """What a drafter with a cache of its own gets of a prompt and gives back: its keys and values of the prompt's
    first whole blocks from the cache (`cached`, in order), and those of later whole blocks (`computed`, by block
    index, up to `blocks`) once it has prefilled them, for the cache to keep."""

    block_tokens: int
    blocks: int
    cached: list[KeysValues]
    computed: dict[int, KeysValues] = field(default_factory=dict)


@dataclass
class CacheCounts:
    """What the cache did since it started: the Prometheus counters read these."""

    hit_tokens: int = 0  # prompt tokens taken from the cache
    miss_tokens: int = 0  # prompt tokens prefilled
    evicted_blocks: int = 0


class PrefixCache:
    """Blocks of `block_tokens` tokens under a budget of `budget_bytes`, least recently used first out."""

    def __init__(self, block_tokens: int, budget_bytes: int, block_bytes: int):
        if budget_bytes < block_bytes:
            raise ValueError(f"prefill.cache_bytes {budget_bytes} holds no block: one block of {block_tokens} tokens "
                             f"takes {block_bytes} bytes for this target; set at least that, or prefill.cache: false")
        self.block_tokens = block_tokens
        self.budget_bytes = budget_bytes
        self.block_bytes = block_bytes
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first
        self.bytes = 0
        self.counts = CacheCounts()
        self._warned_too_large = False

    def keys(self, tokens: list[int], namespace: str) -> list[bytes]:
        """The chain of keys of `tokens`' whole blocks."""
        keys, parent = [], hashlib.sha256(namespace.encode()).digest()
        for start in range(0, len(tokens) - self.block_tokens + 1, self.block_tokens):
            block = torch.tensor(tokens[start : start + self.block_tokens], dtype=torch.int64).numpy().tobytes()
            parent = hashlib.sha256(parent + block).digest()
            keys.append(parent)
        return keys

    def lookup(self, keys: list[bytes]) -> list[Block]:
        """The cached blocks of the longest cached prefix of `keys`, in order; they become the most recently used,
        the first block last, so that a prefix's deepest blocks leave before its shared root."""
        found = []
        for key in keys:
            block = self.blocks.get(key)
            if block is None:
                break
            found.append(block)
        self._touch(keys[: len(found)])
        return found

    def _touch(self, chain: list[bytes]) -> None:
        """A prefix's blocks become the most recently used, its first block last: its root leaves after its leaves."""
        for key in reversed(chain):
            self.blocks.move_to_end(key)

    def snapshot(self) -> tuple[OrderedDict[bytes, Block], int]:
        """The blocks held now (shared, not copied), for `restore`."""
        return OrderedDict(self.blocks), self.bytes

    def restore(self, snapshot: tuple[OrderedDict[bytes, Block], int]) -> None:
        """Hold again just the blocks a `snapshot` held (the bench replays a request as if for the first time)."""
        blocks, _ = snapshot
        self.blocks = OrderedDict(blocks)
        self.bytes = sum(block.nbytes for block in self.blocks.values())  # a drafter's own part may have come since

    def clear(self) -> None:
        """Every block dropped, as in a server just started (the counts go on)."""
        self.blocks.clear()
        self.bytes = 0

    def insert(self, key: bytes, block: Block) -> None:
        """Keep `block` under `key`, evicting the least recently used blocks to stay within the budget."""
        if key in self.blocks:
            self.blocks.move_to_end(key)
            return
        self._evict_for(block.nbytes)
        self.blocks[key] = block
        self.bytes += block.nbytes

    def insert_chain(self, keys: list[bytes], block_at: Callable[[int], Block]) -> None:
        """Keep a prefix's blocks, `keys` in order: those not held yet from `block_at(index)`, then ordered as a
        lookup leaves them."""
        for index, key in enumerate(keys):
            if key not in self.blocks:
                self.insert(key, block_at(index))
        self._touch([key for key in keys if key in self.blocks])

    def attach_own(self, key: bytes, own: KeysValues) -> None:
        """Keep a drafter's own keys and values of a block with it, where the cache still holds the block."""
        block = self.blocks.get(key)
        added = _nbytes(*own)
        if block is None or block.own is not None or block.nbytes + added > self.budget_bytes:
            return
        self.blocks.pop(key)  # out of reach of its own eviction while room is made
        self.bytes -= block.nbytes
        self._evict_for(block.nbytes + added)
        block.own = own
        self.blocks[key] = block
        self.bytes += block.nbytes

    def _evict_for(self, nbytes: int) -> None:
        """Evict the least recently used blocks until `nbytes` more fit in the budget."""
        while self.blocks and self.bytes + nbytes > self.budget_bytes:
            _, old = self.blocks.popitem(last=False)
            self.bytes -= old.nbytes
            self.counts.evicted_blocks += 1

    def fits(self, tokens: int, request_id: str) -> bool:
        """Whether a prompt of `tokens` tokens can be cached whole; the log says once when one cannot."""
        need = tokens // self.block_tokens * self.block_bytes
        if need <= self.budget_bytes:
            return True
        if not self._warned_too_large:
            log.warning("prefix cache: %s's prompt of %d tokens needs %d bytes, more than prefill.cache_bytes %d: it "
                        "is decoded uncached (logged once)", request_id, tokens, need, self.budget_bytes)
            self._warned_too_large = True
        return False

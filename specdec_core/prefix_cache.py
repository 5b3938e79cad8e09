"""The prefix cache: the target's keys and values of prompts already prefilled, kept by their tokens so that
a conversation's next turn, an agent's next step or a shared system prompt is not prefilled again.

Blocks are whole prefill chunks (`prefill.chunk_tokens` tokens, the chunk boundaries counted from position
0), keyed by a hash chain as vLLM's automatic prefix caching keys its blocks: a block's key hashes its
parent's key and its own tokens, and the first block's parent is the namespace, so equal keys mean equal
prefixes within one namespace (an API key and a request's `cache_salt`). Hashed blocks rather than a radix
tree: a lookup is one dictionary probe per block, and eviction needs no tree surgery.

Why whole chunks, computed by prefill only: a prompt is always prefilled in chunks at the same boundaries,
so a block holds exactly the numbers a cold prefill of that prompt computes for those positions, and a
request's text is the same with the cache on or off, bit for bit. Keys and values a decode or verify pass
wrote are computed another way (our int8 kernel and the row-invariant attention, one row at a time) and
never enter the cache; neither does a chunk's partial tail, whose pass is shorter than a full chunk's.

A drafter with a cache of its own (a draft model) keeps its keys and values of a block's chunk with the block
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
from dataclasses import dataclass, field

import torch

log = logging.getLogger("specdec")


KeysValues = tuple[torch.Tensor, torch.Tensor]  # keys and values [L, Hkv, chunk, d] of every layer


@dataclass
class Block:
    """One chunk of a prefix: its keys and values [L, Hkv, chunk, d], for drafters that read the target's
    features its final-normed hidden states [chunk, H], and for drafters with a cache of their own (a draft
    model) their keys and values of the chunk, once one has computed them."""

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
    first whole chunks from the cache (`cached`, in order), and those of later whole chunks (`computed`, by chunk
    index, up to `chunks`) once it has prefilled them, for the cache to keep."""

    chunk_tokens: int
    chunks: int
    cached: list[KeysValues]
    computed: dict[int, KeysValues] = field(default_factory=dict)


@dataclass
class CacheCounts:
    """What the cache did since it started: the Prometheus counters read these."""

    hit_tokens: int = 0  # prompt tokens taken from the cache
    miss_tokens: int = 0  # prompt tokens prefilled
    evicted_blocks: int = 0


class PrefixCache:
    """Blocks of `chunk_tokens` tokens under a budget of `budget_bytes`, least recently used first out."""

    def __init__(self, chunk_tokens: int, budget_bytes: int, block_bytes: int):
        if budget_bytes < block_bytes:
            raise ValueError(f"prefill.cache_bytes {budget_bytes} holds no block: one block of {chunk_tokens} tokens "
                             f"takes {block_bytes} bytes for this target; set at least that, or prefill.cache: false")
        self.chunk_tokens = chunk_tokens
        self.budget_bytes = budget_bytes
        self.block_bytes = block_bytes
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first
        self.bytes = 0
        self.counts = CacheCounts()
        self._warned_too_large = False

    def keys(self, tokens: list[int], namespace: str) -> list[bytes]:
        """The chain of keys of `tokens`' whole chunks."""
        keys, parent = [], hashlib.sha256(namespace.encode()).digest()
        for start in range(0, len(tokens) - self.chunk_tokens + 1, self.chunk_tokens):
            chunk = torch.tensor(tokens[start : start + self.chunk_tokens], dtype=torch.int64).numpy().tobytes()
            parent = hashlib.sha256(parent + chunk).digest()
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
        for key in reversed(keys[: len(found)]):
            self.blocks.move_to_end(key)
        return found

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

    def attach_own(self, key: bytes, own: KeysValues) -> None:
        """Keep a drafter's own keys and values of a chunk with its block, where the cache still holds the block."""
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
        need = tokens // self.chunk_tokens * self.block_bytes
        if need <= self.budget_bytes:
            return True
        if not self._warned_too_large:
            log.warning("prefix cache: %s's prompt of %d tokens needs %d bytes, more than prefill.cache_bytes %d: it "
                        "is decoded uncached (logged once)", request_id, tokens, need, self.budget_bytes)
            self._warned_too_large = True
        return False

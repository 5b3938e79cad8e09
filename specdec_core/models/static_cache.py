"""A KV cache addressed by position, preallocated, as gpt-fast keeps one: row b's token at position p is
in slot p of row b, in every layer.

A pass over k new tokens writes them at slots length..length+k-1 of their rows whatever their tree, and
attends slots below the row's length plus the new tokens its tree mask allows. Rollback is by position:
`commit` moves the kept tokens down to the row's next slots (a tree's path; a chain's kept drafts are
there already) and advances the row's length; what lies past it is dead, and the next pass writes over
it. Nothing is ever concatenated, so a pass's shapes depend only on the batch, its length and the
capacity, which grows in whole blocks: a compiled step sees a few shapes, not one per token.

The interface is `runner.BatchCache`'s, so the engine keeps one or the other, as its target runner makes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 256  # slots: the capacity grows in whole blocks, so a pass's shapes change rarely


def blocks(slots: int, block: int = BLOCK) -> int:
    """`slots` rounded up to whole blocks."""
    return -(-slots // block) * block


@dataclass
class StaticCache:
    """Keys and values [B, Hkv, capacity, d] per layer, each row's tokens at their positions."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    lengths: torch.Tensor  # [B] long: committed tokens per row, the next pass's first position
    pending: int = 0  # tokens the last pass wrote after each row's length, until `commit`

    @classmethod
    def empty(cls, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> StaticCache:
        shape = (0, kv_heads, 0, head_dim)
        return cls(
            keys=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)],
            values=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)],
            lengths=torch.zeros(0, dtype=torch.long, device=device),
        )

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def slots(self) -> int:
        return self.capacity

    @property
    def device(self) -> torch.device:
        return self.lengths.device

    @property
    def valid(self) -> torch.Tensor:
        """[B, capacity] bool: the slots holding a committed token of their row."""
        return torch.arange(self.capacity, device=self.device) < self.lengths[:, None]

    def reserve(self, rows: int, slots: int) -> None:
        """Room for `rows` rows (an empty cache takes the first pass's batch) of `slots` slots each."""
        if self.batch_size == 0 and rows:
            self.lengths = torch.zeros(rows, dtype=torch.long, device=self.device)
            self.keys = [k.new_zeros(rows, *k.shape[1:]) for k in self.keys]
            self.values = [v.new_zeros(rows, *v.shape[1:]) for v in self.values]
        if slots > self.capacity:
            self._grow(blocks(max(slots, 2 * self.capacity)))

    def _grow(self, capacity: int) -> None:
        def grown(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros(t.shape[0], t.shape[1], capacity, t.shape[3])
            out[:, :, : t.shape[2]] = t
            return out

        self.keys, self.values = [grown(k) for k in self.keys], [grown(v) for v in self.values]

    def write_slots(self, k: int) -> torch.Tensor:
        """[B, k] the slots a pass of k new tokens writes: each row's next k positions."""
        return self.lengths[:, None] + torch.arange(k, device=self.device)

    def attend_mask(self, tree_mask: torch.Tensor) -> torch.Tensor:
        """[B, k, capacity] bool, query attends slot: each row's committed slots, then its new tokens as
        `tree_mask` [B, k, k] allows."""
        batch, k, _ = tree_mask.shape
        mask = self.valid[:, None, :].expand(batch, k, self.capacity).clone()
        rows = torch.arange(batch, device=self.device)[:, None]
        mask[rows, :, self.write_slots(k)] = tree_mask.transpose(1, 2)
        return mask

    def append(self, rows: StaticCache) -> None:
        """Join the rows of `rows` (a fresh prefill) to this cache."""
        if self.batch_size == 0:
            self.keys, self.values, self.lengths = rows.keys, rows.values, rows.lengths
            return
        capacity = max(self.capacity, rows.capacity)
        self.reserve(0, capacity)
        rows.reserve(0, capacity)
        self.keys = [torch.cat([a, b]) for a, b in zip(self.keys, rows.keys)]
        self.values = [torch.cat([a, b]) for a, b in zip(self.values, rows.values)]
        self.lengths = torch.cat([self.lengths, rows.lengths])

    def keep_rows(self, keep: list[int]) -> None:
        """Keep only the rows at indices `keep`, in that order (an index may repeat)."""
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.keys = [k.index_select(0, index) for k in self.keys]
        self.values = [v.index_select(0, index) for v in self.values]
        self.lengths = self.lengths.index_select(0, index)

    def commit(self, keep: torch.Tensor) -> None:
        """Settle the last pass's tokens: `keep` [B, k] says which stay. Row b's kept tokens move, in order,
        to its next slots, and its length passes them; the rest are rolled back."""
        k = keep.shape[1]
        if k != self.pending:
            raise RuntimeError(f"commit of {k} tokens after a pass of {self.pending}")
        rows, new = keep.nonzero().unbind(1)  # kept tokens, in row then pass order
        to = (keep.cumsum(1) - 1)[rows, new]
        moved = new != to  # a tree's path past its first branch; a chain's drafts stay put
        if moved.any():
            rows, new, to = rows[moved], new[moved], to[moved]
            start = self.lengths[rows]
            for layer in (*self.keys, *self.values):
                layer[rows, :, start + to] = layer[rows, :, start + new]
        self.lengths = self.lengths + keep.sum(1)
        self.pending = 0

    def read_span(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A one-row cache's keys and values at positions start..end-1, every layer: [L, Hkv, end - start, d] each."""
        return (torch.stack([k[0, :, start:end] for k in self.keys]), torch.stack([v[0, :, start:end] for v in self.values]))

    def write_span(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append keys and values [L, Hkv, n, d] (`read_span`'s) to a one-row cache's committed positions."""
        start, n = int(self.lengths[0]), keys.shape[2]
        self.reserve(1, start + n)
        for layer, (k, v) in enumerate(zip(keys, values)):
            self.keys[layer][0, :, start : start + n] = k
            self.values[layer][0, :, start : start + n] = v
        self.lengths = self.lengths + n

    def drop_last(self, counts: list[int]) -> None:
        """Roll back the last counts[i] committed tokens of row i."""
        self.lengths = self.lengths - torch.tensor(counts, dtype=torch.long, device=self.device)

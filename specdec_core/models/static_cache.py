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

from dataclasses import dataclass, field

import torch

BLOCK = 256  # slots: the capacity grows in whole blocks, so a pass's shapes change rarely
ZEROED = 64  # slots: rows are zeroed ahead of the passes this many at a time, not a few every step


def blocks(slots: int, block: int = BLOCK) -> int:
    """`slots` rounded up to whole blocks."""
    return -(-slots // block) * block


@dataclass
class StaticCache:
    """Keys and values [B, Hkv, capacity, d] per layer, each row's tokens at their positions.

    The memory is taken untouched (`torch.empty`) and each row's slots are zeroed, or written, only up to where a
    pass reads (`make_readable`): on this project's VMs a first touch of a page costs about 2-6 us, so a 3,000-token
    row's 84 MB zeroed or copied at once stalled every running stream for 0.1-0.3 s. `clean` says how far each
    row's slots hold numbers; what lies past it may be any bits (NaN included), and nothing reads it.
    A layer's tensor is a run of rows in a buffer that may hold more rows: rows leave by narrowing the run or
    moving rows within it, and a new row prefilled after free rows (`reserve`'s `rows_before`) joins a batch
    (`append`) by copying the batch's rows in before it, not itself.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    lengths: torch.Tensor  # [B] long: committed tokens per row, the next pass's first position
    pending: int = 0  # tokens the last pass wrote after each row's length, until `commit`
    clean: list[int] = field(default_factory=list)  # per row: its slots below this hold numbers (written or zeroed)

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

    @property
    def _layers(self) -> tuple[torch.Tensor, ...]:
        return (*self.keys, *self.values)

    def reserve(self, rows: int, slots: int, rows_before: int = 0) -> None:
        """Room for `rows` rows (an empty cache takes the first pass's batch) of `slots` slots each, untouched. An
        empty cache's rows come after `rows_before` free rows of the same memory: a batch of up to that many rows
        joins them without copying them (`append`)."""
        if self.batch_size == 0 and rows:
            self.keys, self.values = ([_buffer(t, rows_before + rows, blocks(slots))[rows_before:] for t in tensors]
                                      for tensors in (self.keys, self.values))
            self.lengths = torch.zeros(rows, dtype=torch.long, device=self.device)
            self.clean = [0] * rows
        if slots > self.capacity:
            self._grow(blocks(max(slots, 2 * self.capacity)))

    def make_readable(self, slots: int) -> None:
        """Every row's slots below `slots` hold numbers, as a pass that reads up to there needs: those no pass
        wrote are zeroed (ZEROED at a time)."""
        for row, clean in enumerate(self.clean):
            if clean < slots:
                end = min(self.capacity, blocks(slots, ZEROED))
                for layer in self._layers:
                    layer[row, :, clean:end].zero_()
                self.clean[row] = end

    def _grow(self, capacity: int) -> None:
        held = max(self.clean, default=0)  # past every row's clean slots nothing is worth copying

        def grown(t: torch.Tensor) -> torch.Tensor:
            out = _buffer(t, t.shape[0], capacity)
            out[:, :, :held] = t[:, :, :held]
            return out

        self.keys, self.values = [grown(k) for k in self.keys], [grown(v) for v in self.values]

    def append(self, rows: StaticCache) -> None:
        """Join the rows of `rows` (a fresh prefill) to this cache. It copies whichever side holds fewer written
        slots into free rows beside the other (free rows before `rows`, after this cache's), or both into new
        memory where neither has them."""
        if self.batch_size == 0:
            self.keys, self.values, self.lengths, self.clean = rows.keys, rows.values, rows.lengths, rows.clean
            return
        mine, theirs = self.batch_size, rows.batch_size
        into_theirs = rows.capacity >= self.capacity and _free_rows(rows.keys[0])[0] >= mine
        into_mine = self.capacity >= rows.capacity and _free_rows(self.keys[0])[1] >= theirs
        if into_theirs and (not into_mine or sum(self.clean) <= sum(rows.clean)):
            joined = [_widened(t, mine, 0) for t in rows._layers]
            for to, source in zip(joined, self._layers):
                _copy_rows(to, 0, source, self.clean)
        elif into_mine:
            joined = [_widened(t, 0, theirs) for t in self._layers]
            for to, source in zip(joined, rows._layers):
                _copy_rows(to, mine, source, rows.clean)
        else:
            capacity = max(self.capacity, rows.capacity)
            joined = [_buffer(a, mine + theirs, capacity) for a in self._layers]
            for to, a, b in zip(joined, self._layers, rows._layers):
                _copy_rows(to, 0, a, self.clean)
                _copy_rows(to, mine, b, rows.clean)
        layers = len(self.keys)
        self.keys, self.values = joined[:layers], joined[layers:]
        self.lengths = torch.cat([self.lengths, rows.lengths])
        self.clean = self.clean + rows.clean

    def keep_rows(self, keep: list[int]) -> None:
        """Keep only the rows at indices `keep`, in that order (an index may repeat). A run of rows stays where it
        is; rows in order move down within their memory; any other order is copied into new memory."""
        clean = [self.clean[i] for i in keep]
        if not keep or keep == list(range(keep[0], keep[0] + len(keep))):
            first = keep[0] if keep else 0
            self.keys, self.values = ([t[first : first + len(keep)] for t in tensors] for tensors in (self.keys, self.values))
        elif all(a < b for a, b in zip(keep, keep[1:])):
            for to, source in enumerate(keep):
                if to != source:
                    for layer in self._layers:
                        layer[to, :, : self.clean[source]] = layer[source, :, : self.clean[source]]
            self.keys, self.values = ([t[: len(keep)] for t in tensors] for tensors in (self.keys, self.values))
        else:
            index = torch.tensor(keep, dtype=torch.long, device=self.device)
            held = max(clean)

            def kept(t: torch.Tensor) -> torch.Tensor:
                out = _buffer(t, len(keep), t.shape[2])
                out[:, :, :held] = t[:, :, :held].index_select(0, index)
                return out

            self.keys, self.values = [kept(k) for k in self.keys], [kept(v) for v in self.values]
        self.lengths = self.lengths[torch.tensor(keep, dtype=torch.long, device=self.device)]
        self.clean = clean

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

    def read_span(self, start: int, end: int, row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s keys and values at positions start..end-1 (a row's slots are its positions), every layer:
        [L, Hkv, end - start, d] each, copies."""
        return (torch.stack([k[row, :, start:end] for k in self.keys]), torch.stack([v[row, :, start:end] for v in self.values]))

    def write_span(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append keys and values [L, Hkv, n, d] (`read_span`'s) to a one-row cache's committed positions."""
        start, n = int(self.lengths[0]), keys.shape[2]
        self.reserve(1, start + n)
        for layer, (k, v) in enumerate(zip(keys, values)):
            self.keys[layer][0, :, start : start + n] = k
            self.values[layer][0, :, start : start + n] = v
        self.lengths = self.lengths + n
        self.clean[0] = max(self.clean[0], start + n)

    def drop_last(self, counts: list[int]) -> None:
        """Roll back the last counts[i] committed tokens of row i."""
        self.lengths = self.lengths - torch.tensor(counts, dtype=torch.long, device=self.device)


def _buffer(like: torch.Tensor, rows: int, capacity: int) -> torch.Tensor:
    """Untouched memory for `rows` rows of `capacity` slots, shaped and typed as `like`'s, as a view of it: a layer is
    always a view of its buffer, so the compiled step's graphs (which guard on a view's base) serve every cache,
    grown, joined or narrowed (a grown cache's plain tensors had compiled a second set of graphs)."""
    return torch.empty(rows, like.shape[1], capacity, like.shape[3], dtype=like.dtype, device=like.device)[:rows]


def _free_rows(layer: torch.Tensor) -> tuple[int, int]:
    """The free rows of `layer`'s memory before its rows and after them."""
    row = layer.stride(0)
    if layer.shape[0] == 0 or row == 0:
        return 0, 0
    first = layer.storage_offset() // row
    held = layer.untyped_storage().nbytes() // (row * layer.element_size())
    return first, held - first - layer.shape[0]


def _widened(layer: torch.Tensor, before: int, after: int) -> torch.Tensor:
    """`layer` with `before` of its memory's free rows before it and `after` after it."""
    rows = layer.shape[0] + before + after
    return layer.as_strided((rows, *layer.shape[1:]), layer.stride(), layer.storage_offset() - before * layer.stride(0))


def _copy_rows(to: torch.Tensor, first: int, rows: torch.Tensor, clean: list[int]) -> None:
    """Copy `rows`' slots that hold numbers (each row's below its `clean`) into `to`'s rows from `first` on."""
    held = max(clean, default=0)
    to[first : first + rows.shape[0], :, :held] = rows[:, :, :held]

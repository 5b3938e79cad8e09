"""Drafting with a model: a smaller model of the target's family, and the shared loop of every model drafter.

`ModelDrafter` draws up to gamma tokens per row from q, the draft's
distribution after the request's own sampling transforms, one forward per
token (under the Gumbel rule, with the target's own noise for that position). Two settings apply to every model drafter:

- Early exit: a row stops drafting for this step when the draft's top
  probability for its next token falls under a threshold (for greedy rows,
  the softmax of the adjusted logits; for sampled rows, q itself), so a step's
  draft length adapts token by token under the controller's gamma. The stop
  depends only on the draft's own outputs, so verification stays exact.
- Reduced vocabulary (../vocab.py): logits over N tokens are widened to the
  target's vocabulary with -inf outside the set before the transforms.

`DraftModelDrafter` keeps its own batched KV cache in the engine's row order.
Its cache lags the sequence by the one or two tokens the target emitted last
step; each proposal first catches up on those.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Generator
from typing import TYPE_CHECKING

import torch

from ..models.loading import draft_runner, target_vocab
from ..models.runner import BatchCache, ModelRunner
from ..models.vocab import ReducedVocab
from ..sampling import (
    adjust_logits,
    keyed_tokens,
    make_generator,
    running_counts,
    sample,
    to_probs,
)
from ..prefix_cache import OwnPrefix
from ..sequence import Sequence
from .base import Drafter, DrafterBuilder, Proposal

if TYPE_CHECKING:
    from ..config import Config


class ModelDrafter(Drafter):
    """The draft loop shared by drafters that run a model; subclasses say how to get logits."""

    def __init__(self, target_vocab: int, vocab: ReducedVocab | None = None, early_exit: float = 0.0):
        self.target_vocab = target_vocab
        self.vocab = vocab
        self.early_exit = early_exit
        self.forwarded = 0  # draft tokens fed back to the model in the last proposal

    @abstractmethod
    def _first_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """Logits [B, V'] for each row's first draft token."""

    @abstractmethod
    def _next_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed each row's latest draft token [B, 1]; logits [B, V'] for the next one."""

    def widen(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary: a reduced vocabulary widened, a padded output layer cut."""
        if self.vocab is not None:
            return self.vocab.expand(logits)
        logits = logits[:, : self.target_vocab]
        if logits.shape[-1] < self.target_vocab:
            logits = torch.nn.functional.pad(logits, (0, self.target_vocab - logits.shape[-1]), value=float("-inf"))
        return logits

    def _q(self, logits: torch.Tensor, seq: Sequence, drafted: torch.Tensor) -> tuple[torch.Tensor, float]:
        """A row's q [V_target] for its next draft token given the tokens drafted so far, and the draft's confidence."""
        counts = running_counts(seq.counts, drafted, self.target_vocab)
        counts = counts[-1:] if counts is not None else None
        if seq.params.greedy:
            adjusted = adjust_logits(logits[None], seq.params, counts)[0]
            confidence = float(adjusted.softmax(-1).max()) if self.early_exit else 1.0
            return torch.nn.functional.one_hot(adjusted.argmax(), self.target_vocab).float(), confidence
        q = to_probs(logits[None], seq.params, counts)[0]
        return q, float(q.max())

    def propose(self, seqs: list[Sequence], gamma: int) -> Proposal:
        logits = self.widen(self._first_logits(seqs))
        drafted = torch.zeros(len(seqs), gamma, dtype=torch.long, device=logits.device)
        probs = torch.zeros(len(seqs), gamma, self.target_vocab, device=logits.device)
        lengths = [0] * len(seqs)
        self.forwarded = 0
        for j in range(gamma):
            for i, seq in enumerate(seqs):
                if lengths[i] < j:
                    continue  # this row stopped earlier; its column stays a dummy token the model still reads
                q, confidence = self._q(logits[i], seq, drafted[i, :j])
                if confidence < self.early_exit:
                    continue
                probs[i, j] = q
                drafted[i, j] = self._draw(q, seq, j)
                lengths[i] = j + 1
            if max(lengths) <= j or j == gamma - 1:
                break
            logits = self.widen(self._next_logits(drafted[:, j : j + 1]))
            self.forwarded += 1
        width = max(lengths)
        return Proposal(tokens=drafted[:, :width].cpu(), lengths=lengths, probs=probs[:, :width])

    @staticmethod
    def _draw(q: torch.Tensor, seq: Sequence, j: int) -> torch.Tensor:
        """A row's j-th draft token from its q [V]: the argmax (greedy); under the Gumbel rule, the draw with the
        noise the target will draw that position with (coupled drafts: kept wherever q's draw is p's); else a
        draw from the request's own generator, so that a seed fixes the whole completion."""
        if seq.params.greedy:
            return q.argmax()
        if seq.noise is not None:
            return keyed_tokens(q.log()[None], seq.noise.at([len(seq.output_ids) + j]))[0]
        if seq.generator is None:
            seq.generator = make_generator(seq.params.seed, q.device)
        return sample(q[None], seq.generator)[0]


class DraftModelDrafter(ModelDrafter):
    """A model of its own drafts, from its own cache: a draft model, the target's quantized copy, a student."""

    def __init__(self, runner: ModelRunner, target_vocab: int, vocab: ReducedVocab | None = None, early_exit: float = 0.0):
        """`runner`'s output layer must already be cut to `vocab` when one is given (ReducedVocab.reduce_output)."""
        super().__init__(target_vocab, vocab, early_exit)
        self.runner = runner
        self.cache = runner.new_cache()

    keeps_own_kv = True

    def own_models(self) -> list[torch.nn.Module]:
        return [self.runner.model]

    def prefill(self, seq: Sequence, own: OwnPrefix | None, chunk_tokens: int) -> Generator[None, None, BatchCache]:
        """The prompt on the draft model in passes of chunk_tokens, but for the whole blocks `own` has from the
        prefix cache; what it prefills of the later whole blocks goes back in `own`."""
        ids = seq.tokens  # the whole prompt, as the target prefills it
        row = self.runner.new_cache()
        row.reserve(1, len(ids))
        for keys, values in own.cached if own else ():
            row.write_span(keys, values)
        for start in range(int(row.lengths[0]), len(ids), chunk_tokens):
            chunk = torch.tensor([ids[start : start + chunk_tokens]], device=self.runner.device)
            self.runner.forward(row, chunk, commit=True, last_logits_only=True)
            yield
        if own:
            size = own.block_tokens
            own.computed = {i: row.read_span(i * size, (i + 1) * size) for i in range(len(own.cached), own.blocks)}
        return row

    def add(self, seq: Sequence, features: torch.Tensor | None = None, row: BatchCache | None = None) -> None:
        self.cache.append(row)

    def remove(self, keep: list[int]) -> None:
        self.cache.keep_rows(keep)

    def _first_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """Catch up on the tokens the target emitted since the last proposal."""
        runner, cache = self.runner, self.cache
        pending = [seq.tokens[seen:] for seq, seen in zip(seqs, cache.lengths.tolist())]
        width = max(len(p) for p in pending)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        keep = torch.zeros(len(seqs), width, dtype=torch.bool)
        for i, tokens in enumerate(pending):
            ids[i, : len(tokens)] = torch.tensor(tokens)
            keep[i, : len(tokens)] = True
        logits, _ = runner.forward(cache, ids)
        cache.commit(keep.to(runner.device))
        last = torch.tensor([len(p) - 1 for p in pending], device=logits.device)
        return logits[torch.arange(len(seqs), device=logits.device), last]

    def _next_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        logits, _ = self.runner.forward(self.cache, tokens, commit=True)
        return logits[:, 0]

    def accepted(
        self, seqs: list[Sequence], proposal: Proposal, paths: list[list[int]], features: list[torch.Tensor] | None
    ) -> None:
        # The cache holds the draft tokens fed back; drop those past each row's accepted prefix.
        self.cache.drop_last([max(self.forwarded - len(path), 0) for path in paths])


def from_config(config: Config, target: ModelRunner, build: DrafterBuilder) -> DraftModelDrafter:
    """speculation.draft_model drafting for `target`."""
    spec = config.speculation
    if not spec.draft_model:
        raise ValueError("drafter draft-model needs speculation.draft_model in the config")
    draft, vocab = draft_runner(config.model, target, spec.draft_model, target_vocab(target, spec.vocab_size))
    return DraftModelDrafter(draft, target.vocab_size, vocab, spec.early_exit)

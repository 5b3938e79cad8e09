"""One decoding step for a batch of sequences, speculative or plain.

The target's cache holds every token of a row but the last; each step feeds
that last token plus the row's draft tokens in one pass, so the logits at
position j judge draft token j and the logits after the last kept token give
the next one. Plain decoding is the same step with no draft tokens. A tree
proposal is the same pass with a tree mask (tree.py); the kept path's slots
stay and the rest roll back. Per-position figures count a tree by depth: a
row that drafted a tree of depth d drafted d positions, whatever its width.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from .control import Controller
from .drafters.base import Drafter, Proposal
from .models.runner import BatchCache, ModelRunner
from .sampling import greedy_tokens, make_generator, running_counts, to_probs
from .sequence import Sequence
from .tree import batch_layout, depths, path_counts, within_depth
from .verify import verify_greedy, verify_sampled, verify_tree_greedy, verify_tree_sampled


@dataclass
class RowResult:
    """What one row got from a step."""

    seq: Sequence
    new_tokens: list[int]
    drafted: int
    accepted: int


@dataclass
class StepReport:
    """Measured figures of one step, for metrics and benchmarks."""

    mode: str  # "speculative" or "plain"
    method: str
    batch_size: int
    gamma: int
    draft_s: float
    verify_s: float
    rows: list[RowResult] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)  # rows whose draft token at j was kept
    drafted_per_position: list[int] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)  # rows whose verification raised; removed


class Engine:
    """Owns the target's batch cache, the drafter and the controller."""

    def __init__(self, target: ModelRunner, drafter: Drafter | None, controller: Controller, eos_token_ids: set[int]):
        self.target = target
        self.drafter = drafter
        self.controller = controller
        self.eos_token_ids = frozenset(eos_token_ids)
        self.cache = BatchCache.empty(target.device)
        self.seqs: list[Sequence] = []
        if drafter:
            drafter.attach(self.cache)

    @property
    def wants_features(self) -> bool:
        """Whether the drafter reads the target's features, so passes must return them."""
        return bool(self.drafter and self.drafter.uses_features)

    @property
    def method(self) -> str:
        return self.drafter.name if self.drafter else "none"

    def add(self, seq: Sequence, prompt_logits: bool = False) -> torch.Tensor | None:
        """Prefill a new sequence into the batch; with prompt_logits, returns the prompt's logits [len-1, V]."""
        if not seq.prompt_ids:
            raise ValueError("a prompt needs at least one token")
        seq.stats.method = self.method
        seq.generator = seq.generator or make_generator(seq.params.seed, self.target.device)
        if seq.params.uses_counts:
            seq.counts = torch.zeros(self.target.vocab_size, device=self.target.device)
            for token in seq.output_ids:
                seq.counts[token] += 1
        features = self.wants_features
        row, logits, hidden = self.target.prefill(seq.tokens[:-1], all_logits=prompt_logits, features=features)
        self.cache.append(row)
        if self.drafter:
            try:
                self.drafter.add(seq, hidden)
            except BaseException:
                # Take the row back: a cache row no sequence owns would break every later step.
                self.cache.keep_rows(list(range(len(self.seqs))))
                raise
        self.seqs.append(seq)
        return logits if prompt_logits else None

    def remove(self, seqs: list[Sequence]) -> None:
        """Drop sequences from the batch (finished, cancelled or disconnected)."""
        gone = {id(seq) for seq in seqs}
        keep = [i for i, seq in enumerate(self.seqs) if id(seq) not in gone]
        if len(keep) == len(self.seqs):
            return
        self.cache.keep_rows(keep)
        if self.drafter:
            self.drafter.remove(keep)
        self.seqs = [self.seqs[i] for i in keep]

    def generate(self, seqs: Iterable[Sequence] = ()) -> Iterator[StepReport]:
        """Prefill `seqs` into the batch, then step until the batch is empty, yielding each step's report:
        the decode loop of everything that runs the engine to the end (bench, calibrate, the CLI,
        training data); the server's scheduler steps itself, admitting as it goes."""
        for seq in seqs:
            self.add(seq)
        while self.seqs:
            yield self.step()

    def step(self) -> StepReport:
        """Decode one step for every sequence in the batch; finished ones leave the batch."""
        seqs = self.seqs
        gamma = self.controller.choose(seqs) if self.drafter else 0
        start = time.perf_counter()
        proposal = self._propose(seqs, gamma)
        draft_s = time.perf_counter() - start

        width = proposal.width
        ids = torch.zeros(len(seqs), width + 1, dtype=torch.long)
        for i, seq in enumerate(seqs):
            ids[i, 0] = seq.tokens[-1]
            ids[i, 1 : 1 + proposal.lengths[i]] = proposal.tokens[i, : proposal.lengths[i]]
        parents = [row[:n] for row, n in zip(proposal.parents, proposal.lengths)] if proposal.parents else None
        tree_mask, offsets = batch_layout(parents, width) if parents else (None, None)
        device = self.target.device
        features = self.wants_features
        start = time.perf_counter()
        logits, hidden = self.target.forward(
            self.cache, ids.to(device), tree_mask=None if tree_mask is None else tree_mask.to(device),
            depths=None if offsets is None else offsets.to(device), hidden_states=features,
        )
        verify_s = time.perf_counter() - start

        positions = [max(depths(row), default=0) for row in parents] if parents else proposal.lengths
        report = StepReport(
            mode="speculative" if width else "plain",
            method=self.method,
            batch_size=len(seqs),
            gamma=max(positions, default=0),
            draft_s=draft_s,
            verify_s=verify_s,
            accepted_per_position=[0] * max(positions, default=0),
            drafted_per_position=[0] * max(positions, default=0),
        )
        keep = torch.zeros(len(seqs), width + 1, dtype=torch.bool)
        paths, kept_features = [], []
        for i, seq in enumerate(seqs):
            length, drafted = proposal.lengths[i], positions[i]
            draft = proposal.tokens[i, :length].to(device)
            q = proposal.probs[i, :length] if proposal.probs is not None else None
            try:
                path, tokens = self._verify(seq, draft, q, parents[i] if parents else None, logits[i, : length + 1])
            except Exception as exc:  # this row's numbers (NaN logits, say): it alone leaves the batch
                report.failed.append((seq, exc))
                path, tokens = [], None
            slots = [0] + [1 + j for j in path]  # this step's slots the row keeps: its last token, then the path
            keep[i, slots] = True
            paths.append(path)
            if features:
                kept_features.append(hidden[-1][i, slots])
            if tokens is None:  # failed: keeps only its last token's slot, and leaves the batch below
                continue
            for j in range(drafted):
                report.drafted_per_position[j] += 1
                report.accepted_per_position[j] += j < len(path)
            emitted = self._emit(seq, tokens, logits[i, slots])
            if drafted:
                seq.stats.draft_tokens += drafted
                # Drafts kept past a stop are never delivered, so usage does not count them.
                seq.stats.accepted_tokens += min(len(path), len(emitted))
                seq.stats.verify_steps += 1
                seq.stats.gamma_sum += drafted
                seq.stats.emitted_tokens += len(emitted)
            report.rows.append(RowResult(seq, emitted, drafted, len(path)))
        self.cache.commit(keep.to(device))
        if self.drafter and (width or features):  # feature drafters need every committed token's features
            self.drafter.accepted(seqs, proposal, paths, kept_features if features else None)
        self.controller.observe(
            len(seqs), width + 1, verify_s, width, draft_s, [(row.seq, row.drafted, row.accepted) for row in report.rows],
        )
        report.finished = [seq for seq in seqs if seq.finished]
        self.remove(report.finished + [seq for seq, _ in report.failed])
        return report

    def _propose(self, seqs: list[Sequence], gamma: int) -> Proposal:
        empty = Proposal(tokens=torch.zeros(len(seqs), 0, dtype=torch.long), lengths=[0] * len(seqs), probs=None)
        if not gamma or not self.drafter:
            return empty
        proposal = self.drafter.propose(seqs, gamma)
        # Never draft past a row's token budget: the step emits at most remaining tokens.
        budgets = [max(seq.remaining - 1, 0) for seq in seqs]
        if proposal.parents is None:
            proposal.lengths = [min(n, budget) for n, budget in zip(proposal.lengths, budgets)]
            return proposal
        return _trees_within(proposal, budgets)

    def _verify(
        self, seq: Sequence, draft: torch.Tensor, q: torch.Tensor | None, parents: list[int] | None, logits: torch.Tensor
    ) -> tuple[list[int], list[int]]:
        """(the kept draft indices, the emitted tokens) of one row; `parents` None is a chain."""
        vocab = self.target.vocab_size
        if parents is None:
            counts = running_counts(seq.counts, draft, vocab)
            if seq.params.greedy:
                accepted, tokens = verify_greedy(draft, greedy_tokens(logits, seq.params, counts))
            else:
                accepted, tokens = verify_sampled(draft, q, to_probs(logits, seq.params, counts), seq.generator)
            return list(range(accepted)), tokens
        counts = path_counts(seq.counts, draft, parents, vocab)
        if seq.params.greedy:
            return verify_tree_greedy(draft, parents, greedy_tokens(logits, seq.params, counts))
        return verify_tree_sampled(draft, parents, q, to_probs(logits, seq.params, counts), seq.generator)

    def _emit(self, seq: Sequence, tokens: list[int], logits: torch.Tensor) -> list[int]:
        """Append tokens (the j-th drawn from logits[j]) up to the first stop; returns those appended."""
        emitted = []
        for j, token in enumerate(tokens):
            if seq.top_logprobs is not None:
                logprobs = logits[j].log_softmax(dim=-1)
                seq.token_logprobs.append(float(logprobs[token]))
                top = logprobs.topk(seq.top_logprobs) if seq.top_logprobs else None
                seq.top_logprob_ids.append(list(zip(top.indices.tolist(), top.values.tolist())) if top else [])
            seq.output_ids.append(token)
            if seq.counts is not None:
                seq.counts[token] += 1
            emitted.append(token)
            if token in self.eos_token_ids or token in seq.stop_token_ids:
                seq.finish_reason = "stop"
            elif seq.remaining <= 0:
                seq.finish_reason = "length"
            if seq.finished:
                break
        return emitted


def _trees_within(proposal: Proposal, max_depths: list[int]) -> Proposal:
    """Each row's tree cut to its nodes at depth <= max_depths[i], renumbered."""
    rows = [within_depth(parents[:n], depth) for parents, n, depth in zip(proposal.parents, proposal.lengths, max_depths)]
    width = max((len(kept) for kept, _ in rows), default=0)
    tokens = proposal.tokens.new_zeros(len(rows), width)
    probs = None if proposal.probs is None else proposal.probs.new_zeros(len(rows), width, proposal.probs.shape[-1])
    for i, (kept, _) in enumerate(rows):
        tokens[i, : len(kept)] = proposal.tokens[i, kept]
        if probs is not None:
            probs[i, : len(kept)] = proposal.probs[i, kept]
    return Proposal(tokens, [len(kept) for kept, _ in rows], probs, [parents for _, parents in rows])

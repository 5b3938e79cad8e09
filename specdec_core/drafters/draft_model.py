"""A smaller model of the target's family drafts autoregressively.

The draft keeps its own batched KV cache in the engine's row order. Its cache
lags the sequence by the one or two tokens the target emitted last step; each
proposal first catches up on those, then draws gamma tokens from q, the draft's
distribution after the request's own sampling transforms.
"""

from __future__ import annotations

import torch

from ..models.runner import ModelRunner
from ..sampling import greedy_tokens, make_generator, running_counts, sample, to_probs
from ..sequence import Sequence
from .base import Drafter, Proposal


class DraftModelDrafter(Drafter):
    name = "draft-model"

    def __init__(self, runner: ModelRunner, target_vocab: int):
        self.runner = runner
        self.target_vocab = target_vocab
        self.cache = runner.empty_cache()

    def add(self, seq: Sequence) -> None:
        row, _ = self.runner.prefill(seq.tokens[:-1])
        self.runner.append_rows(self.cache, row)

    def remove(self, keep: list[int]) -> None:
        self.runner.remove_rows(self.cache, keep)

    def _q(self, logits: torch.Tensor, seqs: list[Sequence], drafted: torch.Tensor) -> list[torch.Tensor]:
        """Each row's q [V_target] for the next draft token, given the tokens drafted so far."""
        # Output layers may be padded past the shared vocabulary; the target's size is the one that counts.
        logits = logits[:, : self.target_vocab]
        if logits.shape[-1] < self.target_vocab:
            logits = torch.nn.functional.pad(logits, (0, self.target_vocab - logits.shape[-1]), value=float("-inf"))
        rows = []
        for i, seq in enumerate(seqs):
            counts = running_counts(seq.counts, drafted[i], self.target_vocab)
            counts = counts[-1:] if counts is not None else None
            if seq.params.greedy:
                token = greedy_tokens(logits[i : i + 1], seq.params, counts)
                rows.append(torch.nn.functional.one_hot(token[0], self.target_vocab).float())
            else:
                rows.append(to_probs(logits[i : i + 1], seq.params, counts)[0])
        return rows

    def propose(self, seqs: list[Sequence], gamma: int) -> Proposal:
        runner, cache = self.runner, self.cache
        lengths = cache.lengths.tolist()
        pending = [seq.tokens[seen:] for seq, seen in zip(seqs, lengths)]
        width = max(len(p) for p in pending)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        keep = torch.zeros(len(seqs), width, dtype=torch.bool)
        for i, tokens in enumerate(pending):
            ids[i, : len(tokens)] = torch.tensor(tokens)
            keep[i, : len(tokens)] = True
        logits, _ = runner.forward(cache, ids)
        runner.commit(cache, keep.to(runner.device))
        last = torch.tensor([len(p) - 1 for p in pending], device=logits.device)
        logits = logits[torch.arange(len(seqs), device=logits.device), last]

        drafted = torch.zeros(len(seqs), gamma, dtype=torch.long, device=logits.device)
        probs = torch.zeros(len(seqs), gamma, self.target_vocab, device=logits.device)
        for j in range(gamma):
            q = self._q(logits, seqs, drafted[:, :j])
            for i, seq in enumerate(seqs):
                probs[i, j] = q[i]
                drafted[i, j] = q[i].argmax() if seq.params.greedy else sample(q[i][None], self._generator(seq))
            if j < gamma - 1:
                logits, _ = runner.forward(cache, drafted[:, j : j + 1], commit=True)
                logits = logits[:, 0]
        return Proposal(tokens=drafted.cpu(), lengths=[gamma] * len(seqs), probs=probs)

    def _generator(self, seq: Sequence) -> torch.Generator:
        # Draft draws use the request's own generator, so a seed fixes the whole completion.
        if seq.generator is None:
            seq.generator = make_generator(seq.params.seed, self.runner.device)
        return seq.generator

    def accepted(self, seqs: list[Sequence], proposal: Proposal, accepted: list[int]) -> None:
        # The cache holds drafts 0..gamma-2; drop those past each row's accepted prefix.
        forwarded = max(proposal.tokens.shape[1] - 1, 0)
        self.runner.drop_last(self.cache, [max(forwarded - a, 0) for a in accepted])

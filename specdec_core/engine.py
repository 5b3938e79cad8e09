"""One decoding step for a batch of sequences, speculative or plain.

The target's cache holds every token of a row but the last; each step feeds
that last token plus the row's draft tokens in one pass, so the logits at
position j judge draft token j and the logits after the last kept token give
the next one. Plain decoding is the same step with no draft tokens. A tree
proposal is the same pass with a tree mask (tree.py); the kept path's slots
stay and the rest roll back. Per-position figures count a tree by depth: a
row that drafted a tree of depth d drafted d positions, whatever its width.

A step has three phases: propose (the drafter, cut to each row's budget),
verify (the target pass, each row's own logits processing, then verify.py's
rules over all rows at once) and commit (tokens, cache slots, drafter and
controller told what was kept).
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from .control import Controller
from .drafters import grammar as grammar_drafts
from .drafters.base import Drafter, Proposal
from .grammar import masked
from .models import vnni
from .models.runner import BatchCache, ModelRunner, select_features
from .prefix_cache import Block, OwnPrefix, PrefixCache
from .sampling import (
    PositionNoise,
    SamplingParams,
    greedy_tokens,
    keyed_tokens,
    make_generator,
    running_counts,
    sampling_logits,
    to_probs,
)
from .sequence import Sequence
from .tree import batch_layout, depths, path_counts, within_depth
from .verify import (
    accept_chains_greedy,
    accept_chains_sampled,
    accept_trees_greedy,
    accept_trees_sampled,
)


@dataclass
class RowResult:
    """What one row got from a step."""

    seq: Sequence
    new_tokens: list[int]
    drafted: int  # positions the drafter drafted (a tree's depth), the grammar's forced tokens not among them
    accepted: int
    grammar_drafted: int = 0  # forced tokens the grammar drafted (drafters/grammar.py)
    grammar_accepted: int = 0


@dataclass
class StepReport:
    """Measured figures of one step, for metrics and benchmarks."""

    mode: str  # "speculative" or "plain"
    method: str
    batch_size: int
    gamma: int
    draft_s: float
    verify_s: float
    grammar_s: float = 0.0  # walking the grammars of constrained rows down the proposal, for their masks (0: none)
    rows: list[RowResult] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)  # rows whose draft token at j was kept
    drafted_per_position: list[int] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)  # rows whose verification raised; removed


@dataclass
class Verdict:
    """What the target pass and the acceptance rule made of a step's proposal, row by row."""

    logits: torch.Tensor  # [B, width+1, V] the target's, after each row's last token then each draft
    hidden: tuple[torch.Tensor, ...] | None  # the pass's hidden states, when the drafter reads features
    verify_s: float
    paths: list[list[int]]  # per row, the kept draft indices (a tree's root to leaf); [] for a failed row
    tokens: list[list[int] | None]  # per row, the tokens to emit; None: the row failed
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)


@dataclass
class Admission:
    """A sequence being prefilled, chunk by chunk, before it joins the batch."""

    seq: Sequence
    row: BatchCache  # or a StaticCache: one row, the target runner's kind
    ids: list[int]  # what is prefilled: every token of the sequence (the last one's logits draw its first new token)
    want_logits: bool = False
    looked_up: bool = False  # whether the prefix cache was asked (`Engine.advance`'s first call)
    done: int = 0  # tokens of ids in the row so far
    cached: int = 0  # of which the prefix cache gave
    keys: list[bytes] = field(default_factory=list)  # the prefix cache's keys of ids' whole chunks
    blocks: list[Block] = field(default_factory=list)  # the blocks the prefix cache gave
    # The drafter's own prefill (a draft model's), a pass a call beside the target's chunks; what it gives the
    # cache and the row it made.
    drafting: Generator[None, None, BatchCache | None] | None = None
    own: OwnPrefix | None = None
    draft_row: BatchCache | None = None
    drafted: bool = False
    logits: list[torch.Tensor] = field(default_factory=list)  # each chunk's pass's
    hidden: list[torch.Tensor | None] = field(default_factory=list)  # each block's or chunk's features, when read
    first: RowResult | None = None  # what its join emitted: its first new token (none for echo-only scoring)

    def prompt_logits(self) -> torch.Tensor | None:
        """The prompt's logits [len(ids) - 1, V], each after a prompt token and before the next, when asked for."""
        if not self.want_logits:
            return None
        return torch.cat(self.logits)[:-1]


SAMPLING_RULES = ("gumbel", "rejection")


class Engine:
    """Owns the target's batch cache, the drafter and the controller. Seeded sampled rows are verified by the
    Gumbel rule: draws keyed by position (sampling.PositionNoise), a draft kept iff it is the target's draw, so
    that a seed returns plain decoding's text. Unseeded ones by `unseeded_rule`: "rejection", rejection
    sampling (verify.py) from each row's generator, or "gumbel"."""

    def __init__(
        self, target: ModelRunner, drafter: Drafter | None, controller: Controller, eos_token_ids: set[int],
        unseeded_rule: str = "rejection", chunk_tokens: int = 128, prefix_cache: PrefixCache | None = None,
        grammar_draft_tokens: int = 16, exact_prefill: bool = False, chunk_context_tokens: int | None = None,
    ):
        if unseeded_rule not in SAMPLING_RULES:
            raise ValueError(f"unseeded_rule {unseeded_rule!r} is not one of {SAMPLING_RULES}")
        self.target = target
        self.drafter = drafter
        self.controller = controller
        self.eos_token_ids = frozenset(eos_token_ids)
        self.unseeded_rule = unseeded_rule
        self.cache = target.new_cache()
        self.chunk_tokens = chunk_tokens
        # With it, chunks shrink as the context they attend grows (`_chunk_end`): the context at which a row's
        # attention costs as much as its linear layers.
        self.chunk_context_tokens = chunk_context_tokens
        self.prefix_cache = prefix_cache
        # Prefill passes compute each row as decoding does (row-invariant), so that any pass's keys and values are
        # a cold prefill's: the prefix cache then keeps blocks of any size, answers too (prefix_cache.py).
        self.exact_prefill = exact_prefill
        self.grammar_draft_tokens = grammar_draft_tokens  # most of a grammar's forced continuation a row drafts first
        self.chunks = 0  # prefill passes run, for metrics
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
        """Prefill a new sequence, all its chunks at once, and draw its first token; it joins the batch unless that
        token finished it. With prompt_logits, returns the prompt's logits [len-1, V]."""
        admission = self.begin(seq, prompt_logits)
        while not self.advance(admission):
            pass
        return admission.prompt_logits()

    def warm_up(self) -> None:
        """One prefill chunk through a row of its own, thrown away: what a process's first long pass pays once
        (a quantized target's bf16 weights dequantized and kept, the kernels' first calls, the timing that chooses
        AMX tiles or VNNI for the kernel's verify passes) is paid here, before a server says it is ready, not by
        its first request (measured: 4 s of the default config's first TTFT)."""
        if self.target.row_invariant:  # on our kernel, whose warm-up chunk may take the bf16 product instead
            vnni.amx()
        tokens = min(self.chunk_tokens, self.target.config.max_position_embeddings)
        row = self.target.new_cache()
        row.reserve(1, tokens)
        ids = torch.zeros(1, tokens, dtype=torch.long, device=self.target.device)
        self.target.forward(row, ids, commit=True, last_logits_only=True, row_invariant=self.exact_prefill)
        if self.drafter:  # a draft model's prefill passes keep their weights too
            for _ in self.drafter.prefill(Sequence("warm-up", [0] * tokens, SamplingParams(), 1), None, tokens):
                pass

    def begin(self, seq: Sequence, prompt_logits: bool = False, joining_before: int = 0) -> Admission:
        """Start a new sequence's prefill; `advance` prefills it, a chunk a call. A request for the prompt's logits
        (echo with logprobs) prefills the whole prompt: the cache keeps keys and values, not logits.
        `joining_before`: sequences begun earlier and not yet joined, which join the batch before this one."""
        if not seq.prompt_ids:
            raise ValueError("a prompt needs at least one token")
        ids = seq.tokens
        row = self.target.new_cache()
        # The row's capacity is set once (every chunk's pass sees the same cache layout), as large as the batch's,
        # after room for the rows the batch may hold when it joins: the batch's rows are then copied in beside it,
        # not this one, a long prompt's whole keys and values, into the batch (StaticCache.append).
        row.reserve(1, max(len(ids), self.cache.slots), rows_before=len(self.seqs) + joining_before)
        return Admission(seq, row, ids, want_logits=prompt_logits)

    def _take_cached(self, admission: Admission) -> None:
        """Put the prompt's cached prefix in the admission's row. Done at its first chunk, not when it is admitted:
        prompts prefill one after another, so one admitted with another that begins the same way (a request's n
        choices, a shared system prompt) finds the other's chunks."""
        admission.looked_up = True
        cache, ids, seq = self.prefix_cache, admission.ids, admission.seq
        if cache is None or not cache.fits(len(ids), seq.request_id):
            return
        admission.keys = cache.keys(ids, seq.cache_namespace)
        # The last token is always prefilled: its logits draw the first new token (`_first_token`).
        usable = admission.keys[: (len(ids) - 1) // cache.block_tokens]
        admission.blocks = [] if admission.want_logits else cache.lookup(usable)
        if admission.blocks:  # in one write: a long prefix is hundreds of blocks, each a copy a layer
            blocks = admission.blocks
            admission.row.write_span(torch.cat([b.keys for b in blocks], dim=2), torch.cat([b.values for b in blocks], dim=2))
            admission.hidden.extend(block.hidden for block in blocks)
        admission.done = admission.cached = seq.cached_tokens = int(admission.row.lengths[0])
        cache.counts.hit_tokens += admission.cached
        cache.counts.miss_tokens += len(ids) - admission.cached

    def advance(self, admission: Admission) -> bool:
        """Prefill the admission's next chunk (its cached prefix first), and the drafter's own prefill's next pass;
        once both are in, it joins the batch: at the next call where rows are running, so that they step
        between its last pass and its join (and the first pass that carries it). True when it has joined."""
        if not admission.looked_up:
            self._take_cached(admission)
        ran = self._prefill_chunk(admission)
        ran = self._prefill_draft(admission) or ran  # the draft model's pass in the same round: it reads ids alone
        if admission.done < len(admission.ids) or not admission.drafted or (ran and self.seqs):
            return False
        self._join(admission)
        return True

    def _prefill_chunk(self, admission: Admission) -> bool:
        """The target's next chunk of the admission's prompt; whether there was one."""
        ids, start = admission.ids, admission.done
        end = min(self._chunk_end(start), len(ids))
        if end == start:
            return False
        chunk = torch.tensor([ids[start:end]], device=self.target.device)
        logits, hidden = self.target.forward(
            admission.row, chunk, commit=True, last_logits_only=not admission.want_logits, hidden_states=self.wants_features,
            row_invariant=self.exact_prefill,
        )
        admission.logits.append(logits[0])
        if hidden is not None:
            admission.hidden.append(select_features(hidden, self.drafter.feature_layers)[0])
        admission.done = end
        self.chunks += 1
        self._keep_blocks(admission, start, end)
        return True

    def _chunk_end(self, start: int) -> int:
        """Where a chunk from position `start` ends: `chunk_tokens` on, or, with `chunk_context_tokens` (K), as many
        tokens as keep its pass no costlier than a prompt's first chunk's. Row p costs 1 + p / K (its linear layers,
        then its attention over p positions), so n rows from s cost n (1 + (s + n / 2) / K): a chunk's pass, and the
        running streams' wait for it, stays about as long however much context it attends (at least one token)."""
        first, context = self.chunk_tokens, self.chunk_context_tokens
        if context is None:
            return start + first

        def cost(rows: int, at: int) -> int:  # 2K times the chunk's cost, in whole numbers
            return rows * (2 * context + 2 * at + rows)

        rows = first
        while rows > 1 and cost(rows, start) > cost(first, 0):
            rows -= 1
        return start + rows

    def _prefill_draft(self, admission: Admission) -> bool:
        """The drafter's next pass of its own prefill of the admission; whether there was one."""
        if admission.drafted or not self.drafter:
            admission.drafted = True
            return False
        if admission.drafting is None:
            admission.own = self._own_prefix(admission)
            admission.drafting = self.drafter.prefill(admission.seq, admission.own, self.chunk_tokens)
        try:
            next(admission.drafting)
            return True
        except StopIteration as done:
            admission.draft_row, admission.drafted = done.value, True
            return False

    def _keep_blocks(self, admission: Admission, start: int, end: int) -> None:
        """Put the whole blocks a chunk just prefilled (positions start..end-1) completed into the prefix cache: those
        ending in it (with an exact prefill a block may begin in an earlier chunk). Without an exact prefill a block
        is a whole chunk, so a prompt's partial last chunk stays out."""
        if self.prefix_cache is None:
            return
        size = self.prefix_cache.block_tokens
        blocks = range(start // size, min(end // size, len(admission.keys)))
        if not blocks:
            return
        hidden, first = None, end
        if self.wants_features:  # the last pieces of the features, back to the first block's start (not all of them)
            pieces = []
            for piece in reversed(admission.hidden):
                if first <= blocks.start * size:
                    break
                pieces.append(piece)
                first -= len(piece)
            hidden = torch.cat(pieces[::-1])  # positions first..end-1
        for index in blocks:
            at, to = index * size, (index + 1) * size
            keys, values = admission.row.read_span(at, to)  # stacked: copies, not views of the row
            features = None if hidden is None else hidden[at - first : to - first].clone()
            self.prefix_cache.insert(admission.keys[index], Block(keys, values, features))

    def keep_decoded(self, seqs: list[Sequence]) -> None:
        """Before finished sequences leave the batch: where prefills are exact, the prefix cache keeps the whole
        blocks of each one's prompt and answer (its keys and values are then a cold prefill's), so that a
        conversation's next turn, which resends them, prefills only what is new. Not for drafters that read the
        target's features: the batch keeps no features to go with the blocks."""
        cache = self.prefix_cache
        if cache is None or not self.exact_prefill or self.wants_features:
            return
        rows = {id(seq): i for i, seq in enumerate(self.seqs)}
        size = cache.block_tokens
        for seq in seqs:
            row = rows[id(seq)]
            committed = min(int(self.cache.lengths[row]), len(seq.tokens) - 1)  # past a stop: drafts kept, not emitted
            if not cache.fits(committed, seq.request_id):
                continue
            keys = cache.keys(seq.tokens[:committed], seq.cache_namespace)
            cache.insert_chain(keys, lambda i, row=row: Block(*self.cache.read_span(i * size, (i + 1) * size, row), None))

    def _join(self, admission: Admission) -> None:
        """A prefilled sequence draws its first new token and joins the batch, and its drafter's rows; one that
        this token finished (a stop, one token asked for, echo-only scoring) never joins."""
        seq = admission.seq
        seq.stats.method = self.method
        seq.generator = seq.generator or make_generator(seq.params.seed, self.target.device)
        if not seq.params.greedy and (seq.params.seed is not None or self.unseeded_rule == "gumbel"):
            # An unseeded row's noise is keyed by its generator's random seed.
            seq.noise = PositionNoise(seq.generator.initial_seed(), self.target.vocab_size, self.target.device)
        if seq.params.uses_counts:
            seq.counts = torch.zeros(self.target.vocab_size, device=self.target.device)
            for token in seq.output_ids:
                seq.counts[token] += 1
        admission.first = self._first_token(admission)
        if seq.finished:
            return
        features = None
        if self.wants_features:
            features = torch.cat(admission.hidden)
        self.cache.append(admission.row)
        if self.drafter:
            try:
                self.drafter.add(seq, features, admission.draft_row)
            except BaseException:
                # Take the row back: a cache row no sequence owns would break every later step.
                self.cache.keep_rows(list(range(len(self.seqs))))
                raise
            for index, keys_values in admission.own.computed.items() if admission.own else ():
                self.prefix_cache.attach_own(admission.keys[index], keys_values)
        self.seqs.append(seq)

    def _first_token(self, admission: Admission) -> RowResult:
        """The sequence's first new token, drawn from its prefill's last logits as a step draws a row's token after
        no drafts (the same rule, penalties, grammar mask and noise position), so that it reaches the client a
        target pass sooner than the first step would give it. Raises where that row would fail in a step."""
        seq = admission.seq
        if seq.remaining <= 0:  # echo-only scoring: the prompt was all that was asked
            seq.finish_reason = "length"
            return RowResult(seq, [], 0, 0)
        logits = admission.logits[-1][-1:]
        masks = [None if seq.grammar is None else seq.grammar.walk_chain([])[1]]
        proposal = grammar_drafts.nothing(1)
        drafts = proposal.tokens.to(self.target.device)
        targets, failures = self._row_targets([seq], proposal, drafts, logits[None], masks)
        if failures:
            raise failures[0]
        verdict = Verdict(logits[None], None, 0.0, paths=[[]], tokens=[None])
        self._accept(verdict, [0], [seq], [targets[0]], drafts, proposal)
        return RowResult(seq, self._emit(seq, verdict.tokens[0], logits), 0, 0)

    def _own_prefix(self, admission: Admission) -> OwnPrefix | None:
        """What the drafter's own cache takes from the prefix cache: its keys and values of the blocks the prompt
        found, as far as each has them; None where the drafter has no cache of its own or the prefix cache is off."""
        if self.prefix_cache is None or not self.drafter.keeps_own_kv:
            return None
        cached = []
        for block in admission.blocks:
            if block.own is None:
                break
            cached.append(block.own)
        return OwnPrefix(self.prefix_cache.block_tokens, len(admission.keys), cached)

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
        """Decode one step for every sequence in the batch: propose drafts, verify them all in one target pass,
        commit what each row kept; finished and failed rows leave the batch."""
        seqs = self.seqs
        gamma = self.controller.choose(seqs) if self.drafter else 0
        start = time.perf_counter()
        proposal = self._propose(seqs, gamma)
        draft_s = time.perf_counter() - start
        proposal, masks = self._constrain(seqs, proposal)
        grammar_s = time.perf_counter() - start - draft_s if any(mask is not None for mask in masks) else 0.0
        verdict = self._verify(seqs, proposal, masks)
        return self._commit(seqs, proposal, verdict, gamma, draft_s, grammar_s)

    def _propose(self, seqs: list[Sequence], gamma: int) -> Proposal:
        """The drafter's proposal (after the forced continuations of rows with a grammar) cut to each row's token
        budget; trees come back with exactly their nodes' parents."""
        budgets = [seq.draft_budget for seq in seqs]
        if self.drafter and self.grammar_draft_tokens and any(seq.grammar is not None for seq in seqs):
            speculating = len(seqs) <= self.controller.max_speculative_batch
            proposal = grammar_drafts.propose(self.drafter, seqs, gamma, self.grammar_draft_tokens * speculating, budgets)
        elif self.drafter and gamma:
            proposal = self.drafter.propose(seqs, gamma)
        else:
            return grammar_drafts.nothing(len(seqs))
        if proposal.parents is None:
            return _chains_within(proposal, budgets)
        return proposal.keep([within_depth(parents[:n], budget)
                              for parents, n, budget in zip(proposal.parents, proposal.lengths, budgets)])

    def _constrain(self, seqs: list[Sequence], proposal: Proposal) -> tuple[Proposal, list[torch.Tensor | None]]:
        """Each constrained row's bitmasks for the pass's positions, its proposal cut where the grammar forbids a
        draft (the masked target could never keep it, nor what follows it)."""
        masks: list[torch.Tensor | None] = [None] * len(seqs)
        if all(seq.grammar is None for seq in seqs):
            return proposal, masks
        allowed = []
        for i, seq in enumerate(seqs):
            n = proposal.lengths[i]
            drafts = proposal.tokens[i, :n].tolist()
            if seq.grammar is None:
                allowed.append(list(range(n)))
            elif proposal.parents is None:
                kept, masks[i] = seq.grammar.walk_chain(drafts)
                allowed.append(list(range(kept)))
            else:
                nodes, masks[i] = seq.grammar.walk_tree(drafts, proposal.parents[i][:n])
                allowed.append(nodes)
        if proposal.parents is None:
            return _chains_within(proposal, [len(nodes) for nodes in allowed]), masks
        return proposal.keep(allowed), masks

    def _verify(self, seqs: list[Sequence], proposal: Proposal, masks: list[torch.Tensor | None]) -> Verdict:
        """One target pass over every row's last token and drafts, then the acceptance rule over all rows at once."""
        width, device = proposal.width, self.target.device
        lengths = torch.tensor(proposal.lengths)
        drafts = torch.where(torch.arange(width) < lengths[:, None], proposal.tokens[:, :width].cpu(), 0)  # host
        ids = torch.cat([torch.tensor([seq.tokens[-1] for seq in seqs], dtype=torch.long)[:, None], drafts], dim=1)
        tree_mask, offsets = batch_layout(proposal.parents, width) if proposal.parents else (None, None)
        start = time.perf_counter()
        logits, hidden = self.target.forward(
            self.cache, ids.to(device), tree_mask=None if tree_mask is None else tree_mask.to(device),
            depths=None if offsets is None else offsets.to(device), hidden_states=self.wants_features,
            row_invariant=self.target.row_invariant,
        )
        verdict = Verdict(logits, hidden, time.perf_counter() - start, paths=[[] for _ in seqs], tokens=[None] * len(seqs))
        targets, failures = self._row_targets(seqs, proposal, drafts, logits, masks)
        drafts = drafts.to(device)
        for by_tokens in (True, False):  # the two kinds of rule, each over all its rows
            rows = [i for i in targets if _judged_by_tokens(seqs[i]) == by_tokens]
            if rows:
                self._accept(verdict, rows, [seqs[i] for i in rows], [targets[i] for i in rows], drafts, proposal)
        verdict.failed = [(seqs[i], failures[i]) for i in sorted(failures)]
        return verdict

    def _row_targets(
        self, seqs: list[Sequence], proposal: Proposal, drafts: torch.Tensor, logits: torch.Tensor,
        masks: list[torch.Tensor | None],
    ) -> tuple[dict[int, torch.Tensor], dict[int, Exception]]:
        """Each row's `_targets` by row index, and the rows that failed: a row whose processing raises, or whose
        probabilities the draws would refuse (NaN logits, say), fails alone before the batch's acceptance."""
        targets: dict[int, torch.Tensor] = {}
        failures: dict[int, Exception] = {}
        for i, seq in enumerate(seqs):
            n = proposal.lengths[i]
            try:
                row_logits = logits[i, : n + 1] if masks[i] is None else masked(logits[i, : n + 1], masks[i])
                targets[i] = self._targets(seq, drafts[i, :n], proposal.parents[i] if proposal.parents else None, row_logits)
            except Exception as exc:
                failures[i] = exc
        sampled = [i for i in targets if not _judged_by_tokens(seqs[i])]
        if sampled:
            probs = torch.nn.utils.rnn.pad_sequence([targets[i] for i in sampled], batch_first=True)
            invalid = ~(probs.isfinite() & (probs >= 0)).flatten(1).all(-1)
            for i, bad in zip(sampled, invalid.tolist()):  # one read back for all rows
                if bad:
                    failures[i] = ValueError(f"{seqs[i].request_id}: the target's probabilities are not finite and non-negative")
                    del targets[i]
        return targets, failures

    def _targets(self, seq: Sequence, draft: torch.Tensor, parents: list[int] | None, logits: torch.Tensor) -> torch.Tensor:
        """What one row's drafts are judged against, after its own penalties, temperature and top-k/top-p, after the
        root then after each draft: the target's tokens [n+1], its argmax (greedy) or its keyed draws (the Gumbel
        rule), or its distributions [n+1, V] (rejection sampling)."""
        vocab = self.target.vocab_size
        counts = running_counts(seq.counts, draft, vocab) if parents is None else path_counts(seq.counts, draft, parents, vocab)
        if seq.params.greedy:
            return greedy_tokens(logits, seq.params, counts)
        if seq.noise is None:
            return to_probs(logits, seq.params, counts)
        scores = sampling_logits(logits, seq.params, counts)
        if scores.isnan().any() or not scores.isfinite().any(-1).all():
            raise ValueError(f"{seq.request_id}: the target's sampling logits are NaN, or -inf for every token")
        # Position j of targets judges the token at output position t + depth: the root's next, then each node's.
        t = len(seq.output_ids)
        return keyed_tokens(scores, seq.noise.at([t] + [t + d for d in (depths(parents) if parents else range(1, len(draft) + 1))]))

    def _accept(
        self, verdict: Verdict, rows: list[int], seqs: list[Sequence], targets: list[torch.Tensor], drafts: torch.Tensor,
        proposal: Proposal,
    ) -> None:
        """Batched acceptance for the batch's `rows` (their sequences `seqs`, all greedy or all sampled) into
        verdict's paths and tokens."""
        targets = torch.nn.utils.rnn.pad_sequence(targets, batch_first=True)  # [b, G+1] tokens or [b, G+1, V] probs
        index = torch.tensor(rows, device=drafts.device)
        drafts = drafts[index, : targets.shape[1] - 1]
        lengths = [proposal.lengths[i] for i in rows]
        parents = [proposal.parents[i] for i in rows] if proposal.parents else None
        if _judged_by_tokens(seqs[0]):  # greedy, or the Gumbel rule: a draft is kept iff it is the target's token
            accepted = accept_chains_greedy(drafts, lengths, targets) if parents is None else accept_trees_greedy(drafts, parents, targets)
        else:
            q = None if proposal.probs is None else proposal.probs.to(drafts.device)[index, : drafts.shape[1]]
            generators = [seq.generator for seq in seqs]
            accepted = (
                accept_chains_sampled(drafts, lengths, targets, q, generators) if parents is None
                else accept_trees_sampled(drafts, parents, targets, q, generators)
            )
        # Read back to the host once the rule has run for every row.
        counts, tokens = accepted.counts.tolist(), accepted.tokens.tolist()
        paths = accepted.path.tolist() if accepted.path is not None else [list(range(n)) for n in counts]
        for i, n, path, emitted in zip(rows, counts, paths, tokens):
            verdict.paths[i], verdict.tokens[i] = path[:n], emitted[: n + 1]

    def _commit(
        self, seqs: list[Sequence], proposal: Proposal, verdict: Verdict, gamma: int, draft_s: float, grammar_s: float,
    ) -> StepReport:
        """Append each row's tokens, keep its last token's and kept drafts' cache slots, tell the drafter and
        the controller what was kept, and take finished and failed rows out of the batch."""
        width, features = proposal.width, self.wants_features
        drafted = [max(depths(row), default=0) for row in proposal.parents] if proposal.parents else proposal.lengths
        forced = proposal.forced or [0] * len(seqs)  # the forced tokens lead: a row's first forced[i] depths
        keep = torch.zeros(len(seqs), width + 1, dtype=torch.bool)
        kept_features, rows = [], []
        hidden = select_features(verdict.hidden, self.drafter.feature_layers) if features else None
        for i, (seq, path, tokens) in enumerate(zip(seqs, verdict.paths, verdict.tokens)):
            slots = [0] + [1 + j for j in path]  # this step's slots the row keeps: its last token, then the path
            keep[i, slots] = True
            if features:
                kept_features.append(hidden[i, slots])
            if tokens is not None:  # a failed row keeps only its last token's slot, and leaves the batch below
                emitted = self._emit(seq, tokens, verdict.logits[i, slots])
                # Forced tokens delivered (kept, and not past a stop), then the drafter's.
                by_grammar = min(forced[i], len(path), len(emitted))
                kept = min(len(path), len(emitted)) - by_grammar
                _count_speculation(seq, drafted[i] - forced[i], kept, len(emitted) - by_grammar, forced[i], by_grammar)
                rows.append(RowResult(seq, emitted, drafted[i] - forced[i], kept, forced[i], by_grammar))
        self.cache.commit(keep.to(self.target.device))
        if self.drafter and (gamma or features):  # feature drafters need every committed token's features
            own, own_paths = grammar_drafts.own_paths(proposal, verdict.paths)
            self.drafter.accepted(seqs, own, own_paths, kept_features if features else None)
        positions = max((row.drafted for row in rows), default=0)
        self.controller.observe(
            len(seqs), width + 1, verdict.verify_s, positions, draft_s, [(row.seq, row.drafted, row.accepted) for row in rows],
        )
        report = StepReport(
            mode="speculative" if width else "plain",
            method=self.method,
            batch_size=len(seqs),
            gamma=positions,
            draft_s=draft_s,
            verify_s=verdict.verify_s,
            grammar_s=grammar_s,
            rows=rows,
            accepted_per_position=[sum(row.accepted > j for row in rows) for j in range(positions)],
            drafted_per_position=[sum(row.drafted > j for row in rows) for j in range(positions)],
            finished=[seq for seq in seqs if seq.finished],
            failed=verdict.failed,
        )
        self.keep_decoded(report.finished)
        self.remove(report.finished + [seq for seq, _ in report.failed])
        return report

    def _emit(self, seq: Sequence, tokens: list[int], logits: torch.Tensor) -> list[int]:
        """Append tokens (the j-th drawn from logits[j]) up to the first stop, and move the row's grammar past them;
        returns those appended."""
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
        if seq.noise is not None:  # the positions behind the sequence are never drawn again
            seq.noise.forget_before(len(seq.output_ids))
        if seq.grammar is not None:
            seq.grammar.advance(emitted)
        return emitted


def _judged_by_tokens(seq: Sequence) -> bool:
    """Whether a row's drafts are judged against the target's tokens (greedy, the Gumbel rule), not its p."""
    return seq.params.greedy or seq.noise is not None


def _count_speculation(seq: Sequence, drafted: int, kept: int, emitted: int, forced: int, forced_kept: int) -> None:
    """Add one step's figures to the row's usage: the drafter's (if it drafted), and the grammar's apart. Counts are
    of delivered tokens: drafts kept past a stop are not."""
    stats = seq.stats
    stats.grammar_draft_tokens += forced
    stats.grammar_accepted_tokens += forced_kept
    if not drafted:
        return
    stats.draft_tokens += drafted
    stats.accepted_tokens += kept
    stats.verify_steps += 1
    stats.gamma_sum += drafted
    stats.emitted_tokens += emitted


def _chains_within(proposal: Proposal, lengths: list[int]) -> Proposal:
    """Each row's chain cut to at most lengths[i] tokens (in place: what follows is padding)."""
    proposal.lengths = [min(n, most) for n, most in zip(proposal.lengths, lengths)]
    if proposal.forced is not None:
        proposal.forced = [min(f, n) for f, n in zip(proposal.forced, proposal.lengths)]
    return proposal

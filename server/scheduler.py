"""The scheduler: a bounded queue in front of one worker thread that owns the engine.

The event loop submits a `Job` (one HTTP request: n sequences per prompt) and
reads its `Update`s from an asyncio queue that the worker feeds through
`loop.call_soon_threadsafe`. The worker loads the models, then loops:
drop cancelled sequences, admit waiting ones into free batch slots, prefill
one chunk of the oldest admitted prompt (a long prompt joins the batch over
several rounds, so running streams get a step between its chunks), run one
engine step, and turn each row's new tokens into released text (incremental
detokenization, stop strings) and metrics. Only the worker touches the
engine; the event loop gets a tokenizer copy of its own.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import gc
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch

from specdec_core.config import GrammarConfig
from specdec_core.engine import Admission, Engine, RowResult
from specdec_core.grammar import Grammars
from specdec_core.models.catalogue import REGISTRY
from specdec_core.sequence import Sequence, SpecStats

from .detokenize import Piece, TextOutput
from .metrics import Metrics
from .schemas import APIError, internal_error
from .settings import ServerConfig

log = logging.getLogger("specdec.server")


@dataclass
class Logprob:
    """The target's log-probability of a token, and the top alternatives at its position."""

    token: str
    logprob: float | None  # None for the first prompt token, which nothing predicts
    top: list[tuple[str, float]]


@dataclass
class TokenOut:
    """One released token: its text (possibly cut by a stop string) and, when asked, its logprobs."""

    text: str
    offset: int  # where text starts in the choice's output text
    logprob: Logprob | None = None
    source: str | None = None  # with return_token_sources: "drafter", "grammar" (drafts kept) or "target"


@dataclass
class Update:
    """What one choice got since the last update."""

    index: int
    tokens: list[TokenOut] = field(default_factory=list)
    admitted: bool = False  # first update of a choice: it joined the batch
    prompt_logprobs: list[Logprob] | None = None  # with admitted, when echo with logprobs was asked
    finish_reason: str | None = None
    completion_tokens: int = 0  # tokens delivered so far, stop strings excluded
    cached_tokens: int = 0  # prompt tokens the prefix cache gave
    stats: SpecStats = field(default_factory=SpecStats)  # the choice's speculation so far


@dataclass
class Choice:
    """One sequence of a job, as the client will see it."""

    index: int
    seq: Sequence
    stop: list[str]
    echo_logprobs: bool = False
    output: TextOutput | None = None  # made on admission, by the worker
    last_token_at: float | None = None
    sources: list[str] | None = None  # with return_token_sources: where each output token came from (TokenOut.source)


class Job:
    """One HTTP request in flight: its choices and the queue its updates arrive on."""

    def __init__(self, choices: list[Choice]):
        self.choices = choices
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[Update | APIError] = asyncio.Queue()
        self.arrival = time.monotonic()
        self.cancelled = False
        self.unadmitted = deque(choices)
        self.unfinished = len(choices)
        self.first_token_at: float | None = None

    def post(self, item: Update | APIError) -> None:
        """Hand an update to the event loop (called from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:
            pass  # the loop has closed: nobody is listening any more

    async def updates(self) -> AsyncIterator[Update]:
        """Updates until every choice has finished; raises the APIError that failed the job."""
        unfinished = len(self.choices)
        while unfinished:
            item = await self.events.get()
            if isinstance(item, APIError):
                raise item
            unfinished -= item.finish_reason is not None
            yield item


@dataclass
class ModelInfo:
    """What the event loop needs to know about the loaded target."""

    tokenizer: object  # a copy: the engine's own tokenizer belongs to the worker thread
    vocab_size: int
    context_length: int
    grammars: Grammars  # compiles response_format and tools (in threads of their own)
    tool_format: str  # how the model writes tool calls (server/tools.py)
    drafter: str  # the engine's drafter ("none": it has none); /v1/models says it, for the playground


class Scheduler:
    """Queue, continuous batching and the worker thread."""

    def __init__(self, load: Callable[[], Engine], settings: ServerConfig, metrics: Metrics,
                 grammar: GrammarConfig | None = None):
        self._load = load
        self.settings = settings
        self.grammar = grammar or GrammarConfig()
        self.metrics = metrics
        self.state = "loading"  # loading -> ready -> draining -> stopped, or loading -> failed
        self.error: str | None = None
        self.model: ModelInfo | None = None
        self.engine: Engine | None = None
        self.on_load_error: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._run, name="specdec-worker", daemon=True)
        # Shared with the event loop, under the condition's lock:
        self._cond = threading.Condition()
        self._jobs: set[Job] = set()
        self._waiting: deque[Job] = deque()
        self._cancelled: list[Job] = []
        self._deadline: float | None = None
        self._stopping = False
        # The worker's own: admitted sequences by id, with their job and choice; prompts being prefilled, oldest first.
        self._active: dict[int, tuple[Job, Choice]] = {}
        self._prefilling: deque[tuple[Job, Choice, Admission]] = deque()

    # -- event loop side -----------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job; 503 while loading or draining, 429 with Retry-After when the queue is full."""
        with self._cond:
            if self.state != "ready":
                raise APIError(503, f"the server is {self.state}", type="server_error", code="unavailable")
            if len(self._waiting) >= self.settings.max_queue:
                raise APIError(
                    429, f"the queue is full ({self.settings.max_queue} requests waiting); retry shortly",
                    type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"},
                )
            self._jobs.add(job)
            self._waiting.append(job)
            self.metrics.queue_depth.set(len(self._waiting))
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """The client went away: the worker frees the job's slots before its next step."""
        with self._cond:
            if job in self._jobs and not job.cancelled:
                job.cancelled = True
                self._cancelled.append(job)
                self._cond.notify()

    def drain(self, grace_s: float) -> None:
        """Stop admitting; jobs in flight may finish within grace_s, then they are cancelled."""
        with self._cond:
            if self.state in ("loading", "ready"):
                self.state = "draining"
            deadline = time.monotonic() + grace_s
            self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)
            self._cond.notify()

    def shutdown(self) -> None:
        """Drain (within the configured grace), then stop the worker thread."""
        self.drain(self.settings.shutdown_grace_s)
        with self._cond:
            self._cond.wait_for(lambda: not self._jobs)
            self._stopping = True
            self._cond.notify()
        if self.engine is not None:  # still loading: the daemon thread ends with the process
            self._thread.join()
        if self.state != "failed":
            self.state = "stopped"

    # -- worker side ---------------------------------------------------------

    def _model_info(self, engine: Engine) -> ModelInfo:
        config, target, grammar = engine.target.config, engine.target, self.grammar
        tokenizer = copy.deepcopy(target.tokenizer)
        entry = REGISTRY.get(target.name)
        return ModelInfo(
            tokenizer=tokenizer,
            vocab_size=target.vocab_size,
            context_length=self.settings.max_model_len or config.max_position_embeddings,
            grammars=Grammars(tokenizer, target.vocab_size, engine.eos_token_ids, grammar.compile_timeout_s,
                              grammar.cache_entries, on_compile=self.metrics.grammar_compile.observe),
            tool_format=grammar.tool_format or (entry.tool_format if entry else "hermes"),
            drafter=engine.method,
        )

    def _run(self) -> None:
        try:
            engine = self._load()
            engine.warm_up()
            self.model = self._model_info(engine)
        except Exception as exc:
            # /health tells that it failed and where to look; the cause is in the log, as for any 5xx.
            self.error, self.state = internal_error("loading the models failed", exc).message, "failed"
            if self.on_load_error:
                self.on_load_error()
            return
        self.engine = engine
        # What loading made (about 430,000 objects for the default config) lives as long as the server: a full
        # collection scanned it for 160-185 ms, a stall of every stream whenever one ran. Frozen, it is not scanned.
        gc.collect()
        gc.freeze()
        self.metrics.serving(engine.method, engine.controller.gamma_max)
        self.metrics.watch_prefill(engine)
        with self._cond:
            if self.state == "loading":
                self.state = "ready"
        log.info("ready: target %s, drafter %s, context %d tokens", engine.target.name, engine.method, self.model.context_length)
        while True:
            try:
                if not self._iterate():
                    gc.unfreeze()  # stopped: what loading made may go (a process that serves again, as tests do)
                    return
            except Exception as exc:
                # Whatever broke (a step, a prefill's leftovers, this loop) broke the batch:
                # fail its requests, keep the waiting ones, keep serving.
                what = f"decoding failed for the whole batch ({len(self.engine.seqs)} sequences)"
                self._fail_batch(internal_error(what, exc))

    def _iterate(self) -> bool:
        """One round: cancel, expire, admit, step. False once it is time to stop."""
        with self._cond:
            self._cond.wait_for(lambda: self._jobs or self._stopping)
            if self._stopping:
                return False
            cancelled, self._cancelled = self._cancelled, []
            expired = self._deadline is not None and time.monotonic() >= self._deadline
        for job in cancelled:
            log.info("client gone: cancelled a request, freed %d batch slots", self._drop(job))
        if expired:
            for job in list(self._jobs):
                self._fail(job, APIError(503, "the server is shutting down", type="server_error", code="shutdown"))
        for job, choice in self._take_admissible():
            self._admit(job, choice)
        if self._prefilling:
            self._prefill_chunk()
        if self.engine.seqs:
            self._step()
        self.metrics.running_requests.set(len({id(job) for job, _ in self._active.values()}))
        return True

    def _take_admissible(self) -> list[tuple[Job, Choice]]:
        """Pop waiting choices into the batch's free slots, one per job in turn (oldest first), so
        that a request of many sequences shares the slots with the requests behind it."""
        free = self.settings.max_batch_size - len(self.engine.seqs) - len(self._prefilling)
        taken = []
        with self._cond:
            while free > 0 and self._waiting:
                job = self._waiting.popleft()
                taken.append((job, job.unadmitted.popleft()))
                free -= 1
                if job.unadmitted:
                    self._waiting.append(job)
            self.metrics.queue_depth.set(len(self._waiting))
        return taken

    def _admit(self, job: Job, choice: Choice) -> None:
        """Start a choice's prefill: its cached prefix is in place, its chunks follow, one a round."""
        if job not in self._jobs:
            return  # failed while this choice waited
        try:
            admission = self.engine.begin(choice.seq, choice.echo_logprobs, joining_before=len(self._prefilling))
        except Exception as exc:
            self._fail(job, internal_error(f"the prefill of {choice.seq.request_id} failed", exc))
            return
        self._prefilling.append((job, choice, admission))

    def _prefill_chunk(self) -> None:
        """Prefill the oldest admitted prompt's next chunk; once its last is in, its sequence draws its first token,
        released at once, and joins the batch."""
        job, choice, admission = self._prefilling[0]
        seq = choice.seq
        try:
            joined = self.engine.advance(admission)
        except Exception as exc:
            self._prefilling.popleft()
            self._fail(job, internal_error(f"the prefill of {seq.request_id} failed", exc))
            return
        if not joined:
            return
        self._prefilling.popleft()
        prompt_logits = admission.prompt_logits()
        self._active[id(seq)] = (job, choice)
        choice.output = TextOutput(self.engine.target.tokenizer, seq.prompt_ids, choice.stop)
        prompt_logprobs = self._prompt_logprobs(seq, prompt_logits) if choice.echo_logprobs else None
        job.post(self._update(choice, [], admitted=True, prompt_logprobs=prompt_logprobs))
        self.metrics.generated_tokens.inc(len(admission.first.new_tokens))
        self._release([admission.first])

    def _step(self) -> None:
        report = self.engine.step()
        self.metrics.observe_step(report)
        for seq, exc in report.failed:  # the engine has removed these rows; their requests end here
            if id(seq) in self._active:  # else its job failed already, with another of its rows
                self._fail(self._active[id(seq)][0], internal_error(f"decoding {seq.request_id} failed", exc))
        self._release(report.rows)

    def _release(self, rows: list[RowResult]) -> None:
        """Deliver rows' new tokens as text, and their finishes; rows a stop string ended leave the batch."""
        stopped = []
        for row in rows:
            if id(row.seq) not in self._active:
                continue  # its job failed above, with another of its rows
            job, choice = self._active[id(row.seq)]
            if choice.sources is not None:  # the step's tokens come in order: grammar's drafts, drafter's, target's
                kept = row.grammar_accepted + row.accepted
                choice.sources += [_source(j, row.grammar_accepted, kept) for j in range(len(row.new_tokens))]
            pieces = []
            for token in row.new_tokens:
                pieces += choice.output.add(token)
                if choice.output.stopped:
                    break
            if choice.output.stopped:
                reason = "stop"
                if not row.seq.finished:  # a finished row has left the batch already
                    stopped.append(row.seq)
            elif row.seq.finished:
                pieces += choice.output.finish()
                reason = "stop" if choice.output.stopped else row.seq.finish_reason  # held text may end in a stop
            else:
                reason = None
            self._deliver(job, choice, pieces, reason)
        self.engine.keep_decoded(stopped)  # a stop string ended them; the engine did not know
        self.engine.remove(stopped)

    def _deliver(self, job: Job, choice: Choice, pieces: list[Piece], reason: str | None) -> None:
        """Post released tokens (and the finish, if any) to the job; record token timings."""
        now = time.monotonic()
        if pieces:
            if job.first_token_at is None:
                job.first_token_at = now
                self.metrics.ttft.observe(now - job.arrival)
            # Tokens accepted in one step reach the client together: their gaps are 0.
            gaps = ([now - choice.last_token_at] if choice.last_token_at is not None else []) + [0.0] * (len(pieces) - 1)
            for gap in gaps:
                self.metrics.itl.observe(gap)
            choice.last_token_at = now
        update = self._update(choice, pieces, finish_reason=reason)
        if reason is not None:
            del self._active[id(choice.seq)]
            job.unfinished -= 1
        job.post(update)
        if job.unfinished == 0:
            self.metrics.request_latency.observe(now - job.arrival)
            self._forget(job)

    def _update(self, choice: Choice, pieces: list[Piece], **fields) -> Update:
        """The choice's released pieces, with its figures so far (usage, and continuous usage stats)."""
        seq = choice.seq
        return Update(choice.index, [self._token_out(choice, piece) for piece in pieces],
                      completion_tokens=choice.output.released, cached_tokens=seq.cached_tokens,
                      stats=dataclasses.replace(seq.stats), **fields)

    def _token_out(self, choice: Choice, piece: Piece) -> TokenOut:
        seq = choice.seq
        source = choice.sources[piece.position] if choice.sources is not None else None
        if seq.top_logprobs is None:
            return TokenOut(piece.text, piece.offset, source=source)
        logprob = self._logprob(piece.token_id, seq.token_logprobs[piece.position], seq.top_logprob_ids[piece.position])
        return TokenOut(piece.text, piece.offset, logprob, source)

    def _prompt_logprobs(self, seq: Sequence, logits: torch.Tensor) -> list[Logprob]:
        """The target's logprobs of each prompt token given the ones before it (echo)."""
        logprobs = logits.log_softmax(dim=-1)
        out = [self._logprob(seq.prompt_ids[0], None, [])]
        for j, token in enumerate(seq.prompt_ids[1:]):
            top = logprobs[j].topk(seq.top_logprobs) if seq.top_logprobs else None
            alternatives = list(zip(top.indices.tolist(), top.values.tolist())) if top else []
            out.append(self._logprob(token, float(logprobs[j, token]), alternatives))
        return out

    def _logprob(self, token: int, logprob: float | None, top: list[tuple[int, float]]) -> Logprob:
        decode = self.engine.target.tokenizer.decode
        return Logprob(decode([token]), logprob, [(decode([t]), value) for t, value in top])

    def _drop(self, job: Job) -> int:
        """Remove a job's sequences from the batch and its prompts from the prefills, and forget the job; returns
        the slots freed."""
        prefilling = len(self._prefilling)
        self._prefilling = deque(entry for entry in self._prefilling if entry[0] is not job)
        mine = [choice.seq for choice in job.choices if id(choice.seq) in self._active]
        self.engine.remove(mine)
        for seq in mine:
            del self._active[id(seq)]
        self._forget(job)
        return len(mine) + prefilling - len(self._prefilling)

    def _fail(self, job: Job, error: APIError) -> None:
        self._drop(job)
        job.post(error)

    def _fail_batch(self, error: APIError) -> None:
        """Fail every job with a sequence in the batch, and empty the batch (its state is suspect)."""
        self.engine.remove(list(self.engine.seqs))  # empties the caches without reading them
        jobs = {id(job): job for job, _ in self._active.values()}
        self._active.clear()
        for job in jobs.values():
            self._fail(job, error)

    def _forget(self, job: Job) -> None:
        with self._cond:
            self._jobs.discard(job)
            if job in self._waiting:
                self._waiting.remove(job)
                self.metrics.queue_depth.set(len(self._waiting))
            self._cond.notify_all()  # shutdown() waits for the last job


def _source(j: int, forced: int, kept: int) -> str:
    """Where a step's j-th new token came from, its first `forced` the grammar's kept drafts and up to `kept` drafts."""
    return "grammar" if j < forced else "drafter" if j < kept else "target"

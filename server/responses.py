"""Response and stream-chunk objects, shaped exactly as OpenAI shapes them.

A format knows one endpoint's choice shapes; `collect` and `stream` drive a
job's updates through it, the same way for completions and chat.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, fields

from specdec_core.sequence import SpecStats

from .scheduler import Job, Logprob, TokenOut, Update
from .schemas import APIError, StreamOptions
from .tools import ToolCallParser, split_calls


@dataclass
class Envelope:
    """The fields every response and chunk of one request share."""

    prefix: str  # "cmpl" or "chatcmpl"
    model: str
    id: str = field(init=False)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"

    def wrap(self, object: str, **fields) -> dict:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model, **fields}


def usage(prompt_tokens: int, finals: list[Update], n: int) -> dict:
    """OpenAI usage plus usage.speculative over all of the request's sequences (each one's latest update: its final
    one at the end, its figures so far in continuous usage stats). A prompt's tokens count once however many
    choices (`n`) it has, and so do its cached tokens: its first choice's."""
    stats = SpecStats(method=finals[0].stats.method if finals else "none")
    for update in finals:
        for name in (f.name for f in fields(SpecStats) if f.name != "method"):
            setattr(stats, name, getattr(stats, name) + getattr(update.stats, name))
    completion_tokens = sum(update.completion_tokens for update in finals)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(update.cached_tokens for update in finals if update.index % n == 0)},
        "speculative": stats.as_usage(),
    }


class CompletionFormat:
    """/v1/completions: text choices, logprobs as tokens/token_logprobs/top_logprobs/text_offset."""

    prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, logprobs: bool, echo_texts: list[str] | None, sources: bool = False):
        self.logprobs = logprobs
        self.echo_texts = echo_texts  # per choice index, when echo was asked
        self.sources = sources  # return_token_sources

    def opening(self, update: Update) -> dict | None:
        if self.echo_texts is None:
            return None
        prompt = update.prompt_logprobs or []
        logprobs = _completion_logprobs(prompt, _prompt_offsets(prompt)) if self.logprobs else None
        return self._choice(update.index, self.echo_texts[update.index], logprobs, None)

    def delta(self, index: int, token: TokenOut) -> dict:
        logprobs = _completion_logprobs([token.logprob], [self._base(index) + token.offset]) if self.logprobs else None
        return self._choice(index, token.text, logprobs, None) | _sources([token], self.sources)

    def closing(self, index: int, reason: str) -> dict:
        return self._choice(index, "", None, reason)

    def choice(self, index: int, tokens: list[TokenOut], reason: str, prompt_logprobs: list[Logprob] | None) -> dict:
        text = "".join(token.text for token in tokens)
        logprobs = None
        if self.logprobs:
            prompt = prompt_logprobs or []
            offsets = _prompt_offsets(prompt) + [self._base(index) + token.offset for token in tokens]
            logprobs = _completion_logprobs(prompt + [token.logprob for token in tokens], offsets)
        if self.echo_texts is not None:
            text = self.echo_texts[index] + text
        return self._choice(index, text, logprobs, reason) | _sources(tokens, self.sources)

    def _base(self, index: int) -> int:
        return len(self.echo_texts[index]) if self.echo_texts is not None else 0

    @staticmethod
    def _choice(index: int, text: str, logprobs: dict | None, reason: str | None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}


def _sources(tokens: list[TokenOut], asked: bool) -> dict:
    """return_token_sources' field: where each generated token came from (drafter, grammar, target; an echoed
    prompt's tokens are not among them); {} unless asked."""
    return {"token_sources": [token.source for token in tokens]} if asked else {}


def _prompt_offsets(prompt: list[Logprob]) -> list[int]:
    """Character offsets of the prompt's tokens, from the lengths of their texts."""
    offsets, at = [], 0
    for item in prompt:
        offsets.append(at)
        at += len(item.token)
    return offsets


def _completion_logprobs(items: list[Logprob], offsets: list[int]) -> dict:
    # The sampled token always appears among top_logprobs, as OpenAI documents ("up to logprobs+1").
    return {
        "tokens": [item.token for item in items],
        "token_logprobs": [item.logprob for item in items],
        "top_logprobs": [None if item.logprob is None else {**dict(item.top), item.token: item.logprob} for item in items],
        "text_offset": offsets,
    }


class ChatFormat:
    """/v1/chat/completions: assistant messages, deltas that open with the role, logprobs.content."""

    prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, logprobs: bool, sources: bool = False):
        self.logprobs = logprobs
        self.sources = sources  # return_token_sources

    def opening(self, update: Update) -> dict | None:
        return {"index": update.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def delta(self, index: int, token: TokenOut) -> dict:
        logprobs = {"content": [_chat_logprob(token.logprob)]} if self.logprobs else None
        delta = {"index": index, "delta": {"content": token.text}, "logprobs": logprobs, "finish_reason": None}
        return delta | _sources([token], self.sources)

    def closing(self, index: int, reason: str) -> dict:
        return {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}

    def choice(self, index: int, tokens: list[TokenOut], reason: str, prompt_logprobs: list[Logprob] | None) -> dict:
        return {
            "index": index,
            "message": {"role": "assistant", "content": "".join(token.text for token in tokens)},
            "logprobs": {"content": [_chat_logprob(token.logprob) for token in tokens]} if self.logprobs else None,
            "finish_reason": reason,
        } | _sources(tokens, self.sources)


class ToolChatFormat(ChatFormat):
    """Chat whose choices may call tools: text split into content and tool_calls (tools.ToolCallParser), a
    streamed call in one delta.tool_calls chunk once its block closes, finish_reason tool_calls where there were
    calls. A token held back (it may open a call) sends its logprobs and source with the next chunk."""

    def __init__(self, logprobs: bool, sources: bool = False):
        super().__init__(logprobs, sources)
        self.parsers: dict[int, ToolCallParser] = defaultdict(ToolCallParser)
        self.held: dict[int, list[TokenOut]] = defaultdict(list)

    def delta(self, index: int, token: TokenOut) -> dict | None:
        content, calls = self.parsers[index].feed(token.text)
        self.held[index].append(token)
        return self._chunk(index, content, calls, None) if content or calls else None

    def closing(self, index: int, reason: str) -> dict:
        parser = self.parsers[index]
        return self._chunk(index, parser.finish(), [], _tool_reason(reason, parser.calls))

    def choice(self, index: int, tokens: list[TokenOut], reason: str, prompt_logprobs: list[Logprob] | None) -> dict:
        choice = super().choice(index, tokens, reason, prompt_logprobs)
        content, calls = split_calls(choice["message"]["content"])
        choice["message"]["content"] = content
        if calls:
            choice["message"]["tool_calls"] = calls
        choice["finish_reason"] = _tool_reason(reason, len(calls))
        return choice

    def _chunk(self, index: int, content: str, calls: list[dict], reason: str | None) -> dict:
        delta = ({"content": content} if content else {}) | ({"tool_calls": calls} if calls else {})
        held = self.held.pop(index, [])
        logprobs = {"content": [_chat_logprob(token.logprob) for token in held]} if self.logprobs else None
        chunk = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return chunk | _sources(held, self.sources and bool(held))


def _tool_reason(reason: str, calls: int) -> str:
    return "tool_calls" if calls and reason == "stop" else reason


def _chat_logprob(item: Logprob) -> dict:
    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {**entry(item.token, item.logprob), "top_logprobs": [entry(token, logprob) for token, logprob in item.top]}


Format = CompletionFormat | ChatFormat  # ToolChatFormat among the latter


def _json(data: dict) -> str:
    return json.dumps(data, separators=(",", ":"))


async def collect(job: Job, fmt: Format, envelope: Envelope, prompt_tokens: int, n: int) -> dict:
    """The whole response of a non-streamed request."""
    tokens: dict[int, list[TokenOut]] = {choice.index: [] for choice in job.choices}
    prompts: dict[int, list[Logprob] | None] = {}
    finals: dict[int, Update] = {}
    async for update in job.updates():
        tokens[update.index] += update.tokens
        if update.admitted:
            prompts[update.index] = update.prompt_logprobs
        if update.finish_reason:
            finals[update.index] = update
    choices = [fmt.choice(i, tokens[i], finals[i].finish_reason, prompts.get(i)) for i in sorted(tokens)]
    return envelope.wrap(fmt.object, choices=choices, usage=usage(prompt_tokens, list(finals.values()), n))


async def stream(
    job: Job, fmt: Format, envelope: Envelope, prompt_tokens: int, options: StreamOptions, n: int,
) -> AsyncIterator[str]:
    """SSE data payloads: one chunk per token, a closing chunk per choice, usage if asked (in every chunk too, with
    continuous_usage_stats: the figures so far), then [DONE]."""
    latest: dict[int, Update] = {}

    def chunk(choice: dict) -> str:
        extra = {}
        if options.include_usage:  # continuous_usage_stats adds to it, as vLLM's does
            extra["usage"] = usage(prompt_tokens, list(latest.values()), n) if options.continuous_usage_stats else None
        return _json(envelope.wrap(fmt.chunk_object, choices=[choice], **extra))

    try:
        async for update in job.updates():
            latest[update.index] = update
            opening = fmt.opening(update) if update.admitted else None
            if opening:
                yield chunk(opening)
            for token in update.tokens:
                delta = fmt.delta(update.index, token)
                if delta is not None:  # None: held back (text that may open a tool call)
                    yield chunk(delta)
            if update.finish_reason:
                yield chunk(fmt.closing(update.index, update.finish_reason))
    except APIError as error:
        # Headers are long gone: the error travels as an event, as OpenAI sends it.
        yield _json(error.body())
        return
    if options.include_usage:
        yield _json(envelope.wrap(fmt.chunk_object, choices=[], usage=usage(prompt_tokens, list(latest.values()), n)))
    yield "[DONE]"

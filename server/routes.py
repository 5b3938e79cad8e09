"""HTTP routes: OpenAI completions and chat, models, health, metrics, and the playground page.

A route validates on the event loop, tokenizes in a thread of its own (a
large prompt must not stall every other connection), submits a `Job` to the
scheduler, and answers with the collected JSON or an SSE stream. A client
that goes away (stream or not) has its job cancelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from sse_starlette import EventSourceResponse

from specdec_core.grammar import CompiledGrammar, GrammarError, GrammarSpec
from specdec_core.sequence import Sequence

from .guard import ADDRESS_PREFIX
from .metrics import CLIENT_CLOSED
from .rate_limit import MeteredJob
from .request_limits import check_prompt_tokens, check_request
from .responses import ChatFormat, CompletionFormat, Envelope, Format, ToolChatFormat, collect, stream
from .scheduler import Choice, Job, ModelInfo, Scheduler
from .schemas import (
    ERROR_RESPONSES,
    APIError,
    ChatRequest,
    CompletionRequest,
    SamplingRequest,
    prompt_items,
)
from .tools import response_grammar, template_input, tool_grammar

router = APIRouter(responses=ERROR_RESPONSES)
# One thread: the event loop stays free, and its tokenizer copy is never used by two threads at once.
_tokenizing = ThreadPoolExecutor(1, thread_name_prefix="specdec-tokenize")
T = TypeVar("T")


async def _off_loop(work: Callable[[], T]) -> T:
    return await asyncio.get_running_loop().run_in_executor(_tokenizing, work)


@router.get("/health", responses={200: {"description": "Ready"}, 503: {"description": "Loading, failed or draining"}})
async def health(request: Request) -> JSONResponse:
    """200 when ready; 503 while the models load, after loading failed, and while draining."""
    scheduler: Scheduler = request.app.state.scheduler
    body = {"status": scheduler.state} | ({"error": scheduler.error} if scheduler.error else {})
    return JSONResponse(body, status_code=200 if scheduler.state == "ready" else 503)


PLAYGROUND = Path(__file__).parent / "playground"  # the page's files: no build step, nothing from the network
PLAYGROUND_PAGES = ("/", "/playground")
PLAYGROUND_ASSETS = {"playground.css": "text/css", "playground.js": "text/javascript", "icon.svg": "image/svg+xml",
                     # its markdown renderer and sanitizer, pinned in vendor/VENDOR.md
                     "vendor/marked.umd.js": "text/javascript", "vendor/purify.min.js": "text/javascript"}
PLAYGROUND_PATHS = frozenset(PLAYGROUND_PAGES) | {f"/playground/{name}" for name in PLAYGROUND_ASSETS}
# The page runs only its own files, and talks only to this server.
PLAYGROUND_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


@router.get("/", include_in_schema=False)
@router.get("/playground", include_in_schema=False)
async def playground(request: Request) -> Response:
    """The playground: a chat that shows which tokens the drafter gave (server.playground turns it off)."""
    return _playground_file(request, "playground.html", "text/html")


@router.get("/playground/{name:path}", include_in_schema=False)
async def playground_asset(name: str, request: Request) -> Response:
    if name not in PLAYGROUND_ASSETS:
        raise APIError(404, f"the playground has no file {name!r}")
    return _playground_file(request, name, PLAYGROUND_ASSETS[name])


def _playground_file(request: Request, name: str, media_type: str) -> Response:
    if not request.app.state.playground:
        raise APIError(404, "the playground is turned off on this server (server.playground)")
    return FileResponse(PLAYGROUND / name, media_type=media_type, headers=PLAYGROUND_HEADERS)


@router.get("/v1/models")
async def models(request: Request) -> dict:
    """The served model; once loaded, its entry also names the drafter (an extension, for the playground)."""
    state = request.app.state
    model = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "specdec"}
    loaded = state.scheduler.model
    return {"object": "list", "data": [model | ({"drafter": loaded.drafter} if loaded else {})]}


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    """Prometheus' text format."""
    metrics = request.app.state.metrics
    return Response(metrics.render(), media_type=metrics.content_type)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    model = _model(request, body)
    check_request(request.app.state.limits, body)
    prompts = await _off_loop(lambda: _completion_prompts(body.prompt, model))
    check_prompt_tokens(request.app.state.limits, sum(len(ids) for ids, _ in prompts), "prompt")
    for ids, _ in prompts:
        _check_length(len(ids), body.max_tokens, model.context_length, "prompt")
    echo_texts = [text for _, text in prompts for _ in range(body.n)] if body.echo else None
    fmt = CompletionFormat(logprobs=body.logprobs is not None, echo_texts=echo_texts, sources=body.return_token_sources)
    echo_logprobs = body.echo and body.logprobs is not None
    grammar = await _compiled(model, response_grammar(body), "response_format")
    return await _run(request, body, [ids for ids, _ in prompts], body.max_tokens, body.logprobs, echo_logprobs, fmt,
                      grammar)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request) -> Response:
    model = _model(request, body)
    limits = request.app.state.limits
    check_request(limits, body)
    tokenizer = model.tokenizer
    if not tokenizer.chat_template:
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    spec = tool_grammar(body, model.tool_format)  # checks the tools first: they may not go with response_format
    field = "tools"
    if spec is None:
        spec, field = response_grammar(body), "response_format"
    messages, tools = template_input(body, tokenizer.chat_template)
    try:
        ids = await _off_loop(
            lambda: tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
        )
    except Exception as exc:  # the template itself rejects some conversations (e.g. roles out of order)
        raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from exc
    check_prompt_tokens(limits, len(ids), "messages")
    # Without a limit the completion may fill the rest of the context, as OpenAI's does, up to the server's limit.
    rest = min(max(model.context_length - len(ids), 1), limits.max_tokens)
    max_tokens = body.max_completion_tokens or body.max_tokens or rest
    _check_length(len(ids), max_tokens, model.context_length, "messages")
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    fmt = (ToolChatFormat if body.calls_tools else ChatFormat)(body.logprobs, body.return_token_sources)
    grammar = await _compiled(model, spec, field)
    return await _run(request, body, [list(ids)], max_tokens, top_logprobs, False, fmt, grammar)


async def _compiled(model: ModelInfo, spec: GrammarSpec | None, field: str) -> CompiledGrammar | None:
    """The request's grammar, compiled (or found compiled) off the event loop; a 400 naming `field` when it cannot be."""
    if spec is None:
        return None
    try:
        return await asyncio.get_running_loop().run_in_executor(None, model.grammars.compile, spec, field)
    except GrammarError as exc:
        raise APIError(400, str(exc), param=field) from None


def _model(request: Request, body: SamplingRequest) -> ModelInfo:
    """The loaded target's info; 404 for another model's name, 503 until loaded."""
    state = request.app.state
    if body.model != state.model_name:
        message = f"the model {body.model!r} does not exist; this server serves {state.model_name!r}"
        raise APIError(404, message, param="model", code="model_not_found")
    scheduler: Scheduler = state.scheduler
    if scheduler.model is None:
        message = f"the server is {scheduler.state}; retry when /health answers 200"
        raise APIError(503, message, type="server_error", code="unavailable")
    return scheduler.model


def _completion_prompts(prompt: str | list, model: ModelInfo) -> list[tuple[list[int], str]]:
    """Token ids and text of each prompt (a string, strings, token ids, or lists of token ids)."""
    prompts = []
    for item in prompt_items(prompt):
        if isinstance(item, str):
            ids, text = model.tokenizer.encode(item), item
        else:
            if any(not 0 <= token < model.vocab_size for token in item):
                raise APIError(400, f"prompt token ids must lie in [0, {model.vocab_size})", param="prompt")
            ids, text = list(item), model.tokenizer.decode(item)
        if not ids:
            raise APIError(400, "prompt must not be empty", param="prompt")
        prompts.append((ids, text))
    return prompts


def _check_length(prompt_tokens: int, max_tokens: int, context: int, param: str) -> None:
    if prompt_tokens + max_tokens > context:
        raise APIError(
            400,
            f"this model's maximum context length is {context} tokens, but {prompt_tokens + max_tokens} were requested "
            f"({prompt_tokens} in the prompt, {max_tokens} to generate); shorten the prompt or lower max_tokens",
            param=param,
            code="context_length_exceeded",
        )


async def _run(
    request: Request,
    body: SamplingRequest,
    prompts: list[list[int]],
    max_tokens: int,
    top_logprobs: int | None,
    echo_logprobs: bool,
    fmt: Format,
    grammar: CompiledGrammar | None = None,
) -> Response:
    """Submit n sequences per prompt as one job, each bound to `grammar` if given; answer with JSON or an SSE
    stream."""
    scheduler: Scheduler = request.app.state.scheduler
    envelope = Envelope(fmt.prefix, request.app.state.model_name)
    client = request.state.client  # the guard's name for the caller: an API key's hash, else the address
    choices = []
    for ids in prompts:
        for i in range(body.n):
            index = len(choices)
            params = body.sampling(i, scheduler.model.vocab_size)
            seq = Sequence(f"{envelope.id}-{index}", ids, params, max_tokens, top_logprobs=top_logprobs, client=client,
                           cache_namespace=cache_namespace(client, body.cache_salt),
                           grammar=scheduler.model.grammars.state(grammar) if grammar is not None else None,
                           speculate=body.speculation)
            sources = [] if body.return_token_sources else None
            choices.append(Choice(index, seq, body.stop, echo_logprobs, sources=sources))
    job = MeteredJob(choices, request.app.state.limiter, client)
    scheduler.submit(job)
    prompt_tokens = sum(len(ids) for ids in prompts)
    if body.stream:
        return _streamed(scheduler, job, stream(job, fmt, envelope, prompt_tokens, body.stream_options, body.n))
    return await _collected(request, scheduler, job, collect(job, fmt, envelope, prompt_tokens, body.n))


def cache_namespace(client: str, salt: str | None) -> str:
    """Whose cached prompt chunks a request may read: its API key's (a cache shared across keys would tell one
    key's prompts to another by timing) and its cache_salt's. Never its address: behind a proxy every client
    has the proxy's, and without keys every caller shares one cache."""
    key = "" if client.startswith(ADDRESS_PREFIX) else client
    return f"{key}\n{salt or ''}"


def _streamed(scheduler: Scheduler, job: Job, events: AsyncIterator[str]) -> EventSourceResponse:
    """An SSE response; the job is cancelled however the stream ends early."""

    async def cancel_when_closed() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        finally:  # a failed send, or cancellation once the generator has started
            scheduler.cancel(job)

    async def on_disconnect(message: object) -> None:  # also when the client leaves before the first event
        scheduler.cancel(job)

    return EventSourceResponse(
        cancel_when_closed(),
        sep="\n",
        client_close_handler_callable=on_disconnect,
        # Past SIGTERM sse-starlette would cut streams at once; the scheduler ends them after its grace.
        shutdown_grace_period=scheduler.settings.shutdown_grace_s + 5,
    )


async def _collected(request: Request, scheduler: Scheduler, job: Job, result: Awaitable[dict]) -> Response:
    """The JSON response, unless the client disconnects first: then the job is cancelled."""
    collector = asyncio.ensure_future(result)
    watcher = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not collector.done():  # the client left (or the server is cancelling this handler)
            collector.cancel()
            scheduler.cancel(job)
    if not collector.done() or collector.cancelled():  # cancel() takes effect at the task's next turn
        return Response(status_code=CLIENT_CLOSED)  # nobody reads it; requests_total counts it
    return JSONResponse(collector.result())


async def _disconnected(request: Request) -> None:
    """Returns once the client disconnects (the body has been read, so only that message is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass

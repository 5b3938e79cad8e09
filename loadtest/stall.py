"""`python -m loadtest.stall`: what a long prompt does to a stream already running, on one or more servers.

On each server, one after the other (so that each has the machine to itself), after one unmeasured long
prompt (a server's first long pass keeps its bf16 weights, prefill.keep_bf16_weights):
1. a short streamed request alone, decoded plainly (`speculation: false`, this server's extension): its gaps
   between tokens, the plain one-token step (the median of the gaps over 5 ms: a detokenizer may hold a token
   back and send it with the next);
2. a long prompt alone (one token asked): its time to first token;
3. the short request again, and once it streams, the long prompt (a prompt no cache holds): the longest gap
   between the stream's tokens while the long prompt is admitted (every gap is listed: one a chunk, and the
   one in which the prompt joins the batch), and the long prompt's time to first token; and whether the stream
   outlasted the admission (if not, its later chunks went unmeasured: raise --stream-tokens).

Run it against a server with chunked prefill and one with prefill.chunk_tokens above the prompt's length
(unchunked) in one run, so the ratios compare like with like:

    python -m loadtest.stall --url chunked=http://127.0.0.1:8000 --url unchunked=http://127.0.0.1:8001 \\
        --prompt-tokens 3000 --out bench-out/stall
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import json
import statistics
import uuid
from pathlib import Path

import httpx

from .runner import RequestResult, Target, parse_target, stream_chat

SOURCE_MODULES = ("difflib", "argparse", "statistics", "textwrap")  # the long prompt's text: Python source (PSF licence)
CHARACTERS_PER_TOKEN = 3.8  # about, for Python source in Qwen2.5's tokenizer; the server's usage says exactly
STEP_GAP_S = 0.005  # gaps shorter than this are tokens sent together (held back by the detokenizer)


def long_prompt(tokens: int) -> str:
    """About `tokens` tokens of Python source, behind a fresh nonce so that no prefix cache holds any of it."""
    source = "\n".join(inspect.getsource(importlib.import_module(name)) for name in SOURCE_MODULES)
    return f"[{uuid.uuid4().hex}] Summarise this code.\n```python\n{source[: int(tokens * CHARACTERS_PER_TOKEN)]}\n```"


def body(text: str, max_tokens: int, model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}


async def measure(client: httpx.AsyncClient, target: Target, model: str, prompt_tokens: int, stream_tokens: int) -> dict:
    """The three measurements on one server."""
    short = {**body("Count from one to one thousand in words, one per line.", stream_tokens, model), "speculation": False}
    await stream_chat(client, target, body(long_prompt(prompt_tokens), 1, model), 600)  # warm-up
    alone = await stream_chat(client, target, short, 600)
    long_alone = await stream_chat(client, target, body(long_prompt(prompt_tokens), 1, model), 600)

    async def long_once_streaming(started: asyncio.Event) -> tuple[RequestResult, float]:
        await started.wait()
        sent = asyncio.get_running_loop().time()
        return await stream_chat(client, target, body(long_prompt(prompt_tokens), 1, model), 600), sent

    started = asyncio.Event()
    running = asyncio.create_task(_stream_signalling(client, target, short, started))
    (long_concurrent, sent), (stream, times) = await asyncio.gather(long_once_streaming(started), running)
    answered = sent + (long_concurrent.ttft or 0.0)
    during = [b - a for a, b in zip(times, times[1:]) if b > sent and a < answered]
    step_s = statistics.median([gap for gap in alone.itls if gap > STEP_GAP_S] or [0.0])
    return {
        "target": target.label,
        "step_s": step_s,
        "long_prompt_tokens": long_alone.prompt_tokens,
        "long_prompt_ttft_alone_s": long_alone.ttft,
        "long_prompt_ttft_while_streaming_s": long_concurrent.ttft,
        "largest_gap_while_admitting_s": max(during, default=None),
        "largest_gap_in_steps": max(during) / step_s if during and step_s else None,
        "gaps_while_admitting_s": [round(gap, 3) for gap in during],
        "stream_outlasted_admission": bool(times) and times[-1] >= answered,
        "ok": all(r.ok for r in (alone, long_alone, long_concurrent, stream)),
        "errors": [r.error for r in (alone, long_alone, long_concurrent, stream) if r.error],
    }


async def _stream_signalling(
    client: httpx.AsyncClient, target: Target, request: dict, started: asyncio.Event,
) -> tuple[RequestResult, list[float]]:
    """stream_chat, setting `started` at its fifth token (or its end); also returns every token's arrival (loop time)."""
    times: list[float] = []
    loop = asyncio.get_running_loop()

    def on_token() -> None:
        times.append(loop.time())
        if len(times) == 5:
            started.set()

    try:
        return await stream_chat(client, target, request, 600, on_token), times
    finally:
        started.set()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.stall", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", action="append", required=True, type=parse_target, metavar="[LABEL=]URL")
    parser.add_argument("--prompt-tokens", type=int, default=3000, help="about this many tokens in the long prompt")
    parser.add_argument("--stream-tokens", type=int, default=600, help="the running stream's max_tokens (it must outlast the long prompt's prefill)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/stall"))
    args = parser.parse_args(argv)

    async def run() -> list[dict]:
        async with httpx.AsyncClient(timeout=None) as client:
            rows = []
            for target in args.url:
                model = (await client.get(f"{target.url}/v1/models")).json()["data"][0]["id"]
                rows.append(await measure(client, target, model, args.prompt_tokens, args.stream_tokens))
                print(json.dumps(rows[-1]), flush=True)
            return rows

    rows = asyncio.run(run())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stall.json").write_text(json.dumps({"prompt_tokens": args.prompt_tokens, "servers": rows}, indent=2) + "\n")
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

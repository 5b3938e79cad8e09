"""Faults and bad input against real servers: fuzzing from the OpenAPI schema, overload, disconnects,
SIGTERM under traffic, malformed requests.

All on the tiny random config, so that requests take milliseconds. Servers run in-process (the
real-uvicorn fixture of test_server) where the test looks inside the scheduler, and as a
`specdec serve` subprocess where the test needs a signal or the process's memory. Waits are
bounded only to end a broken run; nothing asserts on wall-clock time.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
import schemathesis
import yaml
from hypothesis import HealthCheck, settings

from tests.test_server import MODEL, NO_EOS, ROOT, error_of, make_config, running, sample

LONG = 1900  # tokens: with NO_EOS, a request that runs until it is cancelled


def wait_until(condition: Callable[[], bool], what: str, limit_s: float = 120.0) -> None:
    """Poll until condition() holds; the limit only ends a broken run."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def spawned(cmd: list[str], ready_url: str, log: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """A process for the test, ready once `ready_url` answers 200; terminated (killed if it must be) at the end."""
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_until(lambda: proc.poll() is not None or answers(ready_url), f"{cmd[0]} to be ready")
        assert proc.poll() is None, f"{cmd} exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def serve_subprocess(tmp_path: Path, **server: object) -> Iterator[tuple[subprocess.Popen, str]]:
    """`specdec serve --config <tiny config with these server settings> --port P`, ready."""
    data = yaml.safe_load((ROOT / "configs/tiny-random.yaml").read_text())
    data["model"]["threads"] = 1
    data["server"].update(server)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(data))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # `python -m server.cli` is the `specdec` entry point, run by this interpreter.
    cmd = [sys.executable, "-m", "server.cli", "serve", "--config", str(config), "--port", str(port)]
    with spawned(cmd, f"{url}/health", tmp_path / "server.log") as proc:
        yield proc, url


def metric(url: str, name: str) -> float:
    return sample(httpx.get(f"{url}/metrics").text, name)


def idle(url: str) -> bool:
    return metric(url, "specdec_running_requests") == 0 and metric(url, "specdec_queue_depth") == 0


def serves(url: str) -> bool:
    """Healthy, and a fresh request completes."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4}
    return answers(f"{url}/health") and httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200


@pytest.fixture(scope="module")
def served():
    with running(make_config(server={"max_model_len": 256})) as served:
        yield served


# -- fuzzing from the OpenAPI schema -------------------------------------------------------


@pytest.fixture(scope="module")
def api_schema(served):
    return schemathesis.openapi.from_url(f"{served.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_fuzzed_requests_get_no_5xx_and_openai_shaped_errors(case, served):
    # Generated bodies rarely name the served model; a third of them do, so generation runs too.
    if isinstance(case.body, dict) and zlib.crc32(json.dumps(case.body, sort_keys=True, default=str).encode()) % 3 == 0:
        case.body["model"] = MODEL
    response = case.call(timeout=120)
    assert response.status_code < 500, f"{case.method} {case.path}: {response.status_code} {response.text[:500]}"
    if response.status_code >= 400:
        assert error_of(response)["message"]


# -- overload ------------------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) * 1024


async def burst(url: str, count: int) -> Counter:
    """`count` completions at once; outcomes by status, or 'lost: <error>' for any without an answer."""
    async def one(client: httpx.AsyncClient, i: int) -> str:
        body = {"model": MODEL, "prompt": f"request {i}", "max_tokens": 8, "logit_bias": NO_EOS}
        try:
            response = await client.post(f"{url}/v1/completions", json=body)
        except httpx.HTTPError as exc:  # a reset, a timeout: no answer
            return f"lost: {type(exc).__name__}"
        if response.status_code == 200:
            assert response.json()["choices"][0]["finish_reason"] == "length"
        elif response.status_code == 429:
            assert error_of(response)["type"] == "rate_limit_error" and response.headers["retry-after"]
        return str(response.status_code)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return Counter(await asyncio.gather(*(one(client, i) for i in range(count))))


def test_overload_gets_completions_or_429s_and_the_server_recovers(tmp_path):
    sent = 300
    with serve_subprocess(tmp_path, max_batch_size=2, max_queue=8) as (proc, url):
        asyncio.run(burst(url, sent))  # warm-up: allocator pools and caches reach their working size
        baseline = rss_bytes(proc.pid)
        outcomes = asyncio.run(burst(url, sent))
        wait_until(lambda: idle(url), "the queue and the batch to empty")
        after = rss_bytes(proc.pid)
        assert serves(url)
    print(f"\noverload: sent {sent}, completed {outcomes['200']}, rejected 429 {outcomes['429']}, "
          f"lost {sent - outcomes['200'] - outcomes['429']}; RSS {baseline / 2**20:.0f} -> {after / 2**20:.0f} MiB")
    assert set(outcomes) <= {"200", "429"}, outcomes  # every request answered, and with one of these
    assert outcomes["200"] >= 10 and outcomes["429"] > 0, outcomes  # the queue did overflow; work still got done
    # A second burst like the first must not grow the process: nothing of the requests is kept.
    assert after - baseline < 0.1 * baseline, (baseline, after)


# -- disconnects ---------------------------------------------------------------------------


def test_clients_leaving_mid_stream_and_while_queued_free_everything(served):
    scheduler = served.app.state.scheduler
    body = {"model": MODEL, "prompt": "x", "max_tokens": 200, "logit_bias": NO_EOS, "stream": True}
    streams = 2 * served.app.state.scheduler.settings.max_batch_size  # half run, half wait
    with httpx.Client(timeout=120) as client, ExitStack() as open_streams:
        responses = [open_streams.enter_context(client.stream("POST", f"{served.url}/v1/completions", json=body))
                     for _ in range(streams)]
        running_now = scheduler.settings.max_batch_size
        wait_until(lambda: metric(served.url, "specdec_running_requests") == running_now, "the batch to fill")
        wait_until(lambda: metric(served.url, "specdec_queue_depth") == streams - running_now, "the queue to fill")
        next(responses[0].iter_lines())  # mid-stream: tokens are flowing
    # Every connection is closed now, the running ones and the queued ones.
    wait_until(lambda: idle(served.url) and not scheduler.engine.seqs, "the slots and the queue to be freed")
    assert serves(served.url)


# -- SIGTERM during traffic ----------------------------------------------------------------


def outcome(response: httpx.Response) -> str:
    """'complete', 'shutdown' (a clean 503-shaped end), 'refused' (came in while draining), or 'lost: ...'."""
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        if events and "error" in events[-1]:
            return "shutdown" if events[-1]["error"]["code"] == "shutdown" else f"lost: {events[-1]}"
        finished = any(choice.get("finish_reason") for event in events for choice in event["choices"])
        return "complete" if finished and response.text.rstrip().endswith("data: [DONE]") else "lost: cut stream"
    if response.status_code == 200:
        return "complete"
    if response.status_code == 503 and error_of(response)["code"] == "shutdown":
        return "shutdown"
    if response.status_code == 503 and error_of(response)["code"] == "unavailable":
        return "refused"  # arrived after the signal: a load balancer retries it on another replica
    return f"lost: {response.status_code} {response.text[:200]}"


def test_sigterm_during_traffic_answers_every_request_and_exits_cleanly(tmp_path):
    results: list[str] = []

    def send(url: str, max_tokens: int, stream: bool) -> None:
        body = {"model": MODEL, "prompt": "x", "max_tokens": max_tokens, "logit_bias": NO_EOS, "stream": stream}
        try:
            results.append(outcome(httpx.post(f"{url}/v1/completions", json=body, timeout=120)))
        except httpx.ConnectError:
            results.append("refused")  # never reached the server: it had stopped listening
        except httpx.HTTPError as exc:
            results.append(f"lost: {type(exc).__name__}")

    with serve_subprocess(tmp_path, max_batch_size=8, max_queue=32, shutdown_grace_s=2) as (proc, url):
        # Long requests outlast the grace; short ones finish within it. Half of each stream.
        mix = [(LONG, True), (LONG, False), (8, True), (8, False)] * 4
        threads = [threading.Thread(target=send, args=(url, n, stream)) for n, stream in mix]
        for thread in threads:
            thread.start()
        wait_until(lambda: metric(url, "specdec_running_requests") == 8, "the batch to fill")
        proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(300)
        assert proc.wait(300) == 0
    counts = Counter(results)
    print(f"\nSIGTERM: sent {len(mix)}, {dict(counts)}")
    assert len(results) == len(mix) and not [r for r in results if r.startswith("lost")], counts
    assert counts["shutdown"] > 0 and counts["complete"] + counts["shutdown"] >= 4, counts


# -- bad input -----------------------------------------------------------------------------

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HELLO = [{"role": "user", "content": "hi"}]


def raw(path: str, content: bytes, content_type: str = "application/json") -> tuple[str, bytes, str]:
    return path, content, content_type


def as_json(path: str, body: object) -> tuple[str, bytes, str]:
    return raw(path, json.dumps(body).encode())


# Each bad request, and the clue a useful answer gives: the param it names, or a word of its message.
BAD = {
    "malformed JSON": (raw(COMPLETIONS, b'{"model": "tiny-random-llama", "prompt": '), "JSON"),
    "invalid UTF-8": (raw(COMPLETIONS, b'{"model": "tiny-random-llama", "prompt": "\xff\xfe"}'), "JSON"),
    "deeply nested JSON": (raw(COMPLETIONS, b"[" * 100_000 + b"]" * 100_000), "JSON"),
    "NaN temperature": (raw(COMPLETIONS, b'{"model": "tiny-random-llama", "prompt": "x", "temperature": NaN}'), "temperature"),
    "not JSON content type": (raw(COMPLETIONS, b'{"model": "tiny-random-llama", "prompt": "x"}', "text/plain"), "object"),
    "a JSON array": (as_json(COMPLETIONS, [1, 2, 3]), "object"),
    "prompt of the wrong type": (as_json(COMPLETIONS, {"model": MODEL, "prompt": {"text": "x"}}), "prompt"),
    "max_tokens a string": (as_json(COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": "ten"}), "max_tokens"),
    "negative max_tokens": (as_json(COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": -1}), "max_tokens"),
    "huge max_tokens": (as_json(COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": 10**30}), "max_tokens"),
    "zero chat max_tokens": (as_json(CHAT, {"model": MODEL, "messages": HELLO, "max_tokens": 0}), "max_tokens"),
    "huge n": (as_json(COMPLETIONS, {"model": MODEL, "prompt": "x", "n": 10**9}), "n"),
    "empty prompt": (as_json(COMPLETIONS, {"model": MODEL, "prompt": ""}), "prompt"),
    "empty prompt list": (as_json(COMPLETIONS, {"model": MODEL, "prompt": []}), "prompt"),
    "huge prompt": (as_json(COMPLETIONS, {"model": MODEL, "prompt": "token " * 200_000}), "prompt"),
    "empty messages": (as_json(CHAT, {"model": MODEL, "messages": []}), "messages"),
    "messages a string": (as_json(CHAT, {"model": MODEL, "messages": "hi"}), "messages"),
    "message without a role": (as_json(CHAT, {"model": MODEL, "messages": [{"content": "hi"}]}), "messages"),
    "unknown role": (as_json(CHAT, {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}), "messages"),
    "seed out of range": (as_json(COMPLETIONS, {"model": MODEL, "prompt": "x", "seed": 2**64}), "seed"),
    "stop of the wrong type": (as_json(COMPLETIONS, {"model": MODEL, "prompt": "x", "stop": 5}), "stop"),
    "model missing": (as_json(CHAT, {"messages": HELLO}), "model"),
}


@pytest.fixture(scope="module")
def bystander(served) -> Iterator[Callable[[], dict]]:
    """A stream that runs through all the bad-input tests; calling it gives its outcome once it ends."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 200, "logit_bias": NO_EOS, "stream": True,
            "stream_options": {"include_usage": True}}
    result: dict = {}

    def listen() -> None:
        with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=300) as response:
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        result.update(last=events[-1], usage=json.loads(events[-2][6:])["usage"])

    thread = threading.Thread(target=listen)
    thread.start()
    wait_until(lambda: metric(served.url, "specdec_running_requests") >= 1, "the bystander to run")

    def outcome() -> dict:
        thread.join(300)
        return result

    yield outcome
    thread.join(300)


@pytest.mark.parametrize("request_, clue", BAD.values(), ids=BAD.keys())
def test_bad_input_gets_a_useful_4xx(served, bystander, request_, clue):
    path, content, content_type = request_
    response = httpx.post(f"{served.url}{path}", content=content, headers={"content-type": content_type}, timeout=120)
    assert 400 <= response.status_code < 500, response.text[:500]
    error = error_of(response)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == clue or clue.lower() in error["message"].lower(), error


def test_bad_input_disturbed_nothing(served, bystander):
    result = bystander()
    assert result["last"] == "data: [DONE]" and result["usage"]["completion_tokens"] == 200
    assert serves(served.url)

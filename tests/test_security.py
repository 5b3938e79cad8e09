"""API keys, request limits, rate limits, CORS and the metrics port, against real servers on loopback.

The rate limiter's clock is replaced by a hand-moved one, so budgets refill only
when a test moves it: Retry-After values are exact, and nothing sleeps.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx
import openai
import pytest

from server.keys import API_KEY_ENV
from server.settings import ServeConfig
from specdec_core.models.catalogue import REGISTRY
from tests.test_server import (
    MODEL,
    NO_EOS,
    Served,
    error_of,
    make_config,
    running,
    sample,
)

KEY_A, KEY_B, KEY_C, KEY_D = (f"sk-test-{name}-0123456789abcdef" for name in ("alpha", "bravo", "charlie", "delta"))
WRONG_KEY = KEY_A[:-1] + "0"  # one character off a real key: key material too, never to be logged
ALLOWED_ORIGIN, REFUSED_ORIGIN = "https://app.example", "https://evil.example"
LIMITS = dict(
    max_body_bytes=1024, max_prompt_tokens=64, max_tokens=4, max_n=2, max_stop=2, max_stop_length=5,
    max_logit_bias=2, max_messages=3, max_top_logprobs=2,
)
USER = {"role": "user", "content": "x"}


class Clock:
    """The rate limiter's clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def refilled(served: Served) -> Served:
    """The server with every client's budgets full again: an hour, more than any test's debt needs, has passed."""
    served.app.state.limiter.clock.now += 3600
    return served


@contextmanager
def serving(config: ServeConfig, environ: dict[str, str] | None = None) -> Iterator[Served]:
    """running(config) with the limiter on a hand-moved clock; environ is set only while the app is made."""
    with ExitStack() as stack:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in (environ or {}).items():
                patch.setenv(name, value)
            served = stack.enter_context(running(config))
        served.app.state.limiter.clock = Clock()
        yield served


def client(served: Served, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=key, max_retries=0, timeout=120)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# -- API keys -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded_server(tmp_path_factory) -> Iterator[Served]:
    """Keys from all three sources (config, key file, environment), small budgets, /metrics behind the key."""
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"# one key per line\n\n{KEY_B}  # the CI's\n")
    config = make_config(
        speculation={"gamma": 2},
        security={
            "api_keys": [KEY_A, KEY_D],
            "api_key_file": str(key_file),
            "metrics": "key",
            "rate_limit": {"requests_per_minute": 3, "tokens_per_minute": 20},
        },
    )
    with serving(config, environ={API_KEY_ENV: KEY_C}) as served:
        yield served


@pytest.fixture
def guarded(guarded_server) -> Served:
    return refilled(guarded_server)


def test_keys_from_config_file_and_environment_are_accepted(guarded):
    for key in (KEY_A, KEY_B, KEY_C, KEY_D):
        assert [model.id for model in client(guarded, key).models.list()] == [MODEL]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("key", [None, WRONG_KEY, KEY_A[:-1]])
def test_missing_and_wrong_keys_get_openai_shaped_401s(guarded, key, stream):
    headers = bearer(key) if key is not None else {}
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": stream}
    response = httpx.post(f"{guarded.url}/v1/completions", json=body, headers=headers)
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    error = error_of(response)
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    if key is not None:
        with pytest.raises(openai.AuthenticationError) as caught:
            client(guarded, key).chat.completions.create(model=MODEL, messages=[USER], max_tokens=2, stream=stream)
        assert caught.value.body["code"] == "invalid_api_key"


def test_other_schemes_and_paths_need_the_key_too(guarded):
    for authorization in (f"Basic {KEY_A}", "Bearer", KEY_A):
        assert httpx.get(f"{guarded.url}/v1/models", headers={"Authorization": authorization}).status_code == 401
    assert httpx.get(f"{guarded.url}/docs").status_code == 401  # guarded by default, not by a list of paths
    assert httpx.get(f"{guarded.url}/v1/models", headers={"Authorization": f"bearer {KEY_A}"}).status_code == 200


def test_right_key_streamed_and_not(guarded):
    api = client(guarded, KEY_B)
    whole = api.completions.create(model=MODEL, prompt="x", max_tokens=5, temperature=0, logit_bias=NO_EOS)
    assert whole.usage.completion_tokens == 5
    chunks = list(api.chat.completions.create(model=MODEL, messages=[USER], max_tokens=5, logit_bias=NO_EOS, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"


def test_health_is_open_and_metrics_need_the_key(guarded):
    assert httpx.get(f"{guarded.url}/health").status_code == 200
    assert httpx.get(f"{guarded.url}/metrics").status_code == 401
    assert "specdec_requests_total" in httpx.get(f"{guarded.url}/metrics", headers=bearer(KEY_C)).text


def test_request_budgets_are_per_key(guarded):
    alpha, bravo = client(guarded, KEY_A), client(guarded, KEY_B)
    for _ in range(3):
        alpha.models.list()
    with pytest.raises(openai.RateLimitError) as caught:
        alpha.models.list()
    # 3 per minute: one more request's worth comes back in 20 s.
    assert caught.value.response.headers["retry-after"] == "20"
    assert caught.value.body["code"] == "rate_limit_exceeded" and "requests_per_minute" in caught.value.body["message"]
    assert bravo.models.list()  # the other key's budget is untouched
    guarded.app.state.limiter.clock.now += 20
    alpha.models.list()
    with pytest.raises(openai.RateLimitError):
        alpha.models.list()


@pytest.mark.parametrize("stream", [False, True])
def test_generated_tokens_are_charged_to_their_key(guarded, stream):
    spender, bystander = client(guarded, KEY_C), client(guarded, KEY_D)
    kwargs = dict(model=MODEL, prompt="x", max_tokens=30, logit_bias=NO_EOS)
    result = spender.completions.create(**kwargs, stream=stream)
    if stream:
        assert list(result)[-1].choices[0].finish_reason == "length"
    # 30 tokens from a budget of 20: 10 in debt, and refused until 1 token is back (11 tokens at 20 per minute).
    with pytest.raises(openai.RateLimitError) as caught:
        spender.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert caught.value.response.headers["retry-after"] == "33" and "tokens_per_minute" in caught.value.body["message"]
    assert bystander.completions.create(model=MODEL, prompt="x", max_tokens=1).choices
    metrics = httpx.get(f"{guarded.url}/metrics", headers=bearer(KEY_A)).text
    assert sample(metrics, 'specdec_rate_limited_total{reason="tokens"}') >= 1


@contextmanager
def captured_logs() -> Iterator[list[str]]:
    """Every server-side log line while the block runs, uvicorn's access log included, at DEBUG, each after its level."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if not record.name.startswith(("openai", "httpx", "httpcore")):  # the client side knows its key
                lines.append(f"{record.levelname} {self.format(record)}")

    handler = Collect(logging.DEBUG)
    # uvicorn's loggers do not propagate to the root; the access log is on only at INFO.
    loggers = [logging.getLogger(name) for name in ("", "uvicorn", "uvicorn.access")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(handler)
            logger.setLevel(level)


def test_no_key_material_in_logs_or_metrics(guarded):
    with captured_logs() as lines:
        api = client(guarded, KEY_A)
        api.completions.create(model=MODEL, prompt="x", max_tokens=3)
        list(api.chat.completions.create(model=MODEL, messages=[USER], max_tokens=3, stream=True))
        with pytest.raises(openai.AuthenticationError):
            client(guarded, WRONG_KEY).models.list()
        in_url = httpx.get(f"{guarded.url}/v1/models?api_key={KEY_D}")  # the access log drops the query
        assert in_url.status_code == 401 and "never in the URL" in error_of(in_url)["message"]
        with pytest.raises(openai.RateLimitError):
            for _ in range(3):
                api.models.list()
        metrics = httpx.get(f"{guarded.url}/metrics", headers=bearer(KEY_B)).text
    assert any("/v1/completions" in line for line in lines)  # the access log was captured
    for key in (KEY_A, KEY_B, KEY_C, KEY_D, WRONG_KEY):
        assert not [line for line in lines if key in line]
        assert key not in metrics


def test_wrong_keys_are_rate_limited_per_address(guarded):
    budget = ServeConfig().security.rate_limit.wrong_keys_per_minute
    statuses = [httpx.get(f"{guarded.url}/v1/models", headers=bearer(WRONG_KEY)).status_code for _ in range(budget + 1)]
    assert statuses == [401] * budget + [429]
    # Once the guesses are spent the address waits, whatever key it sends: a right guess is not told apart.
    refused = httpx.get(f"{guarded.url}/v1/models", headers=bearer(KEY_A))
    assert refused.status_code == 429 and error_of(refused)["code"] == "rate_limit_exceeded"
    assert "wrong_keys_per_minute" in error_of(refused)["message"] and int(refused.headers["retry-after"]) > 0
    guarded.app.state.limiter.clock.now += 60
    assert httpx.get(f"{guarded.url}/v1/models", headers=bearer(KEY_A)).status_code == 200
    metrics = httpx.get(f"{guarded.url}/metrics", headers=bearer(KEY_B)).text
    assert sample(metrics, 'specdec_rate_limited_total{reason="wrong_keys"}') >= 2  # the two 429s at least


def test_cors_is_off_by_default(guarded):
    response = httpx.get(f"{guarded.url}/v1/models", headers=bearer(KEY_A) | {"Origin": ALLOWED_ORIGIN})
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers


# -- limits, CORS, budgets by address ---------------------------------------------------------


@pytest.fixture(scope="module")
def limited_server() -> Iterator[Served]:
    """No keys, small limits, CORS for one origin, 5 requests per minute per address."""
    security = {"limits": LIMITS, "cors_origins": [ALLOWED_ORIGIN], "rate_limit": {"requests_per_minute": 5}}
    with serving(make_config(security=security)) as served:
        yield served


@pytest.fixture
def limited(limited_server) -> Served:
    return refilled(limited_server)


COMPLETION = {"model": MODEL, "prompt": "x", "max_tokens": 1}
CHAT = {"model": MODEL, "messages": [USER], "max_tokens": 1}
ASSISTANT = {"role": "assistant", "content": "y"}


@pytest.mark.parametrize(
    "base, at_limit, past_limit, param, setting",
    [
        (COMPLETION, {"n": 2}, {"n": 3}, "n", "max_n"),
        (COMPLETION, {"max_tokens": 4}, {"max_tokens": 5}, "max_tokens", "max_tokens"),
        (COMPLETION, {"prompt": [5] * 64}, {"prompt": [5] * 65}, "prompt", "max_prompt_tokens"),
        (COMPLETION, {"prompt": [[5] * 32] * 2}, {"prompt": [[5] * 32, [5] * 33]}, "prompt", "max_prompt_tokens"),
        (COMPLETION, {"stop": ["a", "b"]}, {"stop": ["a", "b", "c"]}, "stop", "max_stop"),
        (COMPLETION, {"stop": "abcde"}, {"stop": ["a", "abcdef"]}, "stop", "max_stop_length"),
        (COMPLETION, {"logit_bias": {"5": 1, "6": 1}}, {"logit_bias": {"5": 1, "6": 1, "7": 1}}, "logit_bias", "max_logit_bias"),
        (COMPLETION, {"logprobs": 2}, {"logprobs": 3}, "logprobs", "max_top_logprobs"),
        (CHAT, {"messages": [USER, ASSISTANT, USER]}, {"messages": [USER, ASSISTANT, USER, ASSISTANT]}, "messages", "max_messages"),
        (CHAT, {"logprobs": True, "top_logprobs": 2}, {"logprobs": True, "top_logprobs": 3}, "top_logprobs", "max_top_logprobs"),
        (CHAT, {"max_tokens": 4}, {"max_tokens": 5}, "max_tokens", "max_tokens"),
        (CHAT, {"max_completion_tokens": 4}, {"max_completion_tokens": 5}, "max_completion_tokens", "max_tokens"),
    ],
)
def test_each_limit_at_and_past_its_edge(limited, base, at_limit, past_limit, param, setting):
    path = "/v1/chat/completions" if "messages" in base else "/v1/completions"
    assert httpx.post(f"{limited.url}{path}", json=base | at_limit).status_code == 200
    response = httpx.post(f"{limited.url}{path}", json=base | past_limit)
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == param and error["code"] == "limit_exceeded"
    assert f"security.limits.{setting}" in error["message"] and str(LIMITS[setting]) in error["message"]


def test_chat_without_max_tokens_stops_at_the_limit(limited):
    result = limited.client.chat.completions.create(model=MODEL, messages=[USER], logit_bias=NO_EOS)
    assert result.usage.completion_tokens == LIMITS["max_tokens"] and result.choices[0].finish_reason == "length"


def padded(size: int) -> bytes:
    """A valid completion request of exactly `size` bytes (JSON allows trailing spaces)."""
    return json.dumps(COMPLETION).encode().ljust(size)


def test_body_at_the_limit_passes_and_past_it_is_a_413(limited):
    headers = {"Content-Type": "application/json"}
    limit = LIMITS["max_body_bytes"]
    assert httpx.post(f"{limited.url}/v1/completions", content=padded(limit), headers=headers).status_code == 200
    response = httpx.post(f"{limited.url}/v1/completions", content=padded(limit + 1), headers=headers)
    assert response.status_code == 413
    error = error_of(response)
    assert error["code"] == "request_too_large" and "security.limits.max_body_bytes" in error["message"]


def raw_post(served: Served, headers: str, body: bytes) -> tuple[int, dict]:
    """POST /v1/completions by hand, sending exactly `body` and no more, and read the answer."""
    with socket.create_connection(("127.0.0.1", served.port), timeout=60) as sock:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n{headers}\r\n"
        sock.sendall(head.encode() + body)
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, json.loads(response.read())


def test_a_large_body_is_refused_before_it_has_arrived(limited):
    limit = LIMITS["max_body_bytes"]
    # A declared length past the limit: refused with nothing of the body sent.
    status, body = raw_post(limited, f"Content-Length: {10**12}\r\n", b"")
    assert status == 413 and body["error"]["code"] == "request_too_large"
    # A chunked body is counted as it arrives: refused once past the limit, though it never ends.
    data = padded(limit + 1)
    chunks = b"".join(f"{len(part):x}\r\n".encode() + part + b"\r\n" for part in (data[:500], data[500:]))
    status, body = raw_post(limited, "Transfer-Encoding: chunked\r\n", chunks)
    assert status == 413 and body["error"]["code"] == "request_too_large"


def test_request_budget_by_address_without_keys(limited):
    for _ in range(5):
        limited.client.models.list()
    with pytest.raises(openai.RateLimitError) as caught:
        limited.client.models.list()
    assert caught.value.response.headers["retry-after"] == "12"  # 5 per minute


def preflight(served: Served, origin: str) -> httpx.Response:
    headers = {
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    return httpx.options(f"{served.url}/v1/chat/completions", headers=headers)


def test_cors_allows_the_configured_origin_only(limited):
    allowed = preflight(limited, ALLOWED_ORIGIN)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    refused = preflight(limited, REFUSED_ORIGIN)
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    for origin, allowed in ((ALLOWED_ORIGIN, True), (REFUSED_ORIGIN, False)):
        simple = httpx.get(f"{limited.url}/v1/models", headers={"Origin": origin})
        assert simple.headers.get("access-control-allow-origin") == (origin if allowed else None)


# -- the metrics port ---------------------------------------------------------------------------


def test_metrics_on_their_own_port():
    with serving(make_config(security={"api_keys": [KEY_A], "metrics": "port", "metrics_port": 0})) as served:
        client(served, KEY_A).models.list()
        response = httpx.get(f"{served.url}/metrics", headers=bearer(KEY_A))
        assert response.status_code == 404 and "metrics_port" in error_of(response)["message"]
        port = served.app.state.metrics_listener.server_port
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert sample(metrics, 'specdec_requests_total{endpoint="/v1/models",status="200"}') == 1
        assert KEY_A not in metrics


# -- weights stay data ----------------------------------------------------------------------------


@pytest.mark.real_model
def test_serving_a_registry_model_imports_nothing_from_its_wheels(smollm2_dir):
    config = ServeConfig.model_validate({
        "model": {"target": "smollm2-135m", "dtype": "fp32", "threads": 1}, "speculation": {"drafter": "ngram"},
    })
    with running(config) as served:
        result = served.client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=4)
        assert result.usage.completion_tokens > 0
    distributions = {wheel.dist.replace("-", "_") for entry in REGISTRY.values() for wheel in entry.wheels}
    assert not [name for name in sys.modules if name.split(".")[0] in distributions]

"""The load generator (`python -m loadtest`) against real servers on loopback: a speculative and a plain one."""

from __future__ import annotations

import asyncio
import json
import threading
from contextlib import ExitStack

import pytest

from loadtest.__main__ import main, workload_prompts
from loadtest.report import percentiles
from loadtest.runner import level_prompts, parse_target
from tests.test_server import make_config, running


@pytest.fixture(scope="module")
def servers():
    """A speculative server and a plain one, as the load test compares them."""
    with ExitStack() as stack:
        spec = stack.enter_context(running(make_config(speculation={"gamma": 2})))
        plain = stack.enter_context(running(make_config(speculation={"drafter": "none"})))
        yield spec, plain


@pytest.fixture
def prompts(tmp_path):
    """A few prompts in Spec-Bench's format: only the first turn is sent."""
    path = tmp_path / "question.jsonl"
    rows = [{"question_id": i, "category": c, "turns": [f"{c} question {i}", "a second turn, never sent"]}
            for i, c in enumerate(["writing", "coding", "math"])]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_only_loopback_targets_are_accepted():
    assert parse_target("spec=http://127.0.0.1:8000/").url == "http://127.0.0.1:8000"
    assert parse_target("http://localhost:8001").label == "localhost:8001"
    assert parse_target("v6=http://[::1]:8002").label == "v6"
    for url in ("http://10.0.0.1:8000", "http://192.168.1.2", "http://8.8.8.8", "ftp://127.0.0.1"):
        with pytest.raises(ValueError):
            parse_target(url)


def test_each_level_and_a_later_run_send_prompts_not_sent_before():
    pool = [f"prompt {i}" for i in range(10)]
    first = level_prompts(pool, levels=3, requests=2, offset=0)
    assert first.per_level == [["prompt 0", "prompt 1"], ["prompt 2", "prompt 3"], ["prompt 4", "prompt 5"]]
    assert first.repeated == 0 and first.next_offset == 6 and "--prompt-offset 6" in first.summary()
    second = level_prompts(pool, levels=2, requests=2, offset=first.next_offset)
    sent_before = {text for level in first.per_level for text in level}
    assert not sent_before & {text for level in second.per_level for text in level}
    wrapped = level_prompts(pool, levels=2, requests=3, offset=6)  # 6..11: prompts 0 and 1 again
    assert wrapped.per_level[1] == ["prompt 9", "prompt 0", "prompt 1"] and wrapped.repeated == 2
    assert "2 requests repeated a prompt" in wrapped.summary()
    past_the_end = level_prompts(pool, levels=1, requests=4, offset=12)  # every one sent before, none more than that
    assert past_the_end.per_level == [["prompt 2", "prompt 3", "prompt 4", "prompt 5"]] and past_the_end.repeated == 4


def test_the_code_edit_workload_is_a_prompt_source():
    prompts = workload_prompts("code-edit")
    assert len(prompts) == len(set(prompts)) >= 15
    assert all(p.startswith("Here is a function from Python's") and "```python" in p for p in prompts)


@pytest.fixture
def closing_server():
    """An OpenAI-like server that, as llama-server does, closes each connection after its response without saying so,
    and reports its drafts in `timings` rather than in usage."""
    chunks = [{"choices": [{"delta": {"content": "hi"}}]}, {"choices": [{"delta": {"content": " there"}}]},
              {"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 5},
               "timings": {"draft_n": 4, "draft_n_accepted": 3}}]
    stream = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    answers = {"/health": ("application/json", "{}"), "/v1/models": ("application/json", '{"data": [{"id": "m"}]}'),
               "/v1/chat/completions": ("text/event-stream", stream)}

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        length = int(next((line.split(":")[1] for line in head.split("\r\n") if line.lower().startswith("content-length")), 0))
        await reader.readexactly(length)
        kind, body = answers.get(head.split()[1], ("text/plain", "not found"))
        status = "200 OK" if head.split()[1] in answers else "404 Not Found"
        writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
        await writer.drain()
        await asyncio.sleep(0.05)  # closed a moment later: a client that kept it alive has sent its next request on it
        writer.close()

    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(answer, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    loop.call_soon_threadsafe(loop.stop)
    thread.join()


def test_a_server_that_closes_its_connections_and_reports_drafts_in_timings(closing_server, prompts, tmp_path):
    argv = ["--url", f"llama={closing_server}", "--concurrency", "1", "--requests", "3", "--prompts", str(prompts),
            "--out", str(tmp_path)]
    assert main(argv) == 0
    (level,) = json.loads((tmp_path / "results.json").read_text())["levels"]
    assert level["ok"] == 3 and level["errors"] == {} and level["acceptance_rate"] == 0.75


def test_percentiles():
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}
    assert percentiles([1.0, 2.0, 3.0, 4.0, 5.0])["p50"] == 3.0


def test_concurrency_sweep_with_speculation_on_and_off(servers, prompts, tmp_path):
    spec, plain = servers
    out = tmp_path / "out"
    argv = ["--url", f"spec={spec.url}", "--url", f"plain={plain.url}", "--baseline", "plain",
            "--concurrency", "1,3", "--requests", "4", "--max-tokens", "8", "--prompts", str(prompts), "--out", str(out)]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    levels = results["levels"]
    # Targets interleaved within each level.
    assert [(lv["level"], lv["target"]) for lv in levels] == [(1, "spec"), (1, "plain"), (3, "spec"), (3, "plain")]
    for lv in levels:
        assert lv["sent"] == lv["ok"] == 4 and lv["errors"] == {}
        assert 0 < lv["output_tokens"] <= 4 * 8 and lv["output_tokens_per_s"] > 0
        assert lv["ttft_s"]["p50"] <= lv["e2e_s"]["p50"] and lv["ttft_s"]["p50"] <= lv["ttft_s"]["p99"]
        assert lv["mean_batch_size"] >= 1
    by_target = {lv["target"]: lv for lv in levels if lv["level"] == 1}
    assert by_target["spec"]["speculative_step_share"] > 0 and by_target["plain"]["speculative_step_share"] == 0
    assert by_target["spec"]["acceptance_rate"] is not None and by_target["plain"]["acceptance_rate"] is None
    report = (out / "report.md").read_text()
    assert report.startswith("`python -m loadtest --url spec=") and "| vs plain |" in report
    # 2 levels of 4 requests from a file of 3 prompts: the run must say it repeated 5 of them.
    assert results["prompts"]["repeated"] == 5 and "**5 requests repeated a prompt**" in report
    assert len([line for line in report.splitlines() if line.startswith("| 1 |") or line.startswith("| 3 |")]) == 4
    assert (out / "latency.png").read_bytes().startswith(b"\x89PNG")


def test_rate_mode_and_rejections_are_counted(prompts, tmp_path):
    # One slot and one queue place: a burst at a high rate must meet 429s, which count as errors.
    with running(make_config(server={"max_batch_size": 1, "max_queue": 1})) as small:
        argv = ["--url", small.url, "--rate", "1000", "--requests", "12", "--max-tokens", "16",
                "--prompts", str(prompts), "--out", str(tmp_path)]
        assert main(argv) == 0
    (level,) = json.loads((tmp_path / "results.json").read_text())["levels"]
    assert level["mode"] == "rate" and level["sent"] == 12
    assert level["ok"] + level["errors"].get("HTTP 429", 0) == 12 and level["errors"].get("HTTP 429", 0) > 0


def test_an_api_key_is_sent(prompts, tmp_path, monkeypatch):
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    with running(make_config(security={"api_keys": ["sesame"]})) as keyed:
        argv = ["--url", keyed.url, "--concurrency", "2", "--requests", "2", "--max-tokens", "4",
                "--prompts", str(prompts), "--out", str(tmp_path)]
        with pytest.raises(RuntimeError, match="401"):  # /v1/models refuses the anonymous sweep before it starts
            main(argv)
        assert main([*argv, "--api-key", "sesame"]) == 0
    (level,) = json.loads((tmp_path / "results.json").read_text())["levels"]
    assert level["ok"] == 2


def test_the_stall_tool_measures_a_long_prompt_against_a_running_stream_chunked_and_not(tmp_path):
    """Shapes and counts, not times: both servers answer, the chunked one's stream keeps getting tokens while the
    long prompt is admitted (a gap is measured), and each server reports its long prompt's size."""
    from loadtest.stall import main as stall

    with ExitStack() as stack:
        chunked = stack.enter_context(running(make_config(speculation={"drafter": "none"}, prefill={"chunk_tokens": 16})))
        unchunked = stack.enter_context(running(make_config(speculation={"drafter": "none"}, prefill={"chunk_tokens": 4096})))
        code = stall(["--url", f"chunked={chunked.url}", "--url", f"unchunked={unchunked.url}", "--prompt-tokens", "150",
                      "--stream-tokens", "400", "--out", str(tmp_path)])
    assert code == 0
    rows = json.loads((tmp_path / "stall.json").read_text())["servers"]
    assert [row["target"] for row in rows] == ["chunked", "unchunked"]
    for row in rows:
        assert row["ok"] and row["long_prompt_tokens"] > 100 and row["step_s"] > 0
        assert row["long_prompt_ttft_alone_s"] > 0 and row["long_prompt_ttft_while_streaming_s"] > 0
        assert isinstance(row["stream_outlasted_admission"], bool)
    assert rows[0]["largest_gap_while_admitting_s"] is not None

"""llama.cpp reference rows: reading the tools' own timings, finding the tools, and what builds them.

The logs are what this version's tools printed here (llama.cpp vendored in
llama-cpp-python 0.3.36), trimmed to their summaries; lookup.log is written from
llama-lookup's summary format (examples/lookup/lookup.cpp) with made-up figures.
bench.json is llama-bench's whole `-o json` output, untrimmed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from specdec_cli.main import main
from specdec_tools.bench.llama_cpp import (
    LlamaCpp,
    cmake_flags,
    find_tools,
    parse_completion,
    parse_llama_bench,
    parse_speculative,
)

LOGS = Path(__file__).parent / "data" / "llama_cpp"


def test_completion_timings_are_read_from_its_summary():
    timing = parse_completion((LOGS / "completion.log").read_text(), "text")
    # 23 eval runs after the token the prompt's pass produced.
    assert timing.new_tokens == 24
    assert timing.prefill_s == pytest.approx(0.54932) and timing.decode_s == pytest.approx(3.17831)
    assert timing.drafted is None


def test_speculative_timings_and_acceptance_are_read_from_its_summary():
    timing = parse_speculative((LOGS / "speculative.log").read_text(), "text")
    assert (timing.new_tokens, timing.drafted, timing.accepted) == (27, 30, 21)  # not n_draft = 5, the gamma
    assert timing.prefill_s == pytest.approx(1.19) and timing.decode_s == pytest.approx(10.249)


def test_llama_bench_json_gives_the_median_ms_of_each_pass_and_of_a_generated_token():
    # llama-bench -p 1,2,8,512 -n 4 -r 3 -o json on SmolLM2's GGUF: the middle of each test's three samples_ns
    # (not its avg_ns); pp k is one pass of k tokens, tg 4 four one-token passes.
    costs = parse_llama_bench((LOGS / "bench.json").read_text())
    assert costs.pass_ms == pytest.approx({1: 22.447285, 2: 27.629871, 8: 72.581905, 512: 3873.64225})
    assert costs.token_ms == pytest.approx(87.729478 / 4)
    assert costs.build_commit == "0c1e570" and costs.cpu_info == "Intel(R) Xeon(R) Processor"


def test_the_avx2_build_leaves_every_extension_past_avx2_off_and_native_leaves_amx_off():
    native, avx2 = cmake_flags("native"), cmake_flags("avx2")
    assert "-DGGML_NATIVE=ON" in native and "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in native
    assert {"-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"} <= set(avx2)
    switched_on = [flag for flag in avx2 if flag.endswith("=ON")]
    assert not [flag for flag in switched_on if "AVX512" in flag or "VNNI" in flag or "AMX" in flag]
    # ggml's options past AVX2 (ggml/CMakeLists.txt), each named off rather than left to ggml's defaults
    assert {f"-DGGML_{option}=OFF" for option in ("AVX_VNNI", "AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16",
                                                  "AMX_TILE", "AMX_INT8", "AMX_BF16")} <= set(avx2)
    # the avxvnni build: the avx2 one with AVX-VNNI alone switched on
    assert set(cmake_flags("avxvnni")) ^ set(avx2) == {"-DGGML_AVX_VNNI=ON", "-DGGML_AVX_VNNI=OFF"}
    for flags in (native, avx2):
        assert {"-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"} <= set(flags)
    with pytest.raises(ValueError, match="one of native, avx2, avxvnni"):
        cmake_flags("avx512")


def test_a_log_without_timings_stops_with_the_log():
    with pytest.raises(RuntimeError, match="no eval timing"):
        parse_completion("error: model not found", "")


def test_missing_tools_say_how_to_build_them(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"python -m specdec_tools.bench.llama_cpp build"):
        find_tools(tmp_path)
    (tmp_path / "bin").mkdir()
    for tool in ("llama-completion", "llama-speculative-simple"):
        (tmp_path / "bin" / tool).touch()
    assert find_tools(tmp_path) == tmp_path / "bin"


def fake_tools(directory: Path) -> Path:
    """Stand-ins for the tools that print what the real ones printed (the bench's plumbing, not llama.cpp)."""
    directory.mkdir()
    completion = directory / "llama-completion"
    completion.write_text(f"#!/bin/sh\necho 'def reverse(s): return s[::-1]'\ncat '{LOGS / 'completion.log'}' >&2\n")
    completion.chmod(0o755)
    for tool, log, end in (("llama-speculative-simple", "speculative.log", "\\n\\n"),
                           ("llama-lookup", "lookup.log", "\\n\\n\\n\\n")):
        script = directory / tool
        script.write_text(echoing(log, end))
        script.chmod(0o755)
    server = directory / "llama-server"
    server.write_text(FAKE_SERVER.replace("PYTHON", sys.executable))
    server.chmod(0o755)
    return directory


# llama-server's stand-in: /health, and /completion answering with its timings, where the prompt characters it
# shares with the last request (its prompt cache) are not prefilled again.
FAKE_SERVER = """#!PYTHON
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

last = [""]


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def do_POST(self):
        prompt = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
        new = len(prompt) - len(os.path.commonprefix([last[0], prompt]))
        last[0] = prompt
        timings = {"prompt_n": new, "cache_n": len(prompt) - new, "prompt_ms": 2.0 * new, "predicted_n": 8, "predicted_ms": 400.0}
        data = json.dumps({"content": "def reverse(s): return s[::-1]", "timings": timings}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Handler).serve_forever()
"""


def echoing(log: str, end: str) -> str:
    """A stand-in that reads its prompt file as llama.cpp does, echoes a BOS piece and the prompt, answers,
    prints `end` and its log, and appends to its cache file when given one (-lcd)."""
    return (
        "#!/bin/sh\nescape=1\ncache=/dev/null\n"
        "while [ $# -gt 0 ]; do case $1 in -f) prompt=$2;; -lcd) cache=$2;; --no-escape) escape=;; esac; shift; done\n"
        # and, as llama.cpp does unless told --no-escape, turns the two characters \t into a tab
        "[ -n \"$escape\" ] && sed -i 's/\\\\t/\\t/g' \"$prompt\"\n"
        # -f drops one trailing newline of the file, as llama.cpp's common/arg.cpp does
        "printf '\\n\\n<s>'; if [ \"$(tail -c 1 \"$prompt\" | od -An -tx1 | tr -d ' ')\" = 0a ]; "
        f"then head -c -1 \"$prompt\"; else cat \"$prompt\"; fi; printf 'def reverse(s): return s[::-1]<|im_end|>{end}'\n"
        "echo run >> \"$cache\"\n"
        f"cat '{LOGS / log}' >&2\n"
    )


def test_lookup_text_leaves_the_echoed_prompt_out_and_its_cache_outlives_a_request(tmp_path):
    llama = LlamaCpp(fake_tools(tmp_path / "tools"), tmp_path / "model.gguf", None, threads=1, gamma=5)
    timing = llama.generate("<|im_start|>user\nReverse a string, keeping each \\t<|im_end|>\n", 32, "lookup")
    assert timing.text == "def reverse(s): return s[::-1]<|im_end|>"  # the bench drops the end-of-turn token
    assert (timing.new_tokens, timing.drafted, timing.accepted) == (25, 15, 9)
    assert timing.prefill_s == pytest.approx(0.611) and timing.decode_s == pytest.approx(2.950)
    llama.generate("again", 32, "lookup")
    assert llama.lookup_cache.read_text() == "run\nrun\n"  # one file across requests: llama.cpp's memory
    llama.forget()
    assert not llama.lookup_cache.exists()
    with pytest.raises(ValueError, match="one of plain, speculative, lookup, server"):
        llama.generate("x", 4, "medusa")


def test_llama_server_keeps_its_prompt_cache_across_requests_until_forgotten(tmp_path):
    llama = LlamaCpp(fake_tools(tmp_path / "tools"), tmp_path / "model.gguf", None, threads=1, gamma=5)
    try:
        history = "<|im_start|>user\n" + "tell me more " * 50
        first = llama.generate(history, 8, "server")
        again = llama.generate(history + "and more", 8, "server")
        assert first.prefill_s == pytest.approx(2 * len(history) / 1000) and again.prefill_s == pytest.approx(0.016)
        assert (again.new_tokens, again.decode_s, again.text) == (8, 0.4, "def reverse(s): return s[::-1]")
        assert (first.cached_tokens, again.cached_tokens) == (0, len(history))  # its timings' cache_n
        llama.forget()  # a new server: its prompt cache is empty
        assert llama.generate(history, 8, "server").prefill_s == pytest.approx(first.prefill_s)
    finally:
        llama.close()


def bench(tmp_path, monkeypatch, config: str, tools: Path, prompts: Path) -> list[str]:
    out = tmp_path / "out"
    argv = ["bench", "--config", config, "--drafters", "plain", "--num-prompts", "1", "--max-tokens", "4",
            "--threads", "1", "--llama-cpp", str(tools), "--out", str(out), "--prompts", str(prompts)]
    monkeypatch.setattr(sys, "argv", ["specdec", *argv])
    assert main(argv) == 0
    return json.loads((out / "results.json").read_text())["records"]


def test_bench_adds_llama_cpp_rows_side_by_side(tmp_path, monkeypatch, smollm2_dir, prompts_file):
    config = tmp_path / "smollm2-with-draft.yaml"
    # The GGUF of the target stands in as its own draft: the rows' plumbing is under test, not the pair.
    config.write_text(Path("configs/smollm2.yaml").read_text().replace("  gamma_max: 5", "  gamma_max: 5\n  draft_model: smollm2-135m"))
    records = bench(tmp_path, monkeypatch, str(config), fake_tools(tmp_path / "tools"), prompts_file)
    rows = {r["method"]: r for r in records if r["category"] == "all"}
    assert {"plain", "llama.cpp", "llama.cpp-speculative", "llama.cpp-lookup", "llama.cpp-server"} <= set(rows)
    # The tools' own clock: 4 tokens of text over their prefill plus decode seconds.
    assert rows["llama.cpp"]["tokens_per_s"] > 0 and rows["llama.cpp"]["speedup_vs_plain"]
    assert rows["llama.cpp-speculative"]["acceptance_rate"] == pytest.approx(21 / 30)
    assert rows["llama.cpp-lookup"]["acceptance_rate"] == pytest.approx(9 / 15)


def test_bench_llama_cpp_needs_registry_models(tmp_path, monkeypatch, prompts_file):
    with pytest.raises(SystemExit, match="needs registry models"):
        bench(tmp_path, monkeypatch, "configs/tiny-random.yaml", fake_tools(tmp_path / "tools"), prompts_file)


def test_a_long_prompt_fits_one_batch_and_is_read_verbatim(tmp_path):
    tools = fake_tools(tmp_path / "tools")
    args = tmp_path / "args"
    speculative = tools / "llama-speculative-simple"
    speculative.write_text(speculative.read_text().replace("#!/bin/sh\n", f"#!/bin/sh\necho \"$@\" > '{args}'\n", 1))
    llama = LlamaCpp(tools, tmp_path / "model.gguf", tmp_path / "draft.gguf", threads=1, gamma=5)
    timing = llama.generate("x" * 10, 32, "speculative", context=6000)
    assert timing.text == "def reverse(s): return s[::-1]<|im_end|>"  # its echo of the prompt is not its answer
    given = args.read_text().split()
    # speculative-simple stops on a prompt longer than its batch (2048 by default): the batch is the context
    assert given[given.index("-b") + 1] == given[given.index("-c") + 1] == "6000" and "--no-escape" in given

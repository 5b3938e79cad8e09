"""llama.cpp reference rows: reading the tools' own timings, and finding the tools.

The logs are what this version's tools printed here (llama.cpp vendored in
llama-cpp-python 0.3.36), trimmed to their summaries.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from specdec_core.bench.llama_cpp import find_tools, parse_completion, parse_speculative

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


def test_a_log_without_timings_stops_with_the_log():
    with pytest.raises(RuntimeError, match="no eval timing"):
        parse_completion("error: model not found", "")


def test_missing_tools_say_how_to_build_them(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"python -m specdec_core.bench.llama_cpp build"):
        find_tools(tmp_path)
    (tmp_path / "bin").mkdir()
    for tool in ("llama-completion", "llama-speculative-simple"):
        (tmp_path / "bin" / tool).touch()
    assert find_tools(tmp_path) == tmp_path / "bin"

"""The `specdec` command: plan and generate (tiny random models, no download)."""

import re
from pathlib import Path

import pytest

from server.cli import main
from specdec_core import theory

TINY_CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "tiny-random.yaml")
STATS = re.compile(
    r"-- (?P<tokens>\d+) tokens in [\d.]+ s = [\d.]+ tokens/s; method (?P<method>[\w-]+), "
    r"acceptance (?P<acceptance>[\d.]+)%, mean accepted length [\d.]+, mean gamma [\d.]+, finish (?P<finish>\w+)"
)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_expected_tokens(capsys):
    code, out, _ = run(capsys, "plan", "--alpha", "0.75", "--gamma", "5")
    assert code == 0
    assert "expected tokens per verification step = 3.29" in out


def test_plan_optimal_gamma(capsys):
    code, out, _ = run(capsys, "plan", "--alpha", "0.8", "--draft-ms", "5", "--verify-ms", "50")
    assert code == 0
    gamma, speedup = theory.optimal_gamma(0.8, 5 / 50)
    assert f"optimal gamma = {gamma}," in out
    assert f"speedup over plain decoding = {speedup:.2f}x" in out
    assert f"expected tokens per step = {theory.expected_tokens(0.8, gamma):.2f}" in out


def test_plan_speedup_for_a_given_gamma(capsys):
    code, out, _ = run(capsys, "plan", "--alpha", "0.8", "--gamma", "3", "--draft-ms", "5", "--verify-ms", "50")
    assert code == 0
    assert f"speedup over plain decoding = {theory.speedup(0.8, 3, 0.1):.2f}x" in out


def test_plan_needs_gamma_or_costs(capsys):
    code, out, err = run(capsys, "plan", "--alpha", "0.8", "--draft-ms", "5")
    assert code == 2 and not out
    assert "--gamma" in err and "--verify-ms" in err


def generate(capsys, *extra: str) -> tuple[str, re.Match]:
    prompt = "self.decode(s) + self.decode(s) + self.decode(s) + self."
    code, out, err = run(capsys, "generate", "--config", TINY_CONFIG, "--prompt", prompt, "--max-tokens", "12", *extra)
    assert code == 0
    stats = STATS.search(err)
    assert stats, f"no stats line in {err!r}"
    return out, stats


@pytest.mark.parametrize("drafter", ["ngram", "draft-model", "none"])
def test_generate_prints_text_and_stats(capsys, drafter):
    out, stats = generate(capsys, "--drafter", drafter)
    assert out.strip()
    assert stats["method"] == drafter
    tokens = int(stats["tokens"])
    assert (tokens, stats["finish"]) == (12, "length") or (0 < tokens <= 12 and stats["finish"] == "stop")
    if drafter == "none":
        assert float(stats["acceptance"]) == 0


def test_plain_generate_with_a_seed_is_reproducible(capsys):
    # Plain only: with speculation the draws a step makes depend on the gamma the (timed) controller picks.
    first, _ = generate(capsys, "--drafter", "none", "--temperature", "1", "--seed", "3", "--no-chat")
    second, _ = generate(capsys, "--drafter", "none", "--temperature", "1", "--seed", "3", "--no-chat")
    third, _ = generate(capsys, "--drafter", "none", "--temperature", "1", "--seed", "4", "--no-chat")
    assert first == second != third


def test_calibrate_measures_drafters_against_plain_decoding(capsys, prompts_file):
    code, out, _ = run(capsys, "calibrate", "--config", TINY_CONFIG, "--drafters", "ngram,layer-skip:gamma=2",
                       "--num-prompts", "1", "--max-tokens", "4", "--threads", "1", "--prompts", str(prompts_file))
    assert code == 0
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()}
    assert set(rows) == {"plain", "ngram", "layer-skip:gamma=2"}
    figures = dict(zip(rows["layer-skip:gamma=2"][::2], map(float, rows["layer-skip:gamma=2"][1::2])))
    assert {"speedup", "cost_ratio", "acceptance", "mean_accepted_length"} <= set(figures)
    assert figures["cost_ratio"] > 0 and 1 <= figures["mean_accepted_length"] <= 3  # gamma 2: at most 3 per step


@pytest.mark.parametrize("path", sorted(Path("configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_is_valid(path: Path):
    from specdec_core.config import Config

    Config.load(path)

"""`specdec bench`: the statistics, the prompt selection, and a smoke run on the tiny random models."""

from __future__ import annotations

import json
import sys

import pytest

from specdec_cli.main import main
from specdec_tools.bench.docs import PAGE, cpu_kind, main as docs_main
from specdec_tools.bench.prompts import Prompt, load_prompts, stratified
from specdec_tools.bench.results import controller_checks, records
from specdec_tools.bench.runner import Method, Run, parse_method
from specdec_tools.bench.stats import interleave, ratios_to_plain, summary

# -- measurement design and statistics ---------------------------------------


def test_interleave_brackets_every_method_with_plain():
    assert interleave(["plain", "a", "b"]) == ["plain", "a", "plain", "b", "plain"]
    assert interleave(["a", "b", "c"], plain_every=2) == ["plain", "a", "b", "plain", "c", "plain"]
    assert interleave(["plain"]) == ["plain"]


def test_interleave_rotates_method_order_between_blocks():
    assert interleave(["plain", "a", "b", "c"], rotate=1) == ["plain", "b", "plain", "c", "plain", "a", "plain"]
    assert interleave(["a", "b"], rotate=2) == interleave(["a", "b"])


def test_ratios_to_plain_divide_by_the_neighbouring_plain_runs():
    labels = ["plain", "a", "plain", "b", "plain"]
    ratios = ratios_to_plain(labels, [10.0, 30.0, 20.0, 10.0, 20.0])
    assert ratios[1] == pytest.approx(30 / 15)  # bracketed: mean of both neighbours
    assert ratios[3] == pytest.approx(10 / 20)
    # Plain runs against the previous plain run: the noise floor.
    assert ratios[0] is None and ratios[2] == pytest.approx(2.0) and ratios[4] == pytest.approx(1.0)


def test_ratios_to_plain_reach_the_nearest_plain_runs_on_each_side_or_give_none_without_a_rate():
    ratios = ratios_to_plain(["plain", "a", "b", "plain"], [10.0, 20.0, None, 40.0])
    assert ratios[1] == pytest.approx(20 / 25)  # the plain runs before and after, one of them not adjacent
    assert ratios[2] is None
    assert ratios_to_plain(["a", "b"], [1.0, 2.0]) == [None, None]
    assert ratios_to_plain(["plain", "a"], [10.0, 5.0])[1] == pytest.approx(0.5)  # plain on one side only


def test_with_four_methods_between_plain_runs_every_method_gets_a_ratio():
    order = interleave(["plain", "a", "b", "c", "d", "e"], plain_every=4)
    assert order == ["plain", "a", "b", "c", "d", "plain", "e", "plain"]
    ratios = ratios_to_plain(order, [10.0, 10.0, 20.0, 30.0, 10.0, 30.0, 15.0, 20.0])
    assert ratios[2] == pytest.approx(20 / 20) and ratios[3] == pytest.approx(30 / 20)  # no plain run next to them
    assert ratios[6] == pytest.approx(15 / 25)


def test_summary_median_mean_and_range_skip_missing_values():
    s = summary([1.0, None, 3.0, 2.0, 10.0])
    assert s == {"median": 2.5, "mean": 4.0, "min": 1.0, "max": 10.0, "n": 4}
    assert summary([None]) is None and summary([]) is None


# -- prompts --------------------------------------------------------------------


def _prompts(spec: dict[str, int]) -> list[Prompt]:
    return [Prompt(f"{c}{i}", c, f"{c} question {i}") for c, n in spec.items() for i in range(n)]


def test_stratified_takes_categories_round_robin_in_file_order():
    pool = _prompts({"x": 3, "y": 1, "z": 2})
    assert [p.id for p in stratified(pool, 3)] == ["x0", "y0", "z0"]
    assert [p.id for p in stratified(pool, 5)] == ["x0", "y0", "z0", "x1", "z1"]  # y ran out: others fill in
    assert len(stratified(pool, 100)) == 6


def test_load_prompts_reads_prompt_or_first_turn(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"question_id": 7, "category": "qa", "turns": ["first", "second"]}) + "\n\n"
        + json.dumps({"prompt": "plain text"}) + "\n"
    )
    assert load_prompts(path) == [Prompt("7", "qa", "first"), Prompt("3", "default", "plain text")]


def test_missing_prompts_file_names_the_option(tmp_path):
    with pytest.raises(FileNotFoundError, match="--prompts"):
        load_prompts(tmp_path / "nope.jsonl")


# -- methods and records ----------------------------------------------------------


def test_parse_method_names_and_fixed_gamma():
    assert parse_method("ngram") == Method("ngram", "ngram", None)
    assert parse_method("draft-model:g3") == Method("draft-model:g3", "draft-model", 3)
    assert parse_method("none") == Method("plain", "none")
    assert parse_method("ngram").adaptive and not parse_method("ngram:g4").adaptive
    for drafter in ("layer-skip", "quantized", "hybrid"):  # every drafter the engine has
        assert parse_method(drafter) == Method(drafter, drafter, None)
        assert parse_method(f"{drafter}:g2") == Method(f"{drafter}:g2", drafter, 2)
    student = "distilled:distilled.student=qwen-student"
    assert parse_method(student) == Method(student, "distilled", None, "distilled.student=qwen-student")
    assert parse_method(f"{student}:g3").engine == parse_method(student).engine == "distilled:distilled.student=qwen-student"
    assert parse_method("layer-skip:layer_skip.k=8:vocab_size=512:g2") == Method(
        "layer-skip:layer_skip.k=8:vocab_size=512:g2", "layer-skip", 2, "layer_skip.k=8:vocab_size=512")
    compiled = parse_method("plain:model.step=compiled")  # plain decoding on another step: an engine of its own
    assert compiled == Method("plain:model.step=compiled", "none", None, "model.step=compiled") and compiled.on_engine
    assert not parse_method("plain").on_engine and parse_method("suffix:model.step=static").on_engine
    for bad in ("no-such-drafter", "plain:g2", "ngram:g0", "ngram:4", "plain:vocab_size=8", "ngram:g2:max_n=3"):
        with pytest.raises(ValueError):
            parse_method(bad)


def _run(method: str, block: int, ratio: float | None, **figures) -> Run:
    return Run(method, 1, block, [Prompt(str(block), "c", "")], [[1, 2, 3]], wall_s=1.0, prefill_s=0.2,
               ratio=ratio, decode_ratio=ratio, **figures)


def test_records_pool_figures_and_controller_check_flags_a_slow_adaptive_method():
    runs = [
        _run("plain", 0, None), _run("plain", 1, None),
        _run("ngram", 0, 0.90, draft_tokens=10, accepted_tokens=5, verify_steps=4, gamma_sum=10,
             emitted_in_verify=9, chosen_gammas=[0, 2, 3], accepted_per_position=[3, 2], drafted_per_position=[4, 4],
             matches_plain=[True]),
        _run("ngram", 1, 0.80, draft_tokens=10, accepted_tokens=7, verify_steps=6, gamma_sum=12,
             emitted_in_verify=13, chosen_gammas=[2], accepted_per_position=[4], drafted_per_position=[4],
             matches_plain=[False]),
        _run("ngram:g4", 0, 1.30), _run("ngram:g4", 1, 1.10),
    ]
    recs = records(runs, ["plain", "ngram", "ngram:g4"])
    ngram = next(r for r in recs if r["method"] == "ngram" and r["category"] == "all")
    assert ngram["acceptance_rate"] == pytest.approx(12 / 20)
    assert ngram["mean_accepted_length"] == pytest.approx(22 / 10)
    assert ngram["mean_gamma"] == pytest.approx(22 / 10)
    assert ngram["speedup_vs_plain"]["median"] == pytest.approx(0.85)
    assert ngram["speculative_step_fraction"] == pytest.approx(3 / 4)
    assert ngram["controller_mean_gamma"] == pytest.approx(7 / 3)
    assert ngram["greedy_match_rate"] == pytest.approx(0.5)
    assert ngram["acceptance_by_position"] == [pytest.approx(7 / 8), pytest.approx(2 / 4)]
    assert ngram["prompts"] == 2 and ngram["new_tokens"] == 6
    # Each output's first token comes from its prompt's prefill: decoding made the other two, in 0.8 s.
    assert ngram["decoded_tokens"] == 4 and ngram["decode_tokens_per_s"] == pytest.approx(4 / 1.6)

    methods = [parse_method(m) for m in ("plain", "ngram", "ngram:g4")]
    (check,) = controller_checks(recs, methods)
    assert check["best_alternative"] == "ngram:g4" and check["best_alternative_speedup"] == pytest.approx(1.2)
    assert check["within_tolerance"] is False


# -- smoke run ------------------------------------------------------------------------------------


def test_bench_smoke_run_writes_results_report_and_plots(tmp_path, monkeypatch):
    prompts = tmp_path / "prompts.jsonl"
    lines = [
        {"category": "code", "prompt": "def add(a, b): return a + b. Write def sub(a, b) the same way."},
        {"category": "chat", "turns": ["Say hello, then say hello again."]},
        {"category": "code", "prompt": "for i in range(10): print(i)"},
        {"category": "long", "prompt": "word " * 300},  # about 900 tokens: over --max-prompt-tokens
    ]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    argv = [
        "bench", "--config", "configs/tiny-random.yaml", "--prompts", str(prompts),
        "--drafters", "plain,ngram,ngram:g2,draft-model,layer-skip:g2,quantized:g2,hybrid:g2,plain:model.step=compiled,"
        "ngram:model.step=compiled:g2", "--baseline", "hf-assisted",
        "--max-prompt-tokens", "200", "--max-tokens", "6", "--batch-sizes", "1,2", "--sweep-rows", "2", "--out", str(out),
    ]
    monkeypatch.setattr(sys, "argv", ["specdec", *argv])
    assert main(argv) == 0

    results = json.loads((out / "results.json").read_text())
    header = results["header"]
    assert header["command"].startswith("specdec bench --config configs/tiny-random.yaml")
    assert {"cpu", "cores", "dtype", "torch", "transformers"} <= set(header["machine"])
    assert header["config"]["model"]["target"] == "tiny-random-llama" and header["date"]
    assert header["prompts"]["categories"] == ["code", "chat"] and header["prompts"]["left_out"] == ["long"]

    keys = {(r["method"], r["batch_size"], r["category"]) for r in results["records"]}
    engine_methods = ["plain", "ngram", "ngram:g2", "draft-model", "layer-skip:g2", "quantized:g2", "hybrid:g2",
                      "plain:model.step=compiled", "ngram:model.step=compiled:g2"]
    methods = engine_methods + ["hf-assisted", "hf-prompt-lookup"]
    assert {(m, 1, c) for m in methods for c in ("all", "code", "chat")} <= keys
    assert {(m, 2, "all") for m in engine_methods} <= keys
    assert not any(r["method"].startswith("hf-") and r["batch_size"] == 2 for r in results["records"])
    required = {
        "method", "batch_size", "category", "tokens_per_s", "speedup_vs_plain", "acceptance_rate",
        "mean_accepted_length", "mean_gamma", "greedy_match_rate", "prompts", "new_tokens", "acceptance_by_position",
        "cost_ratio",
    }
    for rec in results["records"]:
        assert required <= set(rec)
        assert rec["tokens_per_s"] > 0
        # fp32 tiny models: every method must reproduce plain greedy decoding exactly.
        assert rec["greedy_match_rate"] in (None, 1.0)
        if rec["method"] != "plain" and rec["batch_size"] == 1:
            assert {"median", "mean"} <= set(rec["speedup_vs_plain"])
    batch1 = {r["method"]: r for r in results["records"] if r["batch_size"] == 1 and r["category"] == "all"}
    assert len(batch1["ngram:g2"]["acceptance_by_position"]) <= 2
    # The cost ratio is measured wherever a model drafted (fixed gamma: it always drafts), and only there.
    assert batch1["plain"]["cost_ratio"] is None and batch1["hf-assisted"]["cost_ratio"] is None
    for method in ("layer-skip:g2", "quantized:g2", "hybrid:g2"):
        assert batch1[method]["cost_ratio"] > 0

    assert results["sweep"]["completed"] == [2] and results["sweep"]["stopped"] is None
    assert {c["method"] for c in results["controller"]} == {"ngram", "draft-model"}
    assert {c["batch_size"] for c in results["controller"]} == {1, 2}

    report = (out / "report.md").read_text()
    for heading in ("## Batch 1, all categories", "## Speedup by category", "## Acceptance by draft position",
                    "## Where the time goes", "## Batch sweep", "## Adaptive controller"):
        assert heading in report
    for png in ("speedup_by_category.png", "acceptance_by_position.png", "speedup_vs_batch.png"):
        assert (out / png).stat().st_size > 0
        assert f"({png})" in report

    # docs/BENCHMARKS.md is generated from such runs: each method's speedup under its CPU kind, and the run cited.
    page, elsewhere = tmp_path / "BENCHMARKS.md", ["--folders", str(tmp_path), "--readme", str(tmp_path / "no-readme.md")]
    assert docs_main([*elsewhere, "--out", str(page)]) == 0
    text = page.read_text()
    kind = cpu_kind(results["header"]["machine"])
    weights = results["header"]["config"]["model"].get("weights") or results["header"]["config"]["model"]["dtype"]
    assert f"### {kind}: tiny-random-llama, {weights}" in text
    speedup = batch1["quantized:g2"]["speedup_vs_plain"]["median"]
    assert f"| `quantized:g2` | {speedup:.2f}x (" in text and "[out](out)" in text
    assert docs_main([*elsewhere, "--out", str(page), "--check"]) == 0
    page.write_text(text.replace("quantized:g2", "quantized:g3"))
    assert docs_main([*elsewhere, "--out", str(page), "--check"]) == 1


def test_the_readmes_figures_are_specdec_over_llama_servers_best_from_the_latest_loadtest(tmp_path):
    def level(target: str, users: int, tokens_per_s: float) -> dict:
        return {"target": target, "mode": "concurrency", "level": users, "sent": 4, "ok": 4, "errors": {},
                "output_tokens_per_s": tokens_per_s, "acceptance_rate": None, "ttft_s": {"p50": 0.1}}

    def run(folder: str, started: str, specdec: float) -> None:
        levels = [level("specdec", 1, specdec), level("llama", 1, 20.0), level("llama-ngram-mod", 1, 25.0)]
        results = {"command": f"python -m loadtest ({folder})", "started": started, "targets": {}, "baseline": "llama",
                   "machine": {"cpu": "AMD EPYC 9B45", "cpu_flags": ["avx512f"]}, "max_tokens": 64,
                   "prompts": {"source": "question.jsonl"}, "levels": levels}
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "results.json").write_text(json.dumps(results))

    run("older", "2026-12-01T10:00:00", specdec=30.0)
    run("newer", "2026-12-05T10:00:00", specdec=50.0)
    (tmp_path / "newer" / "run.sh").write_text("# starts the servers, then loadtest\n")
    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- figures: generated by python -m specdec_tools.bench.docs -->\nold\n<!-- end of figures -->\n")
    argv = ["--folders", str(tmp_path), "--out", str(tmp_path / "BENCHMARKS.md"), "--readme", str(readme)]
    stale = readme.read_text()
    assert docs_main(argv) == 0 and docs_main([*argv, "--check"]) == 0
    fresh = readme.read_text()
    readme.write_text(stale)
    assert docs_main([*argv, "--check"]) == 1  # the page is current, the README's table is not
    readme.write_text(fresh)
    text = fresh
    assert "old" not in text and text.startswith("# x\n") and text.endswith("<!-- end of figures -->\n")
    assert ("| AMD EPYC, AVX-512 | Spec-Bench first turns, 64 tokens | 1 | 50.0 | 25.0 (llama-ngram-mod) | **2.00x** | "
            "`bash newer/run.sh` |") in text and "30.0" not in text


def test_the_benchmarks_page_is_what_the_committed_runs_give():
    assert docs_main(["--check"]) == 0
    assert len(PAGE.read_text().splitlines()) <= 250  # one page a reader takes in: earlier runs stay in their folders


def test_bench_without_prompts_file_says_which_option_to_use(tmp_path):
    with pytest.raises(SystemExit, match="--prompts"):
        main(["bench", "--config", "configs/tiny-random.yaml", "--prompts", str(tmp_path / "missing.jsonl")])


def test_bench_sweep_only_when_batch_size_1_is_not_asked_for(tmp_path, monkeypatch):
    out = tmp_path / "out"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"category": c, "prompt": f"{c}: print(1)"}) + "\n" for c in "ab"))
    argv = [
        "bench", "--config", "configs/tiny-random.yaml", "--prompts", str(prompts), "--drafters", "plain,ngram:g2",
        "--max-tokens", "4", "--batch-sizes", "2", "--out", str(out),
    ]
    monkeypatch.setattr(sys, "argv", ["specdec", *argv])
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert {r["batch_size"] for r in results["records"]} == {2}
    assert results["plots"] == [] and results["header"]["prompts"]["count"] == 0
    assert "## Batch 1" not in (out / "report.md").read_text()

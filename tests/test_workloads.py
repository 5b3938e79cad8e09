"""Serving workloads (`specdec bench --workload`): the requests each builds, how answers flow into later
requests, the agent's edits, and a replay through the bench where memories are emptied (cold) and filled by
other sessions first (warm)."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest

from specdec_cli.main import main
from specdec_core.config import Config, with_overrides
from specdec_tools.bench.prompts import Prompt
from specdec_tools.grammar_cost import instance
from specdec_tools.bench.runner import Bench, Method, Run, run_block
from specdec_tools.bench.workloads import (
    CHAT_TURNS,
    CODE_EDIT_FUNCTIONS,
    INSTRUCTIONS,
    PHASES,
    agent_file,
    apply_edit,
    drive,
    replay,
    requests_in,
    workloads,
)

from .helpers import single_thread  # noqa: F401  (autouse: torch on one thread)


@pytest.fixture()
def two_turns(tmp_path):
    """Spec-Bench's shape: two-turn questions (MT-bench's) and single-turn ones, in two categories each."""
    path = tmp_path / "question.jsonl"
    rows = [
        {"question_id": 1, "category": "writing", "turns": ["Write a haiku about rain.", "Now make it about snow."]},
        {"question_id": 2, "category": "coding", "turns": ["Write a Python is_prime.", "Make it faster."]},
        {"question_id": 3, "category": "writing", "turns": ["Describe a city.", "Describe it at night."]},
        {"question_id": 4, "category": "coding", "turns": ["Reverse a list in C.", "Now in Rust."]},
        {"question_id": 5, "category": "qa", "turns": ["What is the capital of France?"]},
        {"question_id": 6, "category": "math", "turns": ["What is 12 * 13?"]},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def transcript(session, answers):
    """Every prompt a session makes, each answered by the next of `answers`."""
    prompts, replies = [], iter(answers)
    drive(session, lambda prompt: (prompts.append(prompt), next(replies))[1])
    return prompts


def test_multi_turn_puts_the_first_answer_before_the_second_turn(two_turns):
    workload = workloads(two_turns)["multi-turn"]
    first, second = transcript(workload.sessions(1)[0], ["ANSWER ONE", "ANSWER TWO"])
    assert (first.category, second.category) == ("multi-turn 1", "multi-turn 2")
    assert [m["role"] for m in second.messages()] == ["user", "assistant", "user"]
    assert second.messages()[1]["content"] == "ANSWER ONE" and second.text == "Now make it about snow."
    # Only two-turn questions, stratified over their categories; the warm-up sessions are other questions.
    measured = {transcript(s, ["a", "b"])[0].text for s in workload.sessions(2)}
    warmup = {transcript(s, ["a", "b"])[0].text for s in workload.warmup(2)}
    assert measured == {"Write a haiku about rain.", "Write a Python is_prime."} and not measured & warmup
    assert requests_in(workload, 2) == 4


def test_spec_bench_workload_is_the_first_turns_of_every_category(two_turns):
    workload = workloads(two_turns)["spec-bench"]
    prompts = [transcript(s, ["x"])[0] for s in workload.sessions(4)]
    assert [p.text for p in prompts] == ["Write a haiku about rain.", "Write a Python is_prime.",
                                         "What is the capital of France?", "What is 12 * 13?"]
    assert {p.category for p in prompts} == {"spec-bench"}


def test_code_edits_are_real_standard_library_functions_with_an_instruction(two_turns):
    workload = workloads(two_turns)["code-edit"]
    prompts = [transcript(s, ["x"])[0] for s in workload.sessions(len(CODE_EDIT_FUNCTIONS))]
    assert len(prompts) == len(CODE_EDIT_FUNCTIONS)  # every one is pure Python on this interpreter
    for prompt in prompts:
        code = prompt.text.split("```python\n", 1)[1].split("```", 1)[0]
        tree = ast.parse(code)  # dedented, whole: it parses
        assert isinstance(tree.body[0], ast.FunctionDef) and 10 <= len(code.splitlines()) <= 130
        assert "Return the whole code" in prompt.text
    assert {next(i for i in INSTRUCTIONS if i in p.text) for p in prompts} == set(INSTRUCTIONS)


def test_an_agent_edit_replaces_its_function_and_only_it():
    file, names = agent_file("colorsys")
    answer = f"Here:\n```python\ndef {names[1]}(y: float, i: float, q: float) -> tuple:\n    return (y, i, q)\n```"
    edited = apply_edit(file, names[1], answer)
    before, after = ast.parse(file), ast.parse(edited)
    assert [f.name for f in after.body] == [f.name for f in before.body] == names
    assert ast.unparse(after.body[0]) == ast.unparse(before.body[0])
    assert ast.unparse(after.body[1]).startswith(f"def {names[1]}(y: float")
    # An answer with the whole file again: only the function asked for is taken from it.
    whole = f"```python\n{edited.replace('return (y, i, q)', 'return (q, i, y)')}```"
    again = apply_edit(edited, names[1], whole)
    assert [f.name for f in ast.parse(again).body] == names and "return (q, i, y)" in again
    # A truncated answer (no closing fence) or code that defines something else is not applied.
    assert apply_edit(file, names[1], answer.removesuffix("```")) is None
    assert apply_edit(file, names[1], "```python\ndef other():\n    pass\n```") is None


def test_agentic_requests_resend_the_conversation_with_new_tool_output(two_turns):
    session = workloads(two_turns)["agentic"].sessions(1)[0]
    file, names = agent_file("colorsys")
    good = f"```python\ndef {names[0]}(r: float, g: float, b: float) -> tuple:\n    return (r, g, b)\n```"
    prompts = transcript(session, [good, "no code here", good])
    assert len(prompts) == 3 and {p.category for p in prompts} == {"agentic"}
    assert file in prompts[0].text and len(prompts[1].history) == 1 and len(prompts[2].history) == 2
    assert prompts[1].history[0] == (prompts[0].text, good)  # the whole conversation, resent
    assert "```diff" in prompts[1].text and f"def {names[0]}(r: float" in prompts[1].text
    assert "failed" in prompts[2].text and f"`{names[2]}`" in prompts[2].text


def test_a_chat_ui_session_resends_its_long_system_prompt_and_history_every_turn():
    session = workloads(Path("unused.jsonl"))["chat-ui"].sessions(1)[0]
    prompts = []
    drive(session, lambda prompt: prompts.append(prompt) or f"answer {len(prompts)}")
    assert len(prompts) == CHAT_TURNS and len({p.system for p in prompts}) == 1
    assert len(prompts[0].system) > 7_000 and "```python" in prompts[0].system
    assert [len(p.history) for p in prompts] == list(range(CHAT_TURNS))
    assert prompts[-1].history[0] == (prompts[0].text, "answer 1")
    assert prompts[0].messages()[0] == {"role": "system", "content": prompts[0].system}


def test_bench_forgets_what_a_suffix_memory_learnt_and_gives_each_remembering_method_its_own():
    config = with_overrides(Config.load("configs/tiny-random.yaml"), "none:prefill.cache=false")
    methods = [Method("plain", "none"), Method("suffix", "suffix"), Method("suffix:g2", "suffix", 2),
               Method("ngram", "ngram"), Method("ngram:g2", "ngram", 2), Method("ngram:prefill.cache=true", "ngram",
                                                                                  settings="prefill.cache=true")]
    bench = Bench(config, methods, temperature=0.0, seed=0)
    assert [bench.remembers(m) for m in methods] == [False, True, True, False, False, False]
    # Methods that differ only in gamma share an engine, unless it remembers: then one drafts from the other's runs,
    # or finds the prompts the other prefilled in its prefix cache.
    assert bench.engines["ngram"] is bench.engines["ngram:g2"]
    assert bench.engines["suffix"] is not bench.engines["suffix:g2"]
    cached = bench.engines["ngram:prefill.cache=true"]
    assert cached.prefix_cache is not None and bench.engines["ngram"].prefix_cache is None
    bench.run(methods[1], [Prompt("p", "c", "hello there, hello there")], 8, block=0)
    memory = bench.engines["suffix"].drafter.global_memory
    assert memory.size > 0 and bench.engines["suffix:g2"].drafter.global_memory.size == 0
    long = Prompt("q", "c", "the same words again and again " * 80)
    bench.run(methods[-1], [long], 2, block=0)
    assert cached.prefix_cache.blocks
    bench.forget()
    assert bench.engines["suffix"].drafter.global_memory.size == 0 and not cached.prefix_cache.blocks


def test_a_method_run_twice_in_a_block_misses_the_cache_its_first_run_filled():
    """Plain runs between the other methods, several times a block: each of its runs finds the cache as the
    block's first did, so none is faster for having run the block's prompt already; the next block hits."""
    config = Config.load("configs/tiny-random.yaml")
    methods = [Method("plain", "none"), Method("ngram", "ngram")]
    bench = Bench(config, methods, temperature=0.0, seed=0)
    long = Prompt("q", "c", "the same words again and again " * 80)
    runs = run_block(bench, methods, [long], 2, 0, plain_every=1)
    cache = bench.engines["plain"].prefix_cache
    assert [run.method for run in runs].count("plain") == 2
    assert cache.blocks and cache.counts.hit_tokens == 0 and all(run.cached_tokens == 0 for run in runs)
    runs = run_block(bench, methods, [Prompt("q2", "c", long.text + " and once more")], 2, 1, plain_every=1)
    assert cache.counts.hit_tokens > 0
    # each run reports what the cache gave it (records and the report's table sum them)
    assert {run.cached_tokens for run in runs if run.method == "plain"} == {cache.counts.hit_tokens // 2}


class RecordingBench:
    """Just what `replay` uses of a Bench, recording each run: (method, prompt id, history length)."""

    temperature = 0.0

    def __init__(self, remembering: set[str]):
        self.remembering, self.calls = remembering, []
        self.engines = {}  # none with a prefix cache
        self.target = SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda ids, skip_special_tokens: f"answer{len(ids)}"))

    def remembers(self, method: Method) -> bool:
        return method.label in self.remembering

    def forget(self) -> None:
        self.calls.append("forget")

    def run(self, method: Method, prompts: list[Prompt], max_tokens: int, block: int) -> Run:
        self.calls.append((method.label, prompts[0].id, len(prompts[0].history)))
        return Run(method.label, 1, block, prompts, [[1, 2, 3]], wall_s=1.0, prefill_s=0.1)


def test_replay_runs_cold_then_warms_only_the_remembering_methods_on_other_sessions(two_turns):
    methods = [Method("plain", "none"), Method("suffix", "suffix"), Method("ngram", "ngram")]
    bench = RecordingBench({"suffix"})
    runs = replay(bench, methods, workloads(two_turns)["multi-turn"], 1, 8, plain_every=1)
    cold, warm = bench.calls.index("forget"), len(bench.calls) - 1 - bench.calls[::-1].index("forget")
    assert bench.calls.count("forget") == 2 and cold == 0
    measured = [c for c in bench.calls if c != "forget" and not c[1].startswith("warm-up/")]
    warmup = [c for c in bench.calls[warm:] if c != "forget" and c[1].startswith("warm-up/")]
    # The warm-up: the remembering method alone, over the next session (question 2, the next category), both turns.
    assert warmup == [("suffix", "warm-up/suffix/multi-turn/2/1", 0), ("suffix", "warm-up/suffix/multi-turn/2/2", 1)]
    assert all(bench.calls.index(c) > warm for c in warmup)
    # Measured: every method on the same requests, cold then warm, the second turn with the first answer.
    ids = {(label, i) for label, i, _ in measured}
    assert ids == {(m.label, f"{phase}/multi-turn/1/{turn}") for m in methods for phase in PHASES for turn in (1, 2)}
    assert {h for _, i, h in measured if i.endswith("/2")} == {1}
    assert [r.prompts[0].category for r in runs if r.method == "suffix"] == [
        "multi-turn 1 cold", "multi-turn 2 cold", "multi-turn 1 warm", "multi-turn 2 warm"]
    assert len({r.block for r in runs}) == 4  # one block per request, each its own number


def test_bench_replays_workloads_cold_and_warm(tmp_path, monkeypatch, two_turns):
    out = tmp_path / "out"
    argv = ["bench", "--config", "configs/tiny-random.yaml", "--prompts", str(two_turns), "--workload",
            "multi-turn,agentic", "--drafters", "plain,suffix,ngram", "--num-prompts", "1", "--max-tokens", "4",
            "--plain-every", "2", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["specdec", *argv])
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert [w["name"] for w in results["header"]["workloads"]] == ["multi-turn", "agentic"]
    categories = {f"{kind} {phase}" for kind in ("multi-turn 1", "multi-turn 2", "agentic") for phase in PHASES}
    assert set(results["header"]["prompts"]["categories"]) == categories
    records = {(r["method"], r["category"]): r for r in results["records"] if r["batch_size"] == 1}
    for method in ("plain", "suffix", "ngram"):
        for category in categories:
            assert records[method, category]["prompts"] == (3 if category.startswith("agentic") else 1)
    # fp32 tiny models: every method gives plain's text, so every method saw the same conversations.
    assert all(r["greedy_match_rate"] in (None, 1.0) for r in results["records"])
    # Plain's tokens per request, once each, for offline replays of a drafter (ngram_sweep).
    sequences = results["sequences"]
    assert len(sequences) == len({s["id"] for s in sequences}) == 2 * (2 + 3)
    assert all(s["prompt_ids"] and len(s["output_ids"]) <= 4 for s in sequences)
    report = (out / "report.md").read_text()
    assert "`multi-turn`: 1 session(s), 2 request(s)" in report and "agentic warm" in report
    assert (out / "speedup_by_category.png").stat().st_size > 0


@pytest.mark.parametrize(("error", "stopped"), [
    (RuntimeError("llama-speculative-simple failed (1):\nthe prompt exceeds the batch size"),
     "RuntimeError: llama-speculative-simple failed (1):"),
    (KeyboardInterrupt(), "KeyboardInterrupt: "),  # Ctrl-C on a long bench keeps what it measured
])
def test_a_failed_or_interrupted_run_stops_the_bench_with_the_blocks_it_finished_written(
    tmp_path, monkeypatch, two_turns, error, stopped
):
    out = tmp_path / "out"
    argv = ["bench", "--config", "configs/tiny-random.yaml", "--prompts", str(two_turns), "--workload", "multi-turn",
            "--drafters", "plain,ngram", "--num-prompts", "1", "--max-tokens", "4", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["specdec", *argv])
    run = Bench.run

    def failing_after_the_first_block(self, method, prompts, max_tokens, block):
        if block >= 1:  # the warm-up (block -1) and the first request's block go through
            raise error
        return run(self, method, prompts, max_tokens, block)

    monkeypatch.setattr(Bench, "run", failing_after_the_first_block)
    with pytest.raises(type(error)):
        main(argv)
    results = json.loads((out / "results.json").read_text())
    assert results["header"]["stopped"] == stopped
    assert {r["block"] for r in results["runs"]} == {0} and {r["method"] for r in results["runs"]} == {"plain", "ngram"}
    assert [s["id"] for s in results["sequences"]] == ["cold/multi-turn/1/1"]
    assert "Stopped before its end" in (out / "report.md").read_text()


def test_the_json_workload_decodes_every_method_under_its_schema():
    """Each request carries its schema; every method's output is the schema's (valid where it ended by stop), the
    grammar drafting beside the drafter, and plain decoding constrained too; a method off the engine refuses."""
    session_prompts = []
    for session in workloads(Path("unused.jsonl"))["json"].sessions(12):
        drive(session, lambda prompt: session_prompts.append(prompt) or "")
    assert len(session_prompts) == 12 and all(p.schema and json.dumps(p.schema) in p.text for p in session_prompts)
    config = Config.load("configs/tiny-random.yaml")
    methods = [Method("plain", "none"), Method("suffix", "suffix"), Method("suffix:grammar.draft_tokens=0", "suffix",
                                                                           settings="grammar.draft_tokens=0")]
    bench = Bench(config, methods, temperature=0.8, seed=0)  # seeded: every method draws the same text
    runs = [bench.run(method, session_prompts[:6], 600, block=0) for method in methods]
    assert runs[0].outputs == runs[1].outputs == runs[2].outputs
    assert runs[1].grammar_accepted_tokens > 0 and runs[2].grammar_draft_tokens == runs[0].grammar_draft_tokens == 0
    stopped = [(prompt, output) for prompt, output, finish in zip(session_prompts, runs[0].outputs, runs[0].finish_reasons)
               if finish == "stop"]
    assert stopped, "no output ended by stop: validity says nothing"
    for prompt, output in stopped:
        jsonschema.validate(json.loads(bench.target.tokenizer.decode(output, skip_special_tokens=True)), prompt.schema)
    with pytest.raises(ValueError, match="does not take a schema"):
        bench.run(Method("hf-lookup", "hf-lookup"), session_prompts[:1], 8, block=0)


def test_the_cost_tools_instances_are_valid_against_every_shipped_schema():
    for session in workloads(Path("unused.jsonl"))["json"].sessions(12):
        drive(session, lambda prompt: jsonschema.validate(instance(prompt.schema), prompt.schema) or "")

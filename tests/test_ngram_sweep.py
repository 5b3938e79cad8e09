"""The offline n-gram replay counts the steps and drafts the engine takes: greedy, plain's tokens suffice."""

from __future__ import annotations

import json

from specdec_core.control import Controller
from specdec_core.drafters.ngram import NgramDrafter
from specdec_core.engine import Engine
from specdec_core.sampling import SamplingParams
from specdec_core.sequence import Sequence
from specdec_tools import ngram_sweep

from .helpers import single_thread, tiny_runner  # noqa: F401  (single_thread: autouse, torch on one thread)

PROMPT = [3, 7, 1, 4, 3, 7, 1, 5, 3, 7, 2, 4, 3, 7]


def test_replay_equals_the_engines_greedy_steps():
    target = tiny_runner(seed=0, vocab=16)  # a small vocabulary: the target repeats itself, so drafts get kept
    for min_n, max_n, gamma in ((1, 3, 4), (2, 2, 3)):
        engine = Engine(target, NgramDrafter(min_n, max_n, 8), Controller(gamma_max=gamma, fixed_gamma=gamma),
                        eos_token_ids=set())
        seq = Sequence("s", list(PROMPT), SamplingParams(temperature=0.0), 40)
        engine.add(seq)
        steps = 0
        while engine.seqs:
            engine.step()
            steps += 1
        assert seq.stats.accepted_tokens > 0  # the check means something only if drafts were kept
        assert ngram_sweep.replay(PROMPT, seq.output_ids, min_n, max_n, gamma) == (steps, seq.stats.draft_tokens)


def test_the_sweep_reads_a_runs_sequences_and_pools_by_group(tmp_path, capsys):
    results = tmp_path / "results.json"
    repeated = {"id": "a", "category": "code-edit cold", "prompt_ids": [1, 2, 3, 4, 5], "output_ids": [1, 2, 3, 4, 5]}
    novel = {"id": "b", "category": "spec-bench cold", "prompt_ids": [1, 2], "output_ids": [6, 7, 8]}
    results.write_text(json.dumps({"sequences": [repeated, novel]}))
    out = tmp_path / "sweep.json"
    assert ngram_sweep.main([str(results), "--max-n", "2", "--out", str(out)]) == 0
    figures = json.loads(out.read_text())
    tokens = figures["tokens per step, min_n=1 max_n=2"]
    # Copying its prompt: after its first token (1, the prefill's), one step drafts 2, 3, 4, all kept, and adds 5.
    assert tokens["code-edit cold"] == 4 / 1
    assert tokens["spec-bench cold"] == 1.0  # nothing to look up: one token a step
    assert tokens["all"] == 6 / 3
    assert figures["draft tokens per step, min_n=1 max_n=2"]["code-edit cold"] == 3 / 1
    assert figures["command"].startswith("python -m specdec_tools.ngram_sweep") and '"all"' in capsys.readouterr().out

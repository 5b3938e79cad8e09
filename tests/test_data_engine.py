"""The data engine (train/task_prompts.py, answers.py, depth_features.py): prompts from real code and tasks that
share nothing with Spec-Bench, answers that equal plain decoding's whatever the batch, a stopped run that resumes
at any shard to the same files, and the target's features at three depths made once per answers shard."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec_cli.main import main
from specdec_core.config import Config
from specdec_core.models.eagle3_net import feature_layers
from specdec_core.models.loading import eos_ids, load_runner
from specdec_tools.train import answers as answers_module
from specdec_tools.train import depth_features
from specdec_tools.train.answers import MismatchedRun, Shard, answer
from specdec_tools.train.settings import AnswerSettings
from specdec_tools.train.task_prompts import build_prompts, read_prompts, write_prompts

from .helpers import greedy_reference
from .helpers import single_thread  # noqa: F401  (autouse: torch on one thread)

CONFIG = "configs/tiny-random.yaml"
SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
COMMITTED_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "train" / "prompts.jsonl.gz"
SETTINGS = AnswerSettings(answer_tokens=12, batch=3, shard_prompts=2)
TEXTS = ["def add(a, b): return a + b", "Explain recursion.", "x", "Write a poem about rivers.", "import os", "1 + 1 ="]


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl.gz"
    write_prompts([{"id": i, "kind": "general", "task": "test", "source": "here", "text": text} for i, text in enumerate(TEXTS)], path)
    return path


def shard_files(directory: Path) -> dict[str, dict[str, np.ndarray]]:
    out = {}
    for path in sorted(directory.glob("shard-*.npz")):
        with np.load(path) as data:
            out[path.name] = {key: data[key] for key in data.files}
    return out


def word_runs(text: str, n: int = 8) -> set[str]:
    words = text.lower().split()
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


# -- prompts ---------------------------------------------------------------------


def test_prompts_mix_code_and_general_tasks_reproducibly(tmp_path):
    prompts = build_prompts(40, 30, seed=3)
    assert prompts == build_prompts(40, 30, seed=3)
    assert [p["id"] for p in prompts] == list(range(70))
    assert sum(p["kind"] == "code" for p in prompts) == 40
    assert {p["kind"] for p in prompts[:20]} == {"code", "general"}  # shuffled together: any prefix mixes both
    code = next(p for p in prompts if p["kind"] == "code")
    assert "```python\ndef " in code["text"] and ":" in code["source"]
    assert len({p["text"] for p in prompts}) == 70
    write_prompts(prompts, tmp_path / "p.jsonl.gz")
    assert read_prompts(tmp_path / "p.jsonl.gz") == prompts


def test_committed_prompts_share_no_eight_word_run_with_spec_bench():
    if not SPEC_BENCH.is_file():
        pytest.skip(f"Spec-Bench questions not found at {SPEC_BENCH}")
    turns = [turn for line in SPEC_BENCH.read_text().splitlines() for turn in json.loads(line)["turns"]]
    spec_bench = set().union(*map(word_runs, turns))
    prompts = read_prompts(COMMITTED_PROMPTS)
    assert len(prompts) >= 5000
    assert [p["text"] for p in prompts if word_runs(p["text"]) & spec_bench] == []


# -- answers ---------------------------------------------------------------------


def test_answers_are_plain_decodings_whatever_the_batch(tmp_path, prompts_file):
    config = Config.load(CONFIG)
    answer(config, tmp_path / "one", prompts_file, None, dataclasses.replace(SETTINGS, batch=1), progress=False)
    manifest = answer(config, tmp_path / "three", prompts_file, None, SETTINGS, progress=False)
    alone = shard_files(tmp_path / "one")
    assert alone.keys() == {"shard-00000.npz", "shard-00001.npz", "shard-00002.npz"}
    for name, arrays in shard_files(tmp_path / "three").items():
        for key, values in arrays.items():
            assert np.array_equal(values, alone[name][key]), (name, key)
    assert manifest["totals"]["answer_tokens"] == sum(entry["answer_tokens"] for entry in manifest["shards"])
    assert {"kernel", "cpu", "date", "seconds"} <= manifest["shards"][0].keys()
    runner = load_runner(config.model.target, config.model)
    shard = Shard.load(tmp_path / "three" / "shard-00001.npz")
    assert shard.ids == [2, 3]
    for prompt, output in zip(shard.prompts, shard.answers):
        assert output == greedy_reference(runner, prompt, len(output), eos_ids(runner))  # the target's own greedy answer


@pytest.mark.parametrize("stop_at", [0, 1, 2])
def test_a_stopped_run_resumes_at_any_shard_to_the_same_files(tmp_path, prompts_file, monkeypatch, stop_at):
    config = Config.load(CONFIG)
    answer(config, tmp_path / "whole", prompts_file, None, SETTINGS, progress=False)
    saves = {"n": 0}
    save = Shard.save

    def stopping_save(self, path):
        if saves["n"] == stop_at:
            raise KeyboardInterrupt  # the machine stops while this shard is under way
        saves["n"] += 1
        save(self, path)

    monkeypatch.setattr(answers_module.Shard, "save", stopping_save)
    with pytest.raises(KeyboardInterrupt):
        answer(config, tmp_path / "resumed", prompts_file, None, SETTINGS, progress=False)
    assert len(shard_files(tmp_path / "resumed")) == stop_at
    monkeypatch.setattr(answers_module.Shard, "save", save)
    manifest = answer(config, tmp_path / "resumed", prompts_file, None, SETTINGS, progress=False)
    whole = shard_files(tmp_path / "whole")
    resumed = shard_files(tmp_path / "resumed")
    assert resumed.keys() == whole.keys()
    for name in whole:
        assert all(np.array_equal(resumed[name][key], whole[name][key]) for key in whole[name]), name
    assert [entry["file"] for entry in manifest["shards"]] == sorted(whole)
    # Stopped between a shard's file and the manifest's line for it: the shard is made again.
    path = tmp_path / "resumed" / "manifest.json"
    path.write_text(json.dumps({**manifest, "shards": manifest["shards"][:-1]}))
    again = answer(config, tmp_path / "resumed", prompts_file, None, SETTINGS, progress=False)
    assert again["shards"][:-1] == manifest["shards"][:-1] and again["shards"][-1]["file"] == manifest["shards"][-1]["file"]
    last = sorted(whole)[-1]
    assert all(np.array_equal(a, b) for a, b in zip(shard_files(tmp_path / "resumed")[last].values(), whole[last].values()))


def test_a_run_with_other_settings_is_refused(tmp_path, prompts_file, capsys):
    config = Config.load(CONFIG)
    answer(config, tmp_path / "run", prompts_file, 2, SETTINGS, progress=False)
    with pytest.raises(MismatchedRun, match="settings"):
        answer(config, tmp_path / "run", prompts_file, 2, dataclasses.replace(SETTINGS, answer_tokens=13), progress=False)
    code = main(["train", "answers", "--config", CONFIG, "--prompts-file", str(prompts_file), "--out", str(tmp_path / "run"),
                 "--count", "2", "--answer-tokens", "13", "--batch", "3", "--shard-prompts", "2"])
    assert code == 2 and "new --out directory" in capsys.readouterr().err


def test_cli_answers_and_reports(tmp_path, prompts_file, capsys):
    code = main(["train", "answers", "--config", CONFIG, "--prompts-file", str(prompts_file), "--out", str(tmp_path / "run"),
                 "--count", "4", "--answer-tokens", "12", "--batch", "3", "--shard-prompts", "2"])
    assert code == 0
    out = capsys.readouterr().out
    assert "2 shards" in out and "answer tokens/s" in out
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["target"] == "tiny-random-llama" and manifest["settings"]["answer_tokens"] == 12


def test_cli_features_report_or_say_what_to_run_first(tmp_path, prompts_file, capsys, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    assert main(["train", "features", "--config", CONFIG, "--answers", str(tmp_path / "none")]) == 2
    assert "specdec train answers" in capsys.readouterr().err
    answer(Config.load(CONFIG), tmp_path / "run", prompts_file, 2, SETTINGS, progress=False)
    assert main(["train", "features", "--config", CONFIG, "--answers", str(tmp_path / "run")]) == 0
    assert "1 shards" in capsys.readouterr().out


# -- depth features --------------------------------------------------------------


def test_depth_features_are_the_targets_layer_outputs_made_once_per_answers_shard(tmp_path, prompts_file, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    config = Config.load(CONFIG)
    runner = load_runner(config.model.target, config.model)
    answers = tmp_path / "answers"
    answer(config, answers, prompts_file, 4, SETTINGS, progress=False)
    made = []
    shard_features = depth_features.shard_features
    monkeypatch.setattr(depth_features, "shard_features", lambda r, shard, bar: made.append(shard.ids) or shard_features(r, shard, bar))
    directory = depth_features.extract(runner, answers, progress=False, shards=slice(0, 1))  # the first shard alone
    assert made == [[0, 1]]
    depth_features.extract(runner, answers, progress=False)
    assert made == [[0, 1], [2, 3]]
    shards = depth_features.load_features(directory)
    shard = Shard.load(answers / "shard-00000.npz")
    ids = shard.prompts[0] + shard.answers[0]
    with torch.no_grad():
        out = runner.model(torch.tensor([ids]), output_hidden_states=True)
    low, middle, high = feature_layers(runner.config.num_hidden_layers)
    first = slice(0, len(ids))
    for key, depth in (("low", low), ("middle", middle), ("high", high)):
        assert torch.equal(shards[0][key][first], out.hidden_states[depth][0]), key
    assert torch.equal(runner.model.get_output_embeddings()(shards[0]["last"][first]), out.logits[0])
    assert shards[0]["answer_starts"].tolist() == [len(p) for p in shard.prompts]
    assert shards[0]["lengths"].sum() == len(shards[0]["tokens"]) == len(shards[0]["high"])

    answer(config, answers, prompts_file, 6, SETTINGS, progress=False)  # the run went on: one shard more
    depth_features.extract(runner, answers, progress=False)
    assert made == [[0, 1], [2, 3], [4, 5]]
    Shard([0], [[1, 2]], [[3]]).save(answers / "shard-00000.npz")  # an answers shard remade: its features too
    depth_features.extract(runner, answers, progress=False)
    assert made[-1] == [0] and len(made) == 4

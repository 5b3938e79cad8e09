"""The store of trained drafters: a save replaces an artifact whole or not at all, a load checks the target and
says how to train what is missing, and artifacts written before the store (EAGLE's meta without the full
vocabulary's size) still load."""

from __future__ import annotations

import json

import pytest
import torch

from specdec_core.models import artifacts
from specdec_core.models.artifacts import EAGLE, HEADS, STUDENT, MissingArtifactError, load_artifact, save_artifact
from specdec_core.models.vocab import ReducedVocab


@pytest.fixture(autouse=True)
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    return tmp_path


def test_a_save_replaces_the_artifact_whole(cache_root):
    save_artifact(HEADS, cache_root / "heads" / "h", {"old": torch.zeros(2)}, {"target": "t"})
    save_artifact(HEADS, cache_root / "heads" / "h", {"new": torch.ones(3)}, {"target": "t", "epochs": 2},
                  ReducedVocab(torch.tensor([0, 4]), 8))
    loaded = load_artifact(HEADS, "h", "t")
    assert set(loaded.tensors) == {"new"} and loaded.meta["epochs"] == 2
    assert loaded.vocab.ids.tolist() == [0, 4] and loaded.vocab.full_size == 8
    assert sorted(p.name for p in (cache_root / "heads").iterdir()) == ["h"]  # nothing partial left beside it
    assert sorted(p.name for p in (cache_root / "heads" / "h").iterdir()) == ["heads.json", "heads.safetensors"]


def test_an_interrupted_save_leaves_the_old_artifact(cache_root, monkeypatch):
    save_artifact(STUDENT, cache_root / "students" / "s", {"w": torch.zeros(2)}, {"target": "t", "run": 1})

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(artifacts, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_artifact(STUDENT, cache_root / "students" / "s", {"w": torch.ones(2)}, {"target": "t", "run": 2})
    assert load_artifact(STUDENT, "s", "t").meta["run"] == 1


def test_a_save_refuses_a_directory_of_other_files(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="notes.txt"):
        save_artifact(EAGLE, tmp_path, {"w": torch.zeros(1)}, {"target": "t"})
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_load_names_the_command_and_both_targets(cache_root):
    with pytest.raises(MissingArtifactError, match=r"not trained .*specdec train distill --config .* --out absent"):
        load_artifact(STUDENT, "absent", "t")
    save_artifact(EAGLE, cache_root / "eagle" / "e", {"w": torch.zeros(1)}, {"target": "other", "hidden_size": 4})
    with pytest.raises(MissingArtifactError, match=r"trained for 'other' .*not 't'.*specdec train eagle --config c.yaml --out e"):
        load_artifact(EAGLE, "e", "t", config_path="c.yaml")
    with pytest.raises(MissingArtifactError, match=r"\(hidden size 4\), not 'other' \(hidden size 8\)"):
        load_artifact(EAGLE, "e", "other", hidden_size=8)


def test_an_eagle_network_saved_before_the_store_loads(cache_root):
    save_artifact(EAGLE, cache_root / "eagle" / "e", {"w": torch.zeros(1)}, {"target": "t"}, ReducedVocab(torch.tensor([1]), 8))
    meta_path = cache_root / "eagle" / "e" / "eagle.json"
    meta = json.loads(meta_path.read_text())
    del meta["full_vocab_size"]  # EAGLE's meta recorded only the reduced size
    meta_path.write_text(json.dumps(meta))
    assert load_artifact(EAGLE, "e", "t", full_vocab_size=8).vocab.full_size == 8

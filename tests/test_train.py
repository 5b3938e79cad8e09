"""Medusa self-distillation on the tiny random model: data cache, training, heads on disk, CLI."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specdec_cli.main import main
from specdec_core.config import Config
from specdec_core.models.artifacts import MissingArtifactError
from specdec_core.models.loading import load_runner
from specdec_core.models.medusa_heads import (
    MedusaHeads,
    head_logits,
    load_heads,
    output_layer,
)
from specdec_core.models.vocab import ReducedVocab
from specdec_tools.train import data as data_module
from specdec_tools.train import loop as loop_module
from specdec_tools.train import medusa as medusa_module
from specdec_tools.train.data import features
from specdec_tools.train.medusa import train_medusa
from specdec_tools.train.settings import DataSettings, TrainSettings

CONFIG = "configs/tiny-random.yaml"
TARGET = "tiny-random-llama"
DATA = DataSettings(tokens=6000, seq_len=64, prompts=16, answer_tokens=24)
TRAIN = TrainSettings(epochs=4, batch_size=64, lr=1e-2, checkpoint_every=20)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One cache root for the module (features are extracted once), restored afterwards."""
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDEC_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def runner(cache):
    torch.set_num_threads(1)
    config = Config.load(CONFIG)
    return load_runner(config.model.target, config.model)


@pytest.fixture(scope="module")
def data(runner):
    return features(runner, DATA, progress=False)


@pytest.fixture(scope="module")
def trained(runner, data):
    return train_medusa(runner.model.get_output_embeddings(), data, TRAIN, "tiny", progress=False)


def mean_top1(agreement: list[dict]) -> float:
    return sum(head["top1"] for head in agreement) / len(agreement)


def test_identity_heads_repeat_the_targets_next_token_prediction(runner, data):
    heads = MedusaHeads(runner.config.hidden_size, 3)
    hidden = data.heldout.hidden[:10]
    logits = head_logits(heads, hidden, runner.model.get_output_embeddings())
    assert logits.shape == (10, 3, runner.vocab_size)
    assert torch.equal(logits.argmax(-1), data.heldout.predicted[:10, None].expand(10, 3))


def test_training_lowers_the_loss_and_raises_agreement(trained):
    losses = trained["epoch_loss"]
    assert len(losses) == TRAIN.epochs
    assert losses[-1] < losses[0]
    assert mean_top1(trained["agreement"]) > mean_top1(trained["agreement_untrained"])


def test_saved_heads_load_back_with_their_meta(runner, data, trained):
    heads, meta, vocab = load_heads("tiny", TARGET)
    assert vocab is None
    assert meta["agreement"] == trained["agreement"]
    assert meta["tokens"] == {"train": len(data.train), "heldout": len(data.heldout)}
    assert (meta["num_heads"], meta["hidden_size"]) == (TRAIN.num_heads, runner.config.hidden_size)
    # The loaded heads are the trained ones: they reproduce the run's own held-out figures.
    assert medusa_module.agreement(heads, runner.model.get_output_embeddings(), None, data.heldout) == meta["agreement"]


def test_reduced_vocabulary_heads_round_trip(runner, data, cache):
    vocab = ReducedVocab(torch.arange(0, runner.vocab_size, 2), runner.vocab_size)
    settings = TrainSettings(epochs=1, batch_size=256)
    train_medusa(runner.model.get_output_embeddings(), data, settings, "tiny-reduced", vocab, progress=False)
    heads, meta, loaded = load_heads(cache / "heads" / "tiny-reduced", TARGET)
    assert torch.equal(loaded.ids, vocab.ids) and loaded.full_size == runner.vocab_size
    logits = head_logits(heads, data.heldout.hidden[:4], output_layer(runner.model.get_output_embeddings(), loaded))
    assert logits.shape == (4, settings.num_heads, vocab.size) and meta["vocab_size"] == vocab.size


def test_missing_heads_say_how_to_train_them(trained):
    with pytest.raises(MissingArtifactError, match=f"specdec train medusa --config {CONFIG} --out absent"):
        load_heads("absent", TARGET, config_path=CONFIG)
    with pytest.raises(MissingArtifactError, match="trained for 'tiny-random-llama' .*, not 'smollm2-135m'"):
        load_heads("tiny", "smollm2-135m")


def test_the_feature_cache_is_reused_not_recomputed(runner, data, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the target ran again")

    monkeypatch.setattr(data_module, "target_features", forbidden)
    monkeypatch.setattr(data_module, "answer_prompts", forbidden)
    again = features(runner, DATA, progress=False)
    assert again.meta == data.meta and torch.equal(again.train.hidden, data.train.hidden)


def test_concurrent_builders_of_one_cache_extract_it_once(runner, monkeypatch):
    settings = dataclasses.replace(DATA, tokens=1500)
    calls = []
    extract_one = data_module.target_features
    monkeypatch.setattr(data_module, "target_features", lambda *args: calls.append(1) or extract_one(*args))
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda _: features(runner, settings, progress=False), range(2))
    assert len(calls) == sum(first.meta["sequences"].values())
    assert torch.equal(first.train.hidden, second.train.hidden)


def test_cache_holds_the_targets_predictions_and_a_heldout_split(runner, data):
    assert data.meta["positions"]["train"] + data.meta["positions"]["heldout"] == DATA.tokens
    assert int(data.train.lengths.sum()) == len(data.train) and len(data.heldout) > 0
    predicted = runner.model.get_output_embeddings()(data.train.hidden[:50]).argmax(-1)
    assert torch.equal(predicted, data.train.predicted[:50])


def test_an_interrupted_run_resumes_to_the_same_heads(runner, data, monkeypatch):
    lm_head = runner.model.get_output_embeddings()
    settings = TrainSettings(epochs=2, batch_size=128, checkpoint_every=10)
    whole = train_medusa(lm_head, data, settings, "whole", progress=False)
    save = loop_module.save_checkpoint

    def interrupt_after_first(*args, **kwargs):
        save(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(loop_module, "save_checkpoint", interrupt_after_first)
    with pytest.raises(KeyboardInterrupt):
        train_medusa(lm_head, data, settings, "resumed", progress=False)
    monkeypatch.setattr(loop_module, "save_checkpoint", save)
    resumed = train_medusa(lm_head, data, settings, "resumed", resume=True, progress=False)
    assert resumed["agreement"] == whole["agreement"]
    for a, b in zip(load_heads("whole", TARGET)[0].parameters(), load_heads("resumed", TARGET)[0].parameters()):
        assert torch.equal(a, b)


def test_cli_trains_and_reports(data, capsys):
    assert main(["train", "medusa", "--config", CONFIG, "--tokens", str(DATA.tokens), "--seq-len", str(DATA.seq_len),
                 "--prompts", str(DATA.prompts), "--answer-tokens", str(DATA.answer_tokens), "--epochs", "1",
                 "--heads", "2", "--out", "tiny-cli"]) == 0
    out = capsys.readouterr().out
    assert "heads 'tiny-cli' for tiny-random-llama" in out and "t+3" in out
    assert load_heads("tiny-cli", TARGET)[1]["num_heads"] == 2

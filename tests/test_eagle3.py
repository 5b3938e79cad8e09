"""EAGLE-3's network (models/eagle3_net.py) and its training (train/eagle3.py) on the tiny random target: the
training-time test computes what drafting computes; training lowers the loss, saves, and resumes exactly; the
trained drafter serves from a config and decodes plain decoding's text (its exactness beside the other drafters:
test_eagle.py, test_invisible.py, test_prefix_cache.py)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from specdec_cli.main import main
from specdec_core.build import build_drafter
from specdec_core.config import Config, Eagle3Config
from specdec_core.control import Controller
from specdec_core.drafters.eagle import EagleDrafter
from specdec_core.engine import Engine
from specdec_core.models import artifacts
from specdec_core.models.artifacts import EAGLE3, VOCAB_KEY, MissingArtifactError
from specdec_core.models.eagle3_net import Eagle3Net, feature_layers, load_eagle3, ttt_step
from specdec_core.models.fetch import sha256_file
from specdec_core.models.loading import load_runner
from specdec_core.models.vocab import ReducedVocab
from specdec_core.sampling import SamplingParams
from specdec_core.sequence import Sequence
from specdec_tools.train import depth_features, loop
from specdec_tools.train.answers import answer
from specdec_tools.train.eagle3 import evaluate, expected_length, held_out, lr_factor, shard_sequences, train
from specdec_tools.train.eagle3_ship import ship, training_command
from specdec_tools.train.settings import AnswerSettings, Eagle3Settings, bf16_native
from specdec_tools.train.task_prompts import write_prompts

from .helpers import single_thread  # noqa: F401  (autouse: torch on one thread)
from .helpers import decode, greedy_reference, tiny_runner

STEPS = 4


@pytest.fixture(scope="module")
def net() -> Eagle3Net:
    torch.manual_seed(0)
    target = tiny_runner().model
    vocab = ReducedVocab.most_frequent(torch.arange(64.0), 40, {0})
    net = Eagle3Net(target, vocab, intermediate_size=96).eval()
    with torch.no_grad():  # a trained network's scale: random fc rows keep the features' spread
        for parameter in net.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return net


def chain_after(net: Eagle3Net, fused: torch.Tensor, tokens: torch.Tensor, t: int, depth: int) -> list[torch.Tensor]:
    """Drafting as a server would: the real pairs 0..t causally, then `depth` chain nodes fed back one at a time
    (node k: the previous output with token t+1+k, at position t+k); each node's output."""
    positions, kv = torch.arange(t + 1)[None], DynamicCache()
    causal = torch.ones(t + 1, t + 1, dtype=torch.bool).tril()[None]
    hidden, outputs = net(fused[:, : t + 1], tokens[:, 1 : t + 2], positions, causal, kv)[:, -1:], []
    for k in range(1, depth):
        mask = torch.ones(1, 1, kv.get_seq_length() + 1, dtype=torch.bool)
        hidden = net(hidden, tokens[:, t + 1 + k : t + 2 + k], torch.tensor([[t + k]]), mask, kv)
        outputs.append(hidden[:, 0])
    return outputs


@torch.no_grad()
def test_training_time_test_computes_what_drafting_computes(net):
    length = 12
    torch.manual_seed(1)
    fused = net.fuse(*torch.randn(3, 1, length, net.hidden_size))
    tokens = torch.randint(0, 64, (1, length + STEPS + 1))
    valid = torch.ones(1, length, dtype=torch.bool)
    hidden, kv, steps = fused, DynamicCache(), []
    for step in range(STEPS):
        hidden = ttt_step(net, hidden, tokens[:, 1 + step : 1 + step + length], valid, step, kv)
        steps.append(hidden)
    for t in (0, 5, length - 1):
        for k, node in enumerate(chain_after(net, fused, tokens, t, STEPS), start=1):
            torch.testing.assert_close(steps[k][:, t], node, rtol=1e-5, atol=1e-5)
    # A step's outputs at t do not depend on the positions after t: the same text cut after t gives the same.
    cut = 6
    short, kv = fused[:, :cut], DynamicCache()
    for step in range(STEPS):
        short = ttt_step(net, short, tokens[:, 1 + step : 1 + step + cut], valid[:, :cut], step, kv)
        torch.testing.assert_close(short, steps[step][:, :cut], rtol=1e-5, atol=1e-5)


def test_output_layer_starts_as_the_targets_rows_and_drafts_map_back():
    target = tiny_runner().model
    vocab = ReducedVocab.most_frequent(torch.arange(64.0), 16, {0})
    net = Eagle3Net(target, vocab)
    torch.testing.assert_close(net.lm_head.weight, target.get_output_embeddings().weight[vocab.ids])
    assert net.full_ids(torch.tensor([0, 15])).tolist() == [vocab.ids[0].item(), vocab.ids[15].item()]
    embedding = target.get_input_embeddings().weight
    assert all(value.data_ptr() != embedding.data_ptr() for value in net.state_dict().values())  # not the net's to save


# -- training ----------------------------------------------------------------------

CONFIG = "configs/tiny-random.yaml"
TRAIN = Eagle3Settings(steps=3, vocab_size=40, intermediate_size=64, epochs=12, lr=3e-3, batch_sequences=2,
                       heldout_every=4, save_every=5)


@pytest.fixture(scope="module")
def trained_data(tmp_path_factory):
    """Answers to 8 prompts and their depth features, from the tiny random target, in a module-wide cache."""
    root = tmp_path_factory.mktemp("eagle3")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDEC_CACHE", str(root / "cache"))
        prompts = root / "prompts.jsonl.gz"
        write_prompts([{"id": i, "kind": "general", "task": "test", "source": "here", "text": f"prompt {i} " * (i + 1)}
                       for i in range(8)], prompts)
        config = Config.load(CONFIG)
        answer(config, root / "answers", prompts, None, AnswerSettings(answer_tokens=24, batch=4, shard_prompts=4),
               progress=False)
        runner = load_runner(config.model.target, config.model)
        features = depth_features.extract(runner, root / "answers", progress=False)
        yield runner, features, root


@pytest.fixture(scope="module")
def trained(trained_data) -> dict:
    """The drafter trained on them, saved as <root>/net: its JSON."""
    runner, features, root = trained_data
    return train(runner, features, root / "net", TRAIN, progress=False)


def test_training_lowers_the_loss_and_saves_a_drafter_with_its_vocabulary(trained_data, trained):
    runner, features, root = trained_data
    meta = trained
    assert meta["last_batch"]["loss"] < meta["first_batch"]["loss"]
    heldout = meta["heldout"]
    assert len(heldout["step_accuracy"]) == 3 and all(n > 0 for n in heldout["slots"])  # prompts 2 and 6 held out
    assert heldout["expected_length"] == pytest.approx(expected_length(heldout["step_accuracy"]), abs=1e-3)
    assert meta["vocab_size"] == 40 and meta["data"]["shards"] == 2
    saved = load_file(str(root / "net" / "eagle3.safetensors"))
    assert saved["fc.weight"].shape == (runner.config.hidden_size, 3 * runner.config.hidden_size)


def test_an_interrupted_training_resumes_to_the_same_drafter(trained_data, monkeypatch):
    runner, features, root = trained_data
    noisy = dataclasses.replace(TRAIN, noise=0.05, warmup=3, lr_floor=0.1)  # the noise and the schedule resume too
    whole = train(runner, features, root / "whole", noisy, progress=False)
    save = loop.save_checkpoint

    def stop_after_save(*args):
        save(*args)
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "save_checkpoint", stop_after_save)
    with pytest.raises(KeyboardInterrupt):
        train(runner, features, root / "resumed", noisy, progress=False)
    monkeypatch.setattr(loop, "save_checkpoint", save)
    resumed = train(runner, features, root / "resumed", noisy, resume=True, progress=False)
    assert resumed["last_batch"] == whole["last_batch"] and resumed["heldout"] == whole["heldout"]
    ours, theirs = (load_file(str(root / name / "eagle3.safetensors")) for name in ("whole", "resumed"))
    assert all(torch.equal(ours[key], theirs[key]) for key in ours)
    with pytest.raises(ValueError, match="other settings"):  # a checkpoint continues only the run that made it
        monkeypatch.setattr(loop, "save_checkpoint", stop_after_save)
        with pytest.raises(KeyboardInterrupt):
            train(runner, features, root / "other", TRAIN, progress=False)
        monkeypatch.setattr(loop, "save_checkpoint", save)
        train(runner, features, root / "other", dataclasses.replace(TRAIN, lr=1e-3), resume=True, progress=False)


def test_the_schedule_warms_up_to_its_peak_then_falls_to_its_floor():
    settings = Eagle3Settings(warmup=4, lr_floor=0.1)
    factors = [lr_factor(done, 20, settings) for done in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0] and factors[4] == 1.0
    assert all(a >= b for a, b in zip(factors[4:], factors[5:])) and factors[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 15 / 16)))
    assert lr_factor(20, 20, settings) == pytest.approx(0.1)
    # Without warmup and floor it is the cosine to 0 the earlier runs trained with (torch's CosineAnnealingLR).
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=20)
    for done in range(20):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(lr_factor(done, 20, Eagle3Settings()), abs=1e-12)
        optimizer.step()
        cosine.step()


def test_a_frozen_output_layer_is_the_targets_is_not_saved_and_is_rebuilt_as_it_trained(trained_data):
    runner, features, root = trained_data
    meta = train(runner, features, root / "frozen", dataclasses.replace(TRAIN, epochs=2, frozen_head=True), progress=False)
    saved = load_file(str(root / "frozen" / "eagle3.safetensors"))
    assert not set(Eagle3Net.HEAD_KEYS) & set(saved) and "fc.weight" in saved
    net = load_eagle3(root / "frozen", runner.model, runner.name, None, torch.float32)
    assert torch.equal(net.lm_head.weight, net.vocab.head(runner.model.get_output_embeddings()).weight.float())
    assert torch.equal(net.norm.weight, runner.model.get_decoder().norm.weight.float())
    assert evaluate(runner, root / "frozen") == meta["heldout"]  # the rebuilt layer scores as the trained one did
    saved.pop("fc.weight")
    (root / "frozen" / "eagle3.safetensors").unlink()
    save_file(saved, str(root / "frozen" / "eagle3.safetensors"))
    with pytest.raises(ValueError, match="missing.*fc.weight"):  # a tensor that was trained is never rebuilt
        load_eagle3(root / "frozen", runner.model, runner.name, None)


def test_a_piece_makes_its_shards_features_and_the_heldout_prompts_and_starts_from_a_snapshot(trained_data, trained,
                                                                                              tmp_path, monkeypatch):
    runner, made_before, root = trained_data
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))  # a new machine: no features cached
    rule = functools.partial(held_out, settings=TRAIN)
    features = depth_features.extract(runner, root / "answers", progress=False, shards=slice(1, 2), held_out=rule,
                                      heldout_shards=1)
    shards = json.loads((features / "meta.json").read_text())["shards"]
    assert {name: entry["prompts"] for name, entry in shards.items()} == {"features-00000": "held-out", "features-00001": "all"}
    # The held-out part holds what the whole shard holds of those prompts.
    ours, whole = (shard_sequences(where / "features-00000.safetensors", True, TRAIN) for where in (features, made_before))
    assert len(ours) == len(whole) == 1 and all(torch.equal(ours[0][key], whole[0][key]) for key in whole[0])
    with pytest.raises(FileNotFoundError, match="no whole features shards features-00000"):
        train(runner, features, tmp_path / "bad", TRAIN, shards=["features-00000"], progress=False)

    snapshot = tmp_path / "snapshot"  # what a piece commits: int8 rows, its manifest, its held-out figures
    ship(str(root / "net"), runner.name, CONFIG, snapshot)
    piece_settings = dataclasses.replace(TRAIN, epochs=1, warmup=2)
    piece = train(runner, features, tmp_path / "piece", piece_settings, shards=["features-00001"], init=snapshot, progress=False)
    fresh = train(runner, features, tmp_path / "fresh", piece_settings, shards=["features-00001"], progress=False)
    assert piece["init"]["from"] == str(snapshot) and piece["init"]["heldout"] == trained["heldout"]
    assert piece["data"]["shards"] == 1 and piece["first_batch"]["loss"] < fresh["first_batch"]["loss"]
    assert torch.equal(load_file(str(tmp_path / "piece" / "eagle3.safetensors"))[VOCAB_KEY],
                       load_file(str(snapshot / "eagle3.safetensors"))[VOCAB_KEY])  # the snapshot's vocabulary
    assert "--shards 1:2" in training_command(piece, "piece", CONFIG) and f"--init {snapshot}" in training_command(piece, "piece", CONFIG)
    depth_features.extract(runner, root / "answers", progress=False, shards=slice(0, 1))  # trained on later: made whole
    assert json.loads((features / "meta.json").read_text())["shards"]["features-00000"]["prompts"] == "all"


@pytest.mark.parametrize("precision", ["int4", "bf16"])
def test_the_trained_drafter_serves_from_its_config_and_its_text_is_plain_decodings(trained_data, trained, precision):
    runner, _, root = trained_data
    config = Config.load(CONFIG).model_copy(deep=True)
    config.speculation.drafter = "eagle3"
    config.speculation.eagle3 = Eagle3Config(weights=str(root / "net"), precision=precision)
    drafter = build_drafter(config, runner)
    assert isinstance(drafter, EagleDrafter) and drafter.feature_layers == feature_layers(runner.config.num_hidden_layers)
    seqs = [Sequence(f"s{i}", prompt, SamplingParams(temperature=0), 24) for i, prompt in enumerate(([1, 2, 3], [7, 8, 9, 10]))]
    decode(Engine(runner, drafter, Controller(gamma_max=5, fixed_gamma=5), set()), seqs)
    assert all(seq.output_ids == greedy_reference(runner, seq.prompt_ids, 24) for seq in seqs)
    assert sum(seq.stats.draft_tokens for seq in seqs) > 0


def test_a_drafter_served_in_bf16_keeps_the_rotary_frequencies_it_was_trained_with(trained_data, trained):
    runner, _, root = trained_data
    trained_net = load_eagle3(root / "net", runner.model, runner.name, None, torch.float32)
    served = load_eagle3(root / "net", runner.model, runner.name, None, torch.bfloat16)
    assert served.fc.weight.dtype == torch.bfloat16
    torch.testing.assert_close(served.rotary.inv_freq, trained_net.rotary.inv_freq, rtol=0, atol=0)


def test_a_drafter_of_another_target_is_refused_with_the_command_that_trains_one(trained_data, trained):
    _, _, root = trained_data
    other = tiny_runner(seed=1, vocab=64)
    with pytest.raises(MissingArtifactError, match=r"trained for .*specdec train eagle3 --config .* --out"):
        load_eagle3(root / "net", other.model, "another-target", "int4")


def test_the_learning_curve_lists_each_drafters_heldout_figures(trained_data, trained, tmp_path):
    _, _, root = trained_data
    assert main(["train", "eagle3-curve", str(root / "net"), "--config", CONFIG, "--out", str(tmp_path)]) == 0
    point, = json.loads((tmp_path / "learning-curve.json").read_text())["points"]
    # Scored again on the same held-out set, the drafter's figures are those its training recorded.
    assert point["positions"] == trained["data"]["positions"] and point["step_accuracy"] == trained["heldout"]["step_accuracy"]
    assert point["heldout_shards"] == 2
    assert (tmp_path / "learning-curve.png").stat().st_size > 0


@pytest.fixture
def shipped(trained_data, trained, tmp_path, monkeypatch):
    """The trained drafter shipped (into a stand-in for specdec_core/shipped/): its directory."""
    runner, _, root = trained_data
    monkeypatch.setattr(artifacts, "SHIPPED_DIR", tmp_path)
    assert main(["train", "eagle3-ship", str(root / "net"), "--config", CONFIG]) == 0
    return EAGLE3.shipped(runner.name)


def test_a_shipped_drafter_serves_when_the_config_names_none_and_its_text_is_plain_decodings(trained_data, shipped):
    runner, _, root = trained_data
    manifest = json.loads((shipped / "manifest.json").read_text())
    assert manifest["sha256"] == sha256_file(shipped / "eagle3.safetensors") and manifest["gguf_sha256"] is None
    assert manifest["commands"][1].startswith("specdec train eagle3 --config configs/tiny-random.yaml --out net")
    float_net = load_eagle3(root / "net", runner.model, runner.name, None)
    int8_net = load_eagle3(shipped, runner.model, runner.name, None)
    for key, value in float_net.state_dict().items():  # int8 rows: within half a step of each row's scale
        torch.testing.assert_close(int8_net.state_dict()[key], value, atol=value.abs().max().item() / 127, rtol=0)
    config = Config.load(CONFIG).model_copy(deep=True)
    config.speculation.drafter = "eagle3"
    drafter = build_drafter(config, runner)
    seq = Sequence("s", [1, 2, 3], SamplingParams(temperature=0), 24)
    decode(Engine(runner, drafter, Controller(gamma_max=5, fixed_gamma=5), set()), [seq])
    assert seq.output_ids == greedy_reference(runner, seq.prompt_ids, 24)


def test_a_shipped_drafter_is_refused_when_its_file_or_its_targets_file_is_not_the_manifests(trained_data, shipped):
    runner, _, _ = trained_data
    manifest_path = shipped / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "gguf_sha256": "0" * 64}))
    with pytest.raises(MissingArtifactError, match=r"another GGUF file .* train one for it with: specdec train eagle3"):
        load_eagle3(shipped, runner.model, runner.name, "int4")
    manifest_path.write_text(json.dumps(manifest))
    weights = shipped / "eagle3.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    with pytest.raises(MissingArtifactError, match=r"not the file its manifest names .*git checkout"):
        load_eagle3(shipped, runner.model, runner.name, "int4")


def test_cli_says_to_make_the_answers_first(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # no committed answers for the tiny target here either
    assert main(["train", "eagle3", "--config", str(Path(__file__).parents[1] / CONFIG)]) == 2
    assert "specdec train answers" in capsys.readouterr().err


def test_training_runs_under_bf16_only_where_the_cpu_computes_bf16():
    # Emulated bf16 (a Xeon without AVX-512 BF16) trained 2.4x slower than fp32: auto takes fp32 there.
    assert bf16_native(frozenset({"avx512f", "avx512_vnni", "avx512_bf16"})) and bf16_native(frozenset({"amx_bf16"}))
    assert not bf16_native(frozenset({"avx512f", "avx512_vnni"})) and not bf16_native(frozenset({"avx2"}))

"""The distilled students (layer skip, and the draft model): distillation on the tiny random model lowers
the KL to the target and raises held-out agreement and acceptance over the untrained student (plain
layer skip, or the plain draft model); decoding through either student is exact (greedy equality, and
the chi-square harness of test_exactness for sampling); the CLI trains students that a config then
selects; a missing student says how to train it."""

from __future__ import annotations

import sys

import pytest
import torch

from specdec_cli.main import main
from specdec_core.build import build_engine
from specdec_core.config import Config
from specdec_core.control import Controller
from specdec_core.drafters.distilled import AdaptedOutput, Adapter, DistilledDrafter, load_student
from specdec_core.drafters.draft_model import DraftModelDrafter
from specdec_core.engine import Engine
from specdec_core.models.artifacts import MissingArtifactError
from specdec_core.models.loading import load_runner
from specdec_core.sampling import SamplingParams
from specdec_core.sequence import Sequence
from specdec_tools.train import loop as loop_module
from specdec_tools.train.distill import (
    final_hidden,
    first_layers,
    student_inputs,
    train_distill,
)
from specdec_tools.train.settings import DistillSettings

from .helpers import (
    decode,
    greedy_reference,
    single_thread,  # noqa: F401  (autouse: torch on one thread)
    tiny_runner,
)
from .test_exactness import ALPHA, PARAMS, ROWS, VOCAB, exact, generate, pvalues
from .test_train import CONFIG, DATA, cache, data, runner  # noqa: F401  (fixtures: the tiny target and its feature cache)

SETTINGS = DistillSettings(k=1, width=128, epochs=4, batch_size=64, lr=3e-3, checkpoint_every=20)
GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[1, 2, 3, 4, 5], [7], [3, 9, 3, 9, 3, 9, 3], [11, 4, 2, 8, 6, 1, 0, 5, 12, 13]]


DRAFT = "tiny-random-llama@1"  # configs/tiny-random.yaml's draft model


@pytest.fixture(scope="module")
def trained(runner, data):
    return train_distill(runner, data, SETTINGS, "tiny-student", progress=False)


@pytest.fixture(scope="module")
def draft_trained(runner, data):
    draft = load_runner(DRAFT, Config.load(CONFIG).model)
    return train_distill(runner, data, SETTINGS, "tiny-draft-student", progress=False, draft=draft)


def distilled_config(student: str) -> Config:
    return Config.model_validate({
        "model": {"target": "tiny-random-llama", "dtype": "fp32", "device": "cpu", "threads": 1},
        "speculation": {"drafter": "distilled", "gamma": 4, "distilled": {"student": student}},
    })


def random_adapter(hidden: int, scale: float, seed: int) -> Adapter:
    """An adapter whose weights are random: its drafts are often, not always, the target's."""
    adapter = Adapter(hidden, 32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in adapter.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    return adapter.eval().requires_grad_(False)


def test_student_inputs_are_what_the_drafter_reads(runner, data):
    inputs = student_inputs(data, lambda ids: first_layers(runner, ids, 1), "layers1", progress=False)
    first = data.heldout.tokens[: data.heldout.lengths[0]].tolist()
    assert inputs.heldout.shape == (len(data.heldout), runner.config.hidden_size)
    assert torch.allclose(inputs.heldout[: len(first)], first_layers(runner, first, 1))


def test_a_draft_model_students_inputs_are_what_its_output_layer_reads(data):
    draft = load_runner(DRAFT, Config.load(CONFIG).model)
    first = data.heldout.tokens[: data.heldout.lengths[0]].tolist()
    logits, _ = draft.forward(draft.prefill([])[0], torch.tensor([first]))
    assert torch.allclose(draft.model.get_output_embeddings()(final_hidden(draft, first)), logits[0], atol=1e-5)


@pytest.mark.parametrize("student", ["trained", "draft_trained"])
def test_distillation_lowers_the_kl_and_raises_acceptance(student, request):
    trained = request.getfixturevalue(student)
    before, after = trained["heldout"]["untrained"], trained["heldout"]["trained"]
    assert after["kl"] < 0.8 * before["kl"], trained["heldout"]
    assert after["top1"] > before["top1"], trained["heldout"]
    assert after["accept_t1"] > before["accept_t1"], trained["heldout"]
    assert trained["epoch_loss"][-1] < trained["epoch_loss"][0]


def assert_greedy_equals_plain(runner, drafter, prompts: list[list[int]]) -> None:
    """Rows of several lengths, two joining mid-run: each equals plain greedy, and some drafts were kept."""
    engine = Engine(runner, drafter, Controller(gamma_max=4, fixed_gamma=4), eos_token_ids=set())
    seqs = [Sequence(f"r{i}", prompt, GREEDY, 20 - 3 * i) for i, prompt in enumerate(prompts)]
    decode(engine, seqs[:2], joins={3: seqs[2:]})
    for seq in seqs:
        assert seq.output_ids == greedy_reference(runner, seq.prompt_ids, seq.max_tokens)
    assert sum(seq.stats.accepted_tokens for seq in seqs) > 0


def test_greedy_through_the_student_equals_plain_greedy(runner, trained):
    adapter, meta, vocab = load_student("tiny-student", runner.name)
    assert_greedy_equals_plain(runner, DistilledDrafter(runner, adapter, meta["student"]["k"], vocab), PROMPTS)


def test_greedy_through_the_draft_model_student_equals_plain_greedy(runner, data, draft_trained):
    drafter = build_engine(distilled_config("tiny-draft-student"), target=runner).drafter
    assert isinstance(drafter, DraftModelDrafter) and drafter.name == "distilled"
    assert isinstance(drafter.runner.model.get_output_embeddings(), AdaptedOutput)
    # Prompts from held-out text: where the student learned to agree with the target.
    starts = (data.heldout.lengths.cumsum(0) - data.heldout.lengths)[: len(PROMPTS)].tolist()
    assert_greedy_equals_plain(runner, drafter, [data.heldout.tokens[start : start + 8].tolist() for start in starts])


@pytest.mark.parametrize("setting", list(PARAMS))
def test_sampling_through_the_student_is_distributed_as_the_target(setting):
    target = tiny_runner(seed=0, vocab=VOCAB)
    drafter = DistilledDrafter(target, random_adapter(target.config.hidden_size, 0.2, seed=4), k=1)
    prompt, params = [1, 2, 3, 4, 5], PARAMS[setting]
    tokens, seqs = generate(target, drafter, prompt, params, ROWS)
    kept = sum(seq.stats.accepted_tokens for seq in seqs) / sum(seq.stats.draft_tokens for seq in seqs)
    assert 0.1 < kept < 0.9, kept  # drafts both kept and rejected: both branches of the rule ran
    assert min(pvalues(tokens, exact(target, prompt, params)).values()) > ALPHA


@pytest.mark.parametrize("setting", list(PARAMS))
def test_sampling_through_the_draft_model_student_is_distributed_as_the_target(setting):
    # The draft: a second copy of the target behind a random adapter, so drafts are often, not always, kept.
    target, draft = tiny_runner(seed=0, vocab=VOCAB), tiny_runner(seed=0, vocab=VOCAB)
    adapter = random_adapter(draft.config.hidden_size, 0.3, seed=4)
    draft.model.set_output_embeddings(AdaptedOutput(adapter, draft.model.get_output_embeddings()))
    drafter = DraftModelDrafter(draft, target.vocab_size)
    prompt, params = [1, 2, 3, 4, 5], PARAMS[setting]
    tokens, seqs = generate(target, drafter, prompt, params, ROWS)
    kept = sum(seq.stats.accepted_tokens for seq in seqs) / sum(seq.stats.draft_tokens for seq in seqs)
    assert 0.1 < kept < 0.9, kept
    assert min(pvalues(tokens, exact(target, prompt, params)).values()) > ALPHA


def test_an_interrupted_run_resumes_to_the_same_student(runner, data, monkeypatch):
    settings = DistillSettings(k=1, width=32, epochs=2, batch_size=128, checkpoint_every=5)
    train_distill(runner, data, settings, "whole", progress=False)
    save = loop_module.save_checkpoint
    monkeypatch.setattr(loop_module, "save_checkpoint", lambda *args: save(*args) or sys.exit("interrupted"))
    with pytest.raises(SystemExit):
        train_distill(runner, data, settings, "resumed", progress=False)
    monkeypatch.setattr(loop_module, "save_checkpoint", save)
    train_distill(runner, data, settings, "resumed", resume=True, progress=False)
    whole, resumed = (load_student(name, runner.name)[0].state_dict() for name in ("whole", "resumed"))
    assert all(torch.equal(whole[key], resumed[key]) for key in whole)


def test_cli_trains_a_student_a_config_selects(data, capsys):
    assert main(["train", "distill", "--config", CONFIG, "--student", "layer-skip:1", "--out", "cli-student",
                 "--epochs", "1", "--width", "32", "--batch-size", "128", "--tokens", str(DATA.tokens),
                 "--seq-len", str(DATA.seq_len), "--prompts", str(DATA.prompts),
                 "--answer-tokens", str(DATA.answer_tokens)]) == 0
    assert "top-1 agreement" in capsys.readouterr().out
    engine = build_engine(distilled_config("cli-student"))
    assert isinstance(engine.drafter, DistilledDrafter) and engine.drafter.k == 1
    seq = Sequence("r", PROMPTS[0], GREEDY, 12)
    decode(engine, [seq])
    assert seq.output_ids == greedy_reference(engine.target, PROMPTS[0], 12)


def test_cli_trains_a_draft_model_student(data, capsys):
    assert main(["train", "distill", "--config", CONFIG, "--student", "draft-model", "--epochs", "1", "--width", "32",
                 "--batch-size", "128", "--tokens", str(DATA.tokens), "--seq-len", str(DATA.seq_len),
                 "--prompts", str(DATA.prompts), "--answer-tokens", str(DATA.answer_tokens)]) == 0
    assert f"draft model {DRAFT} + adapter" in capsys.readouterr().out
    _, meta, _ = load_student("tiny-random-llama-distilled-draft", "tiny-random-llama")
    assert meta["student"] == {"kind": "draft-model", "model": DRAFT}
    assert isinstance(build_engine(distilled_config("tiny-random-llama-distilled-draft")).drafter, DraftModelDrafter)


def test_missing_student_says_how_to_train_it(cache):
    with pytest.raises(MissingArtifactError, match=r"specdec train distill .*--out never-trained"):
        build_engine(distilled_config("never-trained"))

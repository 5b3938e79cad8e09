"""EAGLE and EAGLE-3 drafting: exactness through the Engine (greedy equality, the sampled distribution), the
draft cache's rollback, the draft tree's shape; EAGLE's training smoke run on the tiny random model."""

from __future__ import annotations

import pytest
import torch

from specdec_core.build import build_drafter
from specdec_core.config import Config
from specdec_core.control import Controller
from specdec_core.drafters.eagle import EagleDrafter, Tree
from specdec_core.engine import Engine
from specdec_core.models.artifacts import MissingArtifactError
from specdec_core.models.eagle3_net import Eagle3Net
from specdec_core.models.eagle_net import CachedDraftLayer, EagleNet, load_eagle
from specdec_core.models.loading import load_runner
from specdec_core.models.vocab import ReducedVocab
from specdec_core.sampling import SamplingParams
from specdec_core.sequence import Sequence
from specdec_tools.train import eagle as train_eagle
from specdec_tools.train.data import DataSettings, features

from .helpers import (
    decode,
    greedy_reference,
    single_thread,  # noqa: F401  (autouse: torch on one thread)
    tiny_runner,
)
from .test_exactness import (
    ALPHA,
    PARAMS,
    PROMPTS,
    ROWS,
    TOKENS,
    VOCAB,
    exact,
    generate,
    pvalues,
)

PROMPTS_GREEDY = [[1, 2, 3, 4, 5], [7, 8, 9], [3], [10, 11, 12, 13, 14, 15, 16, 17]]


KINDS = ["eagle", "eagle3"]


def random_net(target, kind: str) -> CachedDraftLayer:
    """An untrained EAGLE network, or EAGLE-3's over a reduced vocabulary (three quarters of the ids, drawn, so
    that drafts map back through it)."""
    if kind == "eagle":
        return EagleNet(target.model).eval().requires_grad_(False)
    size = target.vocab_size
    vocab = ReducedVocab.most_frequent(torch.randperm(size).float(), 3 * size // 4, set())
    return Eagle3Net(target.model, vocab).to(target.dtype).eval().requires_grad_(False)


def random_drafter(target, top_k: int = 8, depth: int = 4, total_tokens: int = 24, seed: int = 0,
                   kind: str = "eagle") -> EagleDrafter:
    """An untrained network: poor drafts, but wide trees over a small vocabulary still get some kept."""
    torch.manual_seed(seed)
    return EagleDrafter(random_net(target, kind), top_k, depth, total_tokens)


@pytest.fixture(scope="module")
def target():
    return tiny_runner(seed=0, vocab=64)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_plain_decoding(target, kind):
    engine = Engine(target, random_drafter(target, kind=kind), Controller(gamma_max=4, fixed_gamma=4), set())
    seqs = [Sequence(f"s{i}", p, SamplingParams(temperature=0), 24) for i, p in enumerate(PROMPTS_GREEDY)]
    late = Sequence("late", [5, 6, 7], SamplingParams(temperature=0), 24)
    decode(engine, seqs, joins={3: [late]})
    for seq in seqs + [late]:
        assert seq.output_ids == greedy_reference(target, seq.prompt_ids, 24)
    assert sum(seq.stats.accepted_tokens for seq in seqs + [late]) > 0  # the kept-path branch ran


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("setting", ["t1", "t0.7-top_p0.9"])
def test_sampling_is_distributed_as_the_target(setting, kind):
    small = tiny_runner(seed=0, vocab=VOCAB)
    prompt, params = PROMPTS["draft-model"], PARAMS[setting]
    drafter = random_drafter(small, top_k=3, depth=TOKENS, total_tokens=6, kind=kind)
    tokens, seqs = generate(small, drafter, prompt, params, ROWS)
    drafted = sum(seq.stats.draft_tokens for seq in seqs)
    accepted = sum(seq.stats.accepted_tokens for seq in seqs)
    assert 0.05 * drafted < accepted < 0.9 * drafted, (drafted, accepted)  # nodes kept and nodes rejected
    result = pvalues(tokens, exact(small, prompt, params))
    assert min(result.values()) > ALPHA, result


def rows_of(drafter: EagleDrafter) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each row's keys and values at its valid slots, in slot order."""
    layer = drafter.cache.kv.layers[0]
    assert layer.keys.shape[2] == drafter.cache.slots, "pending tree slots were left in the cache"
    return [(layer.keys[i][:, valid], layer.values[i][:, valid]) for i, valid in enumerate(drafter.cache.valid)]


@pytest.mark.parametrize("kind", KINDS)
def test_draft_cache_after_each_step_equals_one_built_from_scratch(target, kind):
    drafter = random_drafter(target, kind=kind)
    engine = Engine(target, drafter, Controller(gamma_max=4, fixed_gamma=4), set())
    for i, prompt in enumerate(PROMPTS_GREEDY):
        engine.add(Sequence(f"s{i}", prompt, SamplingParams(temperature=0), 12 + 4 * i))
    while engine.seqs:
        engine.step()
        if not engine.seqs:
            break
        fresh = EagleDrafter(drafter.net, drafter.top_k, drafter.depth, drafter.total_tokens)
        for seq in engine.seqs:
            _, _, hidden = target.prefill(seq.tokens[:-1], features=drafter.feature_layers)
            fresh.add(seq, hidden)
        assert drafter.cache.lengths.tolist() == [len(seq.tokens) - 1 for seq in engine.seqs]
        assert drafter.cache.lengths.tolist() == fresh.cache.lengths.tolist()
        for (keys, values), (want_keys, want_values) in zip(rows_of(drafter), rows_of(fresh)):
            torch.testing.assert_close(keys, want_keys, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(values, want_values, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(drafter.roots, fresh.roots, atol=1e-4, rtol=1e-4)


def test_the_best_nodes_form_a_tree_even_on_ties():
    tree = Tree(1, torch.device("cpu"))
    # Node 1 is certain (log-probability 0), so it ties its parent 0; node 2 is worse; node 3 ties 0 and 1.
    tree.extend(torch.tensor([[10, 11]]), torch.tensor([[-1, 0]]), torch.tensor([[-0.5, -0.5]]))
    tree.extend(torch.tensor([[12, 13]]), torch.tensor([[0, 1]]), torch.tensor([[-2.0, -0.5]]))
    tokens, parents = tree.best(3)
    assert tokens.tolist() == [[10, 11, 13]]
    assert parents == [[-1, 0, 1]]


@pytest.mark.parametrize("kind", KINDS)
def test_proposals_are_trees_of_distinct_siblings_within_budget(target, kind):
    drafter = random_drafter(target, top_k=3, depth=3, total_tokens=7, kind=kind)
    engine = Engine(target, drafter, Controller(gamma_max=3, fixed_gamma=3), set())
    seq = Sequence("s", [1, 2, 3, 4], SamplingParams(temperature=0), 8)
    engine.add(seq)
    proposal = drafter.propose([seq], 3)
    parents = proposal.parents[0]
    assert proposal.lengths == [7] and proposal.probs is None
    assert all(parent < j for j, parent in enumerate(parents))
    for parent in set(parents):
        siblings = [int(proposal.tokens[0, j]) for j, p in enumerate(parents) if p == parent]
        assert len(siblings) == len(set(siblings))


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    return tmp_path


def test_missing_weights_name_the_training_command(cache_root, target):
    with pytest.raises(MissingArtifactError, match="specdec train eagle --config .* --out nothing"):
        load_eagle("nothing", target.model, target.name)


def test_training_smoke_run_lowers_the_loss_and_the_drafter_loads(cache_root):
    config = Config.model_validate({"model": {"target": "tiny-random-llama", "dtype": "fp32", "threads": 1},
                                    "speculation": {"drafter": "eagle", "gamma": 3, "eagle": {"weights": "smoke"}}})
    runner = load_runner(config.model.target, config.model)
    data = features(runner, DataSettings(tokens=3000, seq_len=48, prompts=8, answer_tokens=16), progress=False)
    settings = train_eagle.EagleSettings(epochs=8, batch_sequences=4, lr=3e-3)
    meta = train_eagle.train(runner, data, "smoke", settings, progress=False)
    assert meta["last_loss"]["loss"] < 0.9 * meta["first_loss"]["loss"], meta
    assert 0 <= meta["heldout"]["top1_agreement"] <= 1 and meta["heldout"]["acceptance_length"] >= 1
    drafter = build_drafter(config, runner)
    assert isinstance(drafter, EagleDrafter)
    seq = Sequence("s", [1, 2, 3, 4], SamplingParams(temperature=0), 16)
    reference = greedy_reference(runner, seq.prompt_ids, 16)
    decode(Engine(runner, drafter, Controller(gamma_max=3, fixed_gamma=3), set()), [seq])
    assert seq.output_ids == reference


def test_resume_continues_from_the_checkpoint(cache_root):
    runner = tiny_runner(seed=0, vocab=64)
    split = train_eagle.FeatureSplit(torch.randn(40, 64), torch.randint(0, 64, (40,)), torch.randint(0, 64, (40,)),
                                     torch.tensor([20, 20]))
    data = train_eagle.Features(cache_root, {"settings": {}, "positions": {"train": 40, "heldout": 40}}, split, split)
    settings = train_eagle.EagleSettings(epochs=2, batch_sequences=1)
    whole = train_eagle.train(runner, data, cache_root / "whole", settings, progress=False)
    train_eagle.train(runner, data, cache_root / "resumed", train_eagle.EagleSettings(epochs=1, batch_sequences=1), progress=False)
    resumed = train_eagle.train(runner, data, cache_root / "resumed", settings, resume=True, progress=False)
    assert resumed["last_loss"] == pytest.approx(whole["last_loss"], rel=1e-4)

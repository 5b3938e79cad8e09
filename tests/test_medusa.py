"""The Medusa drafter: its per-step candidate trees are valid trees within budget, greedy decoding
through it equals plain greedy decoding (fp32, tiny model and SmolLM2-135M), sampling through it
is distributed as the target's (the chi-square harness of test_exactness), and a config whose
heads are missing says how to train them.

Untrained heads are the identity (they predict what the target predicts for the next token), so
the tests perturb them at random: trees come out wide and deep, and are sometimes kept.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from specdec_core.build import build_engine
from specdec_core.config import Config
from specdec_core.control import Controller
from specdec_core.drafters.medusa import MedusaDrafter, candidate_tree
from specdec_core.engine import Engine
from specdec_core.models.artifacts import HEADS, MissingArtifactError, artifact_dir
from specdec_core.models.medusa_heads import MedusaHeads, save_heads
from specdec_core.sampling import SamplingParams
from specdec_core.sequence import Sequence
from specdec_core.tree import children, depths
from specdec_core.models.vocab import ReducedVocab

from .helpers import decode, greedy_reference, tiny_runner
from .helpers import single_thread  # noqa: F401  (autouse: torch on one thread)
from .test_exactness import ALPHA, PARAMS, ROWS, VOCAB, exact, generate, pvalues

SMALL_VOCAB = 16  # the greedy test's target: small enough that random heads' top-k often holds its argmax
GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[1, 2, 3, 4, 5], [7], [3, 9, 3, 9, 3, 9, 3], [11, 4, 2, 8, 6, 1, 0, 5, 12, 13]]


def perturbed_heads(hidden: int, num_heads: int, scale: float, seed: int) -> MedusaHeads:
    """Heads whose blocks are random: each predicts something other than the target's next token."""
    heads = MedusaHeads(hidden, num_heads)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in heads.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    return heads.eval().requires_grad_(False)


def engine_with(target, drafter, gamma: int) -> Engine:
    return Engine(target, drafter, Controller(gamma_max=gamma, fixed_gamma=gamma), eos_token_ids=set())


def all_scores(probs: list[list[float]]) -> list[float]:
    """The score of every node of the full tree (every rank sequence up to every depth)."""
    return [
        math.prod(probs[level][rank] for level, rank in enumerate(path))
        for depth in range(1, len(probs) + 1)
        for path in itertools.product(range(len(probs[0])), repeat=depth)
    ]


@pytest.mark.parametrize("depth, k, budget", [(1, 3, 2), (3, 3, 10), (4, 2, 40), (4, 5, 64), (2, 4, 1)])
def test_candidate_tree_is_the_likeliest_valid_tree_within_budget(depth, k, budget):
    rng = random.Random(depth * 100 + k * 10 + budget)
    probs = [sorted((rng.random() for _ in range(k)), reverse=True) for _ in range(depth)]
    nodes, parents = candidate_tree(probs, budget)
    assert len(nodes) == min(budget, len(all_scores(probs)))
    assert all(-1 <= parent < j for j, parent in enumerate(parents))
    assert [level + 1 for level, _ in nodes] == depths(parents)
    scores = []
    for (level, rank), parent in zip(nodes, parents):
        scores.append((1.0 if parent < 0 else scores[parent]) * probs[level][rank])
    # The best `budget` nodes of the whole tree, and each node's children distinct ranks, likeliest first.
    assert sorted(scores, reverse=True) == pytest.approx(sorted(all_scores(probs), reverse=True)[: len(nodes)])
    for kids in children(parents):
        assert [nodes[j][1] for j in kids] == sorted({nodes[j][1] for j in kids})


def test_proposal_is_a_tree_of_distinct_siblings_within_budget():
    target = tiny_runner(seed=0, vocab=SMALL_VOCAB)
    drafter = MedusaDrafter(target, perturbed_heads(64, 3, 0.3, seed=1), None, tree_nodes=10, top_k=3)
    engine = engine_with(target, drafter, gamma=2)
    for i, prompt in enumerate(PROMPTS):
        engine.add(Sequence(f"r{i}", prompt, GREEDY, 8))
    proposal = drafter.propose(engine.seqs, gamma=2)
    assert proposal.probs is None
    for i, (parents, n) in enumerate(zip(proposal.parents, proposal.lengths)):
        assert len(parents) == n == 10  # 3 + 9 candidates: the budget binds (a one-token prompt's row too)
        assert max(depths(parents), default=0) <= 2
        for kids in children(parents):
            tokens = proposal.tokens[i, kids].tolist()
            assert len(set(tokens)) == len(tokens)


@torch.no_grad()
def test_heads_read_the_feature_of_the_token_before_the_last():
    target = tiny_runner(seed=0, vocab=SMALL_VOCAB)
    drafter = MedusaDrafter(target, perturbed_heads(64, 3, 0.3, seed=1), None, tree_nodes=10, top_k=3)
    engine = engine_with(target, drafter, gamma=3)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add(Sequence(f"r{i}", prompt, GREEDY, 12))
    for _ in range(4):
        engine.step()
        for seq, feature in zip(engine.seqs, drafter.features):
            out = target.model(input_ids=torch.tensor([seq.tokens[:-1]]), output_hidden_states=True)
            assert torch.allclose(feature, out.hidden_states[-1][0, -1], atol=1e-5)


@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "reduced-vocab"])
def test_greedy_equals_plain_greedy(reduced):
    target = tiny_runner(seed=0, vocab=SMALL_VOCAB)
    vocab = ReducedVocab(torch.arange(0, SMALL_VOCAB, 2), SMALL_VOCAB) if reduced else None
    drafter = MedusaDrafter(target, perturbed_heads(64, 4, 0.3, seed=2), vocab, tree_nodes=24, top_k=4)
    engine = engine_with(target, drafter, gamma=4)
    seqs = [Sequence(f"r{i}", prompt, GREEDY, 20 - 3 * i) for i, prompt in enumerate(PROMPTS)]
    reports = decode(engine, seqs[:2], joins={3: seqs[2:]})
    for seq in seqs:
        assert seq.output_ids == greedy_reference(target, seq.prompt_ids, seq.max_tokens)
    accepted = [sum(column) for column in itertools.zip_longest(*(r.accepted_per_position for r in reports), fillvalue=0)]
    assert len(accepted) >= 3 and accepted[1] > 0, accepted  # deep trees, kept past the first level
    assert max(max(row.drafted for row in r.rows) for r in reports) == 4


@pytest.mark.parametrize("setting", list(PARAMS))
def test_sampling_is_distributed_as_the_target(setting):
    target = tiny_runner(seed=0, vocab=VOCAB)
    drafter = MedusaDrafter(target, perturbed_heads(64, 3, 0.05, seed=3), None, tree_nodes=16, top_k=4)
    prompt, params = [1, 2, 3, 4, 5], PARAMS[setting]
    tokens, seqs = generate(target, drafter, prompt, params, ROWS)
    drafted = sum(seq.stats.draft_tokens for seq in seqs)
    accepted = sum(seq.stats.accepted_tokens for seq in seqs)
    assert 0.1 * drafted < accepted < 0.9 * drafted, (drafted, accepted)
    result = pvalues(tokens, exact(target, prompt, params))
    assert min(result.values()) > ALPHA, result


def medusa_config(target: str, heads: str, dtype: str = "fp32") -> Config:
    return Config.model_validate({
        "model": {"target": target, "dtype": dtype, "device": "cpu"},
        "speculation": {"drafter": "medusa", "gamma": 3, "medusa": {"heads": heads, "tree_nodes": 12, "top_k": 3}},
    })


def test_missing_heads_say_how_to_train_them(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    with pytest.raises(MissingArtifactError, match=r"specdec train medusa .*--out never-trained"):
        build_engine(medusa_config("tiny-random-llama", "never-trained"))
    save_heads(MedusaHeads(64, 2), tmp_path / "heads" / "for-qwen", {"target": "tiny-random-qwen2"})
    with pytest.raises(MissingArtifactError, match=r"tiny-random-qwen2.*specdec train medusa"):
        build_engine(medusa_config("tiny-random-llama", "for-qwen"))


def decode_greedy(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    seqs = [Sequence(f"r{i}", prompt, GREEDY, max_tokens) for i, prompt in enumerate(prompts)]
    decode(engine, seqs)
    return [seq.output_ids for seq in seqs]


def test_smollm2_greedy_equals_plain(smollm2_dir, tmp_path):
    """SmolLM2-135M in fp32 with its trained heads when they exist, else untrained ones saved here."""
    name = HEADS.default_name("smollm2-135m")
    if not (artifact_dir(HEADS, name) / "heads.json").is_file():
        name = str(tmp_path)
        save_heads(perturbed_heads(576, 3, 0.01, seed=4), name, {"target": "smollm2-135m"})
    engine = build_engine(medusa_config("smollm2-135m", name))
    plain = build_engine(medusa_config("smollm2-135m", name), drafter="none", target=engine.target)
    tokenizer = engine.target.tokenizer
    prompts = [tokenizer.encode(text) for text in ("def fibonacci(n):", "The capital of France is", "1, 2, 3, 4,")]
    assert decode_greedy(engine, prompts, 24) == decode_greedy(plain, prompts, 24)

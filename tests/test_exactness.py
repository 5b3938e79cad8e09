"""The proof: speculative sampling through the real Engine is distributed exactly as sampling the target,
under both rules for sampled rows (the Gumbel rule, draws keyed by position; rejection sampling), on the
eager step and on the compiled static one.

A tiny random target over a 12-token vocabulary makes the target's own
distribution of the first three generated tokens computable exactly (one
forward over all 144 two-token continuations). Thousands of rows, each with
its own seed, decode three tokens in one batch through Engine.step with a
fixed gamma, so every step speculates; the empirical distributions of each
position and of the first two tokens jointly must pass a chi-square test
against the exact ones, and tokens of probability zero (outside top-p) must
never appear. Negative controls run the same test on wrong rules (no residual
correction; a bonus token drawn at the wrong position; noise that is not
Gumbel; one noise for every position) and must fail it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from scipy import stats

from specdec_core import engine as engine_module
from specdec_core import sampling
from specdec_core.control import Controller
from specdec_core.drafters.draft_model import DraftModelDrafter
from specdec_core.drafters.ngram import NgramDrafter, lookup
from specdec_core.engine import Engine
from specdec_core.models.static_runner import StaticRunner
from specdec_core.sampling import PositionNoise, SamplingParams, make_generator, sample, to_probs
from specdec_core.sequence import Sequence
from specdec_core.verify import accept_chains_sampled

from .helpers import tiny_runner
from .helpers import single_thread  # noqa: F401  (autouse: torch on one thread)

VOCAB = 12
ROWS = 10_000  # enough to see 2% of probability moved between the two likeliest tokens (checked below)
ALPHA = 1e-3  # a p-value below this fails
TOKENS = 3
PROMPTS = {
    "draft-model": [1, 2, 3, 4, 5],
    # After the likeliest first tokens (drawn from the prefill's logits: 0, 2, 3 with p 0.49, 0.11, 0.10) the
    # n-gram drafter finds a match (0; 4, 0; 8, 2), kept often but not always; chosen also for the tests' power.
    "ngram": [3, 3, 8, 2, 4, 0],
}
PARAMS = {
    "t1": SamplingParams(temperature=1.0),
    "t0.7-top_p0.9": SamplingParams(temperature=0.7, top_p=0.9),
    # Penalties make p and q depend on the tokens drafted so far in the step (running counts).
    "t1-penalties": SamplingParams(temperature=1.0, presence_penalty=0.7, frequency_penalty=0.4),
}
# Every drafter with every setting, except n-gram with penalties: the draft model covers the
# engine's running counts and its own, and each case costs seconds.
CASES = [(d, p) for d in PROMPTS for p in PARAMS if (d, p) != ("ngram", "t1-penalties")]


@pytest.fixture(scope="module")
def target():
    return tiny_runner(seed=0, vocab=VOCAB)


@pytest.fixture(scope="module")
def draft():
    return tiny_runner(seed=1, vocab=VOCAB)


def make_drafter(name: str, draft):
    return DraftModelDrafter(draft, VOCAB) if name == "draft-model" else NgramDrafter()


@dataclass
class Exact:
    """The target's exact distributions of the first generated tokens."""

    first: np.ndarray  # [V]
    pair: np.ndarray  # [V, V]: first two jointly
    second: np.ndarray  # [V]
    third: np.ndarray  # [V]


@torch.no_grad()
def exact(target, prompt: list[int], params: SamplingParams) -> Exact:
    n = len(prompt)
    contexts = torch.tensor([prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
    logits = target.model(input_ids=contexts).logits.double()[:, n - 1 :].reshape(VOCAB, VOCAB, 3, VOCAB)
    # Output counts before each generated token: none, then token a, then a and b.
    one_hot = torch.eye(VOCAB, dtype=torch.double)
    counts = torch.stack([torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.double), one_hot[:, None].expand(-1, VOCAB, -1),
                          one_hot[:, None] + one_hot[None, :]], dim=2)
    probs = to_probs(logits.reshape(-1, VOCAB), params, counts.reshape(-1, VOCAB)).reshape(VOCAB, VOCAB, 3, VOCAB)
    first = probs[0, 0, 0]  # after the prompt
    pair = first[:, None] * probs[:, 0, 1]  # p(a) p(b | a)
    third = torch.einsum("ab,abx->x", pair, probs[:, :, 2])
    return Exact(first.numpy(), pair.numpy(), pair.sum(0).numpy(), third.numpy())


def add_rows(engine: Engine, seqs: list[Sequence]) -> None:
    """Engine.add for many sequences of one prompt, in linear time.

    Engine.add prefills one row and concatenates it to the batch, which is
    quadratic over thousands of rows. Add the first for real, copy its cache
    rows (keep_rows with a repeated index), and give each copy what add
    gives a sequence: the method name, its own seeded generator (and noise,
    under the Gumbel rule), with penalties its output counts, and its first
    token, drawn from the prompt's prefilled logits as add draws it.
    """
    admission = engine.begin(seqs[0])
    while not engine.advance(admission):
        pass
    rows = [0] * len(seqs)
    engine.cache.keep_rows(rows)
    if engine.drafter:
        engine.drafter.remove(rows)
    for seq in seqs[1:]:
        seq.stats.method = engine.method
        seq.generator = seq.generator or make_generator(seq.params.seed, engine.target.device)
        if seqs[0].noise is not None:
            seq.noise = PositionNoise(seq.params.seed, engine.target.vocab_size, engine.target.device)
        if seq.params.uses_counts:
            seq.counts = torch.zeros_like(seqs[0].counts)
        engine._first_token(replace(admission, seq=seq))
    engine.seqs = list(seqs)


def generate(
    target, drafter, prompt: list[int], params: SamplingParams, rows: int, rule: str = "gumbel", max_tokens: int = TOKENS + 1
) -> tuple[np.ndarray, list[Sequence]]:
    """Decode TOKENS tokens for `rows` copies of `prompt` in one batch under the sampling rule `rule`: seeded
    rows (the Gumbel rule), or unseeded rows with generators seeded here (rejection sampling); returns tokens
    [rows, TOKENS]. Each row decodes `max_tokens`: by default one more, so that its first step (after the first
    token, which the prefill's logits draw) drafts the TOKENS - 1 tokens after it."""
    controller = Controller(gamma_max=TOKENS, fixed_gamma=TOKENS, max_speculative_batch=rows)
    engine = Engine(target, drafter, controller, eos_token_ids=set(), unseeded_rule="rejection")
    seeded = rule == "gumbel"
    seqs = [Sequence(f"r{i}", list(prompt), replace(params, seed=i if seeded else None), max_tokens) for i in range(rows)]
    if not seeded:
        for i, seq in enumerate(seqs):
            seq.generator = make_generator(i, target.device)
    add_rows(engine, seqs)
    while engine.seqs:
        engine.step()
    assert all(len(seq.output_ids) == max_tokens for seq in seqs)
    return np.array([seq.output_ids[:TOKENS] for seq in seqs]), seqs


def chisquare_pvalue(observed: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of counts to probabilities; cells expecting fewer than 5 are pooled."""
    observed, probs = observed.ravel().astype(float), probs.ravel()
    assert observed[probs == 0].sum() == 0, "a token of probability zero was drawn"
    expected = probs * observed.sum()
    small = (expected < 5) & (probs > 0)
    big = expected >= 5
    obs = np.append(observed[big], observed[small].sum())
    exp = np.append(expected[big], expected[small].sum())
    keep = exp > 0
    return float(stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


def pvalues(tokens: np.ndarray, want: Exact) -> dict[str, float]:
    def counts(column: np.ndarray) -> np.ndarray:
        return np.bincount(column, minlength=VOCAB)

    pair = np.bincount(tokens[:, 0] * VOCAB + tokens[:, 1], minlength=VOCAB * VOCAB)
    return {
        "first": chisquare_pvalue(counts(tokens[:, 0]), want.first),
        "second": chisquare_pvalue(counts(tokens[:, 1]), want.second),
        "third": chisquare_pvalue(counts(tokens[:, 2]), want.third),
        "first two jointly": chisquare_pvalue(pair, want.pair),
    }


@pytest.fixture(scope="module")
def compiled(target, draft) -> tuple[StaticRunner, StaticRunner]:
    """The target and the draft on the compiled static step (model.step: compiled)."""
    return StaticRunner.of(target, compiled=True), StaticRunner.of(draft, compiled=True)


@pytest.mark.parametrize("step", ["eager", "compiled"])
@pytest.mark.parametrize("rule", engine_module.SAMPLING_RULES)
@pytest.mark.parametrize("drafter, setting", CASES)
def test_speculative_sampling_is_distributed_as_the_target(target, draft, compiled, drafter, setting, rule, step):
    if step == "compiled":
        target, draft = compiled
    prompt, params = PROMPTS[drafter], PARAMS[setting]
    tokens, seqs = generate(target, make_drafter(drafter, draft), prompt, params, ROWS, rule)
    drafted = sum(seq.stats.draft_tokens for seq in seqs)
    accepted = sum(seq.stats.accepted_tokens for seq in seqs)
    # Both branches of the rule ran many times: drafts kept, and drafts rejected and replaced.
    assert 0.1 * drafted < accepted < 0.9 * drafted, (drafted, accepted)
    assert drafted >= ROWS
    result = pvalues(tokens, exact(target, prompt, params))
    assert min(result.values()) > ALPHA, result


def wrong_rule(redraw_at: Callable[[int, int], int | None]):
    """accept_chains_sampled, except that a row which kept n of its g drafts draws its last token again, from p at
    position redraw_at(n, g) (None: it keeps the right one)."""

    def rule(drafts, lengths, p, q, generators):
        accepted = accept_chains_sampled(drafts, lengths, p, q, generators)
        for i, (n, g, generator) in enumerate(zip(accepted.counts.tolist(), lengths, generators)):
            at = redraw_at(n, g)
            if at is not None:
                accepted.tokens[i, n] = sample(p[i, at : at + 1], generator)[0]
        return accepted

    return rule


# A wrong rule: on rejection, draw the replacement from p instead of norm(max(0, p - q)).
no_residual = wrong_rule(lambda n, g: n if n < g else None)
# A wrong rule: when every draft is kept, draw the bonus from the last draft's position, not the next.
stale_bonus = wrong_rule(lambda n, g: n - 1 if n == g > 0 else None)


@pytest.mark.parametrize(
    "drafter, rule, rows, max_tokens",
    [
        ("draft-model", no_residual, ROWS // 4, TOKENS + 1),
        ("ngram", no_residual, ROWS // 4, TOKENS + 1),
        # Subtler: it only touches rows whose drafts were all kept, which the draft model's are often enough; with
        # TOKENS, the first step drafts one token, so its bonus is the third token, which the test reads.
        ("draft-model", stale_bonus, ROWS // 2, TOKENS),
    ],
)
def test_negative_control_wrong_rules_fail(target, draft, drafter, rule, rows, max_tokens, monkeypatch):
    monkeypatch.setattr(engine_module, "accept_chains_sampled", rule)
    prompt, params = PROMPTS[drafter], PARAMS["t1"]
    tokens, _ = generate(target, make_drafter(drafter, draft), prompt, params, rows, "rejection", max_tokens)
    result = pvalues(tokens, exact(target, prompt, params))
    assert min(result.values()) < ALPHA * 1e-3, result  # fails the test above, by a wide margin


_gumbel_at = PositionNoise.at
WRONG_NOISE = {
    # Gumbel noise at half scale: argmax(l + g / 2) draws from p^2, renormalized.
    "half-scale": lambda self, positions: _gumbel_at(self, positions) / 2,
    # Every position drawn with position 0's noise: each marginal stays exact, the joint does not.
    "one-position": lambda self, positions: _gumbel_at(self, [0 for _ in positions]),
}


@pytest.mark.parametrize("noise", WRONG_NOISE)
def test_negative_control_wrong_noise_fails(target, draft, noise, monkeypatch):
    monkeypatch.setattr(sampling.PositionNoise, "at", WRONG_NOISE[noise])
    prompt, params = PROMPTS["draft-model"], PARAMS["t1"]
    tokens, _ = generate(target, make_drafter("draft-model", draft), prompt, params, ROWS // 2)
    result = pvalues(tokens, exact(target, prompt, params))
    assert min(result.values()) < ALPHA * 1e-3, result


def test_ngram_prompt_proposes():
    prompt = PROMPTS["ngram"]
    assert [lookup(prompt + [first], 1, 3, TOKENS - 1) for first in (0, 2, 3)] == [[[0]], [[4, 0]], [[8, 2]]]


@pytest.mark.parametrize("drafter, setting", CASES)
def test_sample_size_detects_a_two_percent_shift(target, drafter, setting):
    """Power of each marginal test against 2% of probability moved between its two likeliest tokens."""
    want = exact(target, PROMPTS[drafter], PARAMS[setting])
    for probs in (want.first, want.second, want.third):
        top = np.sort(probs)[::-1]
        cells = int((probs * ROWS >= 5).sum())
        noncentrality = ROWS * 0.02**2 * (1 / top[0] + 1 / top[1])
        critical = stats.chi2.ppf(1 - ALPHA, cells - 1)
        assert stats.ncx2.sf(critical, cells - 1, noncentrality) > 0.9

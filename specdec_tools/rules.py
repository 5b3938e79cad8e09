"""How often each rule for sampled rows keeps a sampling drafter's token: rejection sampling against the
Gumbel rule with coupled drafts.

For each prompt the target samples a completion (at the temperature asked); along it, one pass of the
target and one of the draft model give p and q at every position. There a token drawn from q is kept
with probability sum(min(p, q)) under rejection sampling (1 - total variation), and under the Gumbel rule
with probability P(argmax(log p + g) = argmax(log q + g)) for shared Gumbel noise g, estimated with
`--draws` noise samples over the tokens that carry nearly all of p and q. Both are exact rules, so this
per-token figure is what separates them.

    python -m specdec_tools.rules --config configs/default.yaml --draft-model qwen2.5-coder-0.5b \\
        --prompts ../shared/data/spec_bench/question.jsonl --limit 20 --max-tokens 128 --temperature 0.7
"""

from __future__ import annotations

import numpy as np
import torch
from scipy import stats
from tqdm import tqdm

from specdec_core.build import build_engine
from specdec_core.config import Config
from specdec_core.models.loading import draft_runner
from specdec_core.sampling import SamplingParams, to_probs
from specdec_core.sequence import Sequence

from . import measurement
from .bench.prompts import encode, load_prompts, stratified

SUPPORT = 512  # tokens per position kept for the noise draws: the likeliest under p + q


def kept_by_rule(p: torch.Tensor, q: torch.Tensor, draws: int, generator: torch.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Per position of p, q [n, V]: (rejection sampling's keep probability, the Gumbel rule's estimate)."""
    rejection = torch.minimum(p, q).sum(-1)
    support = (p + q).topk(min(SUPPORT, p.shape[-1]), dim=-1).indices
    log_p, log_q = p.gather(-1, support).log(), q.gather(-1, support).log()
    gumbel = []
    for lp, lq in zip(log_p, log_q):
        noise = -torch.empty(draws, len(lp)).exponential_(generator=generator).log()
        gumbel.append(((lp + noise).argmax(-1) == (lq + noise).argmax(-1)).double().mean())
    return rejection.double().numpy(), torch.stack(gumbel).numpy()


def measure(config: Config, draft_name: str, prompts: list, max_tokens: int, temperature: float, draws: int) -> dict:
    engine = build_engine(config, drafter="none")
    target = engine.target
    draft, _ = draft_runner(config.model, target, draft_name, None)
    params = SamplingParams(temperature=temperature)
    generator = torch.Generator().manual_seed(0)
    rejection, gumbel = [], []
    for i, prompt in enumerate(tqdm(prompts, desc="prompts", unit="prompt")):
        ids = encode(target.tokenizer, prompt.text)
        seq = Sequence(prompt.id, ids, SamplingParams(temperature=temperature, seed=i), max_tokens)
        for _ in engine.generate([seq]):
            pass
        tokens = ids + seq.output_ids
        # Logits after each prompt token from the last on: the distributions the completion was drawn from.
        p = to_probs(target.prefill(tokens, all_logits=True)[1][len(ids) - 1 : -1], params)
        q = to_probs(draft.prefill(tokens, all_logits=True)[1][len(ids) - 1 : -1, : target.vocab_size], params)
        r, g = kept_by_rule(p, q, draws, generator)
        rejection.append(r)
        gumbel.append(g)
    r, g = np.concatenate(rejection), np.concatenate(gumbel)
    difference = stats.ttest_rel(r, g)
    return {
        "target": config.model.target, "weights": config.model.weights, "draft_model": draft_name,
        "temperature": temperature, "prompts": len(prompts), "positions": len(r), "draws": draws,
        "rejection_keep": float(r.mean()), "gumbel_keep": float(g.mean()),
        "difference": float((r - g).mean()),
        "difference_95ci": [float(x) for x in difference.confidence_interval(0.95)],
        "p_value": float(difference.pvalue),
    }


def main(argv: list[str] | None = None) -> None:
    parser = measurement.parser(__doc__, prompts=20)
    parser.add_argument("--draft-model", required=True, help="the sampling drafter's model (same tokenizer)")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--draws", type=int, default=512, help="Gumbel noise samples per position")
    args = parser.parse_args(argv)
    prompts = stratified(load_prompts(args.prompts), args.limit)
    result = measure(Config.load(args.config), args.draft_model, prompts, args.max_tokens, args.temperature, args.draws)
    measurement.report(result, args.out, __spec__.name, argv)


if __name__ == "__main__":
    main()

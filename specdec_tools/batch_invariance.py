"""Does a request's text depend on its neighbours? Each prompt decoded alone, then all of them in one batch,
greedy and seeded, plainly and with each drafter asked for.

    python -m specdec_tools.batch_invariance --config configs/default.yaml --limit 8 --max-tokens 64 \\
        --drafters none,ngram,draft-model
"""

from __future__ import annotations

from dataclasses import replace

from tqdm import tqdm

from specdec_core.build import build_engine
from specdec_core.config import Config
from specdec_core.sampling import SamplingParams
from specdec_core.sequence import Sequence

from . import measurement
from .bench.prompts import encode, load_prompts, stratified

SETTINGS = {"greedy": SamplingParams(temperature=0.0), "seeded-0.7": SamplingParams(temperature=0.7)}


def sequences(ids: list[list[int]], params: SamplingParams, max_tokens: int) -> list[Sequence]:
    """One sequence per prompt, each its own seed: the same alone and in the batch."""
    return [Sequence(f"r{i}", list(p), replace(params, seed=1000 + i), max_tokens) for i, p in enumerate(ids)]


def measure(config: Config, prompts: list, max_tokens: int, drafters: list[str]) -> dict:
    target = build_engine(config, drafter="none").target
    ids = [encode(target.tokenizer, prompt.text) for prompt in prompts]
    figures: dict = {"target": config.model.target, "weights": config.model.weights, "row_invariant": target.row_invariant,
                     "prompts": len(prompts), "max_tokens": max_tokens}
    with tqdm(total=len(drafters) * len(SETTINGS) * (len(ids) + 1), desc="runs") as progress:
        for drafter in drafters:
            # One engine per drafter: what it learns from one request (gamma, a suffix memory) must not show either.
            engine = build_engine(config, drafter=drafter, target=target)
            for name, params in SETTINGS.items():
                alone = []
                for seq in sequences(ids, params, max_tokens):
                    for _ in engine.generate([seq]):
                        pass
                    alone.append(seq.output_ids)
                    progress.update()
                batch = sequences(ids, params, max_tokens)
                for _ in engine.generate(batch):
                    pass
                progress.update()
                figures[f"{drafter} {name}: the same alone and in the batch"] = sum(
                    a == seq.output_ids for a, seq in zip(alone, batch))
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = measurement.parser(__doc__, prompts=8)
    parser.add_argument("--drafters", default="none,ngram", help="comma-separated; none is plain decoding")
    args = parser.parse_args(argv)
    prompts = stratified(load_prompts(args.prompts), args.limit)
    result = measure(Config.load(args.config), prompts, args.max_tokens, args.drafters.split(","))
    measurement.report(result, args.out, __spec__.name, argv)


if __name__ == "__main__":
    main()

"""The n-gram drafter's min_n and max_n, chosen by replaying a bench run's plain decoding.

Greedy verification is exact, so whatever the drafter, the text is plain decoding's: the tokens each
verify step would keep follow from plain's tokens alone, with no model. For every (min_n, max_n) this
replays the drafter's lookup over each prompt and its answer, one step at a time, and reports tokens per
step and draft tokens per step (what a verify pass costs grows with them) per workload phase.

    python -m specdec_tools.ngram_sweep docs/benchmarks/<run>/results.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

from specdec_core.drafters.ngram import lookup

from .measurement import report


def replay(prompt: list[int], output: list[int], min_n: int, max_n: int, gamma: int) -> tuple[int, int]:
    """(steps, draft tokens) to emit `output` after `prompt` when each step verifies the lookup's chain; the first
    token comes from the prompt's prefill, as the engine draws it, not from a step."""
    context, steps, drafted, position = list(prompt) + output[:1], 0, 0, 1
    while position < len(output):
        # As the engine does, never draft past the answer's end: the step emits at most what remains.
        found = lookup(context, min_n, max_n, min(gamma, len(output) - position - 1))
        draft = found[0] if found else []
        kept = 0
        while kept < len(draft) and draft[kept] == output[position + kept]:
            kept += 1
        emitted = kept + 1  # the accepted drafts and the target's own next token
        context += output[position : position + emitted]
        position += emitted
        steps += 1
        drafted += len(draft)
    return steps, drafted


def sweep(sequences: list[dict], grid: list[tuple[int, int]], gamma: int) -> dict:
    """Per (min_n, max_n): tokens per step and draft tokens per step, per group of prompts and over all."""
    figures = {"gamma": gamma, "prompts": len(sequences)}
    for min_n, max_n in tqdm(grid, desc="n-gram settings"):
        totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # tokens, steps, drafted
        for seq in sequences:
            steps, drafted = replay(seq["prompt_ids"], seq["output_ids"], min_n, max_n, gamma)
            for group in ("all", seq["category"]):
                total = totals[group]
                total[0] += max(len(seq["output_ids"]) - 1, 0)  # the steps' tokens: the first is the prefill's
                total[1] += steps
                total[2] += drafted
        setting = f"min_n={min_n} max_n={max_n}"
        figures[f"tokens per step, {setting}"] = {g: round(t / s, 3) for g, (t, s, _) in totals.items()}
        figures[f"draft tokens per step, {setting}"] = {g: round(d / s, 3) for g, (_, s, d) in totals.items()}
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="a bench run's results.json (it holds plain decoding's tokens)")
    parser.add_argument("--gamma", type=int, default=5, help="draft tokens a step may verify (the config's gamma_max)")
    parser.add_argument("--max-n", type=int, default=5, help="the longest n-gram tried")
    parser.add_argument("--out", type=Path, help="also write the figures here, as JSON")
    args = parser.parse_args(argv)
    sequences = json.loads(args.results.read_text()).get("sequences")
    if not sequences:
        raise SystemExit(f"{args.results} holds no plain sequences; rerun specdec bench (it records them now)")
    grid = [(lo, hi) for lo in range(1, args.max_n + 1) for hi in range(lo, args.max_n + 1)]
    report(sweep(sequences, grid, args.gamma), args.out, "specdec_tools.ngram_sweep", argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

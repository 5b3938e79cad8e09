"""How often a verify pass's argmax differs from plain decoding's: the near-ties that numerics flip.

Each prompt is decoded plainly and greedily; then the same text is fed again in verify passes of k tokens
(the target's pass over a row's last token and k - 1 drafts equal to plain's next tokens), and each
position's argmax is compared with the token plain decoding chose there. On a row-invariant target
(ModelRunner.row_invariant: int4 or int8 weights on the CPU) the two must agree everywhere; elsewhere
every disagreement is a place where speculation would change greedy text.

    python -m specdec_tools.flips --config configs/default-bf16.yaml --limit 10 --max-tokens 128 --k 6
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from specdec_core.build import build_engine
from specdec_core.config import Config
from specdec_core.sampling import SamplingParams
from specdec_core.sequence import Sequence

from . import measurement
from .bench.prompts import encode, load_prompts, stratified


def flips(config: Config, prompts: list, max_tokens: int, k: int) -> dict:
    engine = build_engine(config, drafter="none")
    target = engine.target
    positions = flipped = prompts_flipped = 0
    for prompt in tqdm(prompts, desc="prompts", unit="prompt"):
        ids = encode(target.tokenizer, prompt.text)
        seq = Sequence(prompt.id, ids, SamplingParams(temperature=0), max_tokens)
        for _ in engine.generate([seq]):
            pass
        out = seq.output_ids
        # As the engine's prefill computed it: its last logits drew out[0], which no verify pass recomputes.
        cache = target.prefill(ids, row_invariant=engine.exact_prefill)[0]
        mine = 0
        for start in range(0, len(out) - 1, k):
            # The pass: token `start`, then plain's next k - 1 tokens as drafts, judged against the tokens after each.
            window = out[start : start + k]
            logits, _ = target.forward(cache, torch.tensor([window]), commit=True, row_invariant=target.row_invariant)
            chosen = logits[0].argmax(-1).tolist()
            expected = out[start + 1 : start + 1 + len(window)]
            mine += sum(a != b for a, b in zip(chosen, expected))
            positions += len(expected)
        flipped += mine
        prompts_flipped += mine > 0
    return {
        "target": config.model.target, "weights": config.model.weights, "dtype": config.model.dtype,
        "row_invariant": target.row_invariant, "k": k, "prompts": len(prompts), "positions": positions,
        "flipped_positions": flipped, "flip_rate": flipped / positions if positions else None,
        "prompts_with_a_flip": prompts_flipped,
    }


def main(argv: list[str] | None = None) -> None:
    parser = measurement.parser(__doc__)
    parser.add_argument("--k", type=int, default=6, help="tokens per verify pass")
    args = parser.parse_args(argv)
    prompts = stratified(load_prompts(args.prompts), args.limit)
    measurement.report(flips(Config.load(args.config), prompts, args.max_tokens, args.k), args.out, __spec__.name, argv)


if __name__ == "__main__":
    main()

"""Calibrate layer skip's k, and measure drafters against plain decoding, on one loaded target.

    specdec calibrate --config CFG                    # pick speculation.layer_skip.k
    specdec calibrate --config CFG --drafters layer-skip:layer_skip.k=20,quantized,hybrid

(`python -m specdec_tools.calibrate` is the same command.)

Picking k takes two stages. First, for every k at once: the acceptance a
k-layer draft gets, from one forward with hidden states over each prompt and
the target's own greedy continuation of it (greedy: the draft's argmax is the
target's next token; sampled: the sum of min(p, q)), and its cost ratio c(k)
to a plain step, timed at a few k and interpolated (the cost is affine in k:
k layers plus the embedding and output layers). theory.optimal_gamma turns
each (acceptance, c) into a predicted speedup and gamma. Second, the best k's
predicted to beat plain decoding decode the prompts through the engine at
their predicted gamma, interleaved with plain decoding, and the highest
measured speedup wins; when none beats plain, layer skip does not pay on
this model. Measuring drafters (--drafters) uses the config's controller, as
the server would.

Speedups are tokens per second (prefill included, as a client waits) over the
mean of the plain runs just before and after; cost ratios are draft seconds
per draft position over seconds per plain decoding step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specdec_core import theory
from specdec_core.config import Config, with_overrides

from .bench.prompts import add_prompts_argument, encode, load_prompts, stratified

if TYPE_CHECKING:
    import numpy as np
    import torch

    from specdec_core.drafters.layer_skip import LayerSkipDrafter
    from specdec_core.engine import Engine
    from specdec_core.models.runner import ModelRunner
    from specdec_core.sampling import SamplingParams

# specdec_cli/main.py imports this module to build its parser: torch, numpy and the models are imported
# only when a calibration runs, so other commands start fast.

PLAIN = "plain"


@dataclass
class Tally:
    """One method's measured figures over all prompts."""

    speedups: list[float] = field(default_factory=list)
    tokens: int = 0
    wall_s: float = 0.0
    draft_s: float = 0.0
    draft_positions: int = 0
    verify_s: float = 0.0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    emitted_in_verify: int = 0

    def row(self, plain_step_s: float) -> dict:
        def ratio(a: float, b: float) -> float:
            return a / b if b else float("nan")

        return {
            "speedup": statistics.median(self.speedups) if self.speedups else 1.0,
            "tokens_per_s": ratio(self.tokens, self.wall_s),
            "cost_ratio": ratio(ratio(self.draft_s, self.draft_positions), plain_step_s),
            "acceptance": ratio(self.accepted, self.drafted),
            "mean_accepted_length": ratio(self.emitted_in_verify, self.verify_steps),
        }


def decode_one(engine: Engine, prompt: list[int], params: SamplingParams, max_tokens: int, tally: Tally) -> list[int]:
    """Decode one prompt alone; add its figures to `tally`; return the tokens it generated."""
    from specdec_core.sequence import Sequence

    seq = Sequence("calibrate", prompt, params, max_tokens)
    start = time.perf_counter()
    for report in engine.generate([seq]):
        tally.draft_s += report.draft_s
        tally.draft_positions += report.gamma
        tally.verify_s += report.verify_s
        tally.steps += 1
    tally.wall_s += time.perf_counter() - start
    tally.tokens += len(seq.output_ids)
    stats = seq.stats
    tally.drafted += stats.draft_tokens
    tally.accepted += stats.accepted_tokens
    tally.verify_steps += stats.verify_steps
    tally.emitted_in_verify += stats.emitted_tokens
    return seq.output_ids


def measure(engines: dict[str, Engine], prompts: list[list[int]], max_tokens: int, temperature: float) -> dict[str, dict]:
    """Every engine over every prompt, each run between two plain runs; figures per label (PLAIN included)."""
    from specdec_core.sampling import SamplingParams

    tallies = {label: Tally() for label in engines}
    plain = engines[PLAIN]
    for engine in engines.values():  # warm-up, not counted: first-call allocations, the controller's first costs
        decode_one(engine, prompts[0], SamplingParams(temperature=temperature, seed=0), 8, Tally())
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=temperature, seed=zlib.crc32(bytes(str(prompt), "utf8")))
        labels = [label for label in engines if label != PLAIN]
        labels = labels[i % len(labels) :] + labels[: i % len(labels)] if labels else []  # rotate: no method always first
        before = _timed(plain, prompt, params, max_tokens, tallies[PLAIN])
        for label in labels:
            rate = _timed(engines[label], prompt, params, max_tokens, tallies[label])
            after = _timed(plain, prompt, params, max_tokens, tallies[PLAIN])
            tallies[label].speedups.append(rate / ((before + after) / 2))
            before = after
    plain_step_s = tallies[PLAIN].verify_s / tallies[PLAIN].steps
    return {label: tally.row(plain_step_s) for label, tally in tallies.items()}


def _timed(engine: Engine, prompt: list[int], params: SamplingParams, max_tokens: int, tally: Tally) -> float:
    """Tokens per second of one decode of `prompt`."""
    tokens, wall = tally.tokens, tally.wall_s
    decode_one(engine, prompt, params, max_tokens, tally)
    return (tally.tokens - tokens) / (tally.wall_s - wall)


def layer_acceptance(drafter: LayerSkipDrafter, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """[L]: acceptance of a k-layer draft (k = 1..L) at each position of the target's own continuation."""
    import torch

    from specdec_core.sampling import SamplingParams, to_probs

    target = drafter.target
    with torch.no_grad():
        out = target.model(input_ids=torch.tensor([prompt + output], device=target.device), output_hidden_states=True)
        positions = slice(len(prompt) - 1, len(prompt) + len(output) - 1)
        p_logits = out.logits[0, positions].float()
        params = SamplingParams(temperature=temperature or 1.0)
        p = to_probs(p_logits, params) if temperature else None
        decoder = target.model.get_decoder()
        rates = []
        # hidden_states[k] follows layer k; the last one is already normed (it is the target's own output).
        for k in range(1, target.num_layers + 1):
            hidden = out.hidden_states[k][0, positions]
            hidden = hidden if k == target.num_layers else decoder.norm(hidden)
            q_logits = drafter.widen(drafter.head(hidden).float())
            if temperature:
                rates.append(torch.minimum(p, to_probs(q_logits, params)).sum(-1).mean())
            else:
                rates.append((q_logits.argmax(-1) == p_logits.argmax(-1)).float().mean())
        return torch.stack(rates)


def layer_costs(drafter: LayerSkipDrafter, prompt: list[int], reps: int = 5) -> np.ndarray:
    """[L]: c(k) for k = 1..L, the median time of a k-layer draft pass over a plain step's, timed at a few k
    and interpolated (the cost is affine in k: k layers plus the embedding and output layers)."""
    import numpy as np
    import torch

    target = drafter.target
    cache, _, _ = target.prefill(prompt[:-1])
    drafter.attach(cache)
    token = torch.tensor([[prompt[-1]]])

    def median_s(run) -> float:
        times = []
        for _ in range(reps + 1):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
            cache.drop_pending()
        return statistics.median(times[1:])  # the first run warms up

    def plain_step() -> None:
        target.forward(cache, token)
        cache.commit(torch.zeros(1, 1, dtype=torch.bool, device=target.device))

    plain = median_s(plain_step)
    layers = target.num_layers
    ks = sorted({1, layers // 4, layers // 2, 3 * layers // 4, layers} - {0})
    costs = []
    for k in ks:
        drafter.k = k
        costs.append(median_s(lambda: drafter._next_logits(token)) / plain)
    return np.interp(np.arange(1, layers + 1), ks, costs)


def calibrate(config: Config, target: ModelRunner, prompts: list[list[int]], max_tokens: int, temperature: float, top: int) -> int | None:
    """The k with the best measured speedup over plain decoding, or None when no k beats it; prints a table.

    Only k's predicted to beat plain are measured, each at its predicted best gamma (fixed, so that the
    measurement shows what speculating at that k gives rather than the controller's fallback to plain).
    """
    import torch

    from specdec_core.build import build_drafter, build_engine
    from specdec_core.sampling import SamplingParams

    plain = build_engine(config, drafter="none", target=target)
    drafter = build_drafter(config, target, "layer-skip")  # with the configured vocabulary and early exit
    outputs = [decode_one(plain, p, SamplingParams(temperature=0), max_tokens, Tally()) for p in prompts]
    acceptance = torch.stack([layer_acceptance(drafter, p, o, temperature) for p, o in zip(prompts, outputs)]).mean(0)
    costs = layer_costs(drafter, prompts[0])
    predicted = {k: theory.optimal_gamma(float(acceptance[k - 1]), float(costs[k - 1]), config.speculation.gamma_max)
                 for k in range(1, target.num_layers)}
    best = [k for k in sorted(predicted, key=lambda k: predicted[k][1], reverse=True)[:top] if predicted[k][0] > 0]
    engines = {PLAIN: plain} | {
        f"k={k}": build_engine(with_overrides(config, f"layer-skip:layer_skip.k={k}:gamma={predicted[k][0]}"), target=target)
        for k in best
    }
    measured = measure(engines, prompts, max_tokens, temperature) if best else {}
    print(f"{'k':>3} {'acceptance':>10} {'c':>6} {'gamma*':>6} {'predicted':>9} {'measured':>8}")
    for k in range(1, target.num_layers):
        gamma, speedup = predicted[k]
        shown = f"{measured[f'k={k}']['speedup']:8.2f}" if f"k={k}" in measured else ""
        print(f"{k:>3} {float(acceptance[k - 1]):10.3f} {costs[k - 1]:6.3f} {gamma:>6} {speedup:9.2f} {shown}")
    winner = max(best, key=lambda k: measured[f"k={k}"]["speedup"], default=None)
    return winner if winner is not None and measured[f"k={winner}"]["speedup"] > 1.0 else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML config: the target, dtype and speculation settings")
    parser.add_argument("--drafters", help="measure these instead of calibrating: comma-separated name[:key=value...], "
                        "keys under speculation, e.g. layer-skip:layer_skip.k=20:vocab_size=32768:gamma=3")
    add_prompts_argument(parser)
    parser.add_argument("--num-prompts", type=int, default=4, help="prompts, one per category in file order")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top", type=int, default=2, help="calibration: how many of the best predicted k to measure")
    parser.add_argument("--threads", type=int, help="torch CPU threads, overriding the config's model.threads")


def run(args: argparse.Namespace) -> int:
    from specdec_core.build import build_engine
    from specdec_core.models.loading import load_runner

    config = Config.load(args.config)
    if args.threads:
        config.model.threads = args.threads
    target = load_runner(config.model.target, config.model)
    prompts = [encode(target.tokenizer, p.text) for p in stratified(load_prompts(args.prompts), args.num_prompts)]
    if args.drafters:
        specs = [s.strip() for s in args.drafters.split(",") if s.strip()]
        engines = {PLAIN: build_engine(config, drafter="none", target=target)}
        engines |= {spec: build_engine(with_overrides(config, spec), target=target) for spec in specs}
        for label, row in measure(engines, prompts, args.max_tokens, args.temperature).items():
            print(f"{label:<48} " + " ".join(f"{key} {value:.3f}" for key, value in row.items()))
        return 0
    k = calibrate(config, target, prompts, args.max_tokens, args.temperature, args.top)
    print(f"speculation:\n  layer_skip:\n    k: {k}" if k else "no k beat plain decoding: layer skip does not pay for this target")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m specdec_tools.calibrate", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))

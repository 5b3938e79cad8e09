"""What row-invariant attention costs: a target pass over k tokens with SDPA and with our kernel
(models/attention.py), interleaved in one run so that both see the same machine.

Each repetition runs, for each pass length, one pass of each kind on its own cache (same context) and rolls
the pass back but for its first token, so the contexts grow alike. The figure is the median ratio of
kernel to SDPA time per pass length; one-token passes are plain decoding's.

    python -m specdec_tools.attention_cost --config configs/default.yaml --context 300 --reps 8
"""

from __future__ import annotations

import statistics
import time

import torch
from tqdm import tqdm

from specdec_core.config import Config
from specdec_core.models import attention
from specdec_core.models.loading import load_runner

from . import measurement


def measure(config: Config, context: int, lengths: list[int], reps: int) -> dict:
    runner = load_runner(config.model.target, config.model)
    if runner.device.type != "cpu" or attention.extension() is None:
        raise SystemExit("attention_cost: the row-invariant kernel runs on the CPU, and needs g++ to build")
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, runner.vocab_size, (context,), generator=generator).tolist()
    caches = {kernel: runner.prefill(prompt)[0] for kernel in (False, True)}
    times: dict[tuple[bool, int], list[float]] = {(kernel, k): [] for kernel in (False, True) for k in lengths}
    for _ in tqdm(range(reps), desc="repetitions"):
        for k in lengths:
            ids = torch.randint(0, runner.vocab_size, (1, k), generator=generator)
            for kernel, cache in caches.items():
                start = time.perf_counter()
                runner.forward(cache, ids, row_invariant=kernel)
                times[(kernel, k)].append(time.perf_counter() - start)
                cache.commit(torch.tensor([[True] + [False] * (k - 1)]))
    return {
        "target": config.model.target, "weights": config.model.weights, "dtype": config.model.dtype,
        "row_invariant": runner.row_invariant, "context": context, "reps": reps,
        "passes": [
            {
                "k": k,
                "sdpa_ms": 1e3 * statistics.median(times[(False, k)]),
                "kernel_ms": 1e3 * statistics.median(times[(True, k)]),
                "kernel_over_sdpa": statistics.median(a / b for a, b in zip(times[(True, k)], times[(False, k)])),
            }
            for k in lengths
        ],
    }


def main(argv: list[str] | None = None) -> None:
    parser = measurement.parser(__doc__, prompts=None)
    parser.add_argument("--context", type=int, default=300, help="tokens already in the cache")
    parser.add_argument("--lengths", default="1,8", help="comma-separated pass lengths")
    parser.add_argument("--reps", type=int, default=8)
    args = parser.parse_args(argv)
    lengths = [int(k) for k in args.lengths.split(",")]
    measurement.report(measure(Config.load(args.config), args.context, lengths, args.reps), args.out, __spec__.name, argv)


if __name__ == "__main__":
    main()

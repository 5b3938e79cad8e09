"""What row-invariant attention costs: a target pass over k tokens with SDPA and with our kernel
(models/attention.py), and where the CPU has AMX-BF16 tiles with the kernel on them too, interleaved in one
run so that all see the same machine.

Each repetition runs, for each pass length, one pass of each kind on its own cache (same context) and rolls
the pass back but for its first token, so the contexts grow alike. The figures are the median ratios of
kernel (and tiles) to SDPA time per pass length; one-token passes are plain decoding's. Passes of 48 tokens
and more take the kept bf16 weights on AMX hosts with SDPA (vnni.DEQUANTIZE_ROWS_KEPT_AMX), the int8 kernel
with ours.

    python -m specdec_tools.attention_cost --config configs/default.yaml --context 300 --reps 8
"""

from __future__ import annotations

import contextlib
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
    kinds = ["sdpa", "kernel", *(["tiles"] if attention.tiles(torch.empty(1, 1, 1, runner.head_dim, dtype=runner.dtype)) else [])]
    caches = {kind: runner.prefill(prompt)[0] for kind in kinds}
    times: dict[tuple[str, int], list[float]] = {(kind, k): [] for kind in kinds for k in lengths}
    for _ in tqdm(range(reps), desc="repetitions"):
        for k in lengths:
            ids = torch.randint(0, runner.vocab_size, (1, k), generator=generator)
            for kind, cache in caches.items():
                with contextlib.nullcontext() if kind == "tiles" else attention.without_tiles():
                    start = time.perf_counter()
                    runner.forward(cache, ids, row_invariant=kind != "sdpa")
                    times[(kind, k)].append(time.perf_counter() - start)
                cache.commit(torch.tensor([[True] + [False] * (k - 1)]))
    return {
        "target": config.model.target, "weights": config.model.weights, "dtype": config.model.dtype,
        "row_invariant": runner.row_invariant, "context": context, "reps": reps,
        "passes": [
            {
                "k": k,
                **{f"{kind}_ms": 1e3 * statistics.median(times[(kind, k)]) for kind in kinds},
                **{f"{kind}_over_sdpa": statistics.median(a / b for a, b in zip(times[(kind, k)], times[("sdpa", k)]))
                   for kind in kinds[1:]},
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

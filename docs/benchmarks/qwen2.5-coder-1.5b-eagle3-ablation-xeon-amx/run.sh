#!/usr/bin/env bash
# EAGLE-3's recipe ablation, first piece (issue 68): steps against data, and the learning-rate schedule, at equal
# compute: every run takes about 190 optimizer steps of 4 sequences (the 338k point of the EPYC's learning curve:
# 12 shards x 1 epoch at lr 2e-4, 1.562). Batches cut at random (--length-window 1) as that curve's were.
# Makes the features it reads first (20 shards: the held-out set's and the training shards'), then the runs, one at a
# time and alone on the machine, then the curve with the EPYC's points beside them.
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=docs/benchmarks/qwen2.5-coder-1.5b-eagle3-ablation-xeon-amx
common=(--config configs/default.yaml --length-window 1)
schedule=(--lr 1e-3 --warmup 10 --lr-floor 0.1)
specdec train features --config configs/default.yaml --shards 20
run() { name=$1; shift; [ -f "${SPECDEC_CACHE:-$HOME/.cache/specdec}/eagle3/$name/eagle3.json" ] || specdec train eagle3 "${common[@]}" --out "$name" "$@"; }
run e3-abl-3sh-x4-lr2e-4 --shards 3 --epochs 4                         # data: 3 shards seen 4 times, the old schedule
run e3-abl-12sh-lr1e-3-w10-f0.1 --shards 12 "${schedule[@]}"           # schedule: warmup, lr 1e-3, floor
# Next, not run in the first sitting (NOTES: the runs that buy steps or make them count):
# run e3-abl-3sh-x4-lr1e-3-w10-f0.1 --shards 3 --epochs 4 "${schedule[@]}"             # data again, under that schedule
# run e3-abl-12sh-lr1e-3-w10-f0.1-b2 --shards 12 "${schedule[@]}" --batch-sequences 2  # twice the steps, equal compute
# run e3-abl-12sh-lr1e-3-w10-f0.1-frozen --shards 12 "${schedule[@]}" --frozen-head    # the target's output layer, kept
specdec train eagle3-curve e3-abl-3sh-x4-lr2e-4 e3-abl-12sh-lr1e-3-w10-f0.1 --config configs/default.yaml --out "$here" \
    --earlier docs/benchmarks/qwen2.5-coder-1.5b-eagle3-curve-epyc/learning-curve.json

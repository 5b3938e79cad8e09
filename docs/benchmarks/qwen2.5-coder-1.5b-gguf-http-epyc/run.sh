#!/bin/bash
# specdec against llama-server over HTTP, the same GGUF files and 2 threads, each server loaded in turn:
#   bash run.sh [OUT] [LLAMA_CPP_DIR]
# first turns (20 Spec-Bench prompts, 1 user), code edits (8, 1 user), then 1, 4 and 8 users against llama-server
# with 8 slots, each level with prompts no earlier level sent. Needs `specdec pull qwen2.5-coder-1.5b
# qwen2.5-coder-0.5b` and llama.cpp's tools (python -m specdec_tools.bench.llama_cpp build LLAMA_CPP_DIR).
# Nothing else should run meanwhile: 2 cores.
set -euo pipefail
OUT=${1:-bench-out/http}; LLAMA=${2:-/work/llama-native}/bin/llama-server
G=${SPECDEC_CACHE:-$HOME/.cache/specdec}/gguf
T=$G/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf D=$G/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
mkdir -p "$OUT"
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
up() { for _ in $(seq 600); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return; sleep 1; done; exit 1; }
warm() { curl -s "http://127.0.0.1:$1/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model": "m", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}' >/dev/null; }
llama() { local port=$1 slots=$2; shift 2
  "$LLAMA" -m "$T" -t 2 -c 16384 -np "$slots" --host 127.0.0.1 --port "$port" "$@" >"$OUT/llama-$port.log" 2>&1 & }
specdec serve --config configs/default.yaml --port 8000 >"$OUT/specdec.log" 2>&1 &
llama 8001 1; llama 8002 1 --spec-type ngram-mod; llama 8003 1 --spec-type draft-simple -md "$D"
for port in 8000 8001 8002 8003; do up $port; warm $port; done
python -m loadtest --url specdec=http://127.0.0.1:8000 --url llama=http://127.0.0.1:8001 \
  --url llama-ngram-mod=http://127.0.0.1:8002 --url llama-draft=http://127.0.0.1:8003 --baseline llama \
  --concurrency 1 --requests 20 --max-tokens 128 --out "$OUT/first-turns"
python -m loadtest --url specdec=http://127.0.0.1:8000 --url llama-ngram-mod=http://127.0.0.1:8002 \
  --url llama-draft=http://127.0.0.1:8003 --baseline llama-ngram-mod --workload code-edit \
  --concurrency 1 --requests 8 --max-tokens 512 --out "$OUT/code-edit"
kill %2 %3 %4; wait %2 %3 %4 2>/dev/null || true
llama 8012 8 --spec-type ngram-mod; llama 8013 8 --spec-type draft-simple -md "$D"
for port in 8012 8013; do up $port; warm $port; done
python -m loadtest --url specdec=http://127.0.0.1:8000 --url llama-8-ngram-mod=http://127.0.0.1:8012 \
  --url llama-8-draft=http://127.0.0.1:8013 --baseline llama-8-ngram-mod --prompt-offset 20 \
  --concurrency 1,4,8 --requests 16 --max-tokens 128 --out "$OUT/users"

#!/bin/bash
# The EPYC run's script (specdec against llama-server over HTTP) on a Xeon Ice Lake (AVX-512 VNNI, no bf16, no AMX),
# its results written here: bash run.sh [OUT] [LLAMA_CPP_DIR]
here=$(dirname "$0")
exec bash "$here/../qwen2.5-coder-1.5b-gguf-http-epyc/run.sh" "${1:-$here}" "${2:-/work/llama-native}"

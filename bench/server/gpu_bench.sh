#!/usr/bin/env bash
# Run the server benchmark on a borrowed GPU machine: the repo is copied there, the model folder
# is carried in at $MODEL_DIR, results go to $OUT. Everything is bounded by hard timeouts.
#   MODEL_DIR=... OUT=... bash bench/server/gpu_bench.sh [extra gpu_bench.py flags]
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${MODEL_DIR:?set MODEL_DIR to the model folder}"
: "${OUT:=bench/results}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/server:$PWD/contract:$PWD/testkit:$PWD/bench/server${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true) >"$OUT/gpu_info.txt" 2>&1
timeout -k 10 470 python3 bench/server/gpu_bench.py --model "$MODEL_DIR" --out "$OUT" "$@" \
  2>&1 | tee "$OUT/gpu_bench_stdout.txt"

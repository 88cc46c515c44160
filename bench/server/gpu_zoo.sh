#!/usr/bin/env bash
# Every zoo family on a borrowed GPU (bench/server/gpu_zoo.py): its pass, its CUDA graphs and
# its vectors against sentence-transformers; results go to $OUT. Bounded by a hard timeout.
#   OUT=... bash bench/server/gpu_zoo.sh [extra gpu_zoo.py flags]
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:=bench/results}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/server:$PWD/contract:$PWD/testkit${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
timeout -k 10 470 python3 bench/server/gpu_zoo.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_zoo_stdout.txt"

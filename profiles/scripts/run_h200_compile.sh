#!/usr/bin/env bash
# H200: CUDA-graph capture self-check, and eager vs compiled (no CUDA graphs yet) decode speed.
set -u
export PYTHONPATH=~/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=~/m/model.gguf
run() { local name=$1 secs=$2; shift 2; echo "== $name"
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"; tail -12 "$OUT/$name.log"; }
[ "${SKIP_SELFCHECK:-0}" = 1 ] || run capture_selfcheck 90 python3 -m capture.selfcheck_cuda
run bench_compile 330 python3 -m compiled_spec.cli bench --model "$M" --prompts .device/data/question.jsonl \
  --device cuda --dtype bfloat16 --num-prompts 2 --max-tokens 128 --random-draft eagle3 --method eagle3 \
  -k 3 --compile --no-hf --out "$OUT/bench_compile.json"

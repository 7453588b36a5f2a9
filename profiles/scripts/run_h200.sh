#!/usr/bin/env bash
# Measurements on the lent H200 (see README "Measured"). Expects the SmolLM2 GGUF at ~/m/model.gguf
# and the gguf wheel installed in ~/site (the two-call protocol in the project brief).
set -u
export PYTHONPATH=~/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=~/m/model.gguf
P=.device/data/question.jsonl
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> "$OUT/gpu.txt"
run() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  echo "== $name" | tee -a "$OUT/summary.txt"
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"
  tail -6 "$OUT/$name.log" | tee -a "$OUT/summary.txt"
}
run kernels 150 python3 -m kernels.bench_attention
run bench_bf16 300 python3 -m compiled_spec.cli bench --model "$M" --prompts "$P" --device cuda \
  --dtype bfloat16 --num-prompts 4 --max-tokens 256 --random-draft eagle3 --method eagle3 -k 3 \
  --out "$OUT/bench_bf16.json"
run bench_fp32 240 python3 -m compiled_spec.cli bench --model "$M" --prompts "$P" --device cuda \
  --dtype float32 --num-prompts 4 --max-tokens 64 --random-draft eagle3 --method eagle3 -k 3 \
  --out "$OUT/bench_fp32.json"

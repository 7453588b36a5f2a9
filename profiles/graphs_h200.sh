#!/usr/bin/env bash
# Issue 4's H200 figures: bash profiles/graphs_h200.sh smollm2|llama8b (after the setup call of
# the device protocol; ~/m/model.gguf is assembled here when missing).
set -u
export PYTHONPATH=~/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=~/m/model.gguf
[ -f "$M" ] || cat ~/m/part0 .device/p1/part1 > "$M"
SHAPE=${1:?smollm2|llama8b}
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv > "$OUT/gpu_$SHAPE.txt"
if [ "$SHAPE" = smollm2 ]; then
  ARGS=(--model "$M" --draft smollm2-eagle3 --e2e 10 --max-tokens 128)
else
  ARGS=()
fi
timeout 540 python3 profiles/graphs_h200.py --shape "$SHAPE" --tokenizer "$M" "${ARGS[@]}" \
  --out "$OUT/graphs_$SHAPE.json" > "$OUT/graphs_$SHAPE.log" 2>&1
echo "rc=$?"
grep -vE "Warning|warn\(|^\s*$|tokeniz" "$OUT/graphs_$SHAPE.log" | tail -60

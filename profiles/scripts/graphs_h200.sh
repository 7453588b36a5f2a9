#!/usr/bin/env bash
# Issue 4's H200 figures: bash profiles/scripts/graphs_h200.sh smollm2|llama8b. The GGUF travels in three
# parts (the tree with the shipped head plus half the GGUF is over one call's 64 MiB): call 1
# carries .device/q0 + .device/whl and installs, call 2 carries .device/q1, call 3 .device/q2.
set -u
export PYTHONPATH=~/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=~/m/model.gguf
[ -f "$M" ] || cat ~/m/part0 ~/m/part1 .device/q2/part2 > "$M"
SHAPE=${1:?smollm2|llama8b}
shift
EXTRA=("$@")  # e.g. --skip-eager
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv > "$OUT/gpu_$SHAPE.txt"
if [ "$SHAPE" = smollm2 ]; then
  ARGS=(--model "$M" --draft smollm2-eagle3 --e2e ${E2E:-10} --max-tokens 128)
else
  ARGS=()
fi
timeout ${LIMIT:-540} python3 profiles/scripts/graphs_h200.py --shape "$SHAPE" --tokenizer "$M" "${ARGS[@]}" "${EXTRA[@]}" \
  --out "$OUT/graphs_$SHAPE.json" > "$OUT/graphs_$SHAPE.log" 2>&1
echo "rc=$?"
grep -vE "Warning|warn\(|^\s*$|tokeniz" "$OUT/graphs_$SHAPE.log" | tail -60

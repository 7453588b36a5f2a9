#!/usr/bin/env bash
# One device call (after the GGUF setup calls of profiles/scripts/graphs_h200.sh), each section with its
# own time limit, logs in $OUT:
#   1. issue 4: component latencies + kernel profile + end to end (graphs_h200.py, SmolLM2)
#   2. issue 5: head accuracy teacher-forced vs in the engine, on the GPU (head_gap_cpu.py)
#   3. issue 7: tree CUDA graphs replay == eager == vanilla (fp32 tiny pair in .device/tc)
#   4. issue 7: chain vs trees, compiled + graphs, SmolLM2 (trees_h200.py)
set -u
export PYTHONPATH=~/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=~/m/model.gguf
[ -f "$M" ] || cat ~/m/part0 ~/m/part1 .device/q2/part2 > "$M"
E2E=5 LIMIT=170 bash profiles/scripts/graphs_h200.sh smollm2 --skip-eager > "$OUT/s1.txt" 2>&1
echo "graphs: $(grep -m1 "^rc=" "$OUT/s1.txt")"
timeout 100 python3 profiles/scripts/head_gap_cpu.py --model "$M" --device cuda --dtype bfloat16 \
  --set heldout --num-prompts 16 --max-tokens 128 --k-list 1 --trainer-eval 64 \
  --prompts .device/data/question.jsonl --train-prompts .device/data/train_prompts.jsonl \
  > "$OUT/head_gap_gpu.log" 2>&1; echo "head_gap rc $?"
timeout 130 python3 .device/tc/gpu_tree.py > "$OUT/gpu_tree.log" 2>&1; echo "gpu_tree rc $?"
timeout 170 python3 profiles/scripts/trees_h200.py --model "$M" --prompts .device/data/question.jsonl \
  --num-prompts 5 --max-tokens 128 --out "$OUT/trees.json" \
  --configs chain_k5 tree_topk8_steps5_32 tree_topk8_steps5_32_page1 > "$OUT/trees.log" 2>&1
echo "trees rc $?"
for f in head_gap_gpu gpu_tree trees; do echo "== $f"; grep -vE "Warning|warn\(|^\s*$|it/s\]" "$OUT/$f.log" | tail -12; done

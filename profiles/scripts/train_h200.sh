#!/usr/bin/env bash
# Train the shipped EAGLE-3 head for SmolLM2-135M-Instruct on the H200 (after the GGUF setup
# calls described in profiles/scripts/graphs_h200.sh; CODE may point at a frozen copy of the repo):
#   bash profiles/scripts/train_h200.sh data    # self-distil all training prompts (resumable)
#   bash profiles/scripts/train_h200.sh train   # finish the data if cut short, train, measure, export
# INIT=smollm2-eagle3 continues from the shipped head (--init-from) instead of from scratch.
set -u
PHASE=${1:?data|train}
CODE=${CODE:-$PWD}
export PYTHONPATH=~/site:$CODE PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=~/m/model.gguf
[ -f "$M" ] || cat ~/m/part0 ~/m/part1 .device/q2/part2 > "$M"
DATA=$PWD/.device/data
TRAIN=(python3 -m compiled_spec.cli train --target "$M" --prompts "$DATA/train_prompts.jsonl"
  --out ~/head --draft-vocab-size 8192 --temperatures 0 0.8 --val-prompts 256
  --max-new-tokens 256 --max-seq-len 768 --gen-batch-size 1024
  --epochs 3 --batch-size 32 --lr 6e-4 --warmup-steps 100 --ttt-steps 5
  --dtype bfloat16 --save-every 500 --eval-every 300 --log-every 20
  ${INIT:+--init-from $INIT})
cd "$CODE"
if [ "$PHASE" = data ]; then
  nvidia-smi --query-gpu=name,memory.used --format=csv
  ( time timeout 540 "${TRAIN[@]}" --data-only ) > "$OUT/data.log" 2>&1
  tail -c 1500 "$OUT/data.log"; wc -l ~/head/*.jsonl
  exit 0
fi
( time timeout 400 "${TRAIN[@]}" ) > "$OUT/run.log" 2>&1
tail -c 2500 "$OUT/run.log"
HEAD=~/head/best; [ -f $HEAD/config.json ] || HEAD=~/head
cat $HEAD/best.json 2>/dev/null; echo
cp ~/head/train_log.jsonl ~/head/train_curves.png "$OUT/" 2>/dev/null
python3 -m compiled_spec.cli export-head $HEAD "$OUT/head" --dtype bfloat16 --max-shard-mb 15
ACC=(python3 -m compiled_spec.cli acceptance --model "$M" --device cuda --dtype bfloat16
  --max-model-len 2048)
# MT-bench (the evaluation set) with the exported bf16 head, as shipped.
timeout 120 "${ACC[@]}" --draft "$OUT/head" --prompts "$DATA/question.jsonl" --num-prompts 80 \
  --max-tokens 256 --k-list 3 5 7 --out "$OUT/acceptance.json" >> "$OUT/run.log" 2>&1
# The logged held-out accuracy vs what the shipped head reaches (third session: 0.64 logged,
# 0.52 re-measured): the head as trained (fp32) and as exported (bf16) on the trainer's own
# val.jsonl, then the exported head on freshly generated held-out responses.
for H in $HEAD "$OUT/head"; do
  timeout 90 python3 profiles/scripts/eval_head_val.py --model "$M" --head "$H" --val ~/head/val.jsonl \
    >> "$OUT/run.log" 2>&1
done
timeout 120 python3 profiles/scripts/head_gap_cpu.py --model "$M" --device cuda --dtype bfloat16 \
  --draft "$OUT/head" --set heldout --num-prompts 8 --max-tokens 64 --k-list 1 \
  --trainer-eval 64 --prompts "$DATA/question.jsonl" \
  --train-prompts "$DATA/train_prompts.jsonl" >> "$OUT/run.log" 2>&1
# Diagnosis: held-out training prompts and prompts trained on (over- vs under-fitting).
python3 - "$DATA/train_prompts.jsonl" <<'PY'
import json, os, sys
rows = {str(json.loads(l).get("id")): json.loads(l) for l in open(sys.argv[1])}
val = [json.loads(l)["id"] for l in open(os.path.expanduser("~/head/val.jsonl"))][:40]
trn = [i for i in (json.loads(l)["id"] for l in open(os.path.expanduser("~/head/data.jsonl"))) if "#" not in i][:40]
for name, ids in (("val", val), ("trained", trn)):
    with open(f"/tmp/{name}_prompts.jsonl", "w") as f:
        for i in ids:
            f.write(json.dumps({"prompt": rows[i]["prompt"]}) + "\n")
PY
for s in val trained; do
  echo "== $s prompts" >> "$OUT/run.log"
  timeout 60 "${ACC[@]}" --draft "$OUT/head" --prompts /tmp/${s}_prompts.jsonl --num-prompts 40 \
    --max-tokens 256 --k-list 5 >> "$OUT/run.log" 2>&1
done
grep -E "k=|==|tau|val_acc" "$OUT/run.log" | tail -24

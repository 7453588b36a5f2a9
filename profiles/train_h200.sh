#!/usr/bin/env bash
# Train the shipped EAGLE-3 head for SmolLM2-135M-Instruct on the H200, then measure its acceptance
# on MT-bench. Expects ~/m/model.gguf and the gguf wheel in ~/site (the two-call protocol).
set -u
export PYTHONPATH=~/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=~/m/model.gguf
# A shuffled subset of the training prompts (never MT-bench).
python3 - <<'PY'
import json, random
rows = [json.loads(l) for l in open(".device/data/train_prompts.jsonl")]
random.Random(0).shuffle(rows)
with open("/tmp/prompts.jsonl", "w") as f:
    for r in rows[:4000]:
        f.write(json.dumps(r) + "\n")
PY
rm -rf ~/head
( time timeout 420 python3 -m compiled_spec.cli train --target "$M" --prompts /tmp/prompts.jsonl \
    --out ~/head --draft-vocab-size 8192 --num-prompts 4000 --max-new-tokens 256 --max-seq-len 768 \
    --gen-batch-size 256 --steps 2000 --batch-size 32 --lr 6e-4 --warmup-steps 100 --ttt-steps 5 \
    --dtype bfloat16 --save-every 500 --log-every 20 ) > "$OUT/train.log" 2>&1
tail -5 "$OUT/train.log"
python3 - <<'PY'
# Ship the head as two safetensors shards (each under the transfer limit), with an index.
import json, os
from safetensors.torch import load_file, save_file
d = os.path.expanduser("~/head"); out = os.environ.get("OUT", "/tmp/out")
sd = load_file(f"{d}/model.safetensors")
keys = sorted(sd, key=lambda k: -sd[k].numel())
shards, sizes = [{}, {}], [0, 0]
for k in keys:
    i = 0 if sizes[0] <= sizes[1] else 1
    shards[i][k] = sd[k]; sizes[i] += sd[k].numel() * sd[k].element_size()
names = [f"model-0000{i+1}-of-00002.safetensors" for i in range(2)]
wm = {}
for name, sh in zip(names, shards):
    save_file(sh, f"{out}/{name}", metadata={"format": "pt"})
    wm.update({k: name for k in sh})
json.dump({"metadata": {"total_size": sum(sizes)}, "weight_map": wm}, open(f"{out}/model.safetensors.index.json", "w"), indent=1)
os.system(f"cp {d}/config.json {d}/train_log.jsonl {out}/; cp {d}/train_curves.png {out}/ 2>/dev/null")
print("shards", sizes)
PY
timeout 240 python3 -m compiled_spec.cli acceptance --model "$M" --draft ~/head --device cuda \
  --dtype bfloat16 --prompts .device/data/question.jsonl --num-prompts 80 --max-tokens 256 \
  --k-list 3 5 7 --max-model-len 2048 --out "$OUT/acceptance.json" > "$OUT/acceptance.log" 2>&1
grep "k=" "$OUT/acceptance.log"; tail -3 "$OUT/acceptance.log"

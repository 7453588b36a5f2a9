"""The fused decoder layer (``--skinny-gemm --skinny-gemm-layer``) end to end with its Triton
kernels actually running: on the CPU under the Triton interpreter (in a subprocess; the ops
are made to take their kernels for CPU tensors, as they do for CUDA ones), a vanilla and an
EAGLE engine over tiny Llamas whose head_dim (32) the qkv + rope kernel takes, with emulated
CUDA graphs: one whose output depends on its attention (vanilla), one whose next token depends
on the current one alone, so that a mirror EAGLE-1 head drafts some tokens right (speculative,
as a chain and as a draft tree: the fusions are on by default on CUDA, trees included).
In fp32 each must write its default engine's greedy output token for token, and the speculative
engine must accept exactly as many drafts as without the fusions: the kernels only reorder fp32
sums. (On the H200 the fusions moved bf16 tau by ~10%; this pins down that the
fused kernels themselves change neither output nor acceptance.) The same again with the
draft's callables fused too (``skinny_gemm_draft``), with the mirror head and with an EAGLE-3
head, whose layer 0 projects 2h-wide inputs."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

PROMPTS = [[3, 7, 1], [5], [9, 2, 4, 4, 8, 1, 2]]
K = 3
# Interpreted kernels are slow (an engine with the draft's callables fused spent 300 s on 10
# tokens a prompt, forty-first session): few tokens, one captured batch size (the three
# prompts decode together, padded to 4), still enough for drafts to be accepted.
MAX_TOKENS = 4


def _worker(root: str, tok: str) -> None:
    import torch

    import kernels.gemm_ops as ops
    import kernels.qkv_rope_triton as qkv_mod
    import kernels.skinny_gemm_triton as gemm_mod
    from capture import CapturePolicy
    from compiled_spec import LLM, SamplingParams
    from compiled_spec.compile import CompileConfig, capture_graphs, compile_models
    from tests.spec_models import write_bigram_target, write_mirror_eagle1

    from compiled_spec.draft.testing import write_eagle3_head
    from compiled_spec.models.loader import read_model_config

    attn_target = write_bigram_target(Path(root) / "a", vocab=64, hidden=128, layers=2,
                                      attention=True)
    target = write_bigram_target(Path(root) / "t", vocab=64, hidden=128, layers=2)
    head = write_mirror_eagle1(Path(root) / "d", target, noise=0.3)
    # EAGLE-3's layer 0 projects 2h-wide inputs (q/k/v of [256 -> 256] here): its shapes, not
    # its acceptance (random weights), are what the draft's fused kernels meet
    head3 = write_eagle3_head(str(Path(root) / "e3"), read_model_config(target),
                              draft_vocab_size=48, aux_layer_ids=(0, 1, 2))
    calls = {"gemm": 0, "qkv": 0}
    weights: set[int] = set()  # the fused GEMMs' distinct weights (this engine's)

    def counted(fn, key):
        def wrap(*a, **kw):
            calls[key] += 1
            if key == "gemm":
                weights.add(a[1].data_ptr())
            return fn(*a, **kw)
        return wrap

    ops_gemm, ops_qkv = gemm_mod.skinny_gemm_triton, qkv_mod.qkv_rope_write_kv_triton
    gemm_mod.skinny_gemm_triton = counted(ops_gemm, "gemm")
    qkv_mod.qkv_rope_write_kv_triton = counted(ops_qkv, "qkv")
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    out: dict = {}
    # default; the target's layer fused; the draft's callables fused too (skinny_gemm_draft)
    for mode in ("default", "fused", "fused_draft"):
        fused = mode != "default"
        ops._skinny = (lambda x: x.shape[0] <= 64) if fused else (lambda x: False)
        cfg = CompileConfig(inductor=False, skinny_gemm=fused, skinny_gemm_layer=fused,
                            skinny_gemm_draft=mode == "fused_draft")
        # (no vanilla with the draft fused: the same engine as "fused"; no chain with the target
        # alone fused: "fused_draft"'s chain fuses that target too, and the tree checks a draft
        # left unfused; EAGLE-3 and trees with the draft fused in one mode each: the
        # interpreted kernels cost ~1 min an engine; the tree's fused expansion is
        # tests/test_skinny_draft.py's, on the reference ops)
        kinds = {"default": ("vanilla", "spec", "tree", "spec3"),
                 "fused": ("vanilla", "tree"),
                 "fused_draft": ("spec", "spec3")}[mode]
        for kind in kinds:
            at_start = dict(calls)
            weights.clear()
            draft = {"vanilla": None, "spec3": head3}.get(kind, head)
            extra = {} if draft is None else {"num_speculative_tokens": K}
            if kind == "tree":  # a draft tree verifies 6 nodes a request (tree attention)
                extra.update(speculative_topk=2, speculative_num_draft_tokens=6)
            llm = LLM(model=target if draft else attn_target, tokenizer=tok, draft=draft,
                      max_model_len=128, max_num_seqs=4, dtype="float32", **extra)
            models = compile_models(llm.engine.runner, cfg)
            llm._compiled = models
            spec = llm.config.spec
            policy = CapturePolicy(max_batch_size=4, num_speculative_tokens=0 if spec is None
                                   else spec.num_speculative_tokens,
                                   max_model_len=128, batch_sizes=(4,),
                                   seq_len_buckets=(128,))
            capture_graphs(llm.engine.runner, models, policy, llm.config.cache.page_size,
                           emulate=True)
            res = llm.generate(PROMPTS, sp, use_tqdm=False)
            name = f"{mode}_{kind}"
            out[name] = {"ids": [o.outputs[0].token_ids for o in res],
                         "tau": llm.stats.spec.mean_acceptance_length if draft else None,
                         "matches": models.backends["target"].match_counts,
                         "draft_matches": {n: b.match_counts.get("SkinnyGemmFusion", 0)
                                           for n, b in models.backends.items()
                                           if n != "target"},
                         "draft_fused": models.stats()["skinny_gemm"]["draft"],
                         # the fused kernels this engine ran (capture and requests)
                         "calls": {k: calls[k] - at_start[k] for k in calls},
                         "gemm_weights": len(weights)}
    out["calls"] = calls
    print("RESULTS " + json.dumps(out, default=str))


@pytest.mark.heavy
def test_fused_layer_kernels_change_neither_output_nor_acceptance(tmp_path,
                                                                  smollm2_gguf_path) -> None:
    from tests.triton_interpret import run_interpreted

    res = run_interpreted(__file__, flag=f"--worker={tmp_path}::{smollm2_gguf_path}",
                          timeout=900)
    for kind in ("vanilla", "spec", "tree", "spec3"):
        want = res[f"default_{kind}"]["ids"]
        assert len(want) == len(PROMPTS) and all(len(ids) == MAX_TOKENS for ids in want)
        for mode in ("fused", "fused_draft"):
            if f"{mode}_{kind}" in res:
                assert res[f"{mode}_{kind}"]["ids"] == want, (mode, kind)
    assert {k for k in res if k.startswith("fused")} >= {
        "fused_vanilla", "fused_tree", "fused_draft_spec", "fused_draft_spec3"}
    assert res["default_tree"]["ids"] == res["default_spec"]["ids"]  # the same target
    assert res["default_spec3"]["ids"] == res["default_spec"]["ids"]
    # some drafts accepted, exactly as many with the fusions
    assert res["fused_tree"]["tau"] == res["default_tree"]["tau"] > 1.0, res
    assert res["fused_draft_spec"]["tau"] == res["default_spec"]["tau"] > 1.0, res
    assert res["fused_draft_spec3"]["tau"] == res["default_spec3"]["tau"], res
    # skinny_gemm_draft: the pass placed fused ops in the draft's callables too (the chain's
    # first pass and step + pick), and their kernels ran beyond the target's; without it the
    # draft has none
    for kind in ("spec", "spec3"):
        assert res[f"fused_draft_{kind}"]["draft_fused"] is True
        assert res[f"fused_draft_{kind}"]["draft_matches"]["draft_first_pass"] > 0, res
        assert res[f"fused_draft_{kind}"]["draft_matches"]["draft_step_pick"] > 0, res
    assert res["fused_tree"]["draft_fused"] is False
    assert sum(res["fused_tree"]["draft_matches"].values()) == 0, res
    # the draft's kernels ran on top of the target's: over more weights than the same target's
    # alone (the tree's draft is not fused)
    assert res["fused_draft_spec"]["gemm_weights"] > res["fused_tree"]["gemm_weights"] > 0, res
    assert res["default_spec"]["calls"]["gemm"] == 0  # (the default engine: none)
    # the pass placed the fused ops (2 layers: qkv, o_proj, gate_up, down each, in every
    # target graph) and their kernels ran: decode and verify steps (<= 64 rows)
    for kind in ("vanilla", "tree"):
        n = res[f"fused_{kind}"]["matches"]["SkinnyGemmFusion"]
        assert n > 0 and n % 8 == 0, kind
    assert res["default_vanilla"]["matches"].get("SkinnyGemmFusion", 0) == 0
    assert res["calls"]["qkv"] > 0 and res["calls"]["gemm"] > 3 * res["calls"]["qkv"] - 1


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        if arg.startswith("--worker="):
            root, tok = arg[len("--worker="):].split("::")
            _worker(root, tok)

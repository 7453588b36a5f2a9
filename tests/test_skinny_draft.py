"""CompileConfig.skinny_gemm_draft: the target's fusions (passes/skinny_gemm.py) placed in the
draft's compiled callables too. Here on the reference ops (CPU, Triton kernels not taken), so
what is checked is where the pass matched and that the engine's tokens and acceptance stay
those of the default engine; tests/test_skinny_layer_engine.py runs the kernels themselves
(interpreted) for chains."""
from __future__ import annotations

from pathlib import Path

import pytest

from compiled_spec.compile import CompileConfig


def test_config_needs_the_targets_fusions() -> None:
    # None: whenever the target's fusions are on (on by default since the H100's A/B)
    assert CompileConfig().skinny_gemm_draft is None
    CompileConfig(skinny_gemm_draft=True)  # with skinny_gemm None: as the target resolves
    with pytest.raises(ValueError, match="skinny_gemm_draft=True needs skinny_gemm"):
        CompileConfig(skinny_gemm=False, skinny_gemm_draft=True)
    with pytest.raises(ValueError, match="skinny_gemm_draft=1"):
        CompileConfig(skinny_gemm_draft=1)  # type: ignore[arg-type]


def test_tree_and_chain_drafts_take_the_fusions(tmp_path: Path, smollm2_gguf_path) -> None:
    from compiled_spec import LLM, SamplingParams
    from compiled_spec.compile import compile_models, use_compiled
    from compiled_spec.draft.testing import write_eagle3_head
    from compiled_spec.models.loader import read_model_config
    from tests.spec_models import write_bigram_target

    target = write_bigram_target(tmp_path / "t", vocab=64, hidden=32, layers=2)
    head = write_eagle3_head(str(tmp_path / "e3"), read_model_config(target),
                             draft_vocab_size=48, aux_layer_ids=(0, 1, 2))
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got = {}
    # None (the default): as True wherever the target's fusions are on
    for tree, draft_fused in ((False, False), (False, True), (False, None), (True, False),
                              (True, True)):
        extra = {"speculative_topk": 2, "speculative_num_draft_tokens": 6} if tree else {}
        llm = LLM(model=target, tokenizer=smollm2_gguf_path, draft=head, max_model_len=64,
                  max_num_seqs=2, dtype="float32", num_speculative_tokens=2, **extra)
        models = compile_models(llm.engine.runner, CompileConfig(
            inductor=False, skinny_gemm=True, skinny_gemm_layer=True,
            skinny_gemm_draft=draft_fused))
        llm._compiled = models
        use_compiled(llm.engine.runner, models, True)
        ids = [o.outputs[0].token_ids for o in llm.generate([[3, 7, 1], [5]], sp,
                                                            use_tqdm=False)]
        stats = models.stats()
        matches = {n: s["pass_matches"].get("SkinnyGemmFusion", 0)
                   for n, s in stats.items() if isinstance(s, dict) and "pass_matches" in s}
        got[tree, draft_fused] = (ids, llm.stats.spec.mean_acceptance_length)
        assert stats["skinny_gemm"]["draft"] is (draft_fused is not False)
        assert matches["target"] > 0
        drafted = [n for n in matches if n != "target" and matches[n]]
        if draft_fused is False:
            assert drafted == [], matches
        elif tree:  # the expansion step: qkv + rope + KV write, gate_up, a residual
            assert matches["tree_step"] > 0 and matches["draft_first_pass"] > 0, matches
        else:  # first pass and step + pick: qkv, o_proj, gate_up, down each
            assert matches["draft_first_pass"] == matches["draft_step_pick"] == 4, matches
    for tree in (False, True):
        assert got[tree, True] == got[tree, False]
    assert got[False, None] == got[False, True]

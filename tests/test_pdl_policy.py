"""Whether an engine launches with PDL by default (compiled_spec/pdl_policy.py): on only where
the H200 measured it faster (Hopper or newer, the fused layer, calls within 64 rows: every call
of an engine whose widest decode call is that narrow, else its narrow calls through a second
target compile); an explicit setting wins; the engine reports its choice and the widest call
it read."""
from __future__ import annotations

import pytest
import torch

from compiled_spec.pdl_policy import PDL_MAX_WEIGHT, pdl_auto, resolve_pdl
from kernels.dispatch import PDL_MAX_ROWS

H200 = (9, 0)


@pytest.mark.parametrize("device, cap, inductor, fused, rows, on, says", [
    ("cuda", H200, True, True, 1, True, "auto: on"),
    ("cuda", H200, True, True, 6, True, "auto: on"),  # EAGLE-3 k=5 at batch 1
    ("cuda", H200, True, True, PDL_MAX_ROWS, True, "auto: on"),
    ("cuda", H200, True, True, PDL_MAX_ROWS + 1, False, "rows >"),
    ("cuda", H200, True, True, 96, False, "rows >"),  # EAGLE-3 k=5 at batch 16: slower
    ("cuda", H200, True, False, 1, False, "without the fused layer"),  # the 8B shape
    ("cuda", H200, False, True, 1, False, "no triton.enable_pdl"),
    ("cuda", (8, 0), True, True, 1, False, "Hopper"),
    ("cuda", H200, True, True, None, False, "not known"),
    ("cpu", None, True, True, 1, False, "auto: off on cpu"),
])
def test_auto_rule(device, cap, inductor, fused, rows, on, says) -> None:
    got = pdl_auto(device, cap, inductor, fused, rows)
    assert got.on is on and says in got.why
    assert got.why.startswith("auto: on" if on else "auto: off")


@pytest.mark.parametrize("weight, on", [(2 * 1536 * 576, True), (PDL_MAX_WEIGHT, True),
                                        (PDL_MAX_WEIGHT + 1, False), (4096 * 4096, False)])
def test_large_layer_weights_go_without(weight, on) -> None:
    """SmolLM2's fused layer (1.8M-element weights) gained with PDL, the 8B shape's (16.8M and
    up) lost, narrow engine or wide; an explicit pdl=True still wins."""
    for rows, narrow in ((1, False), (384, True)):
        got = pdl_auto("cuda", H200, True, True, rows, narrow=narrow, largest_weight=weight)
        assert got.on is on, (weight, rows, got)
        if not on:
            assert "largest layer weight" in got.why and str(weight) in got.why
    cpu = torch.device("cpu")
    assert resolve_pdl(True, cpu, True, 1, largest_weight=4096 * 4096).on is True


@pytest.mark.parametrize("rows, max_rows", [(1, None), (PDL_MAX_ROWS, None),
                                             (PDL_MAX_ROWS + 1, PDL_MAX_ROWS), (384, PDL_MAX_ROWS)])
def test_auto_narrow_calls_of_a_wide_engine(rows, max_rows) -> None:
    """With pdl_narrow left on, a wide engine keeps PDL for its calls of at most PDL_MAX_ROWS
    rows (a second target compile); a narrow engine has it everywhere."""
    got = pdl_auto("cuda", H200, True, True, rows, narrow=True)
    assert got.on is True and got.max_rows == max_rows
    if max_rows is not None:
        assert f"<= {PDL_MAX_ROWS} rows" in got.why and str(rows) in got.why
    # everything that turns PDL off still does
    assert pdl_auto("cuda", (8, 0), True, True, rows, narrow=True).on is False
    assert pdl_auto("cuda", H200, True, False, rows, narrow=True).on is False
    assert pdl_auto("cpu", None, True, True, rows, narrow=True).on is False


def test_narrow_resolution() -> None:
    cpu = torch.device("cpu")
    assert resolve_pdl(None, cpu, True, 384, None).on is False  # auto: not on the CPU
    forced = resolve_pdl(True, cpu, True, 384, True)  # what the CPU tests use
    assert forced.on and forced.max_rows == PDL_MAX_ROWS
    assert resolve_pdl(True, cpu, True, 8, True).max_rows is None  # nothing wide to split
    assert resolve_pdl(True, cpu, True, 384, None).max_rows is None  # pdl=True alone: all
    assert resolve_pdl(False, cpu, True, 384, True).on is False
    from compiled_spec.compile import CompileConfig

    with pytest.raises(ValueError, match="pdl_narrow=True needs pdl"):
        CompileConfig(pdl=False, pdl_narrow=True)
    with pytest.raises(ValueError, match=r"CompileConfig.pdl_narrow=1"):
        CompileConfig(pdl_narrow=1)  # type: ignore[arg-type]


def test_explicit_setting_wins() -> None:
    cpu = torch.device("cpu")
    assert resolve_pdl(True, cpu, False, 10_000).on is True
    assert resolve_pdl(False, cpu, True, 1).why == "set: pdl=False"
    assert resolve_pdl(None, cpu, True, 1).on is False


def test_config_rejects_a_non_bool() -> None:
    from compiled_spec.compile import CompileConfig

    assert CompileConfig().pdl is None
    with pytest.raises(ValueError, match=r"CompileConfig.pdl='yes'"):
        CompileConfig(pdl="yes")


@pytest.mark.parametrize("spec, per_request, draft_per_request", [
    ({}, 1, None),
    ({"num_speculative_tokens": 5}, 6, 6),
    ({"num_speculative_tokens": 3, "speculative_topk": 4, "speculative_num_draft_tokens": 10},
     10, 4),  # first pass 1 + 3 rows, expansions 4
    ({"num_speculative_tokens": 2, "speculative_topk": 8, "speculative_num_draft_tokens": 20},
     20, 8),  # expansions 8 rows, first pass 3
])
def test_engine_reads_its_widest_decode_call(tmp_path, smollm2_gguf_path, bigram_eagle3, spec,
                                             per_request, draft_per_request) -> None:
    from compiled_spec import LLM
    from compiled_spec.compile import CompileConfig, compile_models
    from compiled_spec.llm_compile import max_decode_rows, max_draft_rows

    target, head = bigram_eagle3
    kw = {"draft": head, **spec} if spec else {}
    llm = LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=64, max_num_seqs=3,
              dtype="float32", **kw)
    assert max_decode_rows(llm.config) == 3 * per_request
    assert max_draft_rows(llm.config) == (None if draft_per_request is None
                                          else 3 * draft_per_request)
    stats = compile_models(llm.engine.runner, CompileConfig(inductor=False),
                           max_decode_rows(llm.config), max_draft_rows(llm.config)).stats()
    off = {"on": False, "why": "auto: off on cpu (PDL is a CUDA launch attribute)",
           "max_rows": None}
    assert stats["pdl"] == off
    assert stats.get("pdl_draft") == (None if draft_per_request is None else off)


def test_a_tree_engine_keeps_pdl_on_its_draft_when_its_verify_is_too_wide(
        monkeypatch, smollm2_gguf_path, bigram_eagle3) -> None:
    """A tree of 10 nodes at 8 requests verifies 80 rows (over the rule) but drafts at most
    8 x 4: the draft's callables get PDL (Inductor's option and our launches' scope), the
    target's wide calls do not; its narrow ones do, through a second compile (pdl_narrow,
    on by default), and with pdl_narrow=False the target has none. The rule is CUDA's, so the
    device's answer is stood in for."""
    import compiled_spec.compile as comp
    from compiled_spec import LLM
    from compiled_spec.llm_compile import max_decode_rows, max_draft_rows

    weights: list[int] = []

    def on_cuda(pdl, device, fused, rows, narrow=False, largest_weight=0):
        weights.append(largest_weight)
        return pdl_auto("cuda", H200, True, True, rows, narrow is not False, largest_weight)

    monkeypatch.setattr(comp, "resolve_pdl", on_cuda)
    target, head = bigram_eagle3
    llm = LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=64, max_num_seqs=8,
              dtype="float32", draft=head, num_speculative_tokens=3, speculative_topk=4,
              speculative_num_draft_tokens=10)
    for narrow in (None, False):
        models = comp.compile_models(
            llm.engine.runner, comp.CompileConfig(inductor=False, pdl_narrow=narrow),
            max_decode_rows(llm.config), max_draft_rows(llm.config))
        assert (models.pdl.on, models.pdl_draft.on) == (narrow is None, True)
        assert models.pdl.max_rows == (PDL_MAX_ROWS if narrow is None else None)
        assert "80" in models.pdl.why and "32 rows" in models.pdl_draft.why
        pdl_of = {name: b.inductor_config.get("triton.enable_pdl", False)
                  for name, b in models.backends.items()}
        assert pdl_of.pop("target") is False
        assert pdl_of.pop("target_pdl", None) is (True if narrow is None else None)
        assert set(pdl_of) >= {"draft_first_pass", "tree_step", "tree_head"}
        assert all(pdl_of.values()), pdl_of
    # the rule read each model's largest layer weight (target, then draft)
    from compiled_spec.gemm_policy import largest_layer_weight
    assert weights[:2] == [largest_layer_weight(llm.engine.runner.model),
                           largest_layer_weight(llm.engine.runner.proposer.draft)]
    assert all(0 < w <= PDL_MAX_WEIGHT for w in weights)

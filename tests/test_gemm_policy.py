"""Whether a target gets our skinny GEMMs by default (compiled_spec/gemm_policy.py): on for
CUDA and 16-bit dtypes (SmolLM2 measured faster on the H200, the 8B shape on the H100 with its
deep-K tiles), off for fp32 and the CPU; an explicit setting always wins, and the engine's stats
say what was decided and why."""
from __future__ import annotations

import pytest
import torch

from compiled_spec.gemm_policy import (READOUT_MIN_WEIGHT, largest_layer_weight, resolve_skinny,
                                       skinny_auto)

SMOLLM2_GATE_UP = 2 * 1536 * 576
LLAMA8B_O_PROJ = 4096 * 4096  # the 8B shape's smallest projection


@pytest.mark.parametrize("device, dtype, weight, on", [
    ("cuda", torch.bfloat16, SMOLLM2_GATE_UP, True),
    ("cuda", torch.float16, SMOLLM2_GATE_UP, True),
    ("cuda", torch.bfloat16, LLAMA8B_O_PROJ, True),
    ("cuda", torch.bfloat16, 14336 * 4096, True),  # the 8B shape's down
    ("cuda", torch.float32, SMOLLM2_GATE_UP, False),
    ("cpu", torch.bfloat16, SMOLLM2_GATE_UP, False),
    ("cuda", torch.bfloat16, 0, False),  # no Linear found: not a layout the pass knows
])
def test_auto_rule(device: str, dtype: torch.dtype, weight: int, on: bool) -> None:
    got, why = skinny_auto(device, dtype, weight)
    assert got is on
    assert why.startswith("auto: on" if on else "auto: off")


class _Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)])
        self.lm_head = torch.nn.Linear(32, 1000)  # outside the compiled graph: not counted


def test_largest_layer_weight_leaves_out_lm_head() -> None:
    assert largest_layer_weight(_Toy()) == 32 * 16
    assert largest_layer_weight(torch.nn.Sequential()) == 0


def test_explicit_settings_win_and_layer_follows() -> None:
    toy = _Toy()
    assert (resolve_skinny(None, None, toy).gemm, resolve_skinny(None, None, toy).layer) == \
        (False, False)
    assert "auto: off on cpu" in resolve_skinny(None, None, toy).why
    on = resolve_skinny(True, None, toy)
    assert (on.gemm, on.layer, on.why) == (True, True, "set: skinny_gemm=True")
    assert on.readout is False  # a model without CausalLM.readout keeps its lm_head
    toy.skinny_readout = False
    assert resolve_skinny(True, None, toy, readout=True).readout is True
    assert resolve_skinny(True, None, toy).readout is False  # 32 x 1000: below the minimum
    big = torch.nn.Module()  # an lm_head of READOUT_MIN_WEIGHT elements (no storage)
    big.lm_head = torch.nn.Linear(READOUT_MIN_WEIGHT // 1000, 1000, bias=False, device="meta")
    big.skinny_readout = False
    assert resolve_skinny(True, None, big).readout is True
    assert resolve_skinny(None, None, big).readout is False  # no parameters' device: no GEMMs
    assert resolve_skinny(False, None, toy).readout is False
    assert resolve_skinny(True, None, toy, readout=False).readout is False  # told not to
    assert resolve_skinny(False, None, toy, readout=True).readout is False  # no GEMMs: none
    toy.tp = object()  # a sharded lm_head gathers across ranks: never ours
    assert resolve_skinny(True, None, toy).readout is False
    from compiled_spec.compile import CompileConfig

    assert CompileConfig(skinny_gemm_readout=False).skinny_gemm_readout is False
    with pytest.raises(ValueError, match="skinny_gemm_readout=1"):
        CompileConfig(skinny_gemm_readout=1)  # type: ignore[arg-type]
    assert resolve_skinny(True, False, toy).layer is False
    off = resolve_skinny(False, None, toy)
    assert (off.gemm, off.layer) == (False, False)
    assert resolve_skinny(None, None, torch.nn.Sequential()).gemm is False


def test_engine_reports_the_choice(tmp_path, smollm2_gguf_path, monkeypatch) -> None:
    from compiled_spec import LLM
    from compiled_spec.compile import CompileConfig, compile_models
    from tests.spec_models import write_bigram_target

    target = write_bigram_target(tmp_path / "t", vocab=64, hidden=64, layers=1)
    llm = LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=64, max_num_seqs=2,
              dtype="float32")
    auto = compile_models(llm.engine.runner, CompileConfig(inductor=False)).stats()
    assert auto["skinny_gemm"]["gemm"] is False and "auto: off on cpu" in auto["skinny_gemm"]["why"]
    forced = compile_models(llm.engine.runner, CompileConfig(inductor=False, skinny_gemm=True))
    assert forced.stats()["skinny_gemm"] == {"gemm": True, "layer": True,
                                             "why": "set: skinny_gemm=True", "readout": False,
                                             "draft": False}  # (no draft to fuse)
    model = llm.engine.runner.model
    assert model.skinny_readout is False  # a small lm_head (64 x 64) stays cuBLAS's
    # told to, the lm_head goes with them: eager logits and the graphs' read the same op
    both = compile_models(llm.engine.runner, CompileConfig(inductor=False, skinny_gemm=True,
                                                           skinny_gemm_readout=True))
    assert both.stats()["skinny_gemm"]["readout"] is True and model.skinny_readout is True
    hidden = torch.randn(3, 64)  # [rows, hidden]
    seen = []
    real = torch.ops.compiled_spec.skinny_linear
    monkeypatch.setattr(torch.ops.compiled_spec, "skinny_linear",
                        lambda *a: seen.append(a[0].shape) or real(*a))
    logits = model.compute_logits(hidden)
    monkeypatch.undo()
    assert seen == [torch.Size([3, 64])] and torch.ops.compiled_spec.skinny_linear is real
    assert torch.equal(logits, model.lm_head(hidden).float())  # (the op's CPU path: the matmul)
    compile_models(llm.engine.runner, CompileConfig(inductor=False, skinny_gemm=False,
                                                    skinny_gemm_readout=True))
    assert model.skinny_readout is False  # no skinny GEMMs, no skinny lm_head
    from passes.skinny_gemm import SkinnyGemmFusion

    passes = forced.backends["target"].pass_manager.passes
    fusion = [p for p in passes if isinstance(p, SkinnyGemmFusion)]
    assert len(fusion) == 1 and fusion[0].layer is True
    assert not any(isinstance(p, SkinnyGemmFusion)
                   for p in compile_models(llm.engine.runner, CompileConfig(inductor=False))
                   .backends["target"].pass_manager.passes)

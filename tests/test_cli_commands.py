"""``compiled-spec acceptance`` and ``compiled-spec profile`` end to end on a tiny model (CPU):
both build their engine from the shared options of ``compiled_spec.engine_args``."""
from __future__ import annotations

import json

import pytest

from compiled_spec.cli import main


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory, smollm2_tokenizer):
    from compiled_spec.draft.testing import write_eagle3_head
    from compiled_spec.models.loader import read_model_config
    from tests.spec_models import write_tiny_llama

    root = tmp_path_factory.mktemp("cli_pair")
    target = write_tiny_llama(root / "target", smollm2_tokenizer, layers=4, max_positions=1024)
    head = write_eagle3_head(str(root / "head"), read_model_config(target))
    return target, head


def test_acceptance_writes_one_row_per_k(tiny_pair, mt_bench_path, tmp_path):
    target, head = tiny_pair
    out = tmp_path / "acc.json"
    assert main(["acceptance", "--model", target, "--draft", head, "--device", "cpu",
                 "--prompts", mt_bench_path, "--num-prompts", "2", "--max-tokens", "6",
                 "--max-model-len", "1024", "--k-list", "1", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["k"] for r in rows] == [1, 2] and all(r["tau"] >= 1.0 for r in rows)


def test_acceptance_per_category_adds_up_to_the_total(tiny_pair, mt_bench_path, tmp_path):
    target, head = tiny_pair
    rows = [json.loads(line) for line in open(mt_bench_path)]
    picked = [r for r in rows if r["category"] == "writing"][:2] + \
        [r for r in rows if r["category"] == "math"][:1]
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in picked))
    out = tmp_path / "acc.json"
    assert main(["acceptance", "--model", target, "--draft", head, "--device", "cpu",
                 "--prompts", str(prompts), "--num-prompts", "3", "--max-tokens", "6",
                 "--max-model-len", "1024", "--k-list", "2", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["results"][0]
    cats = row["tau_by_category"]
    assert {c: v["prompts"] for c, v in cats.items()} == {"math": 1, "writing": 2}
    assert sum(v["drafting_steps"] for v in cats.values()) == row["drafting_steps"] > 0
    accepted = sum((v["tau"] - 1) * v["drafting_steps"] for v in cats.values())
    assert abs(1 + accepted / row["drafting_steps"] - row["tau"]) < 1e-9


def test_acceptance_needs_a_draft(tiny_pair, mt_bench_path):
    assert main(["acceptance", "--model", tiny_pair[0], "--device", "cpu",
                 "--prompts", mt_bench_path, "--num-prompts", "1"]) == 2


def test_profile_writes_a_trace_with_phases(tiny_pair, mt_bench_path, tmp_path, capsys):
    target, head = tiny_pair
    assert main(["profile", "--model", target, "--draft", head, "--device", "cpu",
                 "--prompts", mt_bench_path, "--num-prompts", "1", "--max-tokens", "4",
                 "--max-model-len", "1024", "--out-dir", str(tmp_path / "traces")]) == 0
    assert list((tmp_path / "traces").rglob("*.pt.trace.json"))
    printed = capsys.readouterr().out
    assert "propose" in printed and "verify" in printed


def test_profile_batches_requests_and_prints_a_kernel_table(tiny_pair, mt_bench_path, tmp_path,
                                                            capsys):
    """--batch 3 sends the prompts as one call (the large-batch profile of self-distillation);
    --kernel-table prints the ops with the most time."""
    target, head = tiny_pair
    assert main(["profile", "--model", target, "--device", "cpu", "--prompts", mt_bench_path,
                 "--num-prompts", "3", "--max-tokens", "4", "--max-model-len", "1024",
                 "--batch", "3", "--kernel-table", "5", "--out-dir", str(tmp_path / "t")]) == 0
    printed = capsys.readouterr().out
    assert "Self CPU" in printed and "aten::" in printed
    # An untraced pass first: 3 requests x 4 tokens are 4 engine steps (one prefill, 3 decodes).
    assert "untraced: batch 3, 4 engine steps" in printed
    # --cprofile: the same batch under cProfile, host time per step by function.
    assert main(["profile", "--model", target, "--device", "cpu", "--prompts", mt_bench_path,
                 "--num-prompts", "3", "--max-tokens", "4", "--max-model-len", "1024",
                 "--batch", "3", "--cprofile", "4", "--out-dir", str(tmp_path / "c")]) == 0
    printed = capsys.readouterr().out
    assert "cprofile: 4 engine steps" in printed
    table = printed.split("own us/step", 1)[1].splitlines()[1:5]
    assert len(table) == 4 and all(line.split()[0].replace(".", "").isdigit() for line in table)
    assert main(["profile", "--model", target, "--device", "cpu", "--prompts", mt_bench_path,
                 "--num-prompts", "1", "--batch", "0", "--out-dir", str(tmp_path / "u")]) == 2


def test_cuda_graph_sizes_reach_the_compile_config():
    """--cuda-graph-sizes picks the captured batch sizes (a large-batch profile need not
    capture 67 of them); without it and a cache dir the engine keeps its defaults."""
    import argparse

    from compiled_spec.engine_args import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    kw = engine_kwargs(p.parse_args(["--max-num-seqs", "512", "--cuda-graph-sizes", "1", "512"]))
    assert kw["compile_config"].capture_batch_sizes == (1, 512)
    assert kw["compile_config"].cache_dir is None
    assert "compile_config" not in engine_kwargs(p.parse_args([]))


def test_autotune_gemm_reaches_the_compile_config():
    """--autotune-gemm turns on Inductor's GEMM autotuning through CompileConfig; off, no
    Inductor patch is added; a non-bool value is refused by name."""
    import argparse

    import torch

    from compiled_spec.compile import CompileConfig, inductor_config, precompile_on
    from compiled_spec.engine_args import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_kwargs(p.parse_args(["--autotune-gemm"]))["compile_config"]
    assert cfg.autotune_gemm is True
    assert inductor_config(cfg) == {"max_autotune_gemm": True,
                                    "max_autotune_gemm_backends": "ATEN,TRITON"}
    assert inductor_config(CompileConfig()) == {}
    with pytest.raises(ValueError, match="autotune_gemm"):
        CompileConfig(autotune_gemm="yes")  # type: ignore[arg-type]
    # --[no-]skinny-gemm: the fused skinny-GEMM pass; unset, decided per target (gemm_policy)
    skinny = engine_kwargs(p.parse_args(["--skinny-gemm"]))["compile_config"]
    assert skinny.skinny_gemm is True and skinny.skinny_gemm_layer is None
    off = engine_kwargs(p.parse_args(["--no-skinny-gemm"]))["compile_config"]
    assert off.skinny_gemm is False
    assert engine_kwargs(p.parse_args(["--skinny-gemm", "--no-skinny-gemm-layer"]))[
        "compile_config"].skinny_gemm_layer is False
    both = engine_kwargs(p.parse_args(["--skinny-gemm", "--skinny-gemm-layer"]))
    assert both["compile_config"].skinny_gemm_layer is True
    assert both["compile_config"].skinny_gemm_norms is False
    norms = engine_kwargs(p.parse_args(["--skinny-gemm", "--skinny-gemm-norms"]))
    assert norms["compile_config"].skinny_gemm_norms is True
    assert cfg.skinny_gemm is None and "compile_config" not in engine_kwargs(p.parse_args([]))
    assert engine_kwargs(p.parse_args(["--precompile"]))["compile_config"].precompile is True
    assert engine_kwargs(p.parse_args(["--no-precompile"]))["compile_config"].precompile is False
    # unset: None, resolved per engine (on for CUDA weights, off for the CPU's)
    assert cfg.precompile is None
    assert precompile_on(cfg, torch.nn.Linear(2, 2)) is False
    assert precompile_on(CompileConfig(precompile=True), torch.nn.Linear(2, 2)) is True
    if torch.cuda.is_available():
        assert precompile_on(cfg, torch.nn.Linear(2, 2, device="cuda")) is True
    with pytest.raises(ValueError, match="precompile"):
        CompileConfig(precompile="auto")  # type: ignore[arg-type]
    # --pdl / --no-pdl: programmatic dependent launch (Inductor's half as a config patch);
    # unset: None, decided per engine (pdl_policy.py)
    pdl = engine_kwargs(p.parse_args(["--pdl"]))["compile_config"]
    assert pdl.pdl is True and cfg.pdl is None
    assert engine_kwargs(p.parse_args(["--no-pdl"]))["compile_config"].pdl is False
    assert inductor_config(pdl) == {"triton.enable_pdl": True}
    with pytest.raises(ValueError, match="pdl"):
        CompileConfig(pdl=1)  # type: ignore[arg-type]


def test_every_compile_flag_is_an_option_and_a_config_field_with_one_default():
    """engine_args.COMPILE_FLAGS is the one list the CLI, `engine_kwargs` and the bench read:
    each name is a CompileConfig field whose default is the list's, and an engine option that
    reaches the config when given (a flag added to one place only fails here)."""
    import argparse
    import dataclasses

    from compiled_spec.compile import CompileConfig
    from compiled_spec.engine_args import COMPILE_FLAGS, add_engine_args, engine_kwargs

    fields = {f.name: f.default for f in dataclasses.fields(CompileConfig)}
    assert {n: fields.get(n, "missing") for n in COMPILE_FLAGS} == COMPILE_FLAGS
    p = argparse.ArgumentParser()
    add_engine_args(p)
    for name in COMPILE_FLAGS:
        opt = "--" + name.replace("_", "-")
        cfg = engine_kwargs(p.parse_args([opt, "--skinny-gemm"]))["compile_config"]
        assert getattr(cfg, name) is True, name

"""The persistent compile cache (``compiled_spec/compile_cache.py``): which directory Inductor
uses, and a second process with the same configuration served from it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from compiled_spec.compile import CompileConfig
from compiled_spec.compile_cache import ENV, activate, code_hash, default_cache_dir

ROOT = Path(__file__).resolve().parents[1]


def test_cache_dir_choice(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)  # activate() sets it: undone after
    monkeypatch.setenv("COMPILED_SPEC_CACHE_DIR", str(tmp_path / "ours"))
    assert default_cache_dir() == tmp_path / "ours"
    code = f"code-{code_hash()}"  # one subdirectory per version of the traced code
    assert activate(None) == str(tmp_path / "ours" / code) == os.environ[ENV]
    assert (tmp_path / "ours" / code).is_dir()
    # torch writes its own default there when torch._dynamo is imported: not a user's choice
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir as torch_default

    monkeypatch.setenv(ENV, torch_default())
    assert activate(None) == str(tmp_path / "ours" / code) == os.environ[ENV]
    monkeypatch.setenv(ENV, str(tmp_path / "user"))  # the user's export wins over our default
    assert activate(None) == str(tmp_path / "user")
    explicit = str(tmp_path / "explicit" / code)
    assert activate(str(tmp_path / "explicit")) == explicit  # not over this
    assert os.environ[ENV] == explicit
    assert activate("") == explicit  # "": leave whatever is set alone
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="file/sub"):
        activate(str(tmp_path / "file" / "sub"))
    with pytest.raises(ValueError, match="cache_dir=3"):
        CompileConfig(cache_dir=3)  # type: ignore[arg-type]


def test_triton_binaries_pinned_before_anything_compiles(monkeypatch, tmp_path):
    """Triton's cache folder is chosen when the compile cache is, not when Inductor first builds
    a kernel tuner: a cold start's compile workers and the next start-up's artifact loads must
    look in one folder (else the second start-up builds them again)."""
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

    import compiled_spec.compile_cache as cc

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setattr(cc, "_pinned_triton", None)
    monkeypatch.setenv("COMPILED_SPEC_CACHE_DIR", str(tmp_path / "ours"))
    monkeypatch.setattr(cc, "_our_inductor_dir", None, raising=False)
    first = activate(None)
    ours = str(tmp_path / "ours" / "triton")  # beside the code-* folders: kept across versions
    assert os.environ["TRITON_CACHE_DIR"] == ours == triton_cache_dir(0)  # what Inductor uses
    # A second activation (a compile=True engine makes two) keeps both folders: its own
    # Inductor folder is not a user's export, whose Triton pin would move into it.
    assert activate(None) == first and os.environ["TRITON_CACHE_DIR"] == ours
    activate(str(tmp_path / "explicit"))  # our own pin moves with a later explicit directory
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "explicit" / "triton")
    activate("")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "explicit" / "triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "users"))  # a user's export wins
    activate(None)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "users")
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setenv(ENV, str(tmp_path / "user_inductor"))  # under a user's Inductor folder
    assert activate(None) == str(tmp_path / "user_inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "user_inductor" / "triton")


def test_default_dir_is_ours_after_torch_set_its_own(tmp_path):
    """In a fresh process nobody exported TORCHINDUCTOR_CACHE_DIR, but importing the engine
    (torch._dynamo) makes torch write its temp-dir default there: ours must still be used."""
    env = {k: v for k, v in os.environ.items() if k != ENV}
    env.update(PYTHONPATH=str(ROOT), COMPILED_SPEC_CACHE_DIR=str(tmp_path / "ours"))
    code = ("import os, torch._dynamo, compiled_spec.llm\n"
            "from compiled_spec.compile_cache import ENV, activate\n"
            "torched = os.environ.get(ENV)\n"
            "print(torched, activate(None), os.environ[ENV])")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    torched, chosen, now = p.stdout.split()
    assert torched != "None"  # torch did set it (else this test checks nothing)
    assert chosen == now == str(tmp_path / "ours" / f"code-{code_hash()}")


def test_code_hash_changes_with_any_traced_source(tmp_path):
    """Artifacts of older code are never served to newer code: its directory differs."""
    for pkg in ("compiled_spec", "passes", "kernels", "capture"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "a.py").write_text("x = 1\n")
    before = code_hash(tmp_path)
    assert code_hash.__wrapped__(tmp_path) == before  # stable
    (tmp_path / "kernels" / "a.py").write_text("x = 2\n")
    assert code_hash.__wrapped__(tmp_path) != before
    assert len(before) == 16 and code_hash() != before


_RUN = """
import json, sys
from compiled_spec import LLM, SamplingParams
from compiled_spec.compile import CompileConfig
llm = LLM(model=sys.argv[1], tokenizer=sys.argv[2], dtype="float32", device="cpu",
          max_model_len=128, compile=True, compile_config=CompileConfig(cache_dir=sys.argv[3]))
out = llm.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True))
print(json.dumps({"cache": llm.compile_cache, "startup": sorted(llm.startup_s),
                  "ids": [o.token_ids for o in out]}))
"""


@pytest.mark.heavy
def test_second_process_is_served_from_the_cache(tmp_path, smollm2_gguf_path):
    from tests.spec_models import write_bigram_target

    target = write_bigram_target(tmp_path / "t", vocab=64, layers=2, seed=5)
    env = {k: v for k, v in os.environ.items() if k != ENV}
    env["PYTHONPATH"] = str(ROOT)
    env["COMPILED_SPEC_PROGRESS"] = "0"
    runs = []
    for _ in range(2):
        p = subprocess.run([sys.executable, "-c", _RUN, target, smollm2_gguf_path,
                            str(tmp_path / "cache")], env=env, capture_output=True, text=True,
                           timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["cache"]["dir"] == second["cache"]["dir"] == \
        str(tmp_path / "cache" / f"code-{code_hash()}")
    assert first["cache"]["fxgraph_miss"] >= 1 and first["cache"]["fxgraph_hit"] == 0
    assert second["cache"]["fxgraph_hit"] >= first["cache"]["fxgraph_miss"]
    assert second["cache"]["fxgraph_miss"] == 0
    # torch's compile timers: Dynamo ran in both processes (its tracing is not cached), and
    # the backend's share (passes, AOTAutograd, Inductor) shrank once Inductor was served
    # from the cache.
    for run in runs:
        sec = run["cache"]["seconds"]
        assert sec["dynamo_s"] > 0 and sec["trace_s"] > 0 and sec["backend_s"] > 0, sec
        assert sec["dynamo_s"] >= sec["backend_s"], sec
    assert second["cache"]["seconds"]["inductor_s"] < first["cache"]["seconds"]["inductor_s"]
    assert first["ids"] == second["ids"]
    assert {"load", "compile", "capture"} <= set(first["startup"])
    assert any((tmp_path / "cache").iterdir())


def test_compiled_engine_pins_triton_before_its_attention_warm_up(monkeypatch, tmp_path,
                                                                   bigram_eagle3,
                                                                   smollm2_gguf_path):
    """The engine's attention warm-up builds Triton kernels (CUDA): by then the folder must be
    the one later compiles use, else whichever engine a process builds first decides where
    those kernels land and another process looks for them elsewhere."""
    import compiled_spec.compile_cache as cc
    import compiled_spec.llm as llm_mod

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setattr(cc, "_pinned_triton", None)
    seen = []

    class Recording(llm_mod.LLMEngine):
        def __init__(self, *a, **kw):
            seen.append(os.environ.get("TRITON_CACHE_DIR"))
            super().__init__(*a, **kw)

    monkeypatch.setattr(llm_mod, "LLMEngine", Recording)
    monkeypatch.setattr(llm_mod.LLM, "set_compiled", lambda self, on: None)  # no compile here
    target, _ = bigram_eagle3
    llm_mod.LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=64, compile=True,
                compile_config=CompileConfig(cache_dir=str(tmp_path / "c")))
    assert seen == [str(tmp_path / "c" / "triton")]

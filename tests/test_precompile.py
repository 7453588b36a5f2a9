"""CompileConfig.precompile (compiled_spec/precompile.py): a second process loads the target's
and the draft's precompiled entries instead of tracing them, with vanilla decoding's greedy
output, and a broken file falls back to tracing with its reason reported."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compiled_spec.compile_cache import ENV
from compiled_spec.precompile import PrecompiledModule, PrecompileStats, available

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))

# One LLM with precompile on; with a 6th argument "vanilla" also vanilla decoding, whose token
# ids its greedy output must equal. CPU stand-ins for the CUDA graphs, so that every draft
# callable serves: the graphs' first pass (the draft step), the chain's step + pick and an
# early step's pick + plan besides the uncaptured first pass.
_RUN = """
import json, sys
from capture import CapturePolicy
from compiled_spec import LLM, SamplingParams
from compiled_spec.compile import CompileConfig, capture_graphs
target, head, tok, cache, mode = sys.argv[1:6]
tree = dict(speculative_topk=2, speculative_num_draft_tokens=6) if mode == "tree" else {}
prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]  # longer than k + 1: a cut first pass
sp = SamplingParams(max_tokens=12, ignore_eos=True)
def run():
    llm = LLM(model=target, draft=head, tokenizer=tok, dtype="float32", device="cpu",
              num_speculative_tokens=3, max_model_len=64, page_size=4, max_num_seqs=2,
              compile=True, compile_config=CompileConfig(cache_dir=cache, precompile=True), **tree)
    policy = CapturePolicy(max_batch_size=2, num_speculative_tokens=3, max_model_len=64,
                           batch_sizes=(1, 2), seq_len_buckets=(64,))
    capture_graphs(llm.engine.runner, llm._compiled, policy, 4, emulate=True)
    out = llm.generate(prompts, sp)
    return {"cache": llm.compile_cache, "ids": [o.token_ids for o in out],
            "stats": llm.compile_stats,
            "precompiled": [g.precompiled for b in llm._compiled.backends.values()
                            for g in b.graphs]}
out = {"pre": run()}
if "vanilla" in sys.argv[6:]:
    vanilla = LLM(model=target, tokenizer=tok, dtype="float32", device="cpu", max_model_len=64)
    out["vanilla"] = [o.token_ids for o in vanilla.generate(prompts, sp)]
print(json.dumps(out))
"""
BACKEND = {"target": "target", "first_pass": "draft_first_pass", "step": "draft_step",
           "step_pick": "draft_step_pick", "pick_plan": "draft_pick_plan"}
CALLABLES = set(BACKEND)
TREE_GLUE = {"tree_head", "tree_step", "tree_finish", "tree_early_stage"}


def _starts(tmp_path: Path, pair: tuple[str, str], tok: str, mode: str,
            first_extra: list[str]) -> tuple[dict, dict]:
    """Two fresh processes on one compile cache: (cold, warm) reports."""
    env = {k: v for k, v in os.environ.items() if k != ENV}
    env.update(PYTHONPATH=str(ROOT), COMPILED_SPEC_PROGRESS="0")
    runs = []
    for extra in (first_extra, []):
        p = subprocess.run([sys.executable, "-c", _RUN, *pair, tok, str(tmp_path / "cache"),
                            mode, *extra], env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    return runs[0], runs[1]


def _saved(tmp_path: Path) -> set[str]:
    return {f.name.rsplit("-", 1)[0] for f in (tmp_path / "cache").rglob("precompiled/*.bin")}


def _loaded_all(cold: dict, warm: dict) -> None:
    """Cold saved and traced nothing; warm loaded every entry, used each, traced nothing."""
    first, second = cold["pre"]["cache"]["precompile"], warm["pre"]["cache"]["precompile"]
    assert first["loaded"] == 0 and first["fallbacks"] == [] and first["traced"] == {}, first
    assert second["loaded"] == first["compiled"] == second["hits"], second
    assert second["compiled"] == 0 and second["fallbacks"] == [] and second["traced"] == {}
    # loaded graphs are marked precompiled (start-up's compile seconds leave them out)
    assert not any(cold["pre"]["precompiled"])
    assert warm["pre"]["precompiled"] == [True] * second["loaded"]


@pytest.mark.heavy
def test_warm_start_loads_target_and_draft_instead_of_tracing(tmp_path, bigram_eagle3,
                                                              smollm2_gguf_path):
    # (against vanilla decoding, not a traced engine: fp32 greedy output is vanilla's either
    # way, and tracing the chain again cost ~50 s of CI's budget)
    cold, warm = _starts(tmp_path, bigram_eagle3, smollm2_gguf_path, "chain", ["vanilla"])
    assert _saved(tmp_path) == CALLABLES
    # an entry for every graph the engine compiled for these callables, one each here
    graphs = {n: cold["pre"]["stats"][BACKEND[n]]["graphs"] for n in CALLABLES}
    assert graphs == dict.fromkeys(CALLABLES, 1), graphs
    assert cold["pre"]["cache"]["precompile"]["compiled"] == len(CALLABLES)
    _loaded_all(cold, warm)
    assert cold["pre"]["ids"] == warm["pre"]["ids"] == cold["vanilla"]
    # The loaded callables report their passes as a traced start does: the EAGLE-3 fc hoisted
    # out of the first pass (it runs eagerly beside the loaded graph).
    for stats in (cold["pre"]["stats"], warm["pre"]["stats"]):
        fp = stats["draft_first_pass"]
        assert fp["graphs"] == 1 and fp["pass_matches"]["HoistEagle3Fc"] == 1, fp
        assert stats["draft_step_pick"]["pass_matches"]["BindPerLayerAttnMetadata"] >= 1


@pytest.mark.heavy
def test_warm_tree_engine_loads_its_glue_too(tmp_path, bigram_eagle3, smollm2_gguf_path):
    """A draft tree engine: the tree's glue (top-k head, expansion, node selection, early
    staging: spec/tree_glue.py) saved and loaded with the rest; output vanilla's (fp32)."""
    cold, warm = _starts(tmp_path, bigram_eagle3, smollm2_gguf_path, "tree", ["vanilla"])
    assert TREE_GLUE <= _saved(tmp_path), _saved(tmp_path)
    _loaded_all(cold, warm)
    assert cold["pre"]["ids"] == warm["pre"]["ids"] == cold["vanilla"]
    # Inductor compiled each glue callable once for batch 1 and 2 (views of computed values,
    # not of inputs or strided slices: spec/tree_glue.py, spec/tree.py's ancestor_mask,
    # spec/tree_accept_device.py's early stage).
    graphs = {n: cold["pre"]["stats"][n]["graphs"] for n in TREE_GLUE}
    assert graphs == dict.fromkeys(TREE_GLUE, 1), graphs


def test_a_draft_runner_loads_only_for_an_engine_backend():
    """A draft's saved graph runner reads its per-layer metadata from the engine's backend:
    unpickled outside PrecompiledModule (no backend to bind) it refuses rather than guess."""
    from compiled_spec.precompile import _SerializableRunner

    with pytest.raises(RuntimeError, match="engine's backend"):
        _SerializableRunner.deserialize_compile_artifacts(b"")


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) * 2


def test_unreadable_file_falls_back_and_says_why(tmp_path):
    path = tmp_path / "precompiled" / "tiny-x.bin"
    path.parent.mkdir()
    path.write_bytes(b"not a pickle")
    stats = PrecompileStats()
    mod = _Tiny()
    traced_calls = []

    def traced(*args):
        traced_calls.append(1)
        return mod(*args)

    # a backend whose result torch cannot serialize: aot_compile fails -> traced, reason kept
    pre = PrecompiledModule("tiny", mod, lambda gm, ex: gm.forward, True, traced, path, stats)
    assert stats.loaded == 0 and stats.fallbacks[0].startswith("tiny: load failed")
    x = torch.randn(5, 4)
    with torch.inference_mode():
        out = pre(x)
        torch.testing.assert_close(out, mod(x), rtol=0, atol=0)
        pre(x)
    assert traced_calls == [1, 1] and stats.compiled == 0
    assert len(stats.fallbacks) == 2 and "aot_compile failed" in stats.fallbacks[1]
    assert path.read_bytes() == b"not a pickle"  # nothing half-written over it


def test_saves_and_loads_as_torch_2_11_requires(tmp_path):
    """torch 2.11 (the H200's) differs from 2.13 in two ways that each stopped precompile there:
    enable_aot_compile defaults off and is read when torch.compile builds its wrapper, and
    aot_compile takes only a SerializableCallable from a backend that is not torch's own.
    Both are reproduced here: the flag off, and our backend's result checked for the type."""
    from torch._dynamo.aot_compile_types import SerializableCallable
    from torch._inductor.compile_fx import compile_fx

    from compiled_spec.precompile import serializable_backend

    results = []

    def backend(gm, ex):
        results.append(serializable_backend(compile_fx)(gm, ex))
        return results[-1]

    path = tmp_path / "precompiled" / "tiny-y.bin"
    mod, x = _Tiny(), torch.randn(5, 4)
    with torch._dynamo.config.patch(enable_aot_compile=False), torch.inference_mode():
        stats = PrecompileStats()
        pre = PrecompiledModule("tiny", mod, backend, False, mod, path, stats)
        torch.testing.assert_close(pre(x), mod(x))
        assert stats.compiled == 1 and stats.fallbacks == [], stats
        assert isinstance(results[0], SerializableCallable)  # what 2.11 checks
        assert getattr(results[0], "serialize", None) is None  # so 2.13 does not wrap it again
        again = PrecompileStats()  # a later start-up: loaded, not traced
        pre2 = PrecompiledModule("tiny", mod, backend, False, mod, path, again)
        torch.testing.assert_close(pre2(x), mod(x))
        assert again.loaded == 1 and again.hits == 1 and again.compiled == 0, again
    assert len(results) == 1

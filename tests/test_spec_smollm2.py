"""Speculative decoding on the real target (SmolLM2-135M, fp32 CPU) with random EAGLE heads in the
published layouts: the output must equal vanilla greedy decoding token for token."""
import pytest
import torch

from compiled_spec import LLM, SamplingParams
from compiled_spec.draft.testing import write_eagle1_head, write_eagle3_head

SP = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(smollm2_gguf_path, mt_bench_questions):
    llm = LLM(model=smollm2_gguf_path, dtype="float32", device="cpu", max_model_len=1024)
    prompts = [llm.encode_chat([{"role": "user", "content": mt_bench_questions[i]}]) for i in (1, 5, 30)]
    vanilla = [o.token_ids for o in llm.generate(prompts, SP)]
    return llm.engine.model.config, prompts, vanilla


@pytest.mark.parametrize("method,layers,k,page_size", [
    ("eagle3", 1, 3, 16), ("eagle3", 2, 2, 1), ("eagle", 2, 5, 16), ("eagle", 1, 1, 16)])
def test_random_head_is_lossless(setup, smollm2_gguf_path, tmp_path, method, layers, k, page_size):
    cfg, prompts, vanilla = setup
    if method == "eagle3":
        head = write_eagle3_head(str(tmp_path / "h"), cfg, num_layers=layers, draft_vocab_size=2048,
                                 use_midlayer_prefix=layers == 1)
    else:
        head = write_eagle1_head(str(tmp_path / "h"), cfg, num_layers=layers)
    llm = LLM(model=smollm2_gguf_path, dtype="float32", device="cpu", max_model_len=1024,
              page_size=page_size, draft=head, num_speculative_tokens=k)
    assert llm.engine.draft.config.method == method  # detected from the checkpoint
    outs = llm.generate(prompts, SP)
    assert [o.token_ids for o in outs] == vanilla
    spec = llm.stats.spec
    assert spec.num_drafting_steps > 0 and spec.num_draft_tokens >= spec.num_drafting_steps
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_blocks


def test_shipped_head_is_lossless_and_accepts(setup, smollm2_gguf_path):
    """The head shipped in the package (bf16 shards, loaded in fp32 here) on its own target:
    output identical to vanilla, and it has learned something (a random head gives tau ~1.0)."""
    _, prompts, vanilla = setup
    llm = LLM(model=smollm2_gguf_path, dtype="float32", device="cpu", max_model_len=1024,
              draft="smollm2-eagle3", num_speculative_tokens=3)
    cfg = llm.engine.draft.config
    assert cfg.method == "eagle3" and cfg.draft_vocab_size == 32768
    # its readout is the target's lm_head at the draft vocabulary, rebuilt at load
    d2t = llm.engine.draft.d2t
    rows = torch.arange(32768) + d2t.cpu()
    assert torch.equal(llm.engine.draft.lm_head.weight.detach().cpu(),
                       llm.engine.model.lm_head.weight.detach().cpu()[rows])
    assert [o.token_ids for o in llm.generate(prompts, SP)] == vanilla
    tau = llm.stats.spec.mean_acceptance_length
    print(f"shipped head, 3 MT-bench prompts x 48 tokens, k=3: tau {tau:.3f}")
    assert tau > 1.3


def test_shipped_head_tree_is_lossless(setup, smollm2_gguf_path):
    """Draft trees on the real target (tree attention over the paged cache, KV compaction after
    acceptance): output identical to vanilla."""
    _, prompts, vanilla = setup
    llm = LLM(model=smollm2_gguf_path, dtype="float32", device="cpu", max_model_len=1024,
              draft="smollm2-eagle3", num_speculative_tokens=3, speculative_topk=4,
              speculative_num_draft_tokens=10)
    assert [o.token_ids for o in llm.generate(prompts, SP)] == vanilla
    print(f"shipped head, tree topk 4 steps 3 budget 10: tau "
          f"{llm.stats.spec.mean_acceptance_length:.3f}")
    # Requests ending at different steps: the accepted nodes' KV moves are made after the next
    # proposal, for the requests that go on only (a finished one's blocks are free by then).
    lens = [13, 48, 29]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
                                  for m in lens])
    assert [o.token_ids for o in outs] == [v[:m] for v, m in zip(vanilla, lens)]
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_blocks

"""``compiled_spec::row_topk``: the draft tree's top-k with a fixed tie rule. The Triton kernel
(``kernels.topk_triton``, one launch or two) runs under TRITON_INTERPRET=1 in a subprocess (the
interpreter must be chosen before triton is imported) and must equal the reference, a stable
descending sort, bit for bit: on ties, -inf, single- and multi-chunk rows."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script (--cuda)
from tests.triton_interpret import run_interpreted  # noqa: E402

CASES = [(1, 5, 1, 1024), (3, 64, 8, 1024), (8, 1000, 8, 256), (2, 32768, 8, 1024),
         (4, 300, 16, 64), (2, 7, 7, 1024)]  # rows, row length, k, chunk size


def _worker(device: str = "cpu", repeats: int = 1) -> None:
    """Under the interpreter (``device`` cpu); ``--cuda`` on a GPU, where the fused stage 2
    relies on memory ordering the interpreter cannot exercise: there each fused call repeats
    ``repeats`` times and must give the reference every time."""
    from kernels.ops import row_topk_logprob_ref, row_topk_ref
    from kernels.topk_triton import row_topk_triton

    g = torch.Generator().manual_seed(0)
    out = {}
    for r, n, k, block in CASES:
        for kind in ("continuous", "ties"):
            if kind == "ties":
                levels = torch.tensor([0.0, -1.0, -2.5, float("-inf")])
                x = levels[torch.randint(0, len(levels), (r, n), generator=g)]
            else:
                x = torch.randn(r, n, generator=g)
            rv, ri = row_topk_ref(x, k)
            x, rv, ri = x.to(device), rv.to(device), ri.to(device)
            # stage 2 in stage 1's launch (by each row's last chunk), and as a launch of its own
            for fused in (True, False):
                ok = True
                for _ in range(repeats if fused else 1):
                    v, i = row_topk_triton(x, k, block=block, fused=fused)
                    ok &= torch.equal(i, ri) and torch.equal(v, rv)
                out[f"{r}x{n}_k{k}_b{block}_{kind}_fused{int(fused)}"] = ok
            # log-probabilities (the tree's children): the same indices, values to rounding
            lv, li = row_topk_logprob_ref(x.cpu(), k)
            lv, li = lv.to(device), li.to(device)
            for fused in (True, False):
                ok = True
                for _ in range(repeats if fused else 1):
                    v, i = row_topk_triton(x, k, block=block, fused=fused, logprob=True)
                    ok &= torch.equal(i, li) and torch.allclose(v, lv, rtol=1e-5, atol=1e-5,
                                                                 equal_nan=True)
                out[f"{r}x{n}_k{k}_b{block}_{kind}_logprob_fused{int(fused)}"] = ok
    from kernels.attention_merge_triton import split_counters

    out["counters_back_at_0"] = bool((split_counters(torch.device(device)) == 0).all())
    print("RESULTS " + json.dumps(out))


@pytest.mark.heavy
def test_triton_row_topk_equals_the_stable_sort() -> None:
    res = run_interpreted(__file__)
    assert res == {k: True for k in res} and len(res) == 8 * len(CASES) + 1, res


def test_row_topk_op_ties_go_to_the_smaller_index_and_k_is_checked() -> None:
    import kernels.ops  # noqa: F401

    x = torch.tensor([[1.0, 3.0, 3.0, -1.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    v, i = torch.ops.compiled_spec.row_topk(x, 3)
    assert i.tolist() == [[1, 2, 4], [0, 1, 2]] and v.tolist() == [[3.0] * 3, [0.0] * 3]
    assert i.dtype == torch.int64 and v.dtype == torch.float32
    for bad in (0, 6):
        with pytest.raises(ValueError, match=f"k={bad}"):
            torch.ops.compiled_spec.row_topk(x, bad)


def test_a_wrong_topk_kernel_is_caught_on_first_use(monkeypatch) -> None:
    """Where the Triton kernel runs, its first call per shape is checked against the
    reference: a kernel that returned the wrong candidates fails loudly, not as lower
    acceptance."""
    import kernels.ops as ops
    import kernels.topk_triton as tt

    monkeypatch.setattr(ops, "_use_triton", lambda t: True)
    monkeypatch.setattr(ops, "_ROW_TOPK_CHECKED", set())
    x = torch.randn(2, 50)
    monkeypatch.setattr(tt, "row_topk_triton", lambda x, k, logprob: ops.row_topk_ref(x, k))
    assert torch.equal(ops.row_topk(x, 4)[1], ops.row_topk_ref(x, 4)[1])  # checked, passes
    monkeypatch.setattr(tt, "row_topk_triton", lambda x, k, logprob: ops.row_topk_ref(-x, k))
    with pytest.raises(RuntimeError, match="row_topk Triton kernel disagrees"):
        ops.row_topk(torch.randn(2, 60), 4)
    # The log-probability form: right indices with raw logits for values is caught too.
    monkeypatch.setattr(tt, "row_topk_triton", lambda x, k, logprob: ops.row_topk_ref(x, k))
    with pytest.raises(RuntimeError, match="row_topk_logprob Triton kernel disagrees"):
        ops.row_topk_logprob(torch.randn(2, 70), 4)


def test_row_topk_logprob_is_the_topk_of_log_softmax() -> None:
    import kernels.ops  # noqa: F401

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 500, generator=g) * 4).bfloat16()  # ties too: bf16 has 8 bits
    v, i = torch.ops.compiled_spec.row_topk_logprob(x, 6)
    want_v, want_i = torch.sort(torch.log_softmax(x.float(), -1), descending=True, stable=True)
    assert torch.equal(i, want_i[:, :6]) and torch.allclose(v, want_v[:, :6], atol=1e-5)
    assert v.dtype == torch.float32 and i.dtype == torch.int64
    with pytest.raises(ValueError, match="row_topk_logprob: k=501"):
        torch.ops.compiled_spec.row_topk_logprob(x, 501)


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
elif __name__ == "__main__" and "--cuda" in sys.argv:
    _worker("cuda", repeats=200)


def test_tree_glue_feeds_the_top_k_the_drafts_own_dtype(monkeypatch, smollm2_gguf_path,
                                                       bigram_eagle3) -> None:
    """The tree's top-k reads the draft's bf16 logits as they are (it converts as it loads):
    no [rows, vocab] fp32 copy before it, a kernel per expansion on the H100."""
    import kernels.ops as ops
    from compiled_spec import LLM

    target, head = bigram_eagle3
    llm = LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=64, dtype="bfloat16",
              draft=head, num_speculative_tokens=2, speculative_topk=2,
              speculative_num_draft_tokens=4)
    glue = llm.engine.runner.proposer.glue
    seen = []
    real = ops._row_topk
    monkeypatch.setattr(ops, "_row_topk", lambda x, k, logprob: seen.append(x.dtype) or
                        real(x, k, logprob))
    h = glue.draft.lm_head.weight.shape[1]
    score, tok = glue.head(torch.randn(3, h, dtype=torch.bfloat16))
    assert seen == [torch.bfloat16] and score.dtype == torch.float32 and tok.shape == (3, 2)

"""The proposers' captured calls contain no op a CUDA graph capture refuses. The emulated graphs
of the other tests cannot see these on the CPU, where every tensor lives on the host: a tensor
built from host data inside the call (``x[i] = True``: a host-to-device copy; the first H200
capture of the tree expansion failed on exactly that), a device-to-host read (``.item()``,
``.tolist()``) or ``nonzero``. The calls run eagerly here under a dispatch mode that records the
top-level ATen ops (custom attention ops are one op each: their GPU versions are Triton kernels)."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from compiled_spec import LLM, SamplingParams

REFUSED = {
    torch.ops.aten.lift_fresh.default: "tensor from host data",
    torch.ops.aten._local_scalar_dense.default: "device-to-host read",
    # Under inference mode (the proposers' calls) .item() dispatches as this, not decomposed.
    torch.ops.aten.item.default: "device-to-host read",
    torch.ops.aten.nonzero.default: "nonzero",
}
PROMPTS = [[3, 7, 1], [5], [9, 2, 4, 4, 8, 1, 2], [11, 12]]


class _Record(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.bad: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func in REFUSED:
            self.bad.append(f"{func} ({REFUSED[func]})")
        return func(*args, **(kwargs or {}))


def _watch(obj: Any, name: str, rec: _Record) -> None:
    fn: Callable[..., Any] = getattr(obj, name)

    def watched(*args: Any, **kwargs: Any) -> Any:
        with rec:
            return fn(*args, **kwargs)

    setattr(obj, name, watched)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_captured_proposer_calls_are_capturable(trained_eagle3_pair, smollm2_gguf_path,
                                                tree: bool) -> None:
    target, head = trained_eagle3_pair
    spec = dict(num_speculative_tokens=3)
    if tree:
        spec.update(speculative_topk=2, speculative_num_draft_tokens=6)
    llm = LLM(model=target, tokenizer=smollm2_gguf_path, draft=head, max_model_len=128,
              max_num_seqs=4, **spec)
    prop = llm.engine.runner.proposer
    rec = _Record()
    # What the propose graphs capture: the tree expansion, or the chain's draft loop (steps
    # 2..k, with their on-device pick).
    _watch(prop, "expand" if tree else "run_loop", rec)
    sps = [SamplingParams(max_tokens=12, temperature=t, seed=1, ignore_eos=True)
           for t in (0.0, 0.8, 0.0, 1.0)]
    llm.generate(PROMPTS, sps)
    assert llm.stats.spec.num_drafting_steps > 0
    assert rec.bad == [], sorted(set(rec.bad))


def test_the_check_sees_a_host_scalar_write() -> None:
    """The recorder is not vacuous: the pattern that broke the H200 capture is flagged."""
    rec = _Record()
    fm = torch.zeros(2, 3, 4, dtype=torch.bool)
    ar = torch.arange(3)
    with rec:
        fm[:, ar, ar] = True
    assert any("lift_fresh" in b for b in rec.bad)

"""Ops one draft-tree expansion issues (``TreeProposer.expand``), on the CPU.

On a GPU the whole expansion (layer 1's top-k, every tree step, node selection, the ancestor
mask) replays as one CUDA graph, ``tree_draft_expand``: every non-view aten op in it is a kernel
of that replay, at a few microseconds each for these tiny shapes. The H200 measured the tree
propose at 1.77 ms against the chain's 0.71 ms (results/2026-12-01_h200_session5/). This counts
the ops per expansion on the tests' tiny bigram target (2 layers) with a random EAGLE-3 head,
eager (the draft step's own ops included: compiled and fused in a real engine), and the "glue"
outside the draft step alone.

.venv/bin/python profiles/scripts/tree_expand_ops_cpu.py
"""
from __future__ import annotations

import sys
import tempfile
from collections import Counter
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from compiled_spec import LLM, SamplingParams  # noqa: E402
from compiled_spec.spec.tree_proposer import TreeProposer  # noqa: E402

VIEWS = {"view", "reshape", "expand", "slice", "select", "t", "transpose", "unsqueeze", "squeeze",
         "as_strided", "_unsafe_view", "alias", "permute", "detach", "lift_fresh", "split",
         "unbind", "_reshape_alias", "resolve_conj", "resolve_neg"}


class Count(TorchDispatchMode):
    """Non-view aten ops, except inside the draft step while ``quiet`` > 0."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.quiet = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if not self.quiet and name not in VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def main() -> int:
    from compiled_spec.draft.testing import write_eagle3_head
    from compiled_spec.models.loader import read_model_config
    from profiles.scripts.host_large_batch_cpu import tokenizer_dir
    from tests.spec_models import write_bigram_target

    results: list[tuple[str, Counter]] = []
    orig = TreeProposer.expand

    def counted(self: TreeProposer, live):  # noqa: ANN001
        for glue in (False, True):  # all ops, then the glue alone (same inputs, same outputs)
            m = Count()
            inner = self.base.step_fn

            def step(*a, **k):  # noqa: ANN002, ANN003
                m.quiet += glue
                try:
                    return inner(*a, **k)
                finally:
                    m.quiet -= glue
            self.base.step_fn = step
            try:
                with m:
                    out = orig(self, live)
            finally:
                self.base.step_fn = inner
            results.append(("glue" if glue else "all", m.ops))
        return out

    TreeProposer.expand = counted  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        target = write_bigram_target(Path(tmp) / "t", vocab=512, hidden=32, layers=2)
        head = write_eagle3_head(str(Path(tmp) / "h"), read_model_config(target),
                                 draft_vocab_size=256, aux_layer_ids=(0, 1, 1))
        for topk, tokens in ((4, 16), (8, 32)):
            results.clear()
            llm = LLM(model=target, tokenizer=tokenizer_dir(), draft=head,
                      num_speculative_tokens=5, speculative_topk=topk,
                      speculative_num_draft_tokens=tokens, max_model_len=256)
            llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=24, temperature=0.0,
                                                          ignore_eos=True))
            every, glue = results[-2][1], results[-1][1]
            print(f"topk {topk}, {tokens} tokens, depth 5: {sum(every.values())} ops per "
                  f"expansion, {sum(glue.values())} outside the draft step; "
                  f"glue by op: {dict(glue.most_common(12))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

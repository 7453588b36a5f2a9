"""Kernels one draft-tree propose's expansion (``TreeProposer.expand``) runs, eager vs compiled,
on the CPU.

On a GPU the whole expansion replays as one CUDA graph (``tree_draft_expand``), and each of its
kernels costs the GPU ~1 us at the least: on the H200 the expand graph's 341 kernels took
~0.76 ms of GPU time in tiny kernels (results/2026-12-01_h200_session6/; its ~0.5 ms of launch
in that trace was the profiler's own cost, results/2026-12-01_h200_session7/).
Under compile=True the expansion's parts (layer 1's top-k, each expansion with its glue, the
node selection) are compiled whole, so Inductor fuses the glue. This counts, for one expand
call on the tests' tiny bigram target with a random EAGLE-3 head: eager, every top-level aten
op (each one kernel on a GPU); compiled, Inductor's fused kernels (``cpp_fused_*``, one
Triton kernel each on a GPU, roughly) plus the aten ops its code calls (mm, topk, sort, ...).

.venv/bin/python profiles/scripts/tree_expand_kernels_cpu.py
"""
from __future__ import annotations

import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from compiled_spec import LLM, SamplingParams  # noqa: E402
from compiled_spec.spec.tree_proposer import TreeProposer  # noqa: E402

VIEWS = {"view", "reshape", "expand", "slice", "select", "t", "transpose", "unsqueeze", "squeeze",
         "as_strided", "_unsafe_view", "alias", "permute", "detach", "lift_fresh", "split",
         "unbind", "_reshape_alias", "resolve_conj", "resolve_neg", "empty", "empty_strided",
         "contiguous", "to", "_to_copy_view", "size", "stride", "numel", "is_nonzero"}


def kernels(events) -> Counter:  # noqa: ANN001
    """Top-level ops of a profile: aten ops not nested in another op (views and allocations
    left out), our custom ops (attention, KV write: one Triton kernel each on a GPU, a
    reference of many aten ops on the CPU, which are not counted), Inductor's C++ kernels."""
    evs = sorted((e for e in events if e.name.startswith(("aten::", "compiled_spec::"))
                  or "cpp_fused" in e.name),
                 key=lambda e: e.time_range.start)
    out: Counter = Counter()
    end = -1.0
    for e in evs:
        if "cpp_fused" in e.name:  # graph_<i>_cpp_fused_...
            out["<inductor kernel>"] += 1
            continue
        if e.time_range.start < end:  # inside the previous top-level aten op
            continue
        end = e.time_range.end
        name = e.name.split("::", 1)[1] if e.name.startswith("aten::") else e.name
        if name not in VIEWS:
            out[name] += 1
    return out


def main() -> int:
    from compiled_spec.draft.testing import write_eagle3_head
    from compiled_spec.models.loader import read_model_config
    from profiles.scripts.host_large_batch_cpu import tokenizer_dir
    from tests.spec_models import write_bigram_target

    inductor_config.cpp.enable_kernel_profile = True  # C++ kernels show in the profile
    orig = TreeProposer.expand
    seen: list[Counter] = []

    def profiled(self: TreeProposer, live):  # noqa: ANN001
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = orig(self, live)
        seen.append(kernels(prof.events()))
        return out

    TreeProposer.expand = profiled  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        target = write_bigram_target(Path(tmp) / "t", vocab=512, hidden=32, layers=2)
        head = write_eagle3_head(str(Path(tmp) / "h"), read_model_config(target),
                                 draft_vocab_size=256, aux_layer_ids=(0, 1, 1))
        for topk, tokens in ((4, 16), (8, 32)):
            outs = {}
            for compiled in (False, True):
                seen.clear()
                llm = LLM(model=target, tokenizer=tokenizer_dir(), draft=head,
                          num_speculative_tokens=5, speculative_topk=topk,
                          speculative_num_draft_tokens=tokens, max_model_len=256,
                          compile=compiled)
                outs[compiled] = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(
                    max_tokens=24, temperature=0.0, ignore_eos=True))[0].token_ids
                last = seen[-1]
                label = "compiled" if compiled else "eager"
                print(f"topk {topk}, {tokens} tokens, depth 5, {label}: {sum(last.values())} "
                      f"kernels per expand; {dict(last.most_common(10))}", flush=True)
            assert outs[False] == outs[True], "compiled and eager outputs differ"
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

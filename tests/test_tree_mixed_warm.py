"""A tree step where some requests verify trees and others decode plainly (``not_all_tree``: a
request within two tokens of its end) stages its verify from device tensors (scatters of the
trees into the batch, a tree mask and depths built on the device, the verify graph fed from
them): eager kernels no other step launches. On the H200 (bench of topk 8 / 32 nodes, batch 4
and 16) that one step per run took 160-230 ms against a 2.3-2.9 ms median: the first launch of
each such kernel in the process (lazy CUDA module loading; ~70 ms for the staging alone in a
micro-benchmark there), no Dynamo compile and no graph miss. Start-up (``capture_graphs``) now
runs a dummy mixed step (``engine.tree_verify.warm_mixed_verify``): this test holds every
kernel of a mixed step to have been launched before, at start-up or in the warm-up generate.

Kernels are counted on the CPU by a dispatch mode as (op, dtypes, ranks), outside graph
replays (a replay launches nothing new), view ops left out."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from capture import CapturePolicy
from capture.emulate import EmulatedGraph
from compiled_spec import LLM, SamplingParams
from compiled_spec.compile import CompileConfig, capture_graphs, compile_models
from compiled_spec.engine.stats import counts_since
from compiled_spec.engine.tree_verify import warm_mixed_verify
from compiled_spec.engine.warm_paths import warm_uncaptured_paths

D, TOPK, N = 3, 2, 6
PROMPTS = [[3, 7, 1, 4], [5, 2, 9, 9], [9, 2, 4, 4], [11, 12, 6, 1]]


def _sig(a):
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.dim())
    if isinstance(a, (list, tuple)):
        return tuple(_sig(x) for x in a if isinstance(x, (torch.Tensor, list, tuple)))
    return None


class _Kernels(TorchDispatchMode):
    """Records each kernel-launching op's (op, dtypes, ranks) not seen before as ``new``."""

    def __init__(self, seen: set) -> None:
        super().__init__()
        self.seen, self.new = seen, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func is not torch.ops.aten.lift_fresh.default:
            key = (str(func), tuple(_sig(a) for a in args))
            if key not in self.seen:
                self.seen.add(key)
                self.new.append(key)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def no_modes_in_graphs(monkeypatch):
    """Emulated captures and replays run outside the mode (Dynamo refuses it; on a GPU a
    replay is one launch)."""
    init, replay = EmulatedGraph.__init__, EmulatedGraph.replay

    def init_(self, *a, **k):
        with _disable_current_modes():
            init(self, *a, **k)

    def replay_(self):
        with _disable_current_modes():
            replay(self)
    monkeypatch.setattr(EmulatedGraph, "__init__", init_)
    monkeypatch.setattr(EmulatedGraph, "replay", replay_)


def test_mixed_tree_step_launches_no_kernel_first(trained_eagle3_pair, smollm2_gguf_path,
                                                   no_modes_in_graphs):
    target, head = trained_eagle3_pair
    llm = LLM(model=target, tokenizer=smollm2_gguf_path, draft=head, max_model_len=96,
              max_num_seqs=4, page_size=4, num_kv_blocks=128, num_speculative_tokens=D,
              speculative_topk=TOPK, speculative_num_draft_tokens=N, verify_ahead=True)
    models = compile_models(llm.engine.runner, CompileConfig(inductor=False))
    llm._compiled = models
    policy = CapturePolicy(max_batch_size=4, num_speculative_tokens=D, max_model_len=96,
                           batch_sizes=(1, 2, 4), seq_len_buckets=(96,))
    seen: set = set()
    with _Kernels(seen):  # start-up: capture (and the mixed step's warm-up)
        graphs = capture_graphs(llm.engine.runner, models, policy, 4, emulate=True)
    runner = llm.engine.runner
    execute, propose = runner.execute, runner.propose
    per_step: list[tuple[list[bool], list]] = []  # (in_tree, kernels first seen in the step)
    decoding = [False]

    def execute_(reqs, num_new):
        decoding[0] = all(n == 1 for n in num_new)  # a prefill runs compiled outside graphs
        if not decoding[0]:
            return execute(reqs, num_new)
        mode = _Kernels(seen)
        with mode:
            out = execute(reqs, num_new)
        per_step.append(([d > 0 for d in out.num_draft], mode.new))  # trees, plain requests
        return out

    def propose_(reqs, accepted, draft=True):
        if not decoding[0]:  # the first pass after a prefill: compiled, no graph
            return propose(reqs, accepted, draft)
        mode = _Kernels(seen)
        with mode:
            propose(reqs, accepted, draft)
        per_step[-1][1].extend(mode.new)

    runner.execute, runner.propose = execute_, propose_
    # The bench's warm-up, 16 tokens; one prompt, so no step mixes trees and plain requests.
    # Start-up's dummy requests (engine/warm_paths.py), whose last round runs with the early
    # paths off: the late path (host-side KV moves, the late propose) has its first launches
    # there. Greedy steps near their end propose early since the forty-second session, sampled
    # ones and logprobs since the fifty-third, so its first steps could otherwise be the
    # mixed ones. Then the bench's warm-up, 16 tokens.
    warm_uncaptured_paths(llm.engine)
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm.generate([PROMPTS[0]] * 4, [sp] * 4, use_tqdm=False)
    per_step.clear()  # (the warm-up's own steps may mix: what counts is the run below)
    before = llm.stats.early_propose.as_dict()
    sps = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (40, 34, 27, 21)]
    llm.generate(PROMPTS, sps, use_tqdm=False)
    late = counts_since(before, llm.stats.early_propose.as_dict())["late_reasons"]
    mixed = [new for in_tree, new in per_step if any(in_tree) and not all(in_tree)]
    assert late.get("not_all_tree", 0) > 0 and mixed, (late, len(per_step))
    assert all(new == [] for new in mixed), mixed
    assert graphs.stats()["without_graph"].get("target_tree_verify", {}) == {}


def test_mixed_warm_up_tables_cover_trees_past_two_pages(trained_eagle3_pair,
                                                         smollm2_gguf_path):
    """The warm-up's dummy tree of N nodes needs block tables of ceil(N / page_size) entries.
    With one-block tables (zero-padded to two) a tree past two pages made the Triton kernel
    read table entries past the tensor's end: an illegal address on the H200 for topk 8 /
    48 nodes (page 16). The CPU reference's gathers clamp the index (its table check now
    refuses short tables too); this checks the warm-up's metadata itself."""
    target, head = trained_eagle3_pair
    page, n = 4, 10  # 3 pages
    llm = LLM(model=target, tokenizer=smollm2_gguf_path, draft=head, max_model_len=96,
              max_num_seqs=4, page_size=page, num_kv_blocks=128, num_speculative_tokens=D,
              speculative_topk=4, speculative_num_draft_tokens=n)
    runner = llm.engine.runner
    seen = []
    target_fn = runner.target_fn

    def spy(input_ids, positions, meta, aux_ids):
        seen.append(meta)
        return target_fn(input_ids, positions, meta, aux_ids)
    runner.target_fn = spy
    warm_mixed_verify(runner)
    (meta,) = seen
    assert meta.seq_lens.tolist() == [n, 1]  # the tree's keys, the one-node request's
    assert meta.tree_start.tolist() == [0, 0]
    assert meta.block_tables.shape[1] * page >= n, meta.block_tables.shape

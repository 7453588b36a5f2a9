"""What the engine counts while it runs (``llm.stats``)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from compiled_spec.engine.deferred_first_pass import DeferredStats
from compiled_spec.engine.early_propose import EarlyProposeStats
from compiled_spec.engine.prompt_head import PromptHeadStats
from compiled_spec.engine.verify_ahead import VerifyAheadStats
from compiled_spec.spec.metrics import SpecStats
from compiled_spec.spec.policy import SpecPolicy


@dataclass
class EngineStats:
    num_steps: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0  # tokens emitted by decode/verify steps
    num_preemptions: int = 0
    num_aborted: int = 0
    num_requests_without_speculation: int = 0  # ran plain decoding in a speculative engine
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    num_step_faults: int = 0  # steps that raised (their requests retried alone or aborted)
    # Wall time inside step(), and the part of it spent in steps that carried a prompt chunk
    # (those run without a CUDA graph): where large-batch generation time goes.
    step_s: float = 0.0
    num_prefill_steps: int = 0
    prefill_step_s: float = 0.0
    # The latest decode steps' wall times (no prompt chunk), newest last: their spread (a few
    # slow steps or uniformly slow ones) for the benchmarks.
    recent_decode_step_s: deque = field(default_factory=lambda: deque(maxlen=8192))
    recent_prefill_step_s: deque = field(default_factory=lambda: deque(maxlen=1024))  # likewise
    # Of step_s: the host blocked in the steps' device-to-host copies (waiting for the GPU).
    # Small against step_s: the steps are host-bound, and the GPU idles for the rest.
    host_wait_s: float = 0.0
    # Of step_s: seconds per phase of the decode steps (engine/host_clock.py; "wait" is the
    # host_wait_s of those steps), and of the steps that carried a prompt (prefill_step_s)
    host_phase_s: dict[str, float] = field(default_factory=dict)
    prompt_host_phase_s: dict[str, float] = field(default_factory=dict)
    # Target forwards launched on a GPU, and how many found it idle (every earlier launch's work
    # done: host-bound there); few idle with slow host phases: launches blocked on a full
    # queue, i.e. GPU-bound (engine/host_clock.py, GpuIdleProbe)
    verify_launches: int = 0
    verify_launches_gpu_idle: int = 0
    # speculation_policy="adaptive": its choices and estimates per batch bucket (.summary())
    policy: SpecPolicy | None = None
    # Speculative engines: steps that proposed before the host read their acceptance, and the
    # late ones with why (engine/early_propose.py, early_tree.py); None for vanilla engines.
    early_propose: EarlyProposeStats | None = None
    # Next-step target forwards launched before the bookkeeping (vanilla decode, chains),
    # taken or discarded and why (engine/verify_ahead.py).
    verify_ahead: VerifyAheadStats | None = None
    spec: SpecStats = field(default_factory=SpecStats)
    # Adaptive engines: paused steps whose draft first pass was deferred, and its flushes
    # (engine/deferred_first_pass.py); None where nothing defers.
    deferred_first_pass: DeferredStats | None = None
    # Speculative engines: prompt steps whose heads' draft KV was written while the host
    # waited for the step's tokens, and those written later with why (engine/prompt_head.py)
    prompt_head: PromptHeadStats | None = None
    # Python's full (generation-2) garbage collections that ran inside steps, their total
    # seconds and the longest (per collection; a step's collections, nearly always one, share
    # its pause evenly): each pauses a step by the whole heap's walk (compiled_spec/gc_heap.py).
    gc_full_collections: int = 0
    gc_full_s: float = 0.0
    gc_full_max_s: float = 0.0

    def count_gc(self, n: int, seconds: float) -> None:
        self.gc_full_collections += n
        self.gc_full_s += seconds
        self.gc_full_max_s = max(self.gc_full_max_s, seconds / n)


def counts_since(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What a counters snapshot (``as_dict()`` of ``EarlyProposeStats``, ``VerifyAheadStats``)
    gained between two reads: ints subtracted, per-reason dicts keeping only the reasons that
    grew."""
    out: dict[str, Any] = {}
    for k, v in after.items():
        if isinstance(v, dict):
            out[k] = {r: n - before[k].get(r, 0) for r, n in v.items()
                      if n > before[k].get(r, 0)}
        else:
            out[k] = v - before[k]
    return out

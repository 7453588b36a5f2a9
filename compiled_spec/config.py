"""The engine's configuration tree: small typed dataclasses validated in __post_init__."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from compiled_spec.spec.tree import TreeConfig

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' is bf16 on a GPU and fp32 on the CPU (where bf16 matmuls are slow and inexact)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype={dtype}: supported are float32, bfloat16, float16")
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected 'auto' or one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: supported are 'cpu' and 'cuda'")
    return dev


@dataclass
class CacheConfig:
    page_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # None: sized from memory_gib
    memory_gib: float | None = None  # KV budget when num_blocks is not given (None: see below)
    prefix_caching: bool = False  # reuse the KV of full blocks shared with earlier requests
    prefix_caching_mode: str = "successor"  # "successor" | "recompute" (see prefix_cache.py)

    def __post_init__(self) -> None:
        if self.prefix_caching_mode not in ("successor", "recompute"):
            raise ValueError(f"prefix_caching_mode={self.prefix_caching_mode!r}: expected "
                             "'successor' or 'recompute'")
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size={self.page_size!r}: must be a positive integer")
        if self.num_blocks is not None and (isinstance(self.num_blocks, bool) or not isinstance(
                self.num_blocks, int) or self.num_blocks < 1):
            raise ValueError(f"num_kv_blocks={self.num_blocks!r}: must be a positive integer")
        if self.memory_gib is not None and (isinstance(self.memory_gib, bool) or not isinstance(
                self.memory_gib, (int, float)) or not 0 < self.memory_gib < float("inf")):
            raise ValueError(f"kv_cache_memory_gib={self.memory_gib!r}: must be a finite number > 0")


def auto_min_admit(max_num_seqs: int) -> int:
    """The default bulk-admission size: a quarter of the batch. Why: speculative requests end at
    different steps (acceptance varies), so admitting each freed slot alone cost EAGLE-3 122
    prompt steps for 256 requests at batch 64 (vanilla, whose requests ended together: 8), and
    those steps were 3.3 of its 4.4 s (H200, 2026-12-03, ``bench --waves 4``). A quarter keeps
    the batch at least 3/4 full; batches below 8 admit at once."""
    return max(1, max_num_seqs // 4)


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 8  # running requests per step
    max_num_batched_tokens: int = 4096  # prompt tokens admitted per step (a long prompt may exceed it alone)
    # While requests run, waiting ones start only when at least this many can start together
    # (or every waiting one can): fewer, larger prefill steps. A step with a prompt runs
    # without a CUDA graph and is host-bound (H200, SmolLM2: 15-26 ms against 1.3-3 ms for a
    # decode step, ~40 ms at batch 1,024, whatever the prompt count), so a backlog is admitted
    # in bulk. 1 = admit whenever a slot frees (lowest time to first token); None =
    # ``auto_min_admit(max_num_seqs)``.
    min_admit: int | None = None

    def __post_init__(self) -> None:
        if self.min_admit is not None and (isinstance(self.min_admit, bool)
                                           or not isinstance(self.min_admit, int)
                                           or self.min_admit < 1):
            raise ValueError(f"min_admit={self.min_admit!r}: must be a positive integer or None")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs!r}: must be a positive integer")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens!r}: must be a positive integer")


@dataclass
class SpecConfig:
    draft: str  # path of the draft head (Hugging Face layout)
    method: str | None = None  # "eagle" | "eagle3"; None: detected from the checkpoint
    num_speculative_tokens: int = 3
    draft_sampling: str = "argmax"  # "argmax" (vLLM's default) or "sample" (keeps q for the test)
    # Draft trees (EAGLE-2): on when speculative_topk > 1; num_steps defaults to k and
    # num_draft_tokens (verification budget, root included) to k * topk + 1, capped.
    speculative_topk: int = 1
    speculative_num_steps: int | None = None
    speculative_num_draft_tokens: int | None = None
    # "always" drafts every step; "adaptive" pauses drafting when measured step costs and
    # acceptance say plain decoding is faster at this batch size (compiled_spec/spec/policy.py).
    speculation_policy: str = "always"
    # "adaptive" only: smaller draft counts it may verify instead of k (each 1..k-1), where
    # verifying k + 1 rows per request costs more than the late drafts bring (a compute-bound
    # verify at large batch). Each gets verify CUDA graphs of its own; () = pause only.
    adaptive_k: tuple[int, ...] = ()
    # Greedy chain and tree steps launch the next proposal before the host reads the
    # acceptance (compiled_spec/engine/early_propose.py, early_tree.py); False: always after.
    early_propose: bool = True
    # "adaptive" only: a paused step keeps its one position's target states for a later draft
    # first pass over many such steps at once (compiled_spec/engine/deferred_first_pass.py);
    # False: every paused step runs the draft's first pass itself.
    defer_paused_first_pass: bool = True
    # Paused steps per such first pass (its CUDA graphs' rows per request); None: up to 32,
    # fewer where max_num_seqs times it would pass 2048 rows (``flush_depth``).
    paused_flush_depth: int | None = None
    # A full ring's flush runs behind the next target forward's launch, its host work beside
    # the GPU's forward (forty-ninth session); False: in the deferral that filled the ring,
    # before that launch, the GPU idle meanwhile
    flush_behind_launch: bool = True
    # A prompt step writes the draft KV of each prompt's head (its positions before the
    # graphed proposal's) while the host waits for the step's tokens
    # (compiled_spec/engine/prompt_head.py); False: in the proposal, after that wait
    early_prompt_head: bool = True
    # "adaptive" only: True ends a paused batch's probe of drafting once its own verifications
    # have tried SpecPolicy.probe_trials first drafts and lose to plain decoding. Opt-in: on
    # the H100 (forty-fifth session) it measured no gain (batch 1 +1.3%, batch 64 -8.9% at the
    # median, both inside the rounds' spread); False: probes run their length
    cut_losing_probes: bool = False
    # "adaptive" only: a paused batch's probes of drafting go farther apart where drafting costs
    # more against plain steps, and its probes of new requests back off while they lose
    # (SpecPolicy.probe_cost_ref / fresh_backoff, forty-sixth session); False: neither
    probe_backoff: bool = True

    @property
    def tree(self) -> "TreeConfig | None":
        from compiled_spec.spec.tree import TreeConfig

        if not is_tree(self.speculative_topk, self.speculative_num_draft_tokens):
            return None
        steps = self.speculative_num_steps or self.num_speculative_tokens
        cap = 1 + self.speculative_topk + (steps - 1) * self.speculative_topk ** 2
        n = self.speculative_num_draft_tokens or min(cap, steps * self.speculative_topk + 1)
        return TreeConfig(self.speculative_topk, steps, n)

    def __post_init__(self) -> None:
        if self.method not in (None, "eagle", "eagle3"):
            raise ValueError(f"method={self.method!r}: expected 'eagle', 'eagle3' or None")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"num_speculative_tokens={k!r}: must be an integer >= 1")
        if self.draft_sampling not in ("argmax", "sample"):
            raise ValueError(f"draft_sampling={self.draft_sampling!r}: expected 'argmax' or 'sample'")
        t = self.speculative_topk
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise ValueError(f"speculative_topk={t!r}: must be an integer >= 1")
        self.tree  # validates the tree parameters (TreeConfig raises naming the bad one)
        if self.speculation_policy not in ("always", "adaptive"):
            raise ValueError(f"speculation_policy={self.speculation_policy!r}: expected "
                             "'always' or 'adaptive'")
        if not isinstance(self.adaptive_k, (tuple, list)):
            raise ValueError(f"adaptive_k={self.adaptive_k!r}: expected a tuple of integers")
        ks = tuple(self.adaptive_k)
        for w in ks:
            if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w < k:
                raise ValueError(f"adaptive_k={ks!r}: {w!r} is not an integer in 1..{k - 1} "
                                 f"(below num_speculative_tokens={k})")
        if ks and self.speculation_policy != "adaptive":
            raise ValueError(f"adaptive_k={ks!r} needs speculation_policy='adaptive' (got "
                             f"{self.speculation_policy!r})")
        self.adaptive_k = tuple(sorted(set(ks), reverse=True))
        if not isinstance(self.defer_paused_first_pass, bool):
            raise ValueError(f"defer_paused_first_pass={self.defer_paused_first_pass!r}: "
                             "must be a bool")
        if not isinstance(self.flush_behind_launch, bool):
            raise ValueError(f"flush_behind_launch={self.flush_behind_launch!r}: must be a bool")
        if not isinstance(self.early_prompt_head, bool):
            raise ValueError(f"early_prompt_head={self.early_prompt_head!r}: must be a bool")
        if not isinstance(self.cut_losing_probes, bool):
            raise ValueError(f"cut_losing_probes={self.cut_losing_probes!r}: must be a bool")
        if not isinstance(self.probe_backoff, bool):
            raise ValueError(f"probe_backoff={self.probe_backoff!r}: must be a bool")
        d = self.paused_flush_depth
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"paused_flush_depth={d!r}: must be an integer >= 1 or None")
        if self.speculation_policy == "adaptive" and self.tree is not None:
            raise ValueError("speculation_policy='adaptive' is not supported with draft trees "
                             f"(speculative_topk={t}): use 'always' or a chain (topk 1)")


def verify_ahead_default(device: torch.device) -> bool:
    """EngineConfig.verify_ahead when not given: COMPILED_SPEC_VERIFY_AHEAD (0 or 1) if set, else
    on for CUDA devices only. A CPU runs each op as it is issued, so a forward launched ahead
    overlaps nothing there and the one a request's last step launches is wasted work."""
    env = os.environ.get("COMPILED_SPEC_VERIFY_AHEAD")
    if env is not None:
        return env != "0"
    return device.type == "cuda"


def is_tree(speculative_topk: int, speculative_num_draft_tokens: int | None) -> bool:
    """Whether these speculative options ask for a draft tree (``SpecConfig.tree``)."""
    return speculative_topk != 1 or speculative_num_draft_tokens is not None


def speculation_policy_default(device: torch.device, tree: bool, tensor_parallel: int = 1) -> str:
    """SpecConfig.speculation_policy when not given: COMPILED_SPEC_SPECULATION_POLICY if set, else
    "adaptive" for chains on one CUDA device, "always" otherwise. On the H100 (thirty-sixth
    session, one process, batch 1 / 4 / 16 / 64) the adaptive chain ran within 1.5% of always
    drafting at every batch; on a slower host (thirty-fourth session) always drafting lost to
    vanilla at batch 4 and 64 and the adaptive chain was the best EAGLE row at 16 and 64.
    Trees have no adaptive policy; a CPU's step costs say nothing about a GPU's, and its tests
    want every step drafted; under tensor parallel each rank would time its own steps and
    could choose another mode than the rest."""
    env = os.environ.get("COMPILED_SPEC_SPECULATION_POLICY")
    if env is not None:
        if env not in ("always", "adaptive"):
            raise ValueError(f"COMPILED_SPEC_SPECULATION_POLICY={env!r}: expected 'always' or "
                             "'adaptive'")
        if env == "adaptive" and (tree or tensor_parallel > 1):
            raise ValueError(f"COMPILED_SPEC_SPECULATION_POLICY={env!r} with a draft tree or "
                             f"tensor_parallel_size={tensor_parallel}: neither supports it")
        return env
    return "adaptive" if device.type == "cuda" and not tree and tensor_parallel == 1 else "always"


def early_propose_default() -> bool:
    """SpecConfig.early_propose when not given: on unless COMPILED_SPEC_EARLY_PROPOSE=0."""
    return os.environ.get("COMPILED_SPEC_EARLY_PROPOSE", "1") != "0"


@dataclass
class EngineConfig:
    model: str
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    cache: CacheConfig
    scheduler: SchedulerConfig
    seed: int = 0  # seeds the per-request seeds of requests that give none
    spec: SpecConfig | None = None
    # A step launches the next one's target forward before the engine's bookkeeping: greedy
    # decode steps from the device argmax, early chain steps from their drafts
    # (compiled_spec/engine/verify_ahead.py). On the H200 (fifteenth session, `bench --ab
    # verify_ahead`, batch 1): vanilla 880.8 -> 986.8 tok/s, chain k=5 1898.6 -> 1937.3.
    verify_ahead: bool = True
    # Collect once when ready and freeze the survivors, so that no full collection walks the
    # compiled state mid-serving (compiled_spec/gc_heap.py; on for CUDA: ``freeze_default``).
    gc_freeze: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_model_len, int) or self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len!r}: must be an integer >= 2")

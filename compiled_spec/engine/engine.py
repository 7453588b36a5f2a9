"""The engine loop: admit requests, schedule a batch, run it, finish requests."""
from __future__ import annotations

import logging
import math
import random
import time

from torch import nn

from compiled_spec.config import EngineConfig
from compiled_spec.draft.model import EagleDraft
from compiled_spec.engine.deferred_first_pass import (DeferredFirstPass, DeferredStats,
                                                      flush_depth)
from compiled_spec.engine.early_propose import EarlyProposeStats
from compiled_spec.engine.kv_pool import build_kv_pool
from compiled_spec.engine.model_runner import ModelRunner
from compiled_spec.engine.prompt_head import PromptHeadStats
from compiled_spec.engine.request import CompletionOutput, Request, RequestOutput, Status
from compiled_spec.engine.scheduler import Scheduler
from compiled_spec.engine.stats import EngineStats
from compiled_spec.engine.stopping import emit_count, output_text, stop_reason
from compiled_spec.engine.validation import require_params, validate_prompt, validate_request
from compiled_spec.engine.verify_ahead import VerifyAheadStats
from compiled_spec.gc_heap import CLOCK as GC_CLOCK
from compiled_spec.models.decoder import CausalLM
from compiled_spec.models.fuse import fuse_projections
from compiled_spec.prefix_cache import block_keys, matchable_blocks
from compiled_spec.sampling_params import SamplingParams
from compiled_spec.spec.metrics import SpecStats
from compiled_spec.spec.policy import PLAIN, SPEC, SpecPolicy, mode_k, shrunk
from compiled_spec.spec.proposer import EagleProposer
from kernels.warmup import warm_model_attention
from kernels.warmup_parallel import overlap_enabled

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, cfg: EngineConfig, model: CausalLM, eos_token_ids: list[int], detokenize,
                 draft: EagleDraft | None = None) -> None:
        self.cfg = cfg
        # One GEMM for q/k/v and one for gate/up in every layer (views keep the checkpoint names):
        # fewer kernel launches per decode step, eager and compiled alike.
        fuse_projections(model)
        if draft is not None:
            fuse_projections(draft)
        self.model = model
        self.draft = draft
        mcfg = model.config
        self.allocator, self.kv_caches = build_kv_pool(cfg, model, draft)
        model.bind_kv_cache(self.kv_caches[:mcfg.num_hidden_layers])
        proposer, aux_ids = None, ()
        k = cfg.spec.num_speculative_tokens if cfg.spec is not None else 0
        if draft is not None:
            draft.bind_kv_cache(self.kv_caches[mcfg.num_hidden_layers:])
            proposer = EagleProposer(draft, self.allocator, cfg.device, k,
                                     cfg.spec.draft_sampling == "sample", mcfg.vocab_size)
            proposer.capture_sync = cfg.spec.speculation_policy == "adaptive"
            if proposer.capture_sync and cfg.spec.defer_paused_first_pass:
                # the sync graphs take a whole flush: its depth of rows per request
                proposer.sync_rows = flush_depth(cfg.spec.paused_flush_depth, k,
                                                 cfg.scheduler.max_num_seqs)
            if draft.config.method == "eagle3":
                aux_ids = tuple(draft.config.aux_layer_ids)
        # Uncaptured calls (prefills above all) meet attention launch configurations that no
        # graph capture compiled: compile every reachable one now (CUDA only), not inside the
        # first request of each new prompt-length class.
        attn = self.attention_layers(target=True, draft=True)
        # A cold cache's compile workers keep running while the model compiles (start-up joins
        # them at the first attention launch or at its end: kernels/warmup_pending.py).
        self.kernel_warmup = warm_model_attention(attn, cfg.max_model_len, cfg.max_model_len,
                                                  defer=overlap_enabled())
        tree = cfg.spec.tree if cfg.spec is not None else None
        self.tree = tree
        self.scheduler = Scheduler(cfg.scheduler, self.allocator,
                                   lookahead=tree.lookahead if tree is not None else k,
                                   on_admit=self._match_prefix if cfg.cache.prefix_caching
                                   else None)
        # Speculative engines key cached blocks with their successor token ("successor" mode)
        # or drop the last matched block ("recompute"); see compiled_spec/prefix_cache.py.
        self._successor_keys = draft is not None and cfg.cache.prefix_caching_mode == "successor"
        if tree is not None:
            from compiled_spec.engine.tree_runner import TreeModelRunner

            self.runner: ModelRunner = TreeModelRunner(
                model, self.allocator, cfg.device, cfg.max_model_len, proposer, aux_ids, tree=tree)
        else:
            self.runner = ModelRunner(model, self.allocator, cfg.device, cfg.max_model_len,
                                      proposer, aux_ids)
            if (proposer is not None and cfg.spec.speculation_policy == "adaptive"
                    and cfg.spec.defer_paused_first_pass):
                self.runner.deferred = DeferredFirstPass(proposer, self.allocator,
                                                         proposer.sync_rows,
                                                         cfg.scheduler.max_num_seqs,
                                                         cfg.spec.flush_behind_launch)
        self.eos_token_ids = set(eos_token_ids)
        self.detokenize = detokenize
        self._rng = random.Random(cfg.seed)
        self._next_id = 0
        self.runner.prompt_head.enabled = cfg.spec is not None and cfg.spec.early_prompt_head
        early = self.runner.early if draft is not None else None
        if early is not None:
            early.enabled = cfg.spec.early_propose
        # Vanilla greedy decode and early chain and tree steps launch the next step ahead.
        self.runner.ahead.enabled = cfg.verify_ahead and (cfg.spec is None
                                                          or cfg.spec.early_propose)
        self.runner.ahead.eos_token_ids = self.eos_token_ids
        self.runner.ahead.admits_next = self.scheduler.admits_next
        self.reset_stats()
        self._mode_prev = SPEC  # the last proposal's mode: what this step verifies
        self._obs: tuple[int, str, float] | None = None  # this step, if steady: (B, mode, tau)

    def attention_layers(self, target: bool, draft: bool) -> list[nn.Module]:
        """The attention modules of the target's layers and/or the draft's (the kernel
        warm-ups' list)."""
        attn = [layer.self_attn for layer in self.model.model.layers] if target else []
        if draft and self.draft is not None:
            attn += [layer.self_attn for layer in self.draft.layers]
        return attn

    def reset_stats(self) -> None:
        """Every counter back to zero (after start-up's dummy requests,
        compiled_spec/engine/warm_paths.py): what users read counts their requests. Request
        ids go on increasing: state keyed by id (drafts, a verify launched ahead) can never be
        taken for a later request's."""
        self.stats = EngineStats()
        if self.cfg.spec is not None and self.cfg.spec.speculation_policy == "adaptive":
            # dummy steps' costs (compiles) taught it nothing
            spec = self.cfg.spec
            self.stats.policy = SpecPolicy(modes=(SPEC, *map(shrunk, spec.adaptive_k), PLAIN),
                                           k=self.runner.k,
                                           probe_trials=SpecPolicy.probe_trials
                                           if spec.cut_losing_probes else None,
                                           probe_cost_ref=SpecPolicy.probe_cost_ref
                                           if spec.probe_backoff else math.inf,
                                           fresh_backoff=spec.probe_backoff)
        if self.draft is not None and self.runner.early is not None:
            self.runner.early.stats = EarlyProposeStats()
            self.stats.early_propose = self.runner.early.stats
        if self.draft is not None:
            self.runner.prompt_head.stats = self.stats.prompt_head = PromptHeadStats()
        if self.runner.deferred is not None:
            self.runner.deferred.stats = self.stats.deferred_first_pass = DeferredStats()
        self.runner.ahead.stats = VerifyAheadStats()
        self.stats.verify_ahead = self.runner.ahead.stats
        self.runner.host_wait_s = 0.0
        self.runner.clock.reset()
        self.stats.host_phase_s = self.runner.clock.seconds
        self.stats.prompt_host_phase_s = self.runner.clock.prompt_seconds
        self.runner.gpu_probe.launches = self.runner.gpu_probe.idle = 0
        self.scheduler.num_preemptions = 0

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """Raise ValueError naming what is wrong with a request; touches no state. Returns the
        prompt as Python ints (numpy integers are token ids too; booleans are not)."""
        return validate_request(prompt_token_ids, params, self.model.config.vocab_size,
                                self.cfg.max_model_len, self.allocator)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None) -> int:
        """Validate and queue a request. Bad input raises here and leaves the engine untouched.
        The engine keeps a validated copy of ``params``: later changes to the caller's object do
        not reach the running request."""
        params = require_params(params).checked_copy()  # validated once, on the kept copy
        ids = validate_prompt(prompt_token_ids, self.model.config.vocab_size,
                              self.cfg.max_model_len, self.allocator)
        n = len(ids)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        max_len = self.cfg.max_model_len
        req = Request(req_id=self._next_id, prompt_token_ids=ids, params=params,
                      seed=seed, max_total_tokens=min(n + params.max_tokens, max_len),
                      kv_limit=min(n + params.max_tokens + self.scheduler.lookahead, max_len),
                      prompt=prompt, spec_enabled=self.draft is not None and params.speculate)
        if self.draft is not None:
            req.spec_stats = SpecStats()
            if not req.spec_enabled:
                self.stats.num_requests_without_speculation += 1
        self._next_id += 1
        self.scheduler.add(req)
        return req.req_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Request]:
        """Run one engine step; returns the requests that finished in it.

        A step that raises does not break the engine: its requests' blocks are freed and the
        runner forgets its drafts; alone in the step, the request is finished with
        finish_reason="abort" and the error, else every request of the step is retried alone
        (recomputed, as after preemption, so outputs do not change) to find the one at fault.
        """
        t0 = time.perf_counter()
        clock = self.runner.clock
        clock.start()
        gc_n, gc_s = GC_CLOCK.count, GC_CLOCK.seconds
        batch = self.scheduler.schedule()
        prompt = not batch.empty and max(batch.num_new_tokens) > 1  # carries a prompt chunk
        if prompt:
            clock.prompt_step()
            if self.stats.policy is not None:  # new requests: their acceptance is unknown
                fresh = sum(1 for r in batch.requests if r.num_computed == 0)
                if fresh:
                    self.stats.policy.admitted(fresh)
        clock.mark("schedule")
        finished = list(batch.aborted)
        stats = self.stats
        stats.num_aborted += len(batch.aborted)
        stats.num_preemptions = self.scheduler.num_preemptions
        if batch.empty:
            return finished
        try:
            self._run(batch.requests, batch.num_new_tokens, finished)
        except Exception as e:  # noqa: BLE001 - any fault of one step is contained here
            finished += self._fault([r for r in batch.requests if not r.finished], e)
        # The step ends with a device-to-host copy of its tokens, so wall time is its cost.
        dt = time.perf_counter() - t0
        stats.step_s += dt
        stats.host_wait_s = self.runner.host_wait_s
        stats.host_phase_s, stats.prompt_host_phase_s = clock.seconds, clock.prompt_seconds
        probe = self.runner.gpu_probe
        stats.verify_launches, stats.verify_launches_gpu_idle = probe.launches, probe.idle
        if GC_CLOCK.count != gc_n:  # a full collection paused this step (compiled_spec/gc_heap.py)
            stats.count_gc(GC_CLOCK.count - gc_n, GC_CLOCK.seconds - gc_s)
            self._obs = None  # no cost the policy should learn from
        if self._obs is not None and stats.policy is not None:
            stats.policy.observe(self._obs[0], self._obs[1], dt, self._obs[2])
            self._obs = None
        if prompt:
            stats.num_prefill_steps += 1
            stats.prefill_step_s += dt
            stats.recent_prefill_step_s.append(dt)
        else:
            stats.recent_decode_step_s.append(dt)
        clock.mark("other")
        return finished

    def _forget_drafts(self) -> None:
        """After a step stopped half-way: the runner drops its drafts, so the next step
        verifies nothing (and is no steady step of the drafting mode)."""
        self.runner.reset()
        self._obs, self._mode_prev = None, PLAIN

    def _fault(self, reqs: list[Request], e: Exception) -> list[Request]:
        self._forget_drafts()
        self.stats.num_step_faults += 1
        log.warning("engine step over requests %s raised %s: %s", [r.req_id for r in reqs],
                    type(e).__name__, e)
        if len(reqs) > 1:
            self.scheduler.retry_alone(reqs)
            return []
        for req in reqs:
            self.scheduler.remove(req, f"engine step failed: {type(e).__name__}: {e}")
            req.metrics.finish_time = time.perf_counter()
        self.stats.num_aborted += len(reqs)
        return reqs

    def abort(self, req_ids: set[int], why: str) -> list[Request]:
        """Finish the unfinished requests among ``req_ids`` with finish_reason="abort" and free
        their blocks (``LLM.generate`` calls it when interrupted, Ctrl-C included)."""
        reqs = [r for r in list(self.scheduler.waiting) + self.scheduler.running
                if r.req_id in req_ids]
        for req in reqs:
            self.scheduler.remove(req, why)
        if reqs:
            self._forget_drafts()  # a step may have stopped half-way
            self.stats.num_aborted += len(reqs)
        return reqs

    def _run(self, reqs: list[Request], num_new: list[int], finished: list[Request]) -> None:
        """The step proper; appends to ``finished`` as requests finish (kept if it raises)."""
        stats, sched = self.stats, self.scheduler
        mode = SPEC
        if stats.policy is not None:
            # Decided before the step, from the batch it runs, so that a drafting step can
            # propose early (launched before its acceptance is read); a paused one runs late.
            mode = stats.policy.mode(len(reqs))
            if self.runner.early is not None:
                self.runner.early.paused = mode == PLAIN
            if mode != PLAIN:  # how many of this step's drafts the next step verifies
                self.runner.verify_k = mode_k(mode, self.runner.k)
        out = self.runner.execute(reqs, num_new)
        clock = self.runner.clock
        clock.mark("execute")
        now = time.perf_counter()
        stats.num_steps += 1
        going_on: list[Request] = []
        accepted: dict[int, int] = {}
        spec_k: list[int] = []  # drafts verified / accepted by each request that verified any
        spec_acc: list[int] = []
        lps = out.logprobs or [None] * len(reqs)
        eos, max_len, detok = self.eos_token_ids, self.cfg.max_model_len, self.detokenize
        n_finished = len(finished)
        try:  # every request of a large batch passes here each step: locals, no temporaries
            for req, n, toks, k_d, lp in zip(reqs, num_new, out.new_tokens, out.num_draft, lps):
                if k_d >= req.max_total_tokens - req.num_tokens:
                    # Verified up to its kv_limit, past its budget: what passes the budget is
                    # neither emitted nor counted as drafted (as when k shrank near the end).
                    k_d = req.max_total_tokens - req.num_tokens - 1
                    toks = toks[:k_d + 1]
                acc = len(toks) - 1
                req.suspect = False  # it ran a step (alone, if it was a suspect)
                if n > 1 or req.num_computed == 0:
                    stats.num_prefill_tokens += n
                req.num_computed += n + acc  # accepted drafts' KV was written in verification
                if k_d > 0:
                    spec_k.append(k_d)
                    spec_acc.append(acc)
                    if req.spec_stats is not None:
                        req.spec_stats.add(k_d, acc)
                if req.metrics.first_token_time is None:
                    req.metrics.first_token_time = now
                    # Counted once the request runs (an admission attempt may give blocks back).
                    stats.num_cached_tokens += req.num_cached_tokens
                if lp is None and not req.params.stop:
                    m, reason = emit_count(req, toks, eos, max_len)
                    req.output_token_ids.extend(toks if m == len(toks) else toks[:m])
                    if n == 1:
                        stats.num_decode_tokens += m
                else:  # stop strings read the text after each token; logprobs go per token
                    reason = None
                    for j, tok in enumerate(toks):
                        req.output_token_ids.append(tok)
                        if lp is not None:
                            req.output_logprobs.append(lp[j])
                        if n == 1:
                            stats.num_decode_tokens += 1
                        reason = stop_reason(req, tok, eos, max_len, detok)
                        if reason is not None:
                            break
                if reason is not None:
                    sched.end(req, reason)
                    req.metrics.finish_time = now
                    finished.append(req)
                else:
                    going_on.append(req)
                    accepted[req.req_id] = acc
        finally:
            if len(finished) > n_finished:
                sched.drop_finished()
        if spec_k:
            stats.spec.update(spec_k, spec_acc)
            if stats.policy is not None:
                stats.policy.observe_acceptance(len(reqs), spec_k, spec_acc)
        if stats.policy is not None and going_on:
            # A steady step ran one mode throughout (verified what the last proposal drafted,
            # and drafts again or not alike) and carried no prompt: its cost is that mode's.
            if mode == self._mode_prev and max(num_new) == 1:
                emitted = sum(map(len, out.new_tokens))
                self._obs = (len(reqs), mode, emitted / len(reqs))
            self._mode_prev = mode
        clock.mark("bookkeeping")
        self.runner.propose(going_on, accepted, mode != PLAIN)
        clock.mark("propose")
        if self.cfg.cache.prefix_caching:
            for req in going_on:
                self._register_blocks(req)

    # ---- prefix caching ----------------------------------------------------------------------
    def _match_prefix(self, req: Request) -> None:
        page = self.allocator.page_size
        n = matchable_blocks(req.num_tokens, page)
        keys = block_keys(req.token_ids, page, n, self._successor_keys)
        matched = self.allocator.match(req.req_id, keys)
        if matched and self.draft is not None and not self._successor_keys:
            matched -= 1  # "recompute": the last block's last draft entry may be stale
            self.allocator.shrink(req.req_id, matched * page)
        req.num_computed = req.draft_computed = req.num_cached_tokens = matched * page
        req.num_registered = matched
        req.last_block_hash = keys[matched - 1][0] if matched else None

    def _register_blocks(self, req: Request) -> None:
        """Register the request's newly complete blocks: target KV written and, in speculative
        engines, the draft's too (its first pass ran over them)."""
        page = self.allocator.page_size
        done = req.num_computed if self.draft is None else min(req.num_computed,
                                                               req.draft_computed)
        full = min(done // page, matchable_blocks(req.num_tokens, page))
        if full <= req.num_registered:
            return
        keys = block_keys(req.token_ids, page, full, self._successor_keys,
                          start=req.num_registered, prev=req.last_block_hash)
        for i, (h, key) in enumerate(keys, start=req.num_registered):
            self.allocator.register(req.req_id, i, h, key)
        req.num_registered, req.last_block_hash = full, keys[-1][0]

    def to_output(self, req: Request) -> RequestOutput:
        text = output_text(req, self.detokenize) if req.params.detokenize else ""
        comp = CompletionOutput(text=text, token_ids=list(req.output_token_ids),
                                finish_reason=req.finish_reason, error=req.error,
                                logprobs=None if req.params.logprobs is None
                                else list(req.output_logprobs))
        return RequestOutput(request_id=req.req_id, prompt=req.prompt,
                             prompt_token_ids=req.prompt_token_ids, outputs=[comp],
                             finished=req.status is Status.FINISHED, metrics=req.metrics,
                             spec_stats=req.spec_stats)

"""The engine loop: admit requests, schedule a batch, run it, finish requests."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from compiled_spec.config import EngineConfig
from compiled_spec.engine.model_runner import ModelRunner
from compiled_spec.engine.request import CompletionOutput, Request, RequestOutput, Status
from compiled_spec.engine.scheduler import Scheduler
from compiled_spec.kv_cache import BlockAllocator, allocate_kv_tensors, bytes_per_block
from compiled_spec.models.decoder import CausalLM
from compiled_spec.sampling_params import SamplingParams


@dataclass
class EngineStats:
    num_steps: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_preemptions: int = 0
    num_aborted: int = 0


class LLMEngine:
    def __init__(self, cfg: EngineConfig, model: CausalLM, eos_token_ids: list[int], detokenize) -> None:
        self.cfg = cfg
        self.model = model
        mcfg = model.config
        num_layers = mcfg.num_hidden_layers
        page = cfg.cache.page_size
        num_blocks = cfg.cache.num_blocks
        if num_blocks is None:
            per_block = bytes_per_block(mcfg, page, cfg.dtype, num_layers)
            num_blocks = max(1, int(cfg.cache.memory_gib * (1 << 30)) // per_block)
        self.allocator = BlockAllocator(num_blocks, page)
        self.kv_caches = allocate_kv_tensors(num_layers, num_blocks, page, mcfg.num_key_value_heads,
                                             mcfg.head_dim, cfg.dtype, cfg.device)
        model.bind_kv_cache(self.kv_caches)
        self.scheduler = Scheduler(cfg.scheduler, self.allocator)
        self.runner = ModelRunner(model, self.allocator, cfg.device)
        self.eos_token_ids = set(eos_token_ids)
        self.detokenize = detokenize
        self._rng = random.Random(cfg.seed)
        self._next_id = 0
        self.stats = EngineStats()

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError/TypeError naming what is wrong with a request; touches no state."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        if n >= self.cfg.max_model_len:
            raise ValueError(f"prompt has {n} tokens but max_model_len={self.cfg.max_model_len} "
                             f"leaves no room for output (prompt must be shorter than max_model_len)")
        need = self.allocator.blocks_for(n + 1)
        if need > self.allocator.num_blocks:
            raise ValueError(f"prompt of {n} tokens needs {need} KV blocks of {self.allocator.page_size} "
                             f"tokens, but the whole pool has {self.allocator.num_blocks}")

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None) -> int:
        """Validate and queue a request. Bad input raises here and leaves the engine untouched."""
        self.check_request(prompt_token_ids, params)
        n = len(prompt_token_ids)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Request(req_id=self._next_id, prompt_token_ids=list(prompt_token_ids), params=params,
                      seed=seed, max_total_tokens=min(n + params.max_tokens, self.cfg.max_model_len),
                      prompt=prompt)
        self._next_id += 1
        self.scheduler.add(req)
        return req.req_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Request]:
        """Run one engine step; returns the requests that finished in it."""
        batch = self.scheduler.schedule()
        finished = list(batch.aborted)
        self.stats.num_aborted += len(batch.aborted)
        self.stats.num_preemptions = self.scheduler.num_preemptions
        if batch.empty:
            return finished
        tokens = self.runner.step(batch.requests, batch.num_new_tokens)
        now = time.perf_counter()
        self.stats.num_steps += 1
        for req, n, tok in zip(batch.requests, batch.num_new_tokens, tokens):
            if n > 1 or req.num_computed == 0:
                self.stats.num_prefill_tokens += n
            else:
                self.stats.num_decode_tokens += 1
            req.num_computed += n
            req.output_token_ids.append(tok)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            reason = self._stop_reason(req, tok)
            if reason is not None:
                self.scheduler.finish(req, reason)
                req.metrics.finish_time = now
                finished.append(req)
        return finished

    def _stop_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids:
            return "stop"
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.cfg.max_model_len:
            return "length"
        return None

    def to_output(self, req: Request) -> RequestOutput:
        text = self.detokenize(req.output_token_ids, req.params.skip_special_tokens)
        comp = CompletionOutput(text=text, token_ids=list(req.output_token_ids),
                                finish_reason=req.finish_reason, error=req.error)
        return RequestOutput(request_id=req.req_id, prompt=req.prompt,
                             prompt_token_ids=req.prompt_token_ids, outputs=[comp],
                             finished=req.status is Status.FINISHED, metrics=req.metrics)

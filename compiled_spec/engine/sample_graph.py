"""A sampled step's draws as one CUDA-graph replay (issue 16).

Where a request samples (temperature > 0), a step's tokens are the coupling rule's draws
(``sampled_accept.coupled_targets``): the temperature filter (and top-k / top-p), then per
verified slot a counter-based key and an inverse-CDF draw. Run eagerly that is ~90 small
kernels (the key hashes alone are ~50 integer ops) and five host-to-device copies of the
sampling parameters. On the H100 (fifty-fourth session) a sampled vanilla decode step at
batch 1 took 1.39-1.64 ms against a greedy one's 0.76 ms: the host launching those kernels.

Here the same ops are captured by dummy runs per (padded batch, slots per request, with or
without the sorting filters), and a step costs one upload of its parameters (staged in one
pinned buffer), one copy of its logits into the graphs' input and one replay.

The graph runs the eager path's own functions (``sampler.apply_filters``,
``rejection.coupled_tokens``) on the same per-row values, so it draws the eager path's tokens.
The logits input is float32: the filter's first op upcasts whatever it gets, and bf16 / fp16
convert to float32 exactly, so the graph serves a replayed step's model-dtype logits and an
eager readout's float32 ones alike. Padded rows are greedy (temperature 0, top-p 1) and
sliced away. A batch no graph takes (a request with min-p, a width or batch size not
captured, logits of another dtype) runs eagerly, counted in the stats under its reason: never
a silent fallback.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from capture.cuda_graphs import capture_each, capture_graph
from capture.emulate import emulate_graph
from capture.host_stage import staging
from compiled_spec.sampler import SamplingTensors, apply_filters
from compiled_spec.spec.rejection import coupled_tokens

if TYPE_CHECKING:
    from compiled_spec.engine.request import Request

# Columns of the staged parameters (int64; the float32 ones as their bit patterns, which for
# the non-negative values here fit 31 bits)
SEED, POSITION, TEMPERATURE, TOP_K, TOP_P = range(5)
_COLS = 5
# Logits dtypes whose float32 copy holds the same values (what apply_filters computes on)
EXACT_IN_FP32 = (torch.float32, torch.bfloat16, torch.float16)


def _f32_bits(values: list[float]) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).view(np.int32)


class SampleGraphs:
    """The coupled draws of ``n`` requests' ``w`` slots each from their logits [n, w, V], by
    graph replay (``draw``); the GraphRunner-compatible surface of the engine's registry
    (capture, stats, counts)."""

    name = "sample_draw"

    def __init__(self, batch_sizes: tuple[int, ...], widths: tuple[int, ...], vocab: int,
                 device: torch.device, emulate: bool = False, strict: bool = False) -> None:
        self.sizes = sorted(set(batch_sizes))
        self.widths = sorted(set(widths))
        self.vocab, self.device = vocab, device
        self.emulate, self.strict = emulate, strict
        # A pool of their own: a draw comes between the target's replay and the reads of its
        # outputs (the hidden states the proposal reads), which the target's pool could reuse.
        self.pool = (torch.cuda.graph_pool_handle() if device.type == "cuda" and not emulate
                     else object())
        bm, wm = self.sizes[-1], self.widths[-1]
        self.t_params, h = staging(bm * _COLS, torch.int64, device)
        self.h_params = h.reshape(bm, _COLS)
        with torch.inference_mode():  # written under inference mode, as the engine's buffers
            self.params = torch.zeros(bm, _COLS, dtype=torch.int64, device=device)
            self.logits = torch.zeros(bm * wm * vocab, dtype=torch.float32, device=device)
            self.out = torch.zeros(bm * wm, dtype=torch.int64, device=device)
        # A padded row: greedy, top-p 1 (a top-p of 0 would drop every token of a sorted row)
        self._pad = np.zeros(_COLS, dtype=np.int64)
        self._pad[TOP_P] = _f32_bits([1.0])[0]
        # Recorded after each upload; the next staging waits for it before rewriting the pinned
        # buffer (a step's own device-to-host read orders it already; this keeps it safe when
        # two draws come before one, at no cost when the copy has run).
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None
        self._graphs: dict[tuple[int, int, bool], Any] = {}
        self.capture_failures: list[dict[str, Any]] = []
        self.graph_replays = self.padded_rows = self.eager_fallbacks = 0
        self.fallback_reasons: dict[str, int] = {}

    # ---- the registry's surface --------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.emulate or self.device.type == "cuda"

    @property
    def captured_sizes(self) -> list[int]:
        return sorted({b for b, _, _ in self._graphs})

    def stats(self) -> dict[str, Any]:
        return {"graph_replays": self.graph_replays, "padded_rows": self.padded_rows,
                "eager_fallbacks": self.eager_fallbacks,
                "fallback_reasons": dict(self.fallback_reasons),
                "captured_sizes": self.captured_sizes, "widths": self.widths,
                "captured_graphs": sorted(self._graphs),
                "capture_failures": list(self.capture_failures)}

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.enabled:
            return
        for w in self.widths:
            for sorting in (False, True):
                capture_each(f"{self.name}_w{w}{'_sorted' if sorting else ''}", self.sizes, 0,
                             lambda b, w=w, s=sorting: self._capture_one(b, w, s),
                             self.capture_failures, self.strict)

    # ---- start-up ----------------------------------------------------------------------------
    def _body(self, b: int, w: int, sorting: bool) -> None:
        """The eager path's ops (``sampled_accept._target_probs`` + ``coupled_tokens``) on the
        staged rows; the tokens into ``out``."""
        p = self.params[:b]  # [b, 5]
        temp = p[:, TEMPERATURE].to(torch.int32).view(torch.float32)  # [b]
        top_p = p[:, TOP_P].to(torch.int32).view(torch.float32)  # [b]

        def rows(x: torch.Tensor) -> torch.Tensor:  # per request -> per slot (request-major)
            # (an expand, not repeat_interleave: that one reads its output size back from the
            # device, which a capture cannot do)
            return x[:, None].expand(b, w).reshape(b * w) if w > 1 else x

        st = SamplingTensors(temperature=rows(temp), top_k=rows(p[:, TOP_K]),
                             top_p=rows(top_p), min_p=torch.zeros_like(rows(temp)),
                             seeds=rows(p[:, SEED]), all_greedy=False, any_sorting=sorting,
                             any_min_p=False)
        v = self.vocab
        probs = apply_filters(self.logits[:b * w * v].view(b * w, v), st).view(b, w, v)
        self.out[:b * w].view(b, w).copy_(coupled_tokens(probs, p[:, SEED], p[:, POSITION]))

    def _capture_one(self, b: int, w: int, sorting: bool) -> None:
        self.h_params[:b] = self._pad
        self.params[:b].copy_(self.t_params.view(-1, _COLS)[:b])
        run = lambda: self._body(b, w, sorting)  # noqa: E731
        self._graphs[(b, w, sorting)] = (emulate_graph(run, self.pool) if self.emulate
                                         else capture_graph(run, self.pool))[0]

    # ---- per step ----------------------------------------------------------------------------
    def _why_not(self, reqs: list["Request"], logits: torch.Tensor) -> str | tuple[int, bool]:
        """(the padded batch, with sorting) of a graph that takes this draw, or why none does."""
        if not self.enabled:
            return "cpu"
        n, w, v = logits.shape
        params = [r.params for r in reqs]
        if any(p.min_p > 0 and not p.greedy for p in params):
            return "min_p"
        if w not in self.widths:
            return "width"
        if logits.dtype not in EXACT_IN_FP32 or v != self.vocab:
            return "dtype"
        sorting = any(p.needs_sorting for p in params)  # as build_sampling_tensors' flag
        b = next((s for s in self.sizes if s >= n and (s, w, sorting) in self._graphs), None)
        return "size" if b is None else (b, sorting)

    @torch.inference_mode()
    def draw(self, reqs: list["Request"],
             logits: torch.Tensor,  # [n, w, V]
             ) -> torch.Tensor | None:  # [n, w] int64, valid until the next draw
        """Each request's coupled draw at each of its ``w`` slots (``coupled_targets``); None
        (counted) when no captured graph takes the batch, so the caller draws eagerly."""
        fit = self._why_not(reqs, logits)
        if isinstance(fit, str):
            self.eager_fallbacks += 1
            self.fallback_reasons[fit] = self.fallback_reasons.get(fit, 0) + 1
            return None
        b, sorting = fit
        n, w, v = logits.shape
        params = [r.params for r in reqs]
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the last upload from the pinned buffer has run
        h = self.h_params
        h[:n, SEED] = [r.seed for r in reqs]
        h[:n, POSITION] = [r.num_tokens for r in reqs]  # slot 0's position: the next token's
        h[:n, TEMPERATURE] = _f32_bits([p.temperature for p in params])
        h[:n, TOP_K] = [p.top_k for p in params]
        h[:n, TOP_P] = _f32_bits([p.top_p for p in params])
        h[n:b] = self._pad
        self.params[:b].copy_(self.t_params.view(-1, _COLS)[:b], non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()
        self.logits[:n * w * v].view(n, w, v).copy_(logits)
        self._graphs[(b, w, sorting)].replay()
        self.graph_replays += 1
        self.padded_rows += b - n
        return self.out[:n * w].view(n, w)

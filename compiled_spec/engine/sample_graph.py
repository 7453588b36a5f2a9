"""A sampled step's draws as one CUDA-graph replay (issue 16).

Where a request samples (temperature > 0), a step's tokens are the coupling rule's draws
(``sampled_accept.coupled_targets``): the temperature filter (and top-k / top-p), then per
verified slot a counter-based key and an inverse-CDF draw. Run eagerly that is ~90 small
kernels (the key hashes alone are ~50 integer ops) and five host-to-device copies of the
sampling parameters. On the H100 (fifty-fourth session) a sampled vanilla decode step at
batch 1 took 1.39-1.64 ms against a greedy one's 0.76 ms: the host launching those kernels.

Here the same ops are captured by dummy runs per (padded row count, with or without the
sorting filters), and a step costs one upload of its parameters (staged in one pinned buffer),
one copy of its logits into the graphs' input and one replay.

A row is one draw: its own seed, position, temperature, top-k and top-p. A chain's slot j of a
request is a row at the request's next position + j (``rejection.coupled_tokens``' keys, per
element the same), a draft tree's node a row at its position + 1 (``tree_runner``'s draw).
The graph runs the eager path's own functions (``sampler.apply_filters``, ``position_keys``,
``sample_from_probs``) on the same per-row values, so it draws the eager path's tokens.
The logits input is float32: the filter's first op upcasts whatever it gets, and bf16 / fp16
convert to float32 exactly, so the graph serves a replayed step's model-dtype logits and an
eager readout's float32 ones alike. Padded rows are greedy (temperature 0, top-p 1) and
sliced away. A batch no graph takes (a request with min-p, a width or batch size not
captured, logits of another dtype) runs eagerly, counted in the stats under its reason: never
a silent fallback.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from capture.cuda_graphs import capture_each, capture_graph
from capture.emulate import emulate_graph
from capture.host_stage import staging
from compiled_spec.sampler import (STREAM_TOKEN, SamplingTensors, apply_filters, position_keys,
                                   sample_from_probs)

if TYPE_CHECKING:
    from compiled_spec.engine.request import Request
    from compiled_spec.sampling_params import SamplingParams

# Columns of the staged parameters (int64; the float32 ones as their bit patterns, which for
# the non-negative values here fit 31 bits)
SEED, POSITION, TEMPERATURE, TOP_K, TOP_P = range(5)
_COLS = 5
# Logits dtypes whose float32 copy holds the same values (what apply_filters computes on)
EXACT_IN_FP32 = (torch.float32, torch.bfloat16, torch.float16)
# Rows x vocabulary a graph may take: its float32 input and the filter's and the draw's
# intermediates (float64 CDF, a sort's values and indices) are ~30 bytes per element, ~1 GiB
# of graph pool at this cap; larger draws run eagerly (counted: "size"), where the launches
# are a smaller share of the step.
MAX_ELEMENTS = 1 << 25


def _f32_bits(values: list[float]) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).view(np.int32)


def draw_tokens(logits: torch.Tensor,  # [t, V] float32
                params: torch.Tensor,  # [t, 5] int64: the staged columns (SEED, POSITION, ...)
                sorting: bool) -> torch.Tensor:  # [t] int64
    """The eager path's ops on staged rows: ``apply_filters``, then each row's key and
    inverse-CDF draw. What a sample graph captures, eagerly (~90 kernels) or as compiled by
    ``CompileConfig.sample_compile`` (compiled_spec/compile.py)."""
    temp = params[:, TEMPERATURE].to(torch.int32).view(torch.float32)  # [t]
    st = SamplingTensors(temperature=temp, top_k=params[:, TOP_K],
                         top_p=params[:, TOP_P].to(torch.int32).view(torch.float32),
                         min_p=torch.zeros_like(temp), seeds=params[:, SEED], all_greedy=False,
                         any_sorting=sorting, any_min_p=False)
    probs = apply_filters(logits, st)  # [t, V]
    keys = position_keys(params[:, SEED], params[:, POSITION], STREAM_TOKEN)  # [t]
    return sample_from_probs(probs, keys)


class SampleGraphs:
    """Draws from logits rows by graph replay: a chain's or a decode step's coupled draws
    (``draw``, [n, w, V] -> [n, w]) and a draft tree's per-node draws (``draw_rows``); the
    GraphRunner-compatible surface of the engine's registry (capture, stats, counts)."""

    name = "sample_draw"

    def __init__(self, batch_sizes: tuple[int, ...], widths: tuple[int, ...], vocab: int,
                 device: torch.device, emulate: bool = False, strict: bool = False,
                 max_elements: int = MAX_ELEMENTS) -> None:
        """Row counts captured: each batch size times each width (rows per request: 1 for a
        decode step, k + 1 for a chain's, a tree's nodes), up to ``max_elements`` / vocab."""
        self.sizes = sorted({b * w for b in batch_sizes for w in widths
                             if b * w * vocab <= max_elements} or {1})
        self.vocab, self.device = vocab, device
        self.emulate, self.strict = emulate, strict
        # What the graphs capture: the eager ops, or their compile (set before ``capture``)
        self.draw_fn: Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor] = draw_tokens
        # A pool of their own: a draw comes between the target's replay and the reads of its
        # outputs (the hidden states the proposal reads), which the target's pool could reuse.
        self.pool = (torch.cuda.graph_pool_handle() if device.type == "cuda" and not emulate
                     else object())
        rm = self.sizes[-1]
        self.t_params, h = staging(rm * _COLS, torch.int64, device)
        self.h_params = h.reshape(rm, _COLS)
        with torch.inference_mode():  # written under inference mode, as the engine's buffers
            self.params = torch.zeros(rm, _COLS, dtype=torch.int64, device=device)
            self.logits = torch.zeros(rm, vocab, dtype=torch.float32, device=device)
            self.out = torch.zeros(rm, dtype=torch.int64, device=device)
        # A padded row: greedy, top-p 1 (a top-p of 0 would drop every token of a sorted row)
        self._pad = np.zeros(_COLS, dtype=np.int64)
        self._pad[TOP_P] = _f32_bits([1.0])[0]
        # Recorded after each upload; the next staging waits for it before rewriting the pinned
        # buffer (a step's own device-to-host read orders it already; this keeps it safe when
        # two draws come before one, at no cost when the copy has run).
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None
        self._graphs: dict[tuple[int, bool], Any] = {}
        self.capture_failures: list[dict[str, Any]] = []
        self.graph_replays = self.padded_rows = self.eager_fallbacks = 0
        self.fallback_reasons: dict[str, int] = {}

    # ---- the registry's surface --------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.emulate or self.device.type == "cuda"

    @property
    def captured_sizes(self) -> list[int]:
        return sorted({t for t, _ in self._graphs})

    def stats(self) -> dict[str, Any]:
        return {"graph_replays": self.graph_replays, "padded_rows": self.padded_rows,
                "eager_fallbacks": self.eager_fallbacks,
                "fallback_reasons": dict(self.fallback_reasons),
                "captured_sizes": self.captured_sizes, "captured_graphs": sorted(self._graphs),
                "capture_failures": list(self.capture_failures)}

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.enabled:
            return
        for sorting in (False, True):
            capture_each(f"{self.name}{'_sorted' if sorting else ''}", self.sizes, 0,
                         lambda t, s=sorting: self._capture_one(t, s),
                         self.capture_failures, self.strict)

    # ---- start-up ----------------------------------------------------------------------------
    def _body(self, t: int, sorting: bool) -> None:
        """``draw_fn`` on the staged rows; the tokens into ``out``."""
        self.out[:t].copy_(self.draw_fn(self.logits[:t], self.params[:t], sorting))

    def _capture_one(self, t: int, sorting: bool) -> None:
        self.h_params[:t] = self._pad
        self.params[:t].copy_(self.t_params.view(-1, _COLS)[:t])
        run = lambda: self._body(t, sorting)  # noqa: E731
        self._graphs[(t, sorting)] = (emulate_graph(run, self.pool) if self.emulate
                                      else capture_graph(run, self.pool))[0]

    # ---- per step ----------------------------------------------------------------------------
    def _fit(self, params: list["SamplingParams"], rows: int, logits: torch.Tensor
             ) -> str | tuple[int, bool]:
        """(the padded row count, with sorting) of a graph that takes this draw, or why none
        does."""
        if not self.enabled:
            return "cpu"
        if any(p.min_p > 0 and not p.greedy for p in params):
            return "min_p"
        if logits.dtype not in EXACT_IN_FP32 or logits.shape[-1] != self.vocab:
            return "dtype"
        sorting = any(p.needs_sorting for p in params)  # as build_sampling_tensors' flag
        t = next((s for s in self.sizes if s >= rows and (s, sorting) in self._graphs), None)
        return "size" if t is None else (t, sorting)

    def _miss(self, why: str) -> None:
        self.eager_fallbacks += 1
        self.fallback_reasons[why] = self.fallback_reasons.get(why, 0) + 1

    def _stage(self, reqs: list["Request"], params: list["SamplingParams"], reps: np.ndarray,
               rows: int, padded: int, positions: np.ndarray | None) -> None:
        """Each request's parameters on its ``reps`` rows, padded rows after them, uploaded in
        one copy (``positions`` [rows]: the rows' positions; None: written on the device)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the last upload from the pinned buffer has run
        h = self.h_params
        h[:rows, SEED] = np.repeat(np.fromiter((r.seed for r in reqs), np.int64, len(reqs)),
                                   reps)
        h[:rows, TEMPERATURE] = np.repeat(_f32_bits([p.temperature for p in params]), reps)
        h[:rows, TOP_K] = np.repeat(np.fromiter((p.top_k for p in params), np.int64,
                                                len(reqs)), reps)
        h[:rows, TOP_P] = np.repeat(_f32_bits([p.top_p for p in params]), reps)
        if positions is not None:
            h[:rows, POSITION] = positions
        h[rows:padded] = self._pad
        self.params[:padded].copy_(self.t_params.view(-1, _COLS)[:padded], non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()

    def _replay(self, padded: int, sorting: bool, rows: int) -> torch.Tensor:
        self._graphs[(padded, sorting)].replay()
        self.graph_replays += 1
        self.padded_rows += padded - rows
        return self.out[:rows]

    @torch.inference_mode()
    def draw(self, reqs: list["Request"],
             logits: torch.Tensor,  # [n, w, V]
             ) -> torch.Tensor | None:  # [n, w] int64, valid until the next draw
        """Each request's coupled draw at each of its ``w`` slots (``coupled_targets``: slot
        j at the request's next position + j); None (counted) when no captured graph takes
        the batch, so the caller draws eagerly."""
        n, w, v = logits.shape
        params = [r.params for r in reqs]
        fit = self._fit(params, n * w, logits)
        if isinstance(fit, str):
            self._miss(fit)
            return None
        padded, sorting = fit
        pos0 = np.fromiter((r.num_tokens for r in reqs), np.int64, n)  # slot 0's: the next
        positions = (pos0[:, None] + np.arange(w)).reshape(-1)  # [n * w]
        self._stage(reqs, params, np.full(n, w), n * w, padded, positions)
        self.logits[:n * w].copy_(logits.reshape(n * w, v))
        return self._replay(padded, sorting, n * w).view(n, w)

    @torch.inference_mode()
    def draw_rows(self, reqs: list["Request"], reps: list[int],
                  logits: torch.Tensor,  # [T, V]: request i's reps[i] rows, in order
                  positions: torch.Tensor,  # [T] on the device: each row's drawn position
                  ) -> torch.Tensor | None:  # [T] int64, valid until the next draw
        """A draft tree step's draws, one per row (a node's token at its position + 1); None
        (counted) when no captured graph takes them."""
        t = logits.shape[0]
        params = [r.params for r in reqs]
        fit = self._fit(params, t, logits)
        if isinstance(fit, str):
            self._miss(fit)
            return None
        padded, sorting = fit
        self._stage(reqs, params, np.asarray(reps, dtype=np.int64), t, padded, None)
        self.params[:t, POSITION].copy_(positions)  # behind the upload on the stream
        self.logits[:t].copy_(logits)
        return self._replay(padded, sorting, t)

"""Result rows, per-phase timers and the weight-read floor for the benchmark."""
from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

# Bandwidth of the GPUs we report on: the copy bandwidth measured on the project's H200 when it
# began. Other GPUs are measured at run time (``floor_bandwidth``).
HBM_BYTES_PER_S = {"NVIDIA H200": 4.27e12}


@dataclass
class Row:
    engine: str
    batch: int
    ms_per_token: float  # per request: decode time / (tokens - 1), median over requests
    tokens_per_s: float  # all output tokens / wall time of the timed run
    startup_s: float  # load (+ compile and capture, + warm-up for HF's compile path)
    tau: float | None = None  # mean acceptance length (speculative rows)
    propose_ms: float | None = None  # mean per propose call
    verify_ms: float | None = None  # mean per target forward of a decode / verify step
    floor_ratio: float | None = None  # ms_per_token / weight-read floor (batch-1 rows, GPU)
    peak_mem_gib: float | None = None
    identical: float | None = None  # fraction of prompts whose greedy output == our vanilla's
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_bandwidth(device: torch.device, nbytes: int = 2 << 30, iters: int = 20,
                   warmup: int = 5) -> float:
    """Bytes per second a streaming read (a sum over ``nbytes`` of bf16) reaches on
    ``device``, back-to-back calls with one sync: a floor's yardstick on a GPU that
    ``HBM_BYTES_PER_S`` does not list (an H100 read 3.06e12 in the thirty-third session)."""
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    for _ in range(warmup):
        x.sum()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        x.sum()
    sync(device)
    return nbytes * iters / (time.perf_counter() - t0)


@functools.lru_cache(maxsize=None)
def _measured_bandwidth(device_index: int) -> float:
    """``read_bandwidth`` of one GPU, once per process (a 2 GiB read, ~20 ms)."""
    return read_bandwidth(torch.device("cuda", device_index))


def floor_bandwidth(device: torch.device) -> tuple[float, str] | None:
    """(bytes per second, where it comes from) of the weight-read floor on ``device``; None
    off CUDA. A GPU ``HBM_BYTES_PER_S`` lists takes its figure, any other the streaming read
    measured on it: an H100 bench printed no floor at all in the thirty-third session."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    if name in HBM_BYTES_PER_S:
        return HBM_BYTES_PER_S[name], f"listed for {name}"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _measured_bandwidth(index), f"streaming read measured on {name}"


def floor_ms(model: torch.nn.Module, device: torch.device) -> float | None:
    """Reading every weight once at ``floor_bandwidth``: the batch-1 decode floor."""
    bw = floor_bandwidth(device)
    return None if bw is None else weight_bytes(model) / bw[0] * 1e3


def weight_bytes(module: torch.nn.Module, exclude: torch.nn.Module | None = None) -> int:
    """Bytes of ``module``'s weights, each storage once: tied embeddings and the views that
    fused projections leave behind (q_proj inside qkv_proj) are not counted twice. Storages
    shared with ``exclude`` are left out (a draft reads the target's embedding one row per
    token)."""
    shared = ({p.untyped_storage().data_ptr() for p in exclude.parameters()}
              if exclude is not None else set())
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for p in module.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in shared)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


class PhaseTimer:
    """Wraps callables and times each call. On CUDA it records an event pair per call and reads
    them only in ``mean_ms`` (one sync after the run), so timing adds no host sync to the loop;
    on the CPU it uses the wall clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self._events: dict[str, list[Any]] = {}

    def wrap(self, name: str, fn: Callable[..., Any],
             when: Callable[..., bool] | None = None) -> Callable[..., Any]:
        """``fn`` timed under ``name`` for the calls where ``when(*args)`` holds (all if None)."""
        self._events.setdefault(name, [])

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if when is not None and not when(*args, **kwargs):
                return fn(*args, **kwargs)
            if self.cuda:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                out = fn(*args, **kwargs)
                end.record()
                self._events[name].append((start, end))
            else:
                t0 = time.perf_counter()
                out = fn(*args, **kwargs)
                self._events[name].append((time.perf_counter() - t0) * 1e3)
            return out

        return timed

    def reset(self) -> None:
        for v in self._events.values():
            v.clear()

    def mean_ms(self, name: str) -> float | None:
        ev = self._events.get(name) or []
        if not ev:
            return None
        if self.cuda:
            sync(self.device)
            return sum(s.elapsed_time(e) for s, e in ev) / len(ev)
        return sum(ev) / len(ev)

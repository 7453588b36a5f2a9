"""Compile the paged-attention binaries of a cold start in parallel processes.

On a machine whose Triton cache is empty, ``kernels.warmup`` compiles every reachable attention
configuration one after the other: 12.3 s of SmolLM2's cold start and 18.3 s of the Llama-3.1-8B
shape's on the H200 (eighteenth / nineteenth sessions), against issue 16's 45 s for the whole
start. Threads do not help: Triton holds the GIL while it compiles (12 configurations for sm_90
on the CPU: 8.28 s serial, 8.14 s on two threads). So the configurations are split over worker
processes (``python -m kernels.warmup``, not multiprocessing: a spawned child would
re-import the user's main script), each launching its share on a small cache of the engine's
dtype, shape and strides, so each binary lands in Triton's on-disk cache under the key the engine's
own launch computes; the engine's serial warm-up then loads them from there.

On by default for CUDA engines (``COMPILED_SPEC_PARALLEL_WARMUP=0`` turns it off): on the H200
with cold caches (twentieth session) the attention warm-up took 9.88 s instead of 14.65 s for
SmolLM2 and 11.31 s instead of 17.37 s for the Llama-3.1-8B shape (8 workers, 17
configurations, none failed); each worker's own start (CUDA context, Triton import) is most
of the 9.4 s they took. A worker that fails or times out costs only its time: the serial
warm-up after it compiles whatever is missing. So the workers start first, while the engine's
process launches the two configurations whose second one says whether the cache is cold, and
are stopped unfinished (``stop``) when it says warm.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ENV = "COMPILED_SPEC_PARALLEL_WARMUP"
_ROOT = Path(__file__).resolve().parents[1]  # the directory holding the kernels package
# A cold compile measured 0.5-0.8 s per configuration; a cache hit a few milliseconds.
COLD_S = 0.15


OVERLAP_ENV = "COMPILED_SPEC_WARMUP_OVERLAP"


def overlap_enabled() -> bool:
    """Whether the engine leaves the workers running while the model compiles (joined at the
    first attention launch, ``kernels.warmup_pending``): ``1`` only. Off by default: on the
    H200 (27th session, cold caches) the compile slowed by about what the load saved, the
    workers and Inductor's compile sharing the CPU (SmolLM2 60.7 s waiting at once, 64.2 s
    overlapped; the 8B shape 90.6 / 92.4 s)."""
    return os.environ.get(OVERLAP_ENV, "0") == "1"


PDL_ENV = "COMPILED_SPEC_PDL_WARMUP"


def pdl_warmup_enabled() -> bool:
    """Whether an engine whose calls launch with PDL also compiles the attention binaries
    those launches use (GDC=1, ``kernels.warmup.warm_model_attention(gdc=True)``) at start-up,
    in workers on a cold cache, rather than inside the captures that first launch them:
    ``1`` only. Timed on an H100 (fifty-first session, SmolLM2 shape, empty caches) it made a
    cold start longer, 55.6 s against 40.4: it compiles the 23 GDC=1 binaries the warm-up
    covers, where the captures compile only the 6 they launch."""
    return os.environ.get(PDL_ENV, "0") == "1"


def enabled() -> bool:
    """Workers unless the environment says ``0`` (only CUDA engines ask)."""
    return os.environ.get(ENV, "1") != "0"


def enough_to_share(num_rest: int) -> bool:
    """Whether enough configurations remain to be worth a worker process."""
    return num_rest >= 2


def worth_spreading(first_s: float, num_rest: int) -> bool:
    """Whether the first configuration's time says Triton's cache is cold (a compile, not a
    load) and enough configurations remain to share out."""
    return first_s >= COLD_S and enough_to_share(num_rest)


def num_workers(num_configs: int) -> int:
    """Processes for ``num_configs`` cold configurations: one per two cores (the engine's own
    process and Inductor's workers need the rest), at most 8, at least one config each."""
    return max(1, min(num_configs, (os.cpu_count() or 2) // 2, 8))


def shares(configs: list[tuple[int, int]], workers: int) -> list[list[tuple[int, int]]]:
    """Round-robin split: each worker gets small and large split counts alike."""
    return [configs[i::workers] for i in range(workers) if configs[i::workers]]


def spec_of(k_cache: torch.Tensor, num_heads: int, configs: list[tuple[int, int]],
            rope: bool, gdc: bool = False) -> dict[str, Any]:
    """What a worker needs to launch ``configs`` as the engine would (JSON); ``gdc``: as
    launched with PDL (their GDC=1 binaries)."""
    return {"num_heads": num_heads, "shape": list(k_cache.shape[1:]),
            "stride": list(k_cache.stride()), "dtype": str(k_cache.dtype).removeprefix("torch."),
            "device": k_cache.device.index or 0, "configs": [list(c) for c in configs],
            "rope": rope, "gdc": gdc}


def start(specs: list[dict[str, Any]]) -> list[subprocess.Popen]:
    """One worker process per spec, started now (they compile while the caller goes on)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH")) if p)
    env[ENV] = "0"  # a worker never spawns workers
    return [subprocess.Popen([sys.executable, "-m", "kernels.warmup", json.dumps(s)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for s in specs]


def stop(procs: list[subprocess.Popen]) -> None:
    """Stop workers no longer wanted (a warm cache) and reap them; what they compiled so far
    stays in Triton's cache, which writes each binary whole."""
    for p in procs:
        p.kill()
    for p in procs:
        p.communicate()


def wait(procs: list[subprocess.Popen], timeout_s: float = 180.0) -> tuple[int, int]:
    """Wait for every worker (killing those past ``timeout_s``); returns (configurations the
    workers launched, workers that failed). A failure is printed with its last error line."""
    deadline = time.monotonic() + timeout_s
    launched, failed = 0, 0
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stop([p])
            failed += 1
            print(f"compiled_spec: attention warm-up worker killed after {timeout_s:.0f} s",
                  file=sys.stderr)
            continue
        if p.returncode != 0:
            failed += 1
            tail = (err or b"").decode(errors="replace").strip().splitlines()[-1:]
            print(f"compiled_spec: attention warm-up worker failed ({p.returncode}): "
                  f"{tail[0] if tail else 'no output'}", file=sys.stderr)
            continue
        done = [ln for ln in out.decode(errors="replace").splitlines() if ln.startswith("launched ")]
        launched += int(done[-1].split()[1]) if done else 0
    return launched, failed

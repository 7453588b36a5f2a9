"""CPU: one sampling draw for a [B, V] batch, the exponential race (one hash per vocabulary entry,
the sampler before 2026-12-01) vs inverse-CDF sampling (one hash per row, today's sampler).

python profiles/scripts/sampler_speed_cpu.py [--batch 512] [--vocab 49152] [--repeats 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from compiled_spec.sampler import position_keys, sample_from_probs, uniform_noise  # noqa: E402


def race(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The earlier sampler: argmax(p / E), E ~ Exp(1), one hashed uniform per entry."""
    return (probs / -torch.log(uniform_noise(keys, probs.shape[-1]))).argmax(dim=-1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(a.batch, a.vocab) * 3, dim=-1)
    keys = position_keys(torch.arange(a.batch), torch.full((a.batch,), 7))
    for name, fn in (("exponential race", race), ("inverse CDF", sample_from_probs)):
        times = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            fn(probs, keys)
            times.append(time.perf_counter() - t0)
        print(f"{name}: {1000 * statistics.median(times):.1f} ms per draw of [{a.batch}, "
              f"{a.vocab}] (median of {a.repeats}, {torch.get_num_threads()} threads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

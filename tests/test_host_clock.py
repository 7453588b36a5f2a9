"""The step's host clock and the GPU-idle probe (compiled_spec/engine/host_clock.py), on fake
clocks and events: what the engine reports as host_phase_s and verify_launches_gpu_idle."""
from __future__ import annotations

import torch

from compiled_spec.engine import host_clock
from compiled_spec.engine.host_clock import GpuIdleProbe, HostClock


def test_marks_partition_the_time_between_them(monkeypatch):
    now = iter([0.0, 1.0, 3.0, 6.0, 10.0, 15.0])
    monkeypatch.setattr(host_clock.time, "perf_counter", lambda: next(now))
    clock = HostClock()  # reads 0.0
    clock.start()  # 1.0
    clock.mark("schedule")  # 3.0
    clock.mark("verify")  # 6.0
    clock.mark("schedule")  # 10.0: a phase met twice adds up
    assert clock.seconds == {"schedule": 2.0 + 4.0, "verify": 3.0}
    clock.reset()
    assert clock.seconds == {}


class _Event:
    """A CUDA event stand-in: done or not when queried; records counted."""

    def __init__(self) -> None:
        self.done, self.records = False, 0

    def query(self) -> bool:
        return self.done

    def record(self) -> None:
        self.records += 1


def test_gpu_idle_probe_counts_launches_that_found_the_gpu_idle():
    probe = GpuIdleProbe(torch.device("cpu"))
    probe.before(), probe.after()
    assert (probe.launches, probe.idle) == (0, 0)  # no GPU, nothing counted
    ev = probe._event = _Event()
    for done in (True, False, False, True):
        ev.done = done
        probe.before()
        probe.after()
    assert (probe.launches, probe.idle, ev.records) == (4, 2, 4)


def test_a_prompt_steps_phases_are_kept_apart(monkeypatch):
    now = iter([0.0, 1.0, 2.0, 4.0, 10.0, 11.0, 13.0])
    monkeypatch.setattr(host_clock.time, "perf_counter", lambda: next(now))
    clock = HostClock()  # 0.0
    clock.start()  # 1.0
    clock.prompt_step()
    clock.mark("schedule")  # 2.0: a prompt step's, from the step's start
    clock.mark("verify")  # 4.0
    clock.start()  # 10.0: the next step decodes
    clock.mark("schedule")  # 11.0
    clock.mark("verify")  # 13.0
    assert clock.prompt_seconds == {"schedule": 1.0, "verify": 2.0}
    assert clock.seconds == {"schedule": 1.0, "verify": 2.0}
    clock.reset()
    assert clock.seconds == clock.prompt_seconds == {}

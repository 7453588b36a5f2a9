"""Where an engine step's host time goes, by phase (``llm.stats.host_phase_s``).

At batch 64 a chain step's wait for the GPU is ~5% of the step (twenty-second session): its
time is spent in the host's phases (the host's own work, or launches there blocking on a full
queue: ``GpuIdleProbe`` tells them apart), and a profiler or cProfile inflates exactly that
work (per call, per op), so the phases are timed untraced here, by
``perf_counter`` marks at phase ends (~0.1 us each, a handful per step). The marks partition
the step: their sum is ``EngineStats.step_s`` up to the step's first and last lines (decode
steps in ``seconds``, steps carrying a prompt in ``prompt_seconds``).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

class HostClock:
    """Accumulates seconds per phase: ``start`` at the step's beginning, ``mark(phase)`` at the
    end of each phase (the time since the previous mark goes to ``phase``).

    The engine's phases, in step order: ``schedule``; ``verify`` (taking a launched verify, or
    the late verify's rest), within a verify ``verify_build`` / ``verify_replay`` /
    ``verify_logits``; ``plan``; ``accept`` (before and after the host's ``wait``);
    ``launch_ahead``; ``execute`` (the runner's work after its last mark: logprobs);
    ``decode_check`` (a decode step launching the next one ahead, vanilla or paused: its
    token's draw and copy issued, and whether the launch may go);
    ``paused_sync`` (a paused step launched ahead: its deferral or first pass, before the
    next decode's ``verify_build``);
    ``bookkeeping``; ``propose``; ``other`` (the step's statistics and
    whatever follows ``propose``, prefix-cache registration).
    A draft-tree step marks ``verify``, ``plan``, ``accept`` (up to the draft's launch, then the
    host's walk of the trees and its token lists), ``wait`` and ``launch_ahead`` the same way;
    its tree verify (launched ahead, or the step's own) ``verify_build`` / ``verify_replay`` /
    ``verify_logits`` as the chain's."""

    __slots__ = ("seconds", "prompt_seconds", "_into", "_t")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}  # decode steps (no prompt rows)
        # Steps that carry a prompt chunk: a different path (late propose, varlen graph) whose
        # phases would blur the decode steps' if summed with them.
        self.prompt_seconds: dict[str, float] = {}
        self._into = self.seconds
        self._t = time.perf_counter()

    def start(self) -> None:
        self._into = self.seconds
        self._t = time.perf_counter()

    def prompt_step(self) -> None:
        """The step being timed carries a prompt: its phases (from the last mark on, the
        schedule's included) go to ``prompt_seconds``."""
        self._into = self.prompt_seconds

    def mark(self, phase: str) -> None:
        t = time.perf_counter()
        s = self._into
        s[phase] = s.get(phase, 0.0) + (t - self._t)
        self._t = t

    def reset(self) -> None:
        self.seconds, self.prompt_seconds = {}, {}
        self._into = self.seconds


class GpuIdleProbe:
    """Whether the GPU had run out of work when the host launched a step's target forward.

    A host-bound loop starves the GPU: the work queued before the launch has finished by the
    time the launch comes. A GPU-bound loop fills the launch queue instead, and then launches
    themselves block, so host phases look slow while ``wait`` stays small (the twenty-third
    session's batch-64 phases: 0.25 ms for a 10 us upcast). The probe tells the two apart: an
    event recorded after each launch, queried (not waited on) before the next one."""

    __slots__ = ("launches", "idle", "_event")

    def __init__(self, device: "torch.device") -> None:
        import torch

        self.launches = 0
        self.idle = 0  # launches that found every earlier launch's work done
        self._event = torch.cuda.Event() if device.type == "cuda" else None

    def before(self) -> None:
        if self._event is not None:
            self.launches += 1
            self.idle += self._event.query()

    def after(self) -> None:
        if self._event is not None:
            self._event.record()

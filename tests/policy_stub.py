"""A stand-in for the engine's SpecPolicy in tests: the given modes in turn, step after step,
learning nothing (``spec.policy``'s SPEC, PLAIN and shrunk(k) modes)."""
from __future__ import annotations


class ModesInTurn:
    def __init__(self, modes: list[str]) -> None:
        self.modes, self.n = modes, 0

    def mode(self, batch_size: int) -> str:
        self.n += 1
        return self.modes[(self.n - 1) % len(self.modes)]

    def observe(self, *args) -> None:
        pass

    observe_acceptance = observe
    admitted = observe

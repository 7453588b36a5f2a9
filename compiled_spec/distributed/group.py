"""The tensor-parallel process group, handed to every sharded layer explicitly."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int
    world_size: int
    group: Any = None  # a torch.distributed ProcessGroup; None = the default (world) group

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside [0, {self.world_size})")

    @staticmethod
    def from_default() -> "TPGroup":
        """The initialised default group (torchrun or init_process_group), all ranks."""
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call "
                               "init_process_group (or run under torchrun) first")
        return TPGroup(dist.get_rank(), dist.get_world_size())

    def split(self, n: int, what: str) -> int:
        """n / world_size, refusing shapes that do not divide (names the dimension)."""
        if n % self.world_size:
            raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size="
                             f"{self.world_size}")
        return n // self.world_size

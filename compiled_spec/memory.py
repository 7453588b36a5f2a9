"""How much memory a KV pool may take, checked before it is allocated: a pool larger than the
machine got the process killed by the OS (CPU) with no error at all."""
from __future__ import annotations

import os

import torch

GIB = 1 << 30


def available_bytes(device: torch.device) -> int | None:
    """Memory that can still be allocated on ``device``: free GPU memory on CUDA, the kernel's
    MemAvailable on the CPU (page cache it can drop included), else free physical pages;
    None where it cannot be told (then nothing is checked)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_kv_pool_fits(num_blocks: int, bytes_per_block: int, device: torch.device,
                       asked: str, available: int | None = None) -> None:
    """ValueError naming ``asked`` (the setting that sized the pool) when ``num_blocks`` blocks
    do not fit in what ``device`` has available (``available`` overrides the probe, for tests)."""
    need = num_blocks * bytes_per_block
    have = available_bytes(device) if available is None else available
    if have is not None and need > have:
        raise ValueError(f"{asked}: the KV cache needs {num_blocks} blocks x {bytes_per_block} "
                         f"bytes = {need / GIB:.2f} GiB but only {have / GIB:.2f} GiB is "
                         f"available on {device}; lower it (or leave it unset for a default "
                         "that fits)")

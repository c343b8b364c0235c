"""Memory budgets derived from the device: how large one score array may be.

Both the "mlx" backend (its score blocks) and the fallback rule (whether MLX's unfused attention
may serve a call) size their O(N^2)-per-block arrays from the memory of the device that runs
the call, or MLX's memory limit where that is lower (memory_budget_bytes), not from a fixed
element count.
"""
from __future__ import annotations

import functools
import os

import mlx.core as mx

# Used when neither MLX nor the OS reports a memory size.
_UNKNOWN_MEMORY = 8 << 30


@functools.lru_cache(maxsize=None)
def _memory_bytes(device_type: str) -> int:
    device = mx.Device(mx.gpu if device_type == "gpu" else mx.cpu)
    try:
        info = mx.device_info(device)
    except (TypeError, ValueError, RuntimeError):
        info = {}
    for key in ("memory_size", "total_memory"):
        size = info.get(key)
        if isinstance(size, int) and size > 0:
            return size
    try:  # the CPU (MLX reports no memory size there): physical memory
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return _UNKNOWN_MEMORY


def device_memory_bytes(device: mx.Device) -> int:
    """Memory of `device` in bytes (MLX's device_info; physical memory for the CPU)."""
    return _memory_bytes("gpu" if device.type == mx.gpu else "cpu")


def memory_budget_bytes(device: mx.Device) -> int:
    """What a call may plan with: the device's memory, or MLX's memory limit where that is lower.

    A user who lowers the limit (mx.set_memory_limit) asks MLX to wait for memory instead of
    running ahead; the "mlx" backend then cuts smaller score blocks, so that one block's
    temporaries fit under the limit too (on a GPU they dominate the peak once MLX waits).
    """
    memory = device_memory_bytes(device)
    limit = mx.get_memory_limit()
    return min(memory, limit) if limit > 0 else memory

"""Fault injection: make chosen kernels fail to compile or compute wrong numbers.

What a real Mac could do to our kernels (Apple's compiler rejects one, or one computes wrong
numbers on some GPU family) is reproduced here on demand, so the code that must survive it
(mlx_flash.backends.guard: fall back, warn, count) is tested in CI with the real kernels.

``MLX_FLASH_METALSIM_FAULT``, read at every kernel call:
    ``compile:<text>``  every kernel whose name contains <text> is rejected like a compiler
                        error (:class:`CompileError`, with a diagnostic on the source's first
                        line in the simulator's usual format).
    ``corrupt:<text>``  every kernel whose name contains <text> runs, then one element per
                        launched threadgroup of each floating-point output is made wrong
                        (``CORRUPTION`` added; a non-finite element becomes 0): the error grows
                        with the launch as a wrong threadgroup's would.
Unset or empty: no fault.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from .compiler import CompileError

ENV = "MLX_FLASH_METALSIM_FAULT"
KINDS = ("compile", "corrupt")
# Added to each corrupted element: exact in fp16/bf16, and far past every tolerance (outputs of
# unit-scale inputs are O(1) or smaller).
CORRUPTION = 64.0


@dataclass(frozen=True)
class Fault:
    kind: str   # "compile" or "corrupt"
    text: str   # substring of the kernel names it hits

    def hits(self, kernel_name: str) -> bool:
        return self.text in kernel_name


def active_fault() -> Optional[Fault]:
    """The fault MLX_FLASH_METALSIM_FAULT asks for, or None; a malformed value raises."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    kind, sep, text = value.partition(":")
    if not sep or kind not in KINDS or not text:
        raise ValueError(f"metalsim: {ENV} must be 'compile:<text>' or 'corrupt:<text>' with a "
                         f"non-empty kernel-name substring, got {value!r}.")
    return Fault(kind, text)


def before_compile(kernel_name: str, source: str) -> None:
    """Raise a compiler-like CompileError when a `compile:` fault hits this kernel."""
    fault = active_fault()
    if fault is None or fault.kind != "compile" or not fault.hits(kernel_name):
        return
    first_line = source.strip().split("\n", 1)[0].strip() if source.strip() else ""
    raise CompileError(
        f"metalsim: failed to compile kernel '{kernel_name}':\n"
        f"  source line 1: error: fault injected by {ENV}=compile:{fault.text}\n"
        f"      {first_line}")


def after_launch(kernel_name: str, outputs: Sequence[np.ndarray], output_dtypes: Sequence,
                 threadgroups: int) -> None:
    """Corrupt the outputs in place when a `corrupt:` fault hits this kernel.

    Args:
        outputs: the launch's output buffers (bfloat16 ones hold the raw uint16 bits).
        output_dtypes: their MLX dtypes.
        threadgroups: how many threadgroups the launch ran (>= 1).
    """
    fault = active_fault()
    if fault is None or fault.kind != "corrupt" or not fault.hits(kernel_name):
        return
    for buf, dtype in zip(outputs, output_dtypes):
        if dtype not in (mx.float32, mx.float16, mx.bfloat16) or buf.size == 0:
            continue
        flat = buf.reshape(-1)
        count = min(max(threadgroups, 1), flat.size)
        index = (np.arange(count, dtype=np.int64) * flat.size) // count  # evenly spaced
        if dtype == mx.bfloat16:
            values = (flat[index].astype(np.uint32) << 16).view(np.float32)
            values = np.where(np.isfinite(values), values + CORRUPTION, 0.0).astype(np.float32)
            flat[index] = (values.view(np.uint32) >> 16).astype(np.uint16)
        else:
            values = flat[index]
            flat[index] = np.where(np.isfinite(values), values + CORRUPTION, 0.0)

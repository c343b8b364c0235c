"""Run the "cuda" backend's kernels on the CPU (kernel logic checks on machines without a GPU).

`emulated()` swaps the backend's `mx.fast.cuda_kernel` objects for stand-ins that compile the
same rendered source with the host C++ compiler and the prelude kernels/cuda_emulation.cuh
(fibers per CUDA thread, warp collectives executed when a whole warp reaches them, cp.async
deferred to its wait, shared-memory bounds checks, random warp order). Everything else, the
block planning, rendering, launch geometry and parameter arrays, is the backend's own code.

It checks indexing, tiling, masking, synchronization order and the math of the kernels; it does
not check speed, register pressure or anything NVRTC-specific (compile with nvcc for that).

Usage:
    with cuda_emulator.emulated(seed=1):
        out = flash_attention(q, k, v, backend="cuda")
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from typing import List, Optional

import mlx.core as mx
import numpy as np

from ..render import template_text
from . import cuda

_C_TYPES = {mx.bfloat16: "__nv_bfloat16", mx.float16: "__half", mx.float32: "float", mx.int64: "int64_t",
            mx.bool_: "bool"}
_NP_STORAGE = {mx.bfloat16: np.uint16, mx.float16: np.uint16, mx.float32: np.float32, mx.int64: np.int64,
               mx.bool_: np.bool_}
# Settings of the active emulation (seed of the warp order, copies at issue instead of at wait).
_SETTINGS = {"seed": 0, "eager": False}


def compiler() -> Optional[str]:
    """The host C++ compiler used (None if there is none)."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")


def _cache_dir() -> str:
    path = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "mlx_flash", "cuda_emulator")
    os.makedirs(path, exist_ok=True)
    return path


@functools.lru_cache(maxsize=None)
def _library(source: str) -> ctypes.CDLL:
    """Compile `source` into a shared library once (cached on disk by content hash)."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("[cuda_emulator] no host C++ compiler (set CXX or install g++).")
    digest = hashlib.sha256(source.encode()).hexdigest()[:24]
    path = os.path.join(_cache_dir(), f"k_{digest}.so")
    if not os.path.exists(path):
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "kernel.cpp")
            with open(src, "w") as f:
                f.write(source)
            out = os.path.join(tmp, "kernel.so")
            r = subprocess.run([cxx, "-std=c++17", "-O1", "-fPIC", "-shared", "-w", src, "-o", out],
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"[cuda_emulator] compiling the kernel failed:\n{r.stderr[-6000:]}")
            os.replace(out, path)  # atomic: concurrent test workers never see a partial file
    lib = ctypes.CDLL(path)
    lib.mlxflash_emulate_run.restype = ctypes.c_int
    return lib


class EmulatedKernel:
    """Drop-in for the callable mx.fast.cuda_kernel returns (same keyword arguments)."""

    def __init__(self, name: str, input_names: List[str], output_names: List[str], source: str, header: str,
                 shared_memory: int = 0):
        self.name, self.input_names, self.output_names = name, input_names, output_names
        self.body, self.header, self.shared_memory = source, header, shared_memory

    def _source(self, inputs, output_dtypes) -> str:
        args = [f"  const {_C_TYPES[x.dtype]}* {n} = (const {_C_TYPES[x.dtype]}*)a[{i}];"
                for i, (n, x) in enumerate(zip(self.input_names, inputs))]
        args += [f"  {_C_TYPES[d]}* {n} = ({_C_TYPES[d]}*)a[{len(inputs) + i}];"
                 for i, (n, d) in enumerate(zip(self.output_names, output_dtypes))]
        return (template_text("cuda_emulation.cuh") + "\n" + self.header + "\n"
                + "static void mlxflash_block(void** a) {\n" + "\n".join(args) + "\n  " + self.body + "\n}\n"
                + 'extern "C" int mlxflash_emulate_run(void** a, int gx, int gy, int threads, int smem, int seed, '
                  "int eager, char* err, int len) {\n"
                  "  return mlxflash_emulate(mlxflash_block, a, gx, gy, threads, smem, seed, eager, err, len);\n}\n")

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, **unused):
        lib = _library(self._source(inputs, output_dtypes))
        host_inputs = []
        for x in inputs:
            if x.dtype not in _NP_STORAGE:
                raise TypeError(f"[cuda_emulator] input dtype {x.dtype} is not emulated")
            view = mx.view(x, mx.uint16) if x.dtype in (mx.bfloat16, mx.float16) else x
            host_inputs.append(np.ascontiguousarray(np.array(view)))
        # Outputs poisoned with all-ones bits (NaN for floats): an element never written shows.
        outputs = []
        for shape, d in zip(output_shapes, output_dtypes):
            o = np.empty(shape, _NP_STORAGE[d])
            o.reshape(-1).view(np.uint8)[:] = 0xFF if d != mx.bool_ else 0
            outputs.append(o)
        arrays = host_inputs + outputs
        pointers = (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])
        tx = threadgroup[0]
        gx, gy = grid[0] // tx, grid[1]
        err = ctypes.create_string_buffer(512)
        code = lib.mlxflash_emulate_run(pointers, gx, gy, tx, self.shared_memory, _SETTINGS["seed"],
                                        int(_SETTINGS["eager"]), err, len(err))
        if code != 0:
            raise RuntimeError(f"[cuda_emulator] {self.name}: {err.value.decode()}")
        result = []
        for o, d in zip(outputs, output_dtypes):
            a = mx.array(o)
            result.append(mx.view(a, d) if d in (mx.bfloat16, mx.float16) else a)
        return result


@functools.lru_cache(maxsize=None)
def _emulated_kernel(config: cuda.KernelConfig) -> EmulatedKernel:
    header, body, inputs, outputs = cuda.kernel_source(config)
    return EmulatedKernel(config.name, inputs, outputs, body, header, config.shared_memory)


@functools.lru_cache(maxsize=None)
def _emulated_prepare(dtype: str, head_dim: int, has_d_lse: bool) -> EmulatedKernel:
    header, body, inputs, outputs = cuda.prepare_source(dtype, head_dim, has_d_lse)
    return EmulatedKernel(f"prepare_{head_dim}", inputs, outputs, body, header, 0)


@contextlib.contextmanager
def emulated(seed: int = 0, eager_copies: bool = False):
    """Within the block, backend "cuda" runs its kernels through the CPU emulator.

    Args:
        seed: seed of the random warp order (different seeds interleave warps differently).
        eager_copies: perform cp.async copies at issue instead of at the covering wait.
    """
    saved = (cuda._kernel, cuda._prepare_kernel, cuda.CUDABackend.unavailable_reason, cuda.WGMMA_FORWARD_OVERRIDE,
             cuda.WGMMA_BACKWARD_OVERRIDE, dict(_SETTINGS))
    cuda._kernel = _emulated_kernel
    cuda._prepare_kernel = _emulated_prepare
    cuda.CUDABackend.unavailable_reason = lambda self, device: None
    # wgmma is not emulated: the mma.sync kernels even on a Hopper host
    cuda.WGMMA_FORWARD_OVERRIDE = cuda.WGMMA_BACKWARD_OVERRIDE = False
    _SETTINGS.update(seed=seed, eager=eager_copies)
    try:
        yield
    finally:
        cuda._kernel, cuda._prepare_kernel, cuda.CUDABackend.unavailable_reason = saved[:3]
        cuda.WGMMA_FORWARD_OVERRIDE, cuda.WGMMA_BACKWARD_OVERRIDE = saved[3:5]
        _SETTINGS.clear()
        _SETTINGS.update(saved[5])

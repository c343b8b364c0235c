"""Run the "cuda" backend's kernels on the CPU (kernel logic checks on machines without a GPU).

`backend()` is a CUDABackend whose kernel factory is `KernelFactory`: stand-ins for
`mx.fast.cuda_kernel` objects that compile the same rendered source with the host C++ compiler
and the prelude kernels/cuda_emulation.cuh (fibers per CUDA thread, warp collectives executed
when a whole warp reaches them, cp.async deferred to its wait, shared-memory bounds checks,
random warp order). Everything else, the block planning for the chosen GPU family, rendering,
launch geometry and parameter arrays, is the backend's own code. The wgmma kernels are not
emulated: the emulated backend runs the family's mma.sync kernels.

It checks indexing, tiling, masking, synchronization order and the math of the kernels; it does
not check speed, register pressure or anything NVRTC-specific (compile with nvcc for that).

Strided inputs: MLX passes `<name>_strides` to a kernel whose body names it. The emulator sees
only an input's values, so it lays each such [B, H, N, D] input out itself (KernelFactory.layout):
row-contiguous, token-major (a transposed view of a [B, N, H, D] buffer, as mlx-lm hands them
over), spread (every other element of padded rows at an odd offset: the kernels' element-wise
path), mixed (those three in turn over a kernel's strided inputs), or broadcast (an input whose
rows are constant, e.g. the cotangent of out.sum(), as MLX hands it over: column stride 0; the
others row-contiguous).

Usage:
    out = flash_attention(q, k, v, backend=cuda_emulator.backend(seed=1, capability=86))
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from types import MappingProxyType
from dataclasses import dataclass
from typing import List, Optional

import mlx.core as mx
import numpy as np

from ..render import template_text
from .cuda import CUDABackend
from .cuda_source import Tuning

_C_TYPES = MappingProxyType({mx.bfloat16: "__nv_bfloat16", mx.float16: "__half", mx.float32: "float",
                             mx.int64: "int64_t", mx.int32: "int32_t", mx.bool_: "bool"})
_NP_STORAGE = MappingProxyType({mx.bfloat16: np.uint16, mx.float16: np.uint16, mx.float32: np.float32,
                                mx.int64: np.int64, mx.int32: np.int32, mx.bool_: np.bool_})


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


LAYOUTS = ("row", "token_major", "spread", "mixed", "broadcast")


def _lay_out(x: np.ndarray, layout: str) -> np.ndarray:
    """A [B, H, N, D] view holding x's values in one layout (a view keeps its buffer alive)."""
    if layout == "broadcast":
        constant_rows = (x == x[..., :1]).all()
        return np.broadcast_to(np.ascontiguousarray(x[..., :1]), x.shape) if constant_rows else x
    if layout == "row":
        return x
    if layout == "token_major":
        return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    d = x.shape[-1]  # spread: columns 1, 3, ..., 2 d - 1 of rows of 2 d + 2 elements
    view = np.zeros(x.shape[:-1] + (2 * d + 2,), x.dtype)[..., 1:2 * d:2]
    view[...] = x
    return view


class EmulatedKernel:
    """Drop-in for the callable mx.fast.cuda_kernel returns (same keyword arguments)."""

    def __init__(self, name: str, input_names: List[str], output_names: List[str], source: str, header: str,
                 shared_memory: int = 0, seed: int = 0, eager_copies: bool = False, layout: str = "row"):
        self.name, self.input_names, self.output_names = name, input_names, output_names
        self.body, self.header, self.shared_memory = source, header, shared_memory
        self.seed, self.eager_copies, self.layout = seed, eager_copies, layout
        # As MLX: an input's strides are passed when the body names them.
        self.strided = [f"{n}_strides" in source for n in input_names]

    def _layouts(self) -> List[str]:
        """The layout of each strided input, in order."""
        count = sum(self.strided)
        if self.layout != "mixed":
            return [self.layout] * count
        return [("token_major", "spread", "row")[i % 3] for i in range(count)]

    def _source(self, inputs, output_dtypes) -> str:
        args = [f"  const {_C_TYPES[x.dtype]}* {n} = (const {_C_TYPES[x.dtype]}*)a[{i}];"
                for i, (n, x) in enumerate(zip(self.input_names, inputs))]
        slot = len(inputs) + len(output_dtypes)
        for n, strided in zip(self.input_names, self.strided):
            if strided:
                args.append(f"  const int64_t* {n}_strides = (const int64_t*)a[{slot}];")
                slot += 1
        args += [f"  {_C_TYPES[d]}* {n} = ({_C_TYPES[d]}*)a[{len(inputs) + i}];"
                 for i, (n, d) in enumerate(zip(self.output_names, output_dtypes))]
        return (template_text("cuda_emulation.cuh") + "\n" + self.header + "\n"
                + "static void mlxflash_block(void** a) {\n" + "\n".join(args) + "\n  " + self.body + "\n}\n"
                + 'extern "C" int mlxflash_emulate_run(void** a, int gx, int gy, int threads, int smem, int seed, '
                  "int eager, char* err, int len) {\n"
                  "  return mlxflash_emulate(mlxflash_block, a, gx, gy, threads, smem, seed, eager, err, len);\n}\n")

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, **unused):
        try:
            lib = _library(self._source(inputs, output_dtypes))
        except RuntimeError as error:  # name the kernel, as the GPU's compiler log does
            raise RuntimeError(f"{self.name}: {error}") from None
        host_inputs, strides = [], []
        layouts = iter(self._layouts())
        for x, strided in zip(inputs, self.strided):
            if x.dtype not in _NP_STORAGE:
                raise TypeError(f"[cuda_emulator] input dtype {x.dtype} is not emulated")
            view = mx.view(x, mx.uint16) if x.dtype in (mx.bfloat16, mx.float16) else x
            host = np.ascontiguousarray(np.array(view))
            if strided:
                if host.ndim != 4:
                    raise ValueError(f"[cuda_emulator] {self.name}: strided input of shape {host.shape} is not 4-D")
                host = _lay_out(host, next(layouts))
                strides.append(np.array([s // host.itemsize for s in host.strides], np.int64))
            host_inputs.append(host)
        # Outputs poisoned with all-ones bits (NaN for floats): an element never written shows.
        outputs = []
        for shape, d in zip(output_shapes, output_dtypes):
            o = np.empty(shape, _NP_STORAGE[d])
            o.reshape(-1).view(np.uint8)[:] = 0xFF if d != mx.bool_ else 0
            outputs.append(o)
        arrays = host_inputs + outputs + strides
        pointers = (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])
        tx = threadgroup[0]
        gx, gy = grid[0] // tx, grid[1]
        err = ctypes.create_string_buffer(512)
        code = lib.mlxflash_emulate_run(pointers, gx, gy, tx, self.shared_memory, self.seed,
                                        int(self.eager_copies), err, len(err))
        if code != 0:
            raise RuntimeError(f"[cuda_emulator] {self.name}: {err.value.decode()}")
        result = []
        for o, d in zip(outputs, output_dtypes):
            a = mx.array(o)
            result.append(mx.view(a, d) if d in (mx.bfloat16, mx.float16) else a)
        return result


@dataclass(frozen=True)
class KernelFactory:
    """Drop-in for mx.fast.cuda_kernel (a CUDABackend's kernel_factory) that builds EmulatedKernels.

    Attributes:
        seed: seed of the random warp order (different seeds interleave warps differently).
        eager_copies: perform cp.async copies at issue instead of at the covering wait.
        layout: how strided inputs are laid out (LAYOUTS; see the module docstring).
    """

    seed: int = 0
    eager_copies: bool = False
    layout: str = "row"

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"[cuda_emulator] layout must be one of {LAYOUTS}, got {self.layout!r}.")

    def __call__(self, *, name, input_names, output_names, source, header, shared_memory=0, **unused):
        return EmulatedKernel(name, list(input_names), list(output_names), source, header, shared_memory,
                              self.seed, self.eager_copies, self.layout)


def backend(seed: int = 0, eager_copies: bool = False, capability: int = 90, tuning: Tuning = Tuning(),
            layout: str = "row", sm_count: Optional[int] = None) -> CUDABackend:
    """A "cuda" backend that runs its kernels on the CPU; pass it as flash_attention's `backend`.

    Args:
        seed, eager_copies, layout: see KernelFactory.
        capability: the compute capability whose family plans the kernels (90: sm90's mma.sync rows).
        tuning: overrides of the block table (as CUDABackend's).
        sm_count: the SMs the dK/dV kernel's head splits plan for (as CUDABackend's; None: no splits
            unless the tuning forces them).
    """
    return CUDABackend(tuning=tuning, kernel_factory=KernelFactory(seed, eager_copies, layout), capability=capability,
                       sm_count=sm_count)

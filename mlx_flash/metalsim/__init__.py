"""metalsim: run ``mx.fast.metal_kernel`` kernels on a CPU.

``metalsim.metal_kernel`` takes the same arguments as ``mx.fast.metal_kernel``
and returns a callable with the same keyword arguments (``inputs``,
``template``, ``grid`` (in threads), ``threadgroup``, ``output_shapes``,
``output_dtypes``, ``init_value``, ``verbose``, ``stream``). The Metal body is
translated to C++ (tokenizer.py/rewrite.py), wrapped in the signature MLX
would generate (signature.py), compiled with the clang shipped in the
``ziglang`` pip package (compiler.py) and run with one user-space fiber per
GPU thread (runtime/), so barriers and SIMD-group functions are real
synchronisation points.

Execution model
---------------
* Grid and threadgroup as MLX: ``grid`` counts threads; like MLX, each
  threadgroup dimension is first clamped to the grid dimension
  (``min(threadgroup, grid)``, see ml-explore/mlx#4534), then
  ``ceil(grid / threadgroup)`` threadgroups are dispatched
  (``dispatchThreads``): edge threadgroups are partial and threads outside
  the grid do not exist. ``threads_per_threadgroup`` is the actual (partial)
  size, ``dispatch_threads_per_threadgroup`` the requested one; threads are
  linearised (and grouped into simdgroups of 32) over the actual size.
* Within a threadgroup the threads run in a deterministic order (thread
  index, or reversed with ``thread_order="reversed"`` /
  ``MLX_FLASH_METALSIM_ORDER=reversed``) and only switch at barriers, SIMD
  collectives and thread exit. Threadgroups run in parallel on
  ``MLX_FLASH_METALSIM_THREADS`` (default: all CPUs) OS threads.
* ``threadgroup_barrier`` waits for all live threads of the threadgroup
  (threads that returned early no longer count). A SIMD collective waits for
  all live lanes of the simdgroup; lanes of a partial simdgroup that do not
  exist are inactive and excluded. If lanes wait at a collective while their
  simdgroup mates wait at a barrier (divergent code), the collective runs
  with the waiting lanes as the active set.
* Outputs are poisoned before launch (NaN for floating types, 0xDEADBEEF
  patterns for integers) unless ``init_value`` is given. Threadgroup memory
  is poisoned (0xFF bytes) at the start of every threadgroup.

Faithfulness aids
-----------------
* ``thread_order="reversed"`` exposes missing barriers.
* ``check="bounds"`` (or ``MLX_FLASH_METALSIM_CHECK=bounds``): device,
  constant and threadgroup pointers and threadgroup arrays are compiled as
  bounds-checked wrappers; the first out-of-bounds access raises
  :class:`MetalSimError` naming the kernel, the buffer and the index (the
  access itself is redirected to a scratch slot, so the process survives).
* More than 32 KB of threadgroup memory or more than 1024 threads per
  threadgroup are rejected, as on Metal.
* Compile errors are reported on the lines of the kernel source/header.

Supported MSL
-------------
* Address spaces ``device``, ``constant``, ``thread``, ``threadgroup``;
  ``threadgroup T a[N]...;`` in the body is shared by the threadgroup.
* ``half`` (_Float16) and ``bfloat`` (__bf16), both rounding after each
  operation; ``float16_t``/``bfloat16_t``; vectors ``T2/T3/T4`` of float,
  half, bfloat, int, uint, short, ushort, char, uchar, long, ulong, bool,
  ``packed_T2/T4``, ``vec<T, N>``, swizzles (``.xyzw``, ``.rgba``),
  Metal's vector constructors and conversions, ``as_type<T>``.
* ``metal::``/``fast::``/``precise::`` math (exp, exp2, log, log2, pow, sqrt,
  rsqrt, tanh, sin/cos..., floor/ceil/round/trunc, fma, mad, min/max, clamp,
  mix, step, select, isnan/isinf, dot/length/normalize, popcount/clz/ctz,
  precise::divide, ...), ``numeric_limits``, INFINITY/NAN/MAXFLOAT/M_*_F.
* ``threadgroup_barrier``/``simdgroup_barrier`` with ``mem_flags``;
  simd_sum/product/max/min/and/or/xor, simd_prefix_{in,ex}clusive_{sum,
  product}, simd_shuffle{,_xor,_up,_down,_rotate_up,_rotate_down},
  simd_broadcast{,_first}, simd_all/any/ballot, simd_is_first, and quad_*.
* ``simdgroup_matrix<float|half|bfloat, 8, 8>``: simdgroup_load/store
  (elements_per_row, origin, transpose), simdgroup_multiply(_accumulate),
  make_filled_simdgroup_matrix, thread_elements() with Apple's lane layout.
* Atomics on device/threadgroup memory: ``atomic<int|uint|float>``,
  atomic_{load,store,exchange,compare_exchange_weak}_explicit,
  atomic_fetch_{add,sub,min,max,and,or,xor}_explicit.
* From MLX's utils.h: Limits<T>, ceildiv, elem_to_loc.

MLX's Metal headers and Apple's kernels
--------------------------------------
``#include "mlx/backend/metal/kernels/..."`` resolves against the installed
mlx wheel (includes.py); kernel/parameter attributes are dropped so Apple's
``[[kernel]]`` templates can be called from a body; function constants take
their values from ``function_constants=``.

Language rules and versions
---------------------------
rules.py rejects code Apple's compiler rejects (double, new/delete, virtual,
exceptions, goto, recursion, pointers without an address space, threadgroup
variables outside kernels, ...) with :class:`MetalSimLanguageError`.
``metal_version="3.0"`` compiles for macOS 13: bfloat16_t is then MLX's
portable struct and native bfloat is rejected.

Not supported (rejected at compile time with the kernel name and line):
textures, samplers, imageblocks, raster order groups,
Metal ``[[attributes]]`` inside the body/header, matrix types (floatNxM),
packed 3-vectors, ray tracing, async copies. ``compile_options`` are
validated but all math modes behave like ``safe``.
"""

from .compiler import CompileError
from .kernel import (MetalKernel, MetalSimError, MetalSimLanguageError, MetalSimUnsupportedError,
                     metal_kernel)

__all__ = [
    "metal_kernel",
    "MetalKernel",
    "MetalSimError",
    "MetalSimUnsupportedError",
    "MetalSimLanguageError",
    "CompileError",
]

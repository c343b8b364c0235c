"""metalsim speed figures (a benchmark, not a test): about 20 s on a 2-core CPU.

Prints medians of repeated runs of:
  * a 256x256x256 tiled matmul (threadgroup memory + simdgroup_matrix 8x8), compiled, float32;
  * compiling one kernel variant into an empty cache directory;
  * the per-call overhead of a tiny kernel (1 threadgroup of 32 threads).

Targets on a 2-core x86-64 machine: matmul < 0.2 s, compile < 2 s, per-call overhead < 1 ms.

    python benchmarks/bench_metalsim.py [--repeat N]
"""
from __future__ import annotations

import argparse
import os
import tempfile

import mlx.core as mx
import numpy as np

from mlx_flash import metalsim
from mlx_flash.benchmark import time_call
from mlx_flash.metalsim import compiler, samples

def matmul_kernel():
    return samples.matmul_kernel(metalsim)


def matmul(kernel, a, b):
    return samples.run_matmul(kernel, a, b, mx.float32)


def bench_matmul(repeat: int) -> float:
    kernel = matmul_kernel()
    rng = np.random.default_rng(0)
    a, b = (mx.array(rng.standard_normal((256, 256)).astype(np.float32)) for _ in range(2))
    seconds = time_call(lambda _: matmul(kernel, a, b), warmup=1, min_repeats=repeat, max_repeats=repeat,
                        target_seconds=0).median
    error = np.abs(np.array(matmul(kernel, a, b)) - np.array(a) @ np.array(b)).max()
    if error > 1e-3:
        raise SystemExit(f"tiled matmul is wrong: max error {error}")
    return seconds


def bench_compile(repeat: int) -> float:
    """A fresh kernel object compiled into empty metalsim and zig caches, per repetition. The cache
    locations are environment variables read at compile time; they are restored afterwards."""
    names = ("MLX_FLASH_METALSIM_CACHE", "ZIG_GLOBAL_CACHE_DIR", "ZIG_LOCAL_CACHE_DIR")
    saved = {n: os.environ.get(n) for n in names}
    compiler.load_runtime()  # the runtime library is built once per machine
    a = mx.zeros((64, 64))
    directories = []

    def prepare():
        directories.append(tempfile.TemporaryDirectory())
        for n in names:
            os.environ[n] = directories[-1].name
        return matmul_kernel()

    try:
        return time_call(lambda kernel: matmul(kernel, a, a), prepare=prepare, warmup=0, min_repeats=repeat,
                         max_repeats=repeat, target_seconds=0).median
    finally:
        for n, v in saved.items():
            os.environ.pop(n, None) if v is None else os.environ.__setitem__(n, v)
        for directory in directories:
            directory.cleanup()


def bench_overhead(repeat: int, calls: int = 200) -> float:
    kernel = metalsim.metal_kernel(name="tiny", input_names=["inp"], output_names=["out"],
                                   source="uint i = thread_position_in_grid.x; out[i] = inp[i] + 1.0f;")
    x = mx.zeros((32,))
    arguments = dict(inputs=[x], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(32,)],
                     output_dtypes=[mx.float32])
    return time_call(lambda _: [kernel(**arguments)[0] for _ in range(calls)], warmup=1, min_repeats=repeat,
                     max_repeats=repeat, target_seconds=0).median / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--repeat", type=int, choices=range(1, 101), metavar="{1..100}", default=7,
                        help="timed repetitions per figure")
    args = parser.parse_args()
    print(f"matmul 256x256x256 (tiled, simdgroup_matrix): {bench_matmul(args.repeat) * 1e3:8.1f} ms   (target < 200 ms)")
    print(f"compile one kernel variant (empty cache):      {bench_compile(max(3, args.repeat // 2)) * 1e3:8.1f} ms"
          "   (target < 2000 ms)")
    print(f"per-call overhead (32-thread kernel):          {bench_overhead(args.repeat) * 1e3:8.3f} ms   (target < 1 ms)")


if __name__ == "__main__":
    main()

"""Small calls of every CUDA kernel for every GPU family's plans (run under compute-sanitizer).

    compute-sanitizer --tool memcheck python benchmarks/sanitize_cases.py 80 86 120 native

Each argument is a compute capability to plan for (MLX_FLASH_CUDA_CAPABILITY) or "native" (the
GPU's own, which on an H100 runs the wgmma kernels). Per capability: forward and backward at head
dims across the family's block-table rows, with causal, bool and additive masks, softcap, a
window and GQA; every call is also checked against the "mlx" backend in fp32.
"""
import os
import sys

import mlx.core as mx
import numpy as np

from mlx_flash import flash_attention
from mlx_flash.backends.cuda import CAPABILITY_VARIABLE, CUDABackend

# (head dim, mask, N): head dims in every row range of blocks_cuda.txt (<= 64, <= 128, <= 192,
# <= 256, <= 448, <= 512); N not a multiple of any block.
CASES = ((64, "causal", 100), (96, "bool", 70), (160, "causal", 50), (200, "additive", 40), (320, "window", 40),
         (512, "causal", 33))


def run(capability: str) -> float:
    """Worst relative error of out / dq / dk / dv against the mlx backend over CASES."""
    if capability == "native":
        os.environ.pop(CAPABILITY_VARIABLE, None)
    else:
        os.environ[CAPABILITY_VARIABLE] = capability
    backend = CUDABackend()  # reads the capability per call
    worst = 0.0
    for head_dim, mask, n in CASES:
        mx.random.seed(head_dim)
        q = mx.random.normal((1, 2, n, head_dim)).astype(mx.bfloat16)
        k = mx.random.normal((1, 1, n + 3, head_dim)).astype(mx.bfloat16)
        v = mx.random.normal((1, 1, n + 3, head_dim)).astype(mx.bfloat16)
        kwargs = dict(mask=mask, softcap=20.0 if head_dim == 96 else None)
        if mask == "bool":
            kwargs["mask"] = mx.random.uniform(shape=(1, 1, n, n + 3)) < 0.7
        elif mask == "additive":
            kwargs["mask"] = mx.random.normal((1, 2, n, n + 3)).astype(mx.bfloat16)
        elif mask == "window":
            kwargs.update(mask="causal", window_size=(17, 0))

        def loss(chosen, dtype):
            def f(q_, k_, v_):
                o = flash_attention(q_.astype(dtype), k_.astype(dtype), v_.astype(dtype), backend=chosen, **kwargs)
                return o.astype(mx.float32).sum(), o
            return mx.value_and_grad(f, argnums=(0, 1, 2))

        (_, out), grads = loss(backend, mx.bfloat16)(q, k, v)
        (_, ref), ref_grads = loss("mlx", mx.float32)(*(x.astype(mx.float32) for x in (q, k, v)))
        mx.eval(out, grads, ref, ref_grads)
        for x, r in zip((out, *grads), (ref, *ref_grads)):
            x, r = np.array(x.astype(mx.float32), np.float64), np.array(r, np.float64)
            worst = max(worst, float(np.linalg.norm(x - r) / max(np.linalg.norm(r), 1e-30)))
    family = backend.family()
    print(f"capability {capability}: family {family.name if family else None}, {len(CASES)} cases, "
          f"worst relative error vs mlx fp32 {worst:.2e}", flush=True)
    return worst


if __name__ == "__main__":
    errors = [run(c) for c in (sys.argv[1:] or ["native"])]
    print("sanitize cases done" + (" (ERROR over 6e-2)" if max(errors) > 6e-2 else ""), flush=True)
    sys.exit(1 if max(errors) > 6e-2 else 0)

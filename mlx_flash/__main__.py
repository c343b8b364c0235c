"""`python -m mlx_flash`: check the active backend against the float64 reference, then time it.

1. Correctness: a few small random cases (non-causal, causal with Nq != Nk, GQA with an lse
   cotangent) through `flash_attention` on the chosen backend; O, lse, dQ, dK, dV compared with
   mlx_flash.reference (relative Frobenius error, same tolerances as the test suite). Exit 1 on
   a failure.
2. Speed and memory: forward and forward+backward of mlx-flash vs mx.fast.scaled_dot_product_attention
   at a few sizes, measured in the same run (median of warm runs; see mlx_flash/benchmark.py for
   exactly what is timed), then the backend's own kernels (forward, and backward_query /
   backward_key_value where the backend has them, else its whole backward) with TFLOP/s and
   G instructions/s.

Defaults are sized by device: on a CPU, B=1 H=8 D=64 fp32 at small N (the run stays around a
minute on 2 cores); on a GPU, bf16, D=128, H=16 and N from 2048 to 16384.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np

from . import __version__, benchmark as bm, reference
from .api import flash_attention
from .backends import BACKEND_NAMES, auto_backend_name, get_backend
from .fallback import fallback_counts
from .spec import check_inputs

# Same limits as tests/attention_cases.py: relative Frobenius error per dtype.
FORWARD_TOLERANCE = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}
GRADIENT_TOLERANCE = {"float32": 2e-4, "float16": 1e-2, "bfloat16": 6e-2}

# (label, B, Hq, Hkv, Nq, Nk, causal, lse cotangent)
CHECK_CASES = [("non-causal", 2, 3, 3, 80, 80, False, False),
               ("causal Nq<Nk", 1, 2, 2, 70, 130, True, False),
               ("GQA 4/2 causal +dlse", 1, 4, 2, 96, 96, True, True)]


def relative_error(x, ref: np.ndarray) -> float:
    x = np.asarray(x, dtype=np.float64)
    norm = np.linalg.norm(ref)
    diff = np.linalg.norm(x - ref)
    return float(diff / norm) if norm > 0 else float(diff)


def check_backend(backend: str, dtype: str, head_dim: int, seed: int = 0) -> List[Dict]:
    """Relative errors of O, lse, dQ, dK, dV against the float64 reference for CHECK_CASES."""
    results = []
    rng = np.random.default_rng(seed)
    for label, B, Hq, Hkv, Nq, Nk, causal, lse_cotangent in CHECK_CASES:
        def normal(*shape):
            return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(bm.DTYPES[dtype])

        q, k, v = normal(B, Hq, Nq, head_dim), normal(B, Hkv, Nk, head_dim), normal(B, Hkv, Nk, head_dim)
        d_out = normal(B, Hq, Nq, head_dim)
        d_lse = mx.array(rng.standard_normal((B, Hq, Nq)).astype(np.float32)) if lse_cotangent else None
        mask = "causal" if causal else None
        spec, _ = check_inputs(q, k, v, mask=mask)
        before = fallback_counts()

        def attend(q_, k_, v_):
            return list(flash_attention(q_, k_, v_, mask=mask, return_lse=True, backend=backend))

        cotangents = [d_out, d_lse if d_lse is not None else mx.zeros((B, Hq, Nq), mx.float32)]
        if d_lse is None:  # the common case: only out is used, lse gets no cotangent at all
            def attend(q_, k_, v_):  # noqa: F811
                return [flash_attention(q_, k_, v_, mask=mask, backend=backend)]
            cotangents = [d_out]
        out, lse = flash_attention(q, k, v, mask=mask, return_lse=True, backend=backend)
        _, gradients = mx.vjp(attend, [q, k, v], cotangents)
        mx.eval(out, lse, gradients)
        as_np = [np.array(x.astype(mx.float32)) for x in (q, k, v, d_out)]
        ref_out, ref_lse = reference.attention_forward(*as_np[:3], spec)
        ref_grads = reference.attention_backward(*as_np, spec, d_lse=None if d_lse is None else np.array(d_lse))
        errors = {"out": relative_error(np.array(out.astype(mx.float32)), ref_out),
                  "lse": relative_error(np.array(lse), ref_lse)}
        for name, gradient, ref in zip(("dq", "dk", "dv"), gradients, ref_grads):
            errors[name] = relative_error(np.array(gradient.astype(mx.float32)), ref)
        passed = (max(errors["out"], errors["lse"]) <= FORWARD_TOLERANCE[dtype]
                  and max(errors["dq"], errors["dk"], errors["dv"]) <= GRADIENT_TOLERANCE[dtype])
        fallbacks = [r for r, n in fallback_counts().items() if n > before.get(r, 0)]
        results.append({"case": label, "dtype": dtype, "errors": errors, "passed": passed, "fallbacks": fallbacks})
    return results


def default_config(device: mx.Device) -> Dict:
    if device.type == mx.gpu:
        return {"sizes": [2048, 4096, 8192, 16384], "quick_sizes": [1024, 2048], "dtype": "bfloat16",
                "head_dim": 128, "heads": 16, "warmup": 2, "target_seconds": 0.5}
    # 2-core CPU: MLX matmuls run at a few GFLOP/s, so N=1024 fwd+bwd already takes seconds.
    return {"sizes": [256, 512, 1024], "quick_sizes": [64, 128], "dtype": "float32",
            "head_dim": 64, "heads": 8, "warmup": 0, "target_seconds": 0.5}


def compare_with_mlx(backend: str, case: bm.BenchCase, settings: bm.Settings) -> Dict:
    """Forward and forward+backward of mlx-flash and mx.fast on the same inputs."""
    inputs = bm.random_inputs(case, seed=case.q_len)
    items = {}
    for name, attention in (("mlx-flash", bm.flash_attention_with(backend)), ("mx.fast", bm.fast_attention)):
        for pass_name in ("forward", "forward_backward"):
            prepare, run = bm.mlx_pass(attention, case, inputs, pass_name)
            items[name, pass_name] = (bm.Call(run, prepare), case, pass_name, None)
    return bm.measure_many(items, settings, catch=False)


def time_kernels(backend_name: str, case: bm.BenchCase, settings: bm.Settings) -> Optional[Dict]:
    """The backend's own entry points, called directly with a precomputed forward:
    forward, then backward_query and backward_key_value when present, else backward."""
    backend = get_backend(backend_name)
    q, k, v, d_out = bm.random_inputs(case, seed=case.q_len + 1)
    spec, mask = check_inputs(q, k, v, mask="causal" if case.causal else None)
    reason = backend.unsupported_reason(spec)
    if reason is not None:
        return {"unsupported": reason}
    out, lse = backend.forward(q, k, v, mask, spec)
    mx.eval(out, lse)
    calls = {"forward": lambda _: backend.forward(q, k, v, mask, spec)}
    if hasattr(backend, "backward_query") and hasattr(backend, "backward_key_value"):
        calls["backward_query"] = lambda _: backend.backward_query(q, k, v, mask, out, lse, d_out, None, spec)
        calls["backward_key_value"] = lambda _: backend.backward_key_value(q, k, v, mask, out, lse, d_out, None, spec)
    else:
        calls["backward"] = lambda _: backend.backward(q, k, v, mask, out, lse, d_out, None, spec)
    return bm.measure_many({kernel: (bm.Call(run), case, kernel, None) for kernel, run in calls.items()},
                           settings, catch=False)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mlx_flash", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smallest sizes, fewest repeats")
    parser.add_argument("--sizes", type=int, nargs="+", help="sequence lengths N (Nq = Nk)")
    parser.add_argument("--dtype", help="float32/fp32, float16/fp16 or bfloat16/bf16 (default by device)")
    parser.add_argument("--backend", default="auto", choices=BACKEND_NAMES)
    parser.add_argument("--head-dim", type=int, help="D (default by device)")
    parser.add_argument("--heads", type=int, help="H (default by device)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--causal", action="store_true", help="time causal attention instead of non-causal")
    parser.add_argument("--skip-check", action="store_true", help="only time")
    args = parser.parse_args(argv)
    if args.sizes and any(n < 1 for n in args.sizes):
        parser.error(f"--sizes must be positive, got {args.sizes}")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:  # the plan inspector: mlx_flash/plan_command.py
        from .plan_command import main as plan_main
        return plan_main(argv[1:])
    args = parse_args(argv)
    started = time.perf_counter()
    device = mx.default_device()
    config = default_config(device)
    dtype = bm.dtype_name(args.dtype or config["dtype"])
    head_dim = args.head_dim or config["head_dim"]
    heads = args.heads or config["heads"]
    sizes = args.sizes or (config["quick_sizes"] if args.quick else config["sizes"])
    env = bm.device_description()

    name = auto_backend_name(device) if args.backend == "auto" else args.backend
    print(f"mlx-flash {__version__}, MLX {mx.__version__}, device {env['device_name']} ({env['device']})")
    try:
        reason = get_backend(name).unavailable_reason(device)
    except ValueError as error:
        print(f"backend {name!r}{' (auto)' if args.backend == 'auto' else ''}: {error}")
        return 2
    if reason is not None:
        if args.backend != "auto":
            print(f"backend {name!r} is not available: {reason}")
            return 2
        print(f"backend {name!r} (auto) is not available ({reason}); flash_attention falls back to 'mlx'")
        name = "mlx"
    print(f"backend: {name!r}" + (" (auto)" if args.backend == "auto" else ""))

    failed = False
    if not args.skip_check:
        print("\n1. Correctness vs the float64 reference (relative error ||x - ref|| / ||ref||)")
        rows = []
        for check_dtype in dict.fromkeys(["float32", dtype]):
            for r in check_backend(name, check_dtype, head_dim):
                e = r["errors"]
                note = "; ".join(f"FALLBACK: {f}" for f in r["fallbacks"])
                rows.append([r["case"], r["dtype"]] + [f"{e[n]:.1e}" for n in ("out", "lse", "dq", "dk", "dv")]
                            + [f"{FORWARD_TOLERANCE[r['dtype']]:.0e}/{GRADIENT_TOLERANCE[r['dtype']]:.0e}",
                               "PASS" if r["passed"] else "FAIL", note])
                failed |= not r["passed"]
        print(bm.format_table(["case", "dtype", "O", "lse", "dQ", "dK", "dV", "tol fwd/grad", "result", "note"], rows))
        print("correctness: " + ("FAIL" if failed else "PASS"))

    settings = bm.Settings(warmup=config["warmup"], min_repeats=2 if args.quick else 3,
                           max_repeats=3 if args.quick else 10, target_seconds=config["target_seconds"])
    cases = [bm.BenchCase(batch=args.batch, q_heads=heads, kv_heads=heads, q_len=n, kv_len=n, head_dim=head_dim,
                          dtype=dtype, causal=args.causal) for n in sizes]
    print(f"\n2. mlx-flash[{name}] vs mx.fast.scaled_dot_product_attention, B={args.batch} H={heads} D={head_dim} "
          f"{dtype}{' causal' if args.causal else ''}: median ms of warm runs, peak memory above the inputs; "
          "ratio = mlx-flash / mx.fast (lower is better)")
    rows = []
    for case in cases:
        measured = compare_with_mlx(name, case, settings)
        for pass_name in ("forward", "forward_backward"):
            mine, theirs = measured["mlx-flash", pass_name], measured["mx.fast", pass_name]
            memory_ratio = (f"{mine['peak_memory_bytes'] / theirs['peak_memory_bytes']:.2f}x"
                            if theirs["peak_memory_bytes"] else "-")
            rows.append([case.q_len, bm.PASS_LABELS[pass_name], bm.format_ms(mine["median_ms"]),
                         bm.format_ms(theirs["median_ms"]),
                         f"{mine['median_ms'] / theirs['median_ms']:.2f}x", bm.format_bytes(mine["peak_memory_bytes"]),
                         bm.format_bytes(theirs["peak_memory_bytes"]), memory_ratio])
    print(bm.format_table(["N", "pass", "mlx-flash ms", "mx.fast ms", "time ratio", "mlx-flash mem",
                           "mx.fast mem", "mem ratio"], rows))

    print(f"\n3. backend {name!r} entry points, called directly (backward given the evaluated forward)")
    rows = []
    for case in cases:
        kernels = time_kernels(name, case, settings)
        if "unsupported" in kernels:
            rows.append([case.q_len, "-", "-", "-", "-", f"not served natively: {kernels['unsupported']}"])
            continue
        for kernel, r in kernels.items():
            rows.append([case.q_len, bm.PASS_LABELS[kernel], bm.format_ms(r["median_ms"]), f"{r['tflops']:.3g}",
                         f"{r['ginstrs']:.3g}", ""])
    print(bm.format_table(["N", "kernel", "ms", "TFLOP/s", "GINSTRS/s", "note"], rows))
    print(f"\ndone in {time.perf_counter() - started:.0f} s" + ("; CORRECTNESS FAILED" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

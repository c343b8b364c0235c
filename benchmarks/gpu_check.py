"""Build, test and benchmark the "cuda" backend on an NVIDIA GPU in one go.

Usage (on the GPU machine):
    python benchmarks/gpu_check.py --out DIR [--phases smoke,test,sanitize,bench] [--quick]

Phases:
    probe     small forward and backward calls against MLX (run it alone first, under `timeout`)
    smoke     a few forward / backward checks against the float64 reference, printed at once
    test      pytest tests/test_cuda.py (log in DIR/pytest.log)
    sanitize  compute-sanitizer memcheck and racecheck over small calls of every kernel
    wgmma     the Hopper warpgroup-MMA forward: device info, forward-only checks against the float64
              reference, then its time
              beside the mma.sync forward, MLX and FlashAttention-2, under several block shapes,
              per call and per call of 8 in one evaluation (DIR/wgmma.json)
    profile_wgmma  ncu of the wgmma forward at D=128 (sections and per-instruction stalls)
    overhead  one forward's time through each layer (kernel call, flash_attention, MLX), per call
    sweep     each kernel alone under several block shapes (SWEEP), to choose blocks_cuda.txt rows
    forward   the forward alone under the table's and FORWARD_SHAPES' block shapes, through
              flash_attention, MLX and FlashAttention-2: per call (with and without
              mx.synchronize) and 8 per evaluation, interleaved rounds (DIR/forward.json)
    softcap   softcap's cost: plain vs softcap (tanh.approx) vs softcap through tanhf, fwd and
              fwd+bwd, interleaved rounds (DIR/softcap.json)
    copy      load_swizzled's copy path at three 64-column panels (D = 160, 192) against the old
              one, fwd and fwd+bwd, interleaved rounds (DIR/copy.json)
    order     causal fwd and fwd+bwd in head-major vs block-major CTA order, interleaved rounds
    backward  the wgmma dQ and dK/dV kernels alone against the mma.sync ones: gradients compared,
              times (interleaved rounds) under the traversal blocks of BACKWARD_SHAPES, and the
              dK/dV schemes past D = 128 (DIR/backward.json)
    resources nvcc --resource-usage of every kernel at the table's shapes (needs nvcc, no GPU)
    bench     backend "cuda" vs mx.fast.scaled_dot_product_attention vs torch FlashAttention-2,
              bf16, fwd and fwd+bwd, medians of per-call timings (until mx.eval returns; torch:
              until torch.cuda.synchronize returns); peak memory; the
              backward kernels alone; results in
              DIR/bench.json, a table printed last (--ours-only: backend "cuda" alone).
Every phase runs even if an earlier one fails; the exit code says whether all passed.
"""
from __future__ import annotations

import argparse
import json
import shlex
import os
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def log(*args):
    print(*args, flush=True)


def _max_relative_error(ours, reference):
    """max |ours - reference| / max |reference| over pairs of arrays, the worst pair."""
    import mlx.core as mx
    return max((mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max() / mx.abs(b.astype(mx.float32)).max()).item()
               for a, b in zip(ours, reference))


# Flops of each kernel alone as a multiple of 4*B*H*N^2*D (dK/dV: two of the backward's 2.5).
KERNEL_FLOP_MULTIPLES = {"forward": 1.0, "backward_query": 1.0, "backward_key_value": 1.5}


def _kernel_alone(kernel, q, k, v, m4, do, lse2, delta, spec):
    """A call of one backend kernel on inputs prepared once (lse2 / delta from prepare_backward),
    returning its outputs as a list."""
    from mlx_flash.backends import cuda
    if kernel == "forward":
        return lambda: list(cuda.forward(q, k, v, m4, spec))
    if kernel == "backward_query":
        return lambda: [cuda._backward_query(q, k, v, m4, do, lse2, delta, spec)]
    return lambda: list(cuda._backward_key_value(q, k, v, m4, do, lse2, delta, spec))


# ----------------------------------------------------------------------------- probe
def phase_probe(out_dir):
    """Small forward and backward calls against MLX's attention: run it first, under `timeout`, so
    that a kernel that hangs (a barrier protocol bug) costs seconds of GPU time, not the whole run."""
    import mlx.core as mx
    from mlx_flash import flash_attention
    from mlx_flash.backends import cuda
    from mlx_flash.spec import check_inputs
    ok = True
    for D, causal in ((128, False), (64, True), (256, True)):
        q = mx.random.normal((1, 2, 300, D)).astype(mx.bfloat16)
        mask = "causal" if causal else None
        spec, m4 = check_inputs(q, q, q, mask=mask)
        out, _ = cuda.forward(q, q, q, m4, spec)
        ref = mx.fast.scaled_dot_product_attention(q, q, q, scale=D ** -0.5, mask=mask)
        err = mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max().item()
        ok = ok and err < 0.05
        log(f"probe D={D} causal={causal}: max |ours - MLX| = {err:.3g}")
    # Gradients (the wgmma backward at D <= 128 on Hopper) against MLX's, relative to their size.
    for D, causal, N in ((128, False, 300), (64, True, 333), (96, True, 200)):
        q, k, v, do = (mx.random.normal((1, 2, N, D)).astype(mx.bfloat16) for _ in range(4))
        mask = "causal" if causal else None
        ours = mx.vjp(lambda a, b, c: flash_attention(a, b, c, mask=mask, backend="cuda"), [q, k, v], [do])[1]
        theirs = mx.vjp(lambda a, b, c: mx.fast.scaled_dot_product_attention(a, b, c, scale=D ** -0.5, mask=mask),
                        [q, k, v], [do])[1]
        errs = [_max_relative_error([a], [b]) for a, b in zip(ours, theirs)]
        ok = ok and max(errs) < 0.05
        log(f"probe backward D={D} causal={causal} N={N} (wgmma: {cuda.use_wgmma('backward_key_value', check_inputs(q, k, v)[0])}): "
            f"max |ours - MLX| / max |MLX| dq {errs[0]:.3g} dk {errs[1]:.3g} dv {errs[2]:.3g}")
    return ok


# ----------------------------------------------------------------------------- smoke
def phase_smoke(out_dir):
    from attention_cases import Case, check_case
    cases = [
        Case(head_dim=64, q_len=100, kv_len=77, dtype="float16", mask="causal", group=2),
        Case(head_dim=128, q_len=200, kv_len=300, dtype="bfloat16", mask="additive", softcap=5.0, lse_gradient=True),
        Case(head_dim=256, q_len=130, kv_len=130, dtype="bfloat16", mask="window", window=(10, 5)),
        Case(head_dim=512, q_len=70, kv_len=90, dtype="bfloat16", mask="causal"),
        Case(head_dim=160, q_len=150, kv_len=170, dtype="bfloat16", mask="causal", group=2),
        Case(head_dim=320, q_len=61, kv_len=67, dtype="float16", group=3, softcap=30.0),
    ]
    ok = True
    for case in cases:
        t0 = time.time()
        try:
            errors = check_case(case, backend="cuda")
            log(f"smoke OK   d={case.head_dim} {case.dtype} {case.mask} {case.q_len}x{case.kv_len}: "
                + " ".join(f"{k}={v:.2e}" for k, v in errors.items()) + f" ({time.time() - t0:.1f}s)")
        except Exception as e:  # report and go on: one failure should not hide the others
            ok = False
            log(f"smoke FAIL d={case.head_dim} {case.dtype} {case.mask}: {str(e)[:600]}")
    return ok


# ----------------------------------------------------------------------------- test
def phase_test(out_dir, extra=()):
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", os.path.join(ROOT, "tests", "test_cuda.py"),
           *extra]
    with open(os.path.join(out_dir, "pytest.log"), "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    tail = open(os.path.join(out_dir, "pytest.log")).read().splitlines()[-15:]
    log("pytest:\n  " + "\n  ".join(tail))
    return r.returncode == 0


# ----------------------------------------------------------------------------- sanitize
def sanitize_case():
    """Small calls of every kernel (run under compute-sanitizer)."""
    import mlx.core as mx
    from mlx_flash import flash_attention
    mx.random.seed(0)
    for D, mask, N in ((64, "causal", 100), (72, None, 65), (96, "bool", 70), (130, "bool", 40), (160, "causal", 50),
                       (200, "bool", 40), (320, "causal", 40)):
        q = mx.random.normal((1, 2, N, D)).astype(mx.bfloat16)
        k = mx.random.normal((1, 1, N + 3, D)).astype(mx.bfloat16)
        v = mx.random.normal((1, 1, N + 3, D)).astype(mx.bfloat16)
        m = mask
        if mask == "bool":
            m = mx.random.uniform(shape=(1, 1, N, N + 3)) < 0.7

        def f(q_, k_, v_):
            return flash_attention(q_, k_, v_, mask=m, softcap=20.0 if D == 72 else None, backend="cuda").astype(mx.float32).sum()

        g = mx.grad(f, argnums=(0, 1, 2))(q, k, v)
        mx.eval(g)
    print("sanitize case done", flush=True)


def phase_sanitize(out_dir):
    ok = True
    for tool in ("memcheck", "racecheck"):
        path = os.path.join(out_dir, f"sanitizer_{tool}.log")
        cmd = ["compute-sanitizer", "--tool", tool, "--error-exitcode", "3",
               sys.executable, os.path.abspath(__file__), "--sanitize-case"]
        t0 = time.time()
        try:
            with open(path, "w") as f:
                r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, timeout=240)
            code = r.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        text = open(path).read()
        summary = [l for l in text.splitlines() if "ERROR SUMMARY" in l or "RACECHECK SUMMARY" in l or "done" in l]
        log(f"sanitizer {tool}: exit {code} ({time.time() - t0:.0f}s) " + " | ".join(summary[-3:]))
        ok = ok and code == 0
    return ok


# ----------------------------------------------------------------------------- wgmma
WGMMA_CASES = (  # forward-only checks: head dims over 1..4 panels and odd widths, every mask kind
    dict(head_dim=64, q_len=200, kv_len=333, dtype="bfloat16", mask="causal", group=2),
    dict(head_dim=128, q_len=130, kv_len=260, dtype="float16"),
    dict(head_dim=128, q_len=300, kv_len=300, dtype="bfloat16", mask="additive", softcap=5.0),
    dict(head_dim=80, q_len=65, kv_len=129, dtype="bfloat16", mask="window", window=(20, 3)),
    dict(head_dim=256, q_len=150, kv_len=170, dtype="bfloat16", mask="bool", group=3),
    dict(head_dim=200, q_len=64, kv_len=64, dtype="float16", mask="causal"),
    dict(head_dim=37, q_len=50, kv_len=77, dtype="bfloat16"),
)
# (P, T, consumer warps, pingpong[, stages]) shapes of the wgmma forward timed per head dim (B*N = 16384 for
# D <= 128, else B = 1, N = 4096; H = 16); causal times the first two only.
WGMMA_SWEEP = {64: [(128, 128, 8, True), (128, 192, 8, True), (128, 192, 8, False)],
               128: [(128, 128, 8, True), (128, 160, 8, True), (128, 160, 8, False)],
               160: [(128, 64, 8, False), (128, 96, 8, False), (128, 96, 8, True)],
               256: [(128, 64, 8, False), (128, 64, 8, True)]}


def phase_wgmma(out_dir):
    import mlx.core as mx
    from attention_cases import Case, check_case
    from mlx_flash.backends import cuda
    from mlx_flash.spec import check_inputs
    info = {k_: str(v_) for k_, v_ in mx.device_info().items()}
    log("device_info:", info, "compute capability:", cuda.compute_capability())
    report = dict(device_info=info, capability=cuda.compute_capability(), checks=[], timings=[])
    cuda.WGMMA_FORWARD_OVERRIDE = True
    ok = True
    try:
        for c in WGMMA_CASES:
            try:
                errors = check_case(Case(**c), backend="cuda", gradients=False)
                line = f"wgmma OK   {c}: " + " ".join(f"{k_}={v_:.2e}" for k_, v_ in errors.items())
            except Exception as e:
                ok = False
                line = f"wgmma FAIL {c}: {str(e)[:300]}"
            log(line)
            report["checks"].append(line)
        # Time: the mma.sync forward, then the wgmma forward under WGMMA_SWEEP shapes.
        warm_up_gpu()
        for D, shapes in WGMMA_SWEEP.items():
            B, H, N = (4, 16, 4096) if D <= 128 else (1, 16, 4096)
            for causal in (False, True):
                mx.random.seed(D)
                q, k, v = (mx.random.normal((B, H, N, D)).astype(mx.bfloat16) for _ in range(3))
                spec, m4 = check_inputs(q, k, v, mask="causal" if causal else None)
                flops = 4 * B * H * N * N * D / (2 if causal else 1)
                variants = ([("mma", None)] + [("wgmma", s_) for s_ in (shapes if not causal else shapes[:2])]
                            + [("mlx_sdpa", None), ("torch_fa2", None)])
                for name, shape in variants:
                    cuda.WGMMA_FORWARD_OVERRIDE = name.startswith("wgmma")
                    cuda.BLOCK_OVERRIDES.clear()
                    cuda.WGMMA_PINGPONG = None
                    cuda.WGMMA_STAGES = 2
                    if shape:
                        cuda.BLOCK_OVERRIDES["forward_wgmma"] = (shape[0], shape[1], D, shape[2])
                        cuda.WGMMA_PINGPONG = shape[3]
                        cuda.WGMMA_STAGES = shape[4] if len(shape) > 4 else 2
                    r = dict(D=D, causal=causal, kernel=name, shape=shape)
                    try:
                        # ms: one call, evaluated and synchronized; ms_batched: BATCH calls in one
                        # evaluation (one sync), per call: the framework's per-call host work
                        # then overlaps the GPU's work.
                        if name == "torch_fa2":
                            t, t_batched = _torch_forward_time(B, H, N, D, causal)
                        else:
                            if name == "mlx_sdpa":
                                call = lambda: mx.fast.scaled_dot_product_attention(
                                    q, k, v, scale=D ** -0.5, mask="causal" if causal else None)
                            else:
                                call = lambda: cuda.forward(q, k, v, m4, spec)[0]
                            fn = lambda: mx.eval(call())
                            fn()  # compiles: then the clocks need a ramp (see bench_one)
                            warm_up_gpu(0.5)
                            t = _median_time(fn, reps=10, sync=mx.synchronize)
                            t_batched = _median_time(lambda: mx.eval([call() for _ in range(BATCH)]), reps=5,
                                                     sync=mx.synchronize) / BATCH
                        r.update(ms=t * 1e3, tflops=flops / t / 1e12, ms_batched=t_batched * 1e3,
                                 tflops_batched=flops / t_batched / 1e12)
                    except Exception as e:
                        r["error"] = str(e)[:300]
                        ok = ok and name in ("mlx_sdpa", "torch_fa2")
                    report["timings"].append(r)
                    log("wgmma time", json.dumps(r))
                del q, k, v
    finally:
        cuda.WGMMA_FORWARD_OVERRIDE = None
        cuda.WGMMA_PINGPONG = None
        cuda.WGMMA_STAGES = 2
        cuda.BLOCK_OVERRIDES.clear()
    with open(os.path.join(out_dir, "wgmma.json"), "w") as f:
        json.dump(report, f, indent=1)
    log(f"\n| D | causal | kernel | P, T, warps, pingpong[, stages] | ms | TFLOP/s | ms, {BATCH} per eval | TFLOP/s |")
    for r in report["timings"]:
        log(f"| {r['D']} | {'y' if r['causal'] else 'n'} | {r['kernel']} | {r['shape'] or '-'} | "
            f"{r.get('ms', float('nan')):.3f} | {r.get('tflops', float('nan')):.0f} | "
            f"{r.get('ms_batched', float('nan')):.3f} | {r.get('tflops_batched', float('nan')):.0f} |")
    return ok


BATCH = 8  # calls per evaluation in the "batched" timings


def _torch_forward_time(B, H, N, D, causal, reps=10):
    """Median seconds of torch's FlashAttention-2 forward (bf16) on the same shape: one call
    synchronized, and per call of BATCH calls before one synchronization."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            call = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            one = _median_time(call, reps=reps, sync=torch.cuda.synchronize)
            batched = _median_time(lambda: [call() for _ in range(BATCH)], reps=5, sync=torch.cuda.synchronize)
            return one, batched / BATCH
    finally:
        del q, k, v
        torch.cuda.empty_cache()


def phase_overhead(out_dir):
    """Per-call time of the same forward through each layer of the stack (the kernel call,
    flash_attention, flash_attention with lse, MLX's attention), one call per evaluation and
    BATCH per evaluation, at a tiny shape (host overhead) and at B=4, H=16, N=4096, D=128."""
    import mlx.core as mx
    from mlx_flash import flash_attention
    from mlx_flash.backends import cuda
    from mlx_flash.spec import check_inputs
    warm_up_gpu()
    rows = []
    for B, H, N, D in ((1, 1, 64, 128), (4, 16, 4096, 128)):
        q, k, v = (mx.random.normal((B, H, N, D)).astype(mx.bfloat16) for _ in range(3))
        mx.eval(q, k, v)
        spec, m4 = check_inputs(q, k, v)
        calls = {"kernel": lambda: cuda.forward(q, k, v, m4, spec)[0],
                 "flash_attention": lambda: flash_attention(q, k, v, backend="cuda"),
                 "flash_attention_lse": lambda: flash_attention(q, k, v, backend="cuda", return_lse=True)[1],
                 "mlx_sdpa": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5)}
        for name, call in calls.items():
            mx.eval(call())
            one = _median_time(lambda: mx.eval(call()), reps=10, sync=mx.synchronize)
            batched = _median_time(lambda: mx.eval([call() for _ in range(BATCH)]), reps=5, sync=mx.synchronize) / BATCH
            rows.append(dict(B=B, H=H, N=N, D=D, call=name, ms=one * 1e3, ms_batched=batched * 1e3))
            log("overhead", json.dumps(rows[-1]))
    with open(os.path.join(out_dir, "overhead.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return True


# ----------------------------------------------------------------------------- bench
def _record_medians(row, times, flops):
    """row[key + "_ms"] and row[key + "_tflops"] from the median of each key's samples (seconds);
    keys ending in "_fb" (forward + backward) count 3.5x the forward's flops. Returns row."""
    for key, values in times.items():
        t = sorted(values)[len(values) // 2]
        row[key + "_ms"] = t * 1e3
        row[key + "_tflops"] = flops * (3.5 if key.endswith("_fb") else 1.0) / t / 1e12
    return row


def _median_time(fn, warmup=3, reps=10, sync=None):
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def bench_one(B, H, N, D, causal, with_torch=True, reps=10, references=True):
    """One benchmark row; references=False times only backend "cuda" (no MLX / torch runs)."""
    import mlx.core as mx
    from mlx_flash import flash_attention
    from mlx_flash.backends import get_backend
    from mlx_flash.spec import check_inputs

    mx.random.seed(B * N + D)
    q, k, v, do = (mx.random.normal((B, H, N, D)).astype(mx.bfloat16) for _ in range(4))
    mx.eval(q, k, v, do)
    mask = "causal" if causal else None
    scale = D ** -0.5
    flops = 4 * B * H * N * N * D / (2 if causal else 1)
    row = dict(B=B, H=H, N=N, D=D, causal=causal)
    # A call's time ends when mx.eval returns: it blocks until the outputs are computed (the
    # counterpart of torch's call + torch.cuda.synchronize below). Tables up to session 6 also
    # waited for mx.synchronize, which adds MLX's completion-handler round trip on its worker
    # thread (0-0.1 ms per call in the forward phase, for MLX's attention and ours alike).
    sync = lambda: None

    def ours_fwd():
        mx.eval(flash_attention(q, k, v, scale=scale, mask=mask, backend="cuda"))

    def mlx_fwd():
        mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask))

    def ours_fb():
        o, vjp = mx.vjp(lambda a, b, c: flash_attention(a, b, c, scale=scale, mask=mask, backend="cuda"), [q, k, v], [do])
        mx.eval(o, vjp)

    def mlx_fb():
        o, vjp = mx.vjp(lambda a, b, c: mx.fast.scaled_dot_product_attention(a, b, c, scale=scale, mask=mask), [q, k, v], [do])
        mx.eval(o, vjp)

    # Compile every kernel of the row first, then bring the clocks back up: an H100 left idle
    # during a multi-second NVRTC compile drops to 345 MHz, and three warm-up calls of ~1 ms do
    # not ramp it back (the first-timed forward of a row once measured 2x slow).
    for name, fn in (("ours_fwd", ours_fwd), ("mlx_fwd", mlx_fwd), ("ours_fb", ours_fb), ("mlx_fb", mlx_fb)):
        if references or not name.startswith("mlx"):
            try:
                fn()
            except Exception:
                pass  # reported by the timing below
    warm_up_gpu(1.0)
    for name, fn, mult in (("ours_fwd", ours_fwd, 1.0), ("mlx_fwd", mlx_fwd, 1.0),
                           ("ours_fb", ours_fb, 3.5), ("mlx_fb", mlx_fb, 3.5)):
        if not references and name.startswith("mlx"):
            continue
        try:
            t = _median_time(fn, reps=reps, sync=sync)
            row[name + "_ms"] = t * 1e3
            row[name + "_tflops"] = flops * mult / t / 1e12
        except Exception as e:
            row[name + "_error"] = str(e)[:300]
    # Peak memory of fwd+bwd (after the warm runs above).
    for name, fn in (("ours_fb", ours_fb), ("mlx_fb", mlx_fb)):
        if not references and name.startswith("mlx"):
            continue
        try:
            mx.synchronize()
            mx.reset_peak_memory()
            base = mx.get_active_memory()
            fn()
            mx.synchronize()
            row[name + "_peak_mib"] = (mx.get_peak_memory() - base) / 2**20
        except Exception as e:
            row[name + "_peak_error"] = str(e)[:300]
    # Backward kernels alone.
    try:
        backend = get_backend("cuda")
        spec, m4 = check_inputs(q, k, v, scale=scale, mask=mask)
        out, lse = backend.forward(q, k, v, m4, spec)
        mx.eval(out, lse)
        t = _median_time(lambda: mx.eval(backend.backward_query(q, k, v, m4, out, lse, do, None, spec)), reps=reps, sync=sync)
        row["ours_dq_ms"] = t * 1e3
        t = _median_time(lambda: mx.eval(backend.backward_key_value(q, k, v, m4, out, lse, do, None, spec)), reps=reps, sync=sync)
        row["ours_dkdv_ms"] = t * 1e3
    except Exception as e:
        row["ours_bwd_error"] = str(e)[:300]
    if with_torch and references and D <= 256:
        row.update(bench_torch(B, H, N, D, causal, flops, reps))
    return row


def bench_torch(B, H, N, D, causal, flops, reps):
    res = {}
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        sync = torch.cuda.synchronize
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            def fwd():
                F.scaled_dot_product_attention(q, k, v, is_causal=causal)

            qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

            def fb():
                o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                o.backward(do)

            for name, fn, mult in (("fa2_fwd", fwd, 1.0), ("fa2_fb", fb, 3.5)):
                t = _median_time(fn, reps=reps, sync=sync)
                res[name + "_ms"] = t * 1e3
                res[name + "_tflops"] = flops * mult / t / 1e12
        del q, k, v, do, qg, kg, vg
        torch.cuda.empty_cache()
    except Exception as e:
        res["fa2_error"] = str(e)[:300]
    return res


# Softcap calls (B, H, N, D, cap): plain, softcap with tanh.approx (fast_tanh) and softcap with
# tanhf (the kernels before session 7), fwd and fwd+bwd through flash_attention.
SOFTCAP_SHAPES = ((4, 16, 4096, 64, 30.0), (1, 16, 4096, 256, 50.0))


def _kernel_text_rewrite(cuda, template, old, new):
    """A switch between the kernels as they are (off) and with `old` replaced by `new` in the
    template file `template` at render time (on), for A/B timings of one change in one run."""
    from mlx_flash import render
    original = render.template_text
    assert old in original(template), f"{old!r} not in {template}"

    def use(on):
        cuda.template_text = (lambda name: original(name).replace(old, new) if name == template else original(name)) \
            if on else original
        cuda._kernel.cache_clear()
    return use


# (B, H, N, D) for the copy phase: three 64-column panels (D = 160, 192) and four (256, control).
COPY_SHAPES = ((1, 16, 4096, 160), (1, 16, 4096, 192), (1, 16, 4096, 256))


def phase_copy(out_dir, rounds=4):
    """load_swizzled's fast path where 16-byte chunks per row do not divide the copying threads
    (three panels) against the old element-index path (kernel text rewritten at render time):
    forward per call and 8 per evaluation, fwd+bwd per call, interleaved rounds."""
    import mlx.core as mx
    from mlx_flash import flash_attention
    from mlx_flash.backends import cuda
    use_old = _kernel_text_rewrite(cuda, "wgmma_common.cuh", "if (vec && CHUNKS <= THREADS) {",
                                   "if (vec && THREADS % CHUNKS == 0) {")
    rows = []
    warm_up_gpu(1.0)
    try:
        for B, H, N, D in COPY_SHAPES:
            mx.random.seed(D)
            q, k, v, do = (mx.random.normal((B, H, N, D)).astype(mx.bfloat16) for _ in range(4))
            mx.eval(q, k, v, do)
            flops = 4 * B * H * N * N * D
            call = lambda: flash_attention(q, k, v, backend="cuda")
            grads = lambda: mx.vjp(lambda a, b, c: flash_attention(a, b, c, backend="cuda"), [q, k, v], [do])
            times, outs = {}, {}
            for _ in range(rounds):
                for name, old in (("new", False), ("old", True)):
                    use_old(old)
                    if name not in outs:  # compile, and keep the outputs for the comparison
                        outs[name] = grads()
                        mx.eval(outs[name])
                    times.setdefault(name + "_fwd", []).append(
                        _median_time(lambda: mx.eval(call()), warmup=2, reps=5, sync=lambda: None))
                    times.setdefault(name + "_fwd8", []).append(_median_time(
                        lambda: mx.eval([call() for _ in range(BATCH)]), warmup=1, reps=3, sync=lambda: None) / BATCH)
                    times.setdefault(name + "_fb", []).append(
                        _median_time(lambda: mx.eval(grads()), warmup=1, reps=5, sync=lambda: None))
            row = _record_medians(dict(B=B, H=H, N=N, D=D), times, flops)
            (o1, g1), (o2, g2) = outs["new"], outs["old"]
            row["max_abs_diff_new_vs_old"] = max(mx.abs(a - b).max().item() for a, b in zip(o1 + g1, o2 + g2))
            rows.append(row)
            log("copy", json.dumps({k_: round(v_, 4) if isinstance(v_, float) else v_ for k_, v_ in row.items()}))
            del q, k, v, do, outs
    finally:
        use_old(False)
    with open(os.path.join(out_dir, "copy.json"), "w") as f:
        json.dump(rows, f, indent=1)
    log(f"\n| B,H,N,D | TFLOP/s fwd new / old | fwd {BATCH} per eval new / old | fwd+bwd new / old | max diff |")
    for r in rows:
        log(f"| {r['B']},{r['H']},{r['N']},{r['D']} | {r['new_fwd_tflops']:.0f} / {r['old_fwd_tflops']:.0f} | "
            f"{r['new_fwd8_tflops']:.0f} / {r['old_fwd8_tflops']:.0f} | {r['new_fb_tflops']:.0f} / "
            f"{r['old_fb_tflops']:.0f} | {r['max_abs_diff_new_vs_old']:.2g} |")
    return all(r["max_abs_diff_new_vs_old"] == 0 for r in rows)


def phase_softcap(out_dir, rounds=4):
    """Softcap's cost: the same call without softcap, with it, and with it through tanhf (the
    kernel text rewritten at render time), fwd and fwd+bwd timed in interleaved rounds (per call,
    until mx.eval returns)."""
    import mlx.core as mx
    from mlx_flash import flash_attention
    from mlx_flash.backends import cuda
    fast_line = "t = fast_tanh(raw * (scale / cap));"
    use_tanhf = _kernel_text_rewrite(cuda, "attention_common.cuh", fast_line, "t = tanhf(raw * (scale / cap));")
    rows = []
    warm_up_gpu(1.0)
    try:
        for B, H, N, D, cap in SOFTCAP_SHAPES:
            mx.random.seed(D)
            q, k, v, do = (mx.random.normal((B, H, N, D)).astype(mx.bfloat16) for _ in range(4))
            mx.eval(q, k, v, do)
            flops = 4 * B * H * N * N * D
            variants = (("plain", None, False), ("softcap", cap, False), ("softcap_tanhf", cap, True))
            times, outs = {}, {}
            for _ in range(rounds):
                for name, softcap, tanhf in variants:
                    use_tanhf(tanhf)
                    fwd = lambda: mx.eval(flash_attention(q, k, v, softcap=softcap, backend="cuda"))
                    fb = lambda: mx.eval(mx.vjp(lambda a, b, c: flash_attention(a, b, c, softcap=softcap, backend="cuda"),
                                                [q, k, v], [do]))
                    if name not in outs:  # compile, and keep the outputs for the comparison
                        outs[name] = mx.vjp(lambda a, b, c: flash_attention(a, b, c, softcap=softcap, backend="cuda"),
                                            [q, k, v], [do])
                        mx.eval(outs[name])
                    times.setdefault(name + "_fwd", []).append(_median_time(fwd, warmup=2, reps=5, sync=lambda: None))
                    times.setdefault(name + "_fb", []).append(_median_time(fb, warmup=1, reps=5, sync=lambda: None))
            row = _record_medians(dict(B=B, H=H, N=N, D=D, cap=cap), times, flops)
            (o1, g1), (o2, g2) = outs["softcap"], outs["softcap_tanhf"]
            row["rel_err_fast_vs_tanhf"] = _max_relative_error(o1 + g1, o2 + g2)
            rows.append(row)
            log("softcap", json.dumps({k_: round(v_, 4) if isinstance(v_, float) else v_ for k_, v_ in row.items()}))
            del q, k, v, do, outs
    finally:
        use_tanhf(False)
    with open(os.path.join(out_dir, "softcap.json"), "w") as f:
        json.dump(rows, f, indent=1)
    log("\n| B,H,N,D | cap | TFLOP/s fwd plain / softcap / tanhf | fwd+bwd plain / softcap / tanhf | rel err fast vs tanhf |")
    for r in rows:
        log(f"| {r['B']},{r['H']},{r['N']},{r['D']} | {r['cap']} | {r['plain_fwd_tflops']:.0f} / {r['softcap_fwd_tflops']:.0f} / "
            f"{r['softcap_tanhf_fwd_tflops']:.0f} | {r['plain_fb_tflops']:.0f} / {r['softcap_fb_tflops']:.0f} / "
            f"{r['softcap_tanhf_fb_tflops']:.0f} | {r['rel_err_fast_vs_tanhf']:.2g} |")
    return all(r["rel_err_fast_vs_tanhf"] < 0.02 for r in rows)


# Causal shapes (B, H, N, D) for the CTA-order A/B test.
ORDER_SHAPES = [(4, 16, 4096, 64), (4, 16, 4096, 128), (1, 16, 16384, 128), (1, 16, 4096, 160), (1, 16, 4096, 256),
                (1, 16, 4096, 512)]


def phase_order(out_dir, rounds=4):
    """Causal forward and fwd+bwd in head-major vs block-major CTA order, interleaved (A B A B ...)
    so that neither order is always timed after the other (the bench's single comparison always
    favoured whichever order it timed second), plus the non-causal time for the ratio."""
    import mlx.core as mx
    from mlx_flash import flash_attention
    from mlx_flash.backends import cuda
    rows = []
    warm_up_gpu(1.0)
    for B, H, N, D in ORDER_SHAPES:
        mx.random.seed(D)
        q, k, v, do = (mx.random.normal((B, H, N, D)).astype(mx.bfloat16) for _ in range(4))
        mx.eval(q, k, v, do)

        def fwd(mask):
            mx.eval(flash_attention(q, k, v, mask=mask, backend="cuda"))

        def fb(mask):
            o, g = mx.vjp(lambda a, b, c: flash_attention(a, b, c, mask=mask, backend="cuda"), [q, k, v], [do])
            mx.eval(o, g)

        times = {}
        for name, order in (("non_causal", None), ("head_major", False), ("block_major", True)):
            cuda.BLOCK_MAJOR_OVERRIDE = order
            mask = None if order is None else "causal"
            fwd(mask), fb(mask)  # compile
        warm_up_gpu(0.5)
        for _ in range(rounds):
            for name, order in (("non_causal", None), ("head_major", False), ("block_major", True)):
                cuda.BLOCK_MAJOR_OVERRIDE = order
                mask = None if order is None else "causal"
                for kind, fn in (("fwd", fwd), ("fb", fb)):
                    t = _median_time(lambda: fn(mask), warmup=1, reps=5, sync=mx.synchronize)
                    times.setdefault(f"{name}_{kind}", []).append(t * 1e3)
        cuda.BLOCK_MAJOR_OVERRIDE = None
        row = dict(B=B, H=H, N=N, D=D, **{key: sorted(v)[len(v) // 2] for key, v in times.items()}, rounds=times)
        rows.append(row)
        log(f"order {B}x{H}x{N}x{D}: causal/non-causal fwd head-major "
            f"{row['head_major_fwd'] / row['non_causal_fwd']:.2f} block-major {row['block_major_fwd'] / row['non_causal_fwd']:.2f}"
            f"; f+b head-major {row['head_major_fb'] / row['non_causal_fb']:.2f} block-major "
            f"{row['block_major_fb'] / row['non_causal_fb']:.2f} (medians of {rounds} interleaved rounds)")
        del q, k, v, do
    with open(os.path.join(out_dir, "order.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return True


# The wgmma backward kernels against the mma.sync ones, alone (bf16, H=16, N=4096, B=4 for D <= 128
# else 1): (D, causal) -> traversal blocks T to time for each wgmma kernel (None = the table's).
BACKWARD_SHAPES = {(64, False): (None,), (64, True): (None,), (128, False): (None,), (160, False): (None, 32),
                   (160, True): (None,),
                   (192, False): (None, 32), (256, False): (None, 32), (256, True): (None, 32)}
# dQ with three consumer warpgroups (P = 192, 12 warps): head dim -> traversal blocks T to time
# (the widest that neither spill nor serialize, nvcc 13.0).
BACKWARD_QUERY_THREE_WARPGROUPS = {64: (64, 80), 128: (32, 48)}
# dK/dV with all of D in each consumer warpgroup past D = 128 (up to 160 fits the registers):
# head dim -> traversal blocks T to time (nvcc 13.0: 12 bytes spilled at T <= 32, T = 48 serializes).
BACKWARD_KEY_VALUE_WHOLE = {160: (16, 32)}
BACKWARD_ROUNDS = 4  # interleaved rounds: every variant of a shape timed once per round


def _backward_variants(kernel, D, blocks):
    """(name, (P, T) or None for the table's row, settings of the cuda module's hooks) to compare
    for one kernel and head dim. Past D = 128 the dK/dV kernel runs both of its schemes: P = 64
    (column groups) and P = 128 (slices)."""
    base = dict(WGMMA_BACKWARD_PINGPONG=False)
    kinds = [("wgmma", None, {})]
    if os.environ.get("MLX_FLASH_BACKWARD_PINGPONG") == "1":
        kinds.append(("wgmma_pingpong", None, dict(WGMMA_BACKWARD_PINGPONG=True)))
    if kernel == "backward_key_value" and D > 128:
        kinds = [("wgmma_column_groups", 64, {}), ("wgmma_slices", 128, {})]
    variants = [("mma", None, dict(base, WGMMA_BACKWARD_OVERRIDE=False))]
    for t in blocks:
        for name, p, hooks in kinds:
            block = None if p is None and t is None else (p or 128, t, 8, 128) if D > 128 else (p or 128, t)
            variants.append((name, block, dict(base, WGMMA_BACKWARD_OVERRIDE=True, **hooks)))
    if kernel == "backward_key_value":
        for t in BACKWARD_KEY_VALUE_WHOLE.get(D, ()):  # all of D in each warpgroup
            variants.append(("wgmma_whole", (128, t, 8, D), dict(base, WGMMA_BACKWARD_OVERRIDE=True)))
    if kernel == "backward_query":
        for t in BACKWARD_QUERY_THREE_WARPGROUPS.get(D, ()):
            variants.append(("wgmma_three_warpgroups", (192, t, 12), dict(base, WGMMA_BACKWARD_OVERRIDE=True)))
    return variants


def _apply_hooks(cuda, kernel, D, block, hooks):
    """Sets the hooks; block (P, T[, consumer warps, default 8[, H]]), T None = the table's T,
    H (dK/dV columns per warpgroup) by default the table's."""
    for name, value in hooks.items():
        setattr(cuda, name, value)
    cuda.BLOCK_OVERRIDES.clear()
    if block is not None:
        import mlx.core as mx
        from mlx_flash import planner
        p, t, warps, *columns = tuple(block) + (8,) * (len(block) == 2)
        row = planner.plan("cuda", kernel, D, mx.bfloat16, cuda.WGMMA_FAMILY)
        cuda.BLOCK_OVERRIDES[kernel + "_wgmma"] = (p, t if t is not None else row.traversal_block,
                                                   columns[0] if columns else row.head_block, warps)


def phase_backward(out_dir):
    """dQ and dK/dV kernels alone, wgmma vs mma.sync: gradients compared, then timed in
    BACKWARD_ROUNDS interleaved rounds (medians of 5 calls each; the median round is reported),
    so that clock drift between variants does not favour one. Past D = 128 the dK/dV kernel runs
    both schemes (column groups, slices); MLX_FLASH_BACKWARD_PINGPONG=1 adds ping-pong variants."""
    import mlx.core as mx
    from mlx_flash.backends import cuda
    from mlx_flash.spec import check_inputs
    rows, ok = [], True
    warm_up_gpu(1.0)
    keep = os.environ.get("MLX_FLASH_BACKWARD_HEAD_DIMS")  # e.g. 160,192: only those head dims
    for (D, causal), blocks in BACKWARD_SHAPES.items():
        if keep and str(D) not in keep.split(","):
            continue
        B, H, N = (4 if D <= 128 else 1), 16, 4096
        mx.random.seed(D)
        q, k, v, do = (mx.random.normal((B, H, N, D)).astype(mx.bfloat16) for _ in range(4))
        spec, m4 = check_inputs(q, k, v, mask="causal" if causal else None)
        out, lse = cuda.forward(q, k, v, m4, spec)
        delta, lse2 = cuda.prepare_backward(out, lse, do, None, spec)
        mx.eval(out, lse, delta, lse2)
        flops = 4 * B * H * N * N * D / (2 if causal else 1)
        for kernel in ("backward_query", "backward_key_value"):
            fn = _kernel_alone(kernel, q, k, v, m4, do, lse2, delta, spec)
            timed, reference = [], None
            for name, t, hooks in _backward_variants(kernel, D, blocks):  # compile and check each
                _apply_hooks(cuda, kernel, D, t, hooks)
                r = dict(D=D, causal=causal, kernel=kernel, variant=name,
                         T=cuda.kernel_config(kernel, spec, None).traversal_block)
                try:
                    result = fn()
                    mx.eval(result)
                    if reference is None:
                        reference = result
                    else:
                        r["rel_err_vs_mma"] = _max_relative_error(result, reference)
                        ok = ok and r["rel_err_vs_mma"] < 0.02
                    timed.append((r, t, hooks, []))
                except Exception as e:
                    ok = False
                    r["error"] = str(e)[:400]
                rows.append(r)
            for _ in range(BACKWARD_ROUNDS):
                for r, t, hooks, samples in timed:
                    _apply_hooks(cuda, kernel, D, t, hooks)
                    samples.append(_median_time(lambda: mx.eval(fn()), reps=5, sync=mx.synchronize))
            for r, t, hooks, samples in timed:
                t_s = sorted(samples)[len(samples) // 2]
                r.update(ms=t_s * 1e3, tflops=flops * KERNEL_FLOP_MULTIPLES[kernel] / t_s / 1e12,
                         ms_rounds=[round(x * 1e3, 3) for x in samples])
                log("backward", json.dumps({k_: round(v_, 4) if isinstance(v_, float) else v_ for k_, v_ in r.items()}))
        del q, k, v, do, out, lse, delta, lse2
    _apply_hooks(cuda, "backward_query", 0, None, dict(WGMMA_BACKWARD_OVERRIDE=None, WGMMA_BACKWARD_PINGPONG=False))
    with open(os.path.join(out_dir, "backward.json"), "w") as f:
        json.dump(rows, f, indent=1)
    log("\n| D | causal | kernel | variant | T | ms | TFLOP/s | rel err vs mma |")
    for r in rows:
        log(f"| {r['D']} | {'y' if r['causal'] else 'n'} | {r['kernel']} | {r['variant']} | {r['T'] or '-'} | "
            f"{r.get('ms', float('nan')):.3f} | {r.get('tflops', float('nan')):.0f} | "
            f"{r.get('rel_err_vs_mma', float('nan')):.2g} |" + (" ERR " + r["error"][:200] if "error" in r else ""))
    return ok


# Block shapes (P, T, H, warps) to time per kernel and head dim; the first of each list is the
# table's row at the time of writing. B*N = 16384 for D <= 128, B = 1, N = 4096 above; H = 16.
SWEEP = {
    64: {"forward": [(128, 128, 64, 4), (128, 64, 64, 8), (64, 64, 64, 4)],
         "backward_query": [(128, 64, 64, 4), (128, 64, 64, 8), (64, 32, 64, 4)],
         "backward_key_value": [(128, 64, 64, 4), (128, 64, 64, 8), (64, 64, 64, 4)]},
    128: {"forward": [(128, 64, 128, 4), (128, 64, 128, 8), (128, 32, 128, 8), (64, 32, 128, 4)],
          "backward_query": [(128, 32, 128, 4), (128, 64, 128, 8), (64, 32, 128, 4)],
          "backward_key_value": [(64, 64, 128, 4), (128, 32, 128, 8), (128, 64, 64, 8)]},
    160: {"forward": [(128, 64, 192, 8), (64, 64, 160, 4)],
          "backward_query": [(128, 32, 192, 8), (128, 64, 192, 8)],
          "backward_key_value": [(64, 64, 128, 8), (64, 32, 128, 8)]},
    256: {"forward": [(128, 32, 256, 8), (64, 32, 256, 4)],
          "backward_query": [(128, 32, 256, 8), (64, 64, 128, 8)],
          "backward_key_value": [(64, 64, 128, 8), (64, 32, 128, 8)]},
    512: {"forward": [(64, 32, 256, 8)],
          "backward_query": [(64, 16, 256, 8), (32, 32, 128, 8)],
          "backward_key_value": [(32, 32, 128, 8)]},
}

# The wgmma forward under other block shapes, against the table's: (B, H, N, D, what the call
# adds: None, "causal", "softcap" or "bool") -> (P, T, warps[, pingpong]) variants (12 warps = three
# consumer warpgroups of 64 query rows, 8 = two; pingpong forces WGMMA_PINGPONG on or off).
# MLX_FLASH_FORWARD_HEAD_DIMS=160,192 keeps only those head dims.
FORWARD_SHAPES = {(4, 16, 4096, 64, None): ((128, 128, 8), (192, 64, 12), (192, 112, 12)),
                  (4, 16, 4096, 64, "causal"): ((128, 128, 8), (192, 64, 12)),
                  (4, 16, 4096, 64, "softcap"): ((128, 128, 8), (192, 64, 12)),
                  (4, 16, 4096, 64, "bool"): ((128, 128, 8), (192, 64, 12)),
                  (4, 16, 4096, 128, None): ((192, 64, 12),),
                  # D = 160 / 192 measured slower per call than D = 256 (193 / 202 against 342
                  # TFLOP/s, session 7's table) with the same row: pingpong, wider key tiles.
                  (1, 16, 4096, 160, None): ((128, 64, 8, True), (128, 96, 8)),
                  (1, 16, 4096, 192, None): ((128, 64, 8, True), (128, 96, 8)),
                  (1, 16, 4096, 256, None): ((128, 64, 8, True),)}
FORWARD_ROUNDS = 4


def phase_forward(out_dir):
    """The forward alone: the table's wgmma configuration, FORWARD_SHAPES' variants, the same
    call through flash_attention, MLX's attention and torch's FlashAttention-2, timed in
    FORWARD_ROUNDS interleaved rounds three ways: one call per evaluation ("eval": mx.eval
    returns once the result is computed), the same followed by mx.synchronize ("sync": also waits
    for MLX's completion handlers, what the bench times) and BATCH calls per evaluation
    ("batched", per call). Outputs are compared with the table configuration's."""
    import mlx.core as mx
    from mlx_flash import flash_attention
    from mlx_flash.backends import cuda
    from mlx_flash.spec import check_inputs
    rows, ok = [], True
    warm_up_gpu(1.0)
    keep = os.environ.get("MLX_FLASH_FORWARD_HEAD_DIMS")
    for (B, H, N, D, adds), shapes in FORWARD_SHAPES.items():
        if keep and str(D) not in keep.split(","):
            continue
        mx.random.seed(D)
        q, k, v = (mx.random.normal((B, H, N, D)).astype(mx.bfloat16) for _ in range(3))
        causal, softcap = adds == "causal", 30.0 if adds == "softcap" else None
        mask = "causal" if causal else (mx.random.uniform(shape=(1, 1, N, N)) < 0.9 if adds == "bool" else None)
        mx.eval(q, k, v, *([mask] if adds == "bool" else []))
        spec, m4 = check_inputs(q, k, v, mask=mask, softcap=softcap)
        flops = 4 * B * H * N * N * D / (2 if causal else 1)
        kernel_call = lambda: cuda.forward(q, k, v, m4, spec)[0]
        variants = [("table", None, kernel_call)] + [
            (f"P{p}_T{t}_w{w}" + ("" if not pp else "_pingpong" if pp[0] else "_no_pingpong"), (p, t, D, w, *pp),
             kernel_call) for p, t, w, *pp in shapes]
        variants += [("flash_attention", None, lambda: flash_attention(q, k, v, mask=mask, softcap=softcap,
                                                                        backend="cuda"))]
        if softcap is None:
            variants += [("mlx_sdpa", None, lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5,
                                                                                          mask=mask))]
        timed, reference = [], None
        def apply(override):
            cuda.BLOCK_OVERRIDES.clear()
            cuda.WGMMA_PINGPONG = None
            if override:
                cuda.BLOCK_OVERRIDES["forward_wgmma"] = override[:4]
                cuda.WGMMA_PINGPONG = override[4] if len(override) > 4 else None

        for name, override, call in variants:  # compile and check
            apply(override)
            r = dict(B=B, H=H, N=N, D=D, adds=adds, variant=name)
            try:
                result = call()
                mx.eval(result)
                if reference is None:
                    reference = result
                elif name != "mlx_sdpa":
                    r["rel_err_vs_table"] = _max_relative_error([result], [reference])
                    ok = ok and r["rel_err_vs_table"] < 0.02
                timed.append((r, override, call, {}))
            except Exception as e:
                ok = ok and name == "mlx_sdpa"
                r["error"] = str(e)[:400]
            rows.append(r)
        fa2 = dict(B=B, H=H, N=N, D=D, adds=adds, variant="torch_fa2")
        with_fa2 = adds in (None, "causal")  # torch's FlashAttention-2 has no softcap or array mask
        if with_fa2:
            rows.append(fa2)
        warm_up_gpu(0.5)
        for _ in range(FORWARD_ROUNDS):
            for r, override, call, samples in timed:
                apply(override)
                one = lambda: mx.eval(call())
                samples.setdefault("eval", []).append(_median_time(one, warmup=2, reps=7, sync=lambda: None))
                samples.setdefault("sync", []).append(_median_time(one, warmup=2, reps=7, sync=mx.synchronize))
                samples.setdefault("batched", []).append(_median_time(
                    lambda: mx.eval([call() for _ in range(BATCH)]), warmup=1, reps=3, sync=mx.synchronize) / BATCH)
            if not with_fa2:
                continue
            try:
                one, batched = _torch_forward_time(B, H, N, D, causal, reps=7)
                fa2.setdefault("samples", {}).setdefault("sync", []).append(one)
                fa2["samples"].setdefault("batched", []).append(batched)
            except Exception as e:
                fa2["error"] = str(e)[:300]
        apply(None)
        for r, samples in [(r, s_) for r, _, _, s_ in timed] + [(fa2, fa2.get("samples", {}))] * with_fa2:
            _record_medians(r, samples, flops)
            r.pop("samples", None)
            log("forward", json.dumps({k_: round(v_, 4) if isinstance(v_, float) else v_ for k_, v_ in r.items()}))
        del q, k, v, reference
    with open(os.path.join(out_dir, "forward.json"), "w") as f:
        json.dump(rows, f, indent=1)
    nan = float("nan")
    log(f"\n| B,H,N,D | adds | variant | TFLOP/s eval | sync | {BATCH} per eval | rel err vs table |")
    for r in rows:
        log(f"| {r['B']},{r['H']},{r['N']},{r['D']} | {r['adds'] or '-'} | {r['variant']} | "
            f"{r.get('eval_tflops', nan):.0f} | {r.get('sync_tflops', nan):.0f} | {r.get('batched_tflops', nan):.0f} | "
            f"{r.get('rel_err_vs_table', nan):.2g} |" + (" ERR " + r["error"][:200] if "error" in r else ""))
    return ok


def phase_sweep(out_dir, head_dims=None):
    """Time each kernel alone under several block shapes (SWEEP), bf16, non-causal."""
    import mlx.core as mx
    from mlx_flash.backends import cuda
    from mlx_flash.spec import check_inputs
    backend = cuda.BACKEND
    results = []
    for D, kernels in SWEEP.items():
        if head_dims and D not in head_dims:
            continue
        B, H, N = (4, 16, 4096) if D <= 128 else (1, 16, 4096)
        mx.random.seed(D)
        q, k, v, do = (mx.random.normal((B, H, N, D)).astype(mx.bfloat16) for _ in range(4))
        spec, m4 = check_inputs(q, k, v)
        cuda.BLOCK_OVERRIDES.clear()
        out, lse = backend.forward(q, k, v, m4, spec)
        delta, lse2 = cuda.prepare_backward(out, lse, do, None, spec)
        mx.eval(out, lse, delta, lse2)
        flops = 4 * B * H * N * N * D
        for kernel, configs in kernels.items():
            for cfg in configs:
                cuda.BLOCK_OVERRIDES.clear()
                cuda.BLOCK_OVERRIDES[kernel] = cfg
                r = dict(D=D, kernel=kernel, P=cfg[0], T=cfg[1], H=cfg[2], warps=cfg[3])
                try:
                    call = _kernel_alone(kernel, q, k, v, m4, do, lse2, delta, spec)
                    fn, mult = (lambda: mx.eval(call())), KERNEL_FLOP_MULTIPLES[kernel]
                    t0 = time.time()
                    fn()  # compile
                    r["compile_s"] = time.time() - t0
                    t = _median_time(fn, reps=10, sync=mx.synchronize)
                    r.update(ms=t * 1e3, tflops=flops * mult / t / 1e12)
                except Exception as e:
                    r["error"] = str(e)[:300]
                results.append(r)
                log("sweep", json.dumps({k_: round(v_, 3) if isinstance(v_, float) else v_ for k_, v_ in r.items()}))
        del q, k, v, do, out, lse, delta, lse2
    cuda.BLOCK_OVERRIDES.clear()
    with open(os.path.join(out_dir, "sweep.json"), "w") as f:
        json.dump(results, f, indent=1)
    log("\n| D | kernel | P | T | H | warps | ms | TFLOP/s |")
    for r in results:
        log(f"| {r['D']} | {r['kernel']} | {r['P']} | {r['T']} | {r['H']} | {r['warps']} | "
            f"{r.get('ms', float('nan')):.3f} | {r.get('tflops', float('nan')):.0f} |" + (" ERR" if "error" in r else ""))
    return not any("error" in r for r in results)


def phase_resources(out_dir, head_dims=(64, 128, 160, 192, 256, 512)):
    """Registers, stack and spills of every kernel at the table's block shapes (nvcc --resource-usage).

    Needs nvcc only (no GPU): each rendered kernel is wrapped in a __global__ signature like the one
    mx.fast.cuda_kernel generates and compiled for sm_90a. NVRTC (what MLX runs) allocates the same
    way up to small differences.
    """
    import re
    import shutil
    import tempfile
    import mlx.core as mx
    from mlx_flash.backends import cuda
    from mlx_flash.spec import check_inputs
    if shutil.which("nvcc") is None:
        log("resources: no nvcc")
        return False
    types = {"params": "int64_t", "fparams": "float", "lse2": "float", "delta": "float", "lse": "float"}
    ok = True
    if os.environ.get("RESOURCES_HEAD_DIMS"):
        head_dims = [int(d) for d in os.environ["RESOURCES_HEAD_DIMS"].split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        for D in head_dims:
            for causal in (False, True):
                q = mx.zeros((1, 2, 64, D), mx.bfloat16)
                spec = check_inputs(q, q, q, mask="causal" if causal else None)[0]
                for kernel in ("forward", "backward_query", "backward_key_value", "forward_wgmma",
                               "backward_query_wgmma", "backward_key_value_wgmma"):
                    base = kernel.replace("_wgmma", "")
                    wgmma = kernel != base
                    if wgmma and D > cuda.WGMMA_MAX_HEAD_DIMS[base]:
                        continue
                    cuda.WGMMA_FORWARD_OVERRIDE = cuda.WGMMA_BACKWARD_OVERRIDE = wgmma
                    try:
                        cfg = cuda.kernel_config(base, spec, None)
                    finally:
                        cuda.WGMMA_FORWARD_OVERRIDE = cuda.WGMMA_BACKWARD_OVERRIDE = None
                    header, body, inputs, outputs = cuda.kernel_source(cfg)
                    sig = ", ".join([f"const {types.get(n, cfg.dtype)}* {n}" for n in inputs]
                                    + [f"{types.get(n, cfg.dtype)}* {n}" for n in outputs])
                    path = os.path.join(tmp, cfg.name + ".cu")
                    with open(path, "w") as f:
                        f.write("#include <cstdint>\n#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n" + header
                                + f"\n__global__ void {cfg.name}({sig}) {{\n{body}\n}}\n")
                    r = subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "--resource-usage",
                                        "-c", path, "-o", path + ".o"], capture_output=True, text=True)
                    text = r.stdout + r.stderr
                    regs = re.search(r"Used (\d+) registers", text)
                    spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
                    serialized = "serialized" in text  # ptxas: wgmma serialized (a fence or register problem)
                    ok = ok and r.returncode == 0
                    log(f"resources D={D} causal={causal} {kernel}: warps={cfg.warps} CG={cfg.col_groups} "
                        f"WM={cfg.m_tiles} P={cfg.parallel_block} T={cfg.traversal_block} H={cfg.slice_width} "
                        f"smem={cfg.shared_memory} regs={regs.group(1) if regs else '?'} "
                        f"stack/spill-st/spill-ld={spill.groups() if spill else '?'}"
                        + (" WGMMA SERIALIZED: " + text[-400:] if serialized else "")
                        + ("" if r.returncode == 0 else " COMPILE ERROR: " + text[-500:]))
    return ok


def profile_case(kind="all"):
    """One call of each kernel at D=128 (for ncu); kind "wgmma": three wgmma forward calls only
    (D from MLX_FLASH_PROFILE_HEAD_DIM, default 128);
    "wgmma_dkdv": three calls of the wgmma dK/dV kernel alone at D=256 (B=1, H=16, N=4096)."""
    import mlx.core as mx
    from mlx_flash import flash_attention
    B, H, N, D = 4, 16, 4096, 128
    if kind == "wgmma_dkdv":
        from mlx_flash.backends import cuda
        from mlx_flash.spec import check_inputs
        B, D = 1, 256
        q, k, v, do = (mx.random.normal((B, H, N, D)).astype(mx.bfloat16) for _ in range(4))
        spec, m4 = check_inputs(q, k, v)
        out, lse = cuda.forward(q, k, v, m4, spec)
        delta, lse2 = cuda.prepare_backward(out, lse, do, None, spec)
        fn = _kernel_alone("backward_key_value", q, k, v, m4, do, lse2, delta, spec)
        for _ in range(3):
            mx.eval(fn())
        return
    if kind == "wgmma":
        from mlx_flash.backends import cuda
        from mlx_flash.spec import check_inputs
        cuda.WGMMA_FORWARD_OVERRIDE = True
        D = int(os.environ.get("MLX_FLASH_PROFILE_HEAD_DIM", D))
        q, k, v = (mx.random.normal((B, H, N, D)).astype(mx.bfloat16) for _ in range(3))
        spec, m4 = check_inputs(q, k, v)
        for _ in range(3):
            mx.eval(cuda.forward(q, k, v, m4, spec))
        return
    q, k, v, do = (mx.random.normal((B, H, N, D)).astype(mx.bfloat16) for _ in range(4))
    for _ in range(2):
        o, g = mx.vjp(lambda a, b, c: flash_attention(a, b, c, backend="cuda"), [q, k, v], [do])
        mx.eval(o, g)


def phase_profile(out_dir):
    path = os.path.join(out_dir, "ncu.txt")
    cmd = ["ncu", "--clock-control", "none", "--kernel-name", "regex:mlxflash_(forward|backward)", "--launch-skip", "3",
           "--launch-count", "3", "--section", "SpeedOfLight", "--section", "Occupancy", "--section", "LaunchStats",
           "--section", "WarpStateStats", "--section", "MemoryWorkloadAnalysis",
           sys.executable, os.path.abspath(__file__), "--profile-case"]
    with open(path, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, timeout=300)
    keys = ("custom_kernel", "Duration", "Compute (SM) Throughput", "Memory Throughput", "Achieved Occupancy",
            "Registers Per Thread", "Stall", "Issue Slots Busy", "Bank Conflicts", "L1/TEX Hit", "Theoretical Occupancy")
    for line in open(path).read().splitlines():
        if any(k in line for k in keys):
            log("ncu", line.strip()[:160])
    return r.returncode == 0


def phase_profile_wgmma(out_dir):
    """ncu of the wgmma forward at D=128 (B=4, H=16, N=4096), or with MLX_FLASH_PROFILE_WGMMA=dkdv
    of the wgmma dK/dV kernel at D=256 (B=1): the sections' text in ncu_wgmma.txt, the report in
    ncu_wgmma.ncu-rep and its per-SASS-instruction stall samples in ncu_wgmma_sass.csv."""
    report = os.path.join(out_dir, "ncu_wgmma")
    dkdv = os.environ.get("MLX_FLASH_PROFILE_WGMMA") == "dkdv"
    kernel = "backward_key_value_wgmma" if dkdv else "forward_wgmma"
    cmd = ["ncu", "--clock-control", "none", "--kernel-name", f"regex:mlxflash_{kernel}", "--launch-skip", "1",
           "--launch-count", "1", "--import-source", "no", "-f", "-o", report]
    for section in ("SpeedOfLight", "WarpStateStats", "SchedulerStats", "ComputeWorkloadAnalysis",
                    "MemoryWorkloadAnalysis", "SourceCounters", "LaunchStats", "Occupancy"):
        cmd += ["--section", section]
    cmd += [sys.executable, os.path.abspath(__file__), "--profile-case", "--profile-kind", "wgmma_dkdv" if dkdv else "wgmma"]
    with open(report + "_run.txt", "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, timeout=400)
    with open(report + ".txt", "w") as f:
        subprocess.run(["ncu", "--import", report + ".ncu-rep", "--page", "details"], stdout=f,
                       stderr=subprocess.STDOUT, timeout=120)
    with open(report + "_sass.csv", "w") as f:
        subprocess.run(["ncu", "--import", report + ".ncu-rep", "--page", "source", "--csv", "--print-source", "sass"],
                       stdout=f, stderr=subprocess.STDOUT, timeout=120)
    keys = ("Duration", "Throughput", "Stall", "Issue", "Eligible", "Active Warps", "Pipe", "Bank", "Hit Rate",
            "Registers", "Bandwidth")
    for line in open(report + ".txt").read().splitlines():
        if any(k in line for k in keys):
            log("ncu", line.strip()[:160])
    return r.returncode == 0


BENCH_SHAPES = [
    # (B, H, N, D): B * N = 16384, H = 16 for D <= 128; B = 1, H = 16, N = 4096 for large D.
    (4, 16, 4096, 64), (4, 16, 4096, 128), (1, 16, 16384, 128),
    (1, 16, 4096, 160), (1, 16, 4096, 192), (1, 16, 4096, 256), (1, 16, 4096, 512),
]


def warm_up_gpu(seconds=3.0):
    """Matrix products until the clocks have ramped up (an idle H100 sits at 345 MHz)."""
    import mlx.core as mx
    a = mx.random.normal((8192, 8192)).astype(mx.bfloat16)
    t0 = time.time()
    while time.time() - t0 < seconds:
        mx.eval(a @ a)
    mx.synchronize()


def phase_bench(out_dir, quick=False, references=True):
    shapes = BENCH_SHAPES[:2] + BENCH_SHAPES[5:6] if quick else BENCH_SHAPES
    warm_up_gpu()
    rows = []
    for B, H, N, D in shapes:
        for causal in (False, True):
            t0 = time.time()
            try:
                row = bench_one(B, H, N, D, causal, reps=5 if quick else 10, references=references)
            except Exception as e:
                row = dict(B=B, H=H, N=N, D=D, causal=causal, error=str(e)[:300])
            rows.append(row)
            log(f"bench {B}x{H}x{N}x{D} causal={causal} ({time.time() - t0:.0f}s): "
                + json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}))
            with open(os.path.join(out_dir, "bench.json"), "w") as f:
                json.dump(rows, f, indent=1)
    print_table(rows)
    return True


def print_table(rows):
    def f(row, key, fmt="{:.0f}"):
        v = row.get(key)
        return fmt.format(v) if isinstance(v, (int, float)) else "-"

    log("\n| B | H | N | D | causal | ours fwd | mlx fwd | FA2 fwd | ours f+b | mlx f+b | FA2 f+b | ours f+b ms | "
        "mlx f+b ms | dq ms | dkdv ms | ours peak MiB | mlx peak MiB |")
    log("|" + "---|" * 17)
    by_key = {(r["B"], r["N"], r["D"], r["causal"]): r for r in rows}
    for r in rows:
        log(f"| {r['B']} | {r['H']} | {r['N']} | {r['D']} | {'y' if r['causal'] else 'n'} | "
            f"{f(r, 'ours_fwd_tflops')} | {f(r, 'mlx_fwd_tflops')} | {f(r, 'fa2_fwd_tflops')} | "
            f"{f(r, 'ours_fb_tflops')} | {f(r, 'mlx_fb_tflops')} | {f(r, 'fa2_fb_tflops')} | "
            f"{f(r, 'ours_fb_ms', '{:.2f}')} | {f(r, 'mlx_fb_ms', '{:.2f}')} | {f(r, 'ours_dq_ms', '{:.2f}')} | "
            f"{f(r, 'ours_dkdv_ms', '{:.2f}')} | {f(r, 'ours_fb_peak_mib')} | {f(r, 'mlx_fb_peak_mib')} |")
    log("(TFLOP/s: 4*B*H*N^2*D fwd, x3.5 fwd+bwd, halved for causal)")
    for r in rows:
        if r["causal"]:
            nc = by_key.get((r["B"], r["N"], r["D"], False))
            if nc and "ours_fb_ms" in r and "ours_fb_ms" in nc:
                log(f"causal/non-causal time N={r['N']} D={r['D']}: fwd {r.get('ours_fwd_ms', 0) / nc.get('ours_fwd_ms', 1):.2f} "
                    f"f+b {r['ours_fb_ms'] / nc['ours_fb_ms']:.2f}")
    errors = [(r["D"], r["causal"], k, v) for r in rows for k, v in r.items() if "error" in k]
    for e in errors:
        log("error:", *e)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    parser.add_argument("--phases", default="smoke,test,sanitize,bench")
    parser.add_argument("--quick", action="store_true", help="fewer benchmark shapes and repetitions")
    parser.add_argument("--ours-only", action="store_true", help="bench: time only backend cuda (no MLX / torch)")
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments (shell syntax)")
    parser.add_argument("--sanitize-case", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile-case", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile-kind", default="all", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sanitize_case:
        sanitize_case()
        return 0
    if args.profile_case:
        profile_case(args.profile_kind)
        return 0
    os.makedirs(args.out, exist_ok=True)
    import mlx.core as mx
    log(f"mlx {mx.__version__}, cuda available: {mx.cuda.is_available()}")
    results = {}
    for phase in args.phases.split(","):
        t0 = time.time()
        try:
            if phase == "probe":
                results[phase] = phase_probe(args.out)
            elif phase == "smoke":
                results[phase] = phase_smoke(args.out)
            elif phase == "test":
                results[phase] = phase_test(args.out, shlex.split(args.pytest_args))
            elif phase == "sanitize":
                results[phase] = phase_sanitize(args.out)
            elif phase == "resources":
                results[phase] = phase_resources(args.out)
            elif phase == "wgmma":
                results[phase] = phase_wgmma(args.out)
            elif phase == "sweep":
                results[phase] = phase_sweep(args.out)
            elif phase == "backward":
                results[phase] = phase_backward(args.out)
            elif phase == "forward":
                results[phase] = phase_forward(args.out)
            elif phase == "softcap":
                results[phase] = phase_softcap(args.out)
            elif phase == "copy":
                results[phase] = phase_copy(args.out)
            elif phase == "order":
                results[phase] = phase_order(args.out)
            elif phase == "profile":
                results[phase] = phase_profile(args.out)
            elif phase == "overhead":
                results[phase] = phase_overhead(args.out)
            elif phase == "profile_wgmma":
                results[phase] = phase_profile_wgmma(args.out)
            elif phase == "bench":
                results[phase] = phase_bench(args.out, args.quick, references=not args.ours_only)
            else:
                raise ValueError(f"unknown phase {phase!r}")
        except Exception:
            results[phase] = False
            log(f"phase {phase} crashed:\n{traceback.format_exc()}")
        log(f"== phase {phase}: {'ok' if results[phase] else 'FAILED'} ({time.time() - t0:.0f}s)")
    log("phases:", results)
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

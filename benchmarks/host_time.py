"""Host-side (Python) time of one flash_attention call, with no GPU and no kernel run.

What is timed: building the call's graph, nothing else. The kernel objects are stubs (made in
this script only) that return zeros of the output shapes and dtypes without compiling or running
anything, and nothing is evaluated inside the timed loop:
    cuda   a CUDABackend whose kernel factory builds the stubs, passed as flash_attention's
           `backend` as the CPU emulator's is, with the GPU's compute capability read as on a GPU
           (MLX_FLASH_CUDA_CAPABILITY, unset, then the device, made to say 90 here): the
           sm90 family's mma.sync rows (the wgmma variants need a factory-less backend on a real
           sm_90; their host path is the same).
    metal  MLX_FLASH_METAL_SIM=1 with mlx_flash.metalsim.metal_kernel replaced by the stub
           factory (MLX_FLASH_SELF_CHECK=0: the stubs' zeros would fail the first-use check).
    auto   backend="auto" where it resolves to that "cuda" backend (as on an sm90 GPU): the last
           shape is one that kernels/dispatch_cuda.txt hands to mx.fast there, so its row is what
           a routed call costs on top of mx.fast's own (this tree's "auto" resolution is replaced
           in the measuring process only); the other shapes run the stubs as the cuda row.
    null   a backend object whose forward and backward return zeros and nothing else: the floor
           of flash_attention's own path (argument checks, backend selection, mx.custom_function).
    mx.fast  mx.fast.scaled_dot_product_attention on the CPU, for scale (MLX's own attention).
Modes: "fwd" = one forward call; "fwd+bwd" = mx.vjp of the call (the forward and the backward
graph, built, not evaluated). Times are the calling thread's CPU time (time.thread_time_ns): on a
shared machine, time spent descheduled does not count. The first call of each row (the first-contact probe, kernel
"compiles") is a warm-up outside the timing; a row is the 20th percentile of --repeats calls
(QUANTILE), the best of --rounds rounds.

    python benchmarks/host_time.py                      # this checkout
    python benchmarks/host_time.py --against HEAD~3     # and a git revision, interleaved rounds
    python benchmarks/host_time.py --profile            # + cProfile top entries (cuda, metal)

--against takes REV's mlx_flash/ and kernels/ (a folder holding them, or a git revision's, extracted
to a temporary directory: benchmarks/versions.py) and runs this script on it and on this checkout in
subprocesses, alternating, so both columns come from one run.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import versions  # benchmarks/versions.py: the other version's tree and its server process

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve()

# name -> (B, Hq, Hkv, Nq, Nk, D, dtype, mask): decode (one query, GQA), a short prefill, and a prefill
# that "auto" routes on an sm90 GPU.
# "decode+": a decode step's cache grows, so each timed call has one key more than the last
# (a new spec every call; the inputs are lazy zeros, never evaluated).
SHAPES = {
    "decode B1 H32/8 1x512 D128 bf16": (1, 32, 8, 1, 512, 128, "bfloat16", None),
    "decode+ B1 H32/8 1x(512+i) D128 bf16": (1, 32, 8, 1, 512, 128, "bfloat16", "growing"),
    "prefill B2 H8 256 D64 f16 causal": (2, 8, 8, 256, 256, 64, "float16", "causal"),
    # kernels/dispatch_cuda.txt hands this one to mx.fast on an sm90 GPU (the "auto" rows)
    "prefill B1 H16 1024 D128 bf16": (1, 16, 16, 1024, 1024, 128, "bfloat16", None),
}
MODES = ("fwd", "fwd+bwd")
# Each row reports this quantile of its calls' times (1/5: the 20th percentile), the best of its
# rounds: on a shared machine other processes only ever add time, in bursts longer than a call.
QUANTILE = (1, 5)


def _environment() -> None:
    """Before mlx_flash is imported: the simulator on, its self-check off, no tuned tables of the user's."""
    os.environ["MLX_FLASH_METAL_SIM"] = "1"
    os.environ["MLX_FLASH_SELF_CHECK"] = "0"
    os.environ.setdefault("XDG_CACHE_HOME", tempfile.mkdtemp(prefix="host_time_cache_"))


class StubKernel:
    """A compiled kernel's stand-in: zeros of the output shapes (lazy arrays, nothing runs)."""

    def __init__(self, **kwargs):
        self.name = kwargs.get("name")

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, **unused):
        import mlx.core as mx

        return [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes)]


def stub_factory(**kwargs):
    return StubKernel(**kwargs)


class NullBackend:
    """The backend protocol with no work: zeros of the right shapes (no kernels, no guard)."""

    name = "null"

    def unavailable_reason(self, device):
        return None

    def unsupported_reason(self, spec):
        return None

    def forward(self, q, k, v, mask, spec, sinks=None):
        import mlx.core as mx

        return mx.zeros(q.shape[:3] + (v.shape[3],), q.dtype), mx.zeros(q.shape[:3], mx.float32)

    def backward(self, q, k, v, mask, out, lse, d_out, d_lse, spec, sinks=None):
        import mlx.core as mx

        return mx.zeros(q.shape, q.dtype), mx.zeros(k.shape, k.dtype), mx.zeros(v.shape, v.dtype), None


def _inputs(shape, repeats: int = 0):
    """(q, k, v, mask, cotangent, growing): growing = [(k, v)] of Nk + 1 + i keys (decode+) or None."""
    import mlx.core as mx

    B, Hq, Hkv, Nq, Nk, D, dtype, mask = shape
    dt = getattr(mx, dtype)
    q = mx.random.normal((B, Hq, Nq, D)).astype(dt)
    k = mx.random.normal((B, Hkv, Nk, D)).astype(dt)
    v = mx.random.normal((B, Hkv, Nk, D)).astype(dt)
    cotangent = mx.ones((B, Hq, Nq, D), dt)
    mx.eval(q, k, v, cotangent)
    growing = None
    if mask == "growing":
        growing = [(mx.zeros((B, Hkv, Nk + 1 + i, D), dt),) * 2 for i in range(repeats)]
        mask = None
    return q, k, v, mask, cotangent, growing


def _sm90_backend():
    """The "cuda" row's backend: the sm90 family's plans with stub kernels."""
    from mlx_flash.backends import cuda

    class OnAnSm90(cuda.CUDABackend):
        def capability(self):  # as CUDABackend's, with the device's answer (cached there) 90
            override = cuda.capability_override()
            return override if override is not None else 90

    os.environ.pop(cuda.CAPABILITY_VARIABLE, None)
    return OnAnSm90(kernel_factory=stub_factory)


def _call(backend_name: str):
    """(q, k, v, mask) -> out, through the named path."""
    import mlx.core as mx
    from mlx_flash import flash_attention

    if backend_name == "cuda":
        backend = _sm90_backend()
        return lambda q, k, v, mask: flash_attention(q, k, v, mask=mask, backend=backend)
    if backend_name == "auto":  # backend="auto" resolved to the cuda row's backend, as on an sm90 GPU
        from mlx_flash import backends

        sm90 = _sm90_backend()
        real = backends.get_backend
        backends.auto_backend_name = lambda device: "cuda"
        backends.get_backend = lambda name: sm90 if name == "cuda" else real(name)
        return lambda q, k, v, mask: flash_attention(q, k, v, mask=mask)
    if backend_name == "metal":
        from mlx_flash import metalsim

        metalsim.metal_kernel = stub_factory  # the backend looks it up per compile
        return lambda q, k, v, mask: flash_attention(q, k, v, mask=mask, backend="metal")
    if backend_name == "null":
        backend = NullBackend()
        return lambda q, k, v, mask: flash_attention(q, k, v, mask=mask, backend=backend)
    if backend_name == "mx.fast":
        return lambda q, k, v, mask: mx.fast.scaled_dot_product_attention(
            q, k, v, scale=q.shape[-1] ** -0.5, mask=mask)
    raise ValueError(f"unknown backend {backend_name!r}")


def _timed(call, shape, mode: str, repeats: int):
    """Per-call host seconds (list of `repeats`), after one warm-up call."""
    import mlx.core as mx

    q, k, v, mask, cotangent, growing = _inputs(shape, repeats)
    if mode == "fwd":
        def once(k, v):
            return call(q, k, v, mask)
    else:
        def once(k, v):
            return mx.vjp(lambda q, k, v: call(q, k, v, mask), [q, k, v], [cotangent])
    mx.eval(once(k, v))  # warm-up: first contact, stub "compiles"; evaluates zeros only
    times = []
    for i in range(repeats):
        kv = growing[i] if growing else (k, v)
        start = time.thread_time_ns()
        result = once(*kv)
        times.append((time.thread_time_ns() - start) * 1e-9)
        del result
    return times


def rows(backends):
    """[(row label, backend, shape name, mode)] in print order."""
    return [(f"{name:<8}{mode:<8}{label}", name, label, mode) for name in backends for label in SHAPES
            for mode in MODES]


class Meter:
    """Times rows in this process (the backends' stubs installed once)."""

    def __init__(self, backends):
        self.calls = {name: _call(name) for name in backends}

    def row(self, name: str, label: str, mode: str, repeats: int) -> float:
        """Microseconds of one row (the QUANTILE of its calls)."""
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fallback would time another path: fail loudly instead
            return statistics.quantiles(_timed(self.calls[name], SHAPES[label], mode, repeats), n=QUANTILE[1])[
                QUANTILE[0] - 1] * 1e6


def measure(backends, repeats: int, rounds: int):
    """{row label: microseconds, best of rounds}."""
    meter, best = Meter(backends), {}
    for _ in range(rounds):
        for row, name, label, mode in rows(backends):
            value = meter.row(name, label, mode, repeats)
            best[row] = min(best.get(row, value), value)
    return best


def serve(backends) -> None:
    """--serve: read 'backend|shape|mode|repeats' lines, answer each with its time (us)."""
    meter = Meter(backends)
    print("ready", flush=True)
    for line in sys.stdin:
        name, label, mode, repeats = line.rstrip("\n").split("|")
        print(meter.row(name, label, mode, int(repeats)), flush=True)


def profile(backend_name: str, mode: str, repeats: int, top: int) -> str:
    """cProfile's top entries (by own time) over `repeats` calls of the first shape."""
    import mlx.core as mx

    call = _call(backend_name)
    shape = next(iter(SHAPES.values()))
    q, k, v, mask, cotangent, _ = _inputs(shape)
    if mode == "fwd":
        def once():
            return call(q, k, v, mask)
    else:
        def once():
            return mx.vjp(lambda q, k, v: call(q, k, v, mask), [q, k, v], [cotangent])
    mx.eval(once())
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(repeats):
        once()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    lines = [line for line in text.getvalue().splitlines() if line.strip()]
    start = next(i for i, line in enumerate(lines) if "ncalls" in line)
    header = f"--- cProfile {backend_name} {mode}, {repeats} calls of {next(iter(SHAPES))} (tottime) ---"
    return "\n".join([header] + [line.replace(str(ROOT) + "/", "") for line in lines[start:]])


class Child:
    """This script in --serve mode under `tree` (versions.Server)."""

    def __init__(self, tree: str, backends):
        self.server = versions.Server(SCRIPT, tree, ["--backends", ",".join(backends)])
        if self.server.ready != "ready":
            raise RuntimeError(f"measuring under {tree} failed to start: {self.server.ready!r}")

    def row(self, name: str, label: str, mode: str, repeats: int) -> float:
        return float(self.server.ask(f"{name}|{label}|{mode}|{repeats}", f"{name} {mode} {label}"))

    def close(self) -> None:
        self.server.close()


def compare(args) -> None:
    """This checkout against `args.against`: two processes, alternating row by row (which one goes
    first alternates too), so that the machine's slow spells fall on both columns alike."""
    with tempfile.TemporaryDirectory(prefix="host_time_ref_") as scratch:
        ref = versions.version_tree(args.against, scratch)
        children = [Child(ref, args.backends), Child(str(ROOT), args.backends)]
        before, after = {}, {}
        try:
            for round_ in range(args.rounds):
                for index, (row, name, label, mode) in enumerate(rows(args.backends)):
                    pairs = list(zip(children, (before, after)))
                    for child, store in (pairs if (round_ + index) % 2 == 0 else pairs[::-1]):
                        value = child.row(name, label, mode, args.repeats)
                        store[row] = min(store.get(row, value), value)
        finally:
            for child in children:
                child.close()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "mlx_flash"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    print(f"host us per call (20th percentile of {args.repeats} calls, best of {args.rounds} interleaved rounds)")
    print(f"{'':<56}{args.against:>12}{head + ('+' if dirty else ''):>12}{'ratio':>8}")
    for row in after:
        b, a = before.get(row), after[row]
        print(f"{row:<56}{b:>12.1f}{a:>12.1f}{b / a:>8.2f}" if b else f"{row:<56}{'-':>12}{a:>12.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=200, help="timed calls per row (default 200)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each row keeps its best (default 3)")
    parser.add_argument("--backends", type=lambda s: s.split(","), default=["cuda", "auto", "metal", "null", "mx.fast"])
    parser.add_argument("--against", help="a git revision or a folder with mlx_flash/ and kernels/, measured too")
    parser.add_argument("--profile", action="store_true", help="print cProfile's top entries too")
    parser.add_argument("--top", type=int, default=25, help="profile entries shown (default 25)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    _environment()
    if args.serve:  # under versions.Server: the working folder is the version's tree
        sys.path.insert(0, os.getcwd())
        serve(args.backends)
        return
    if args.against:
        compare(args)
    else:
        sys.path.insert(0, os.environ.get("PYTHONPATH") or str(ROOT))
        best = measure(args.backends, args.repeats, args.rounds)
        print(f"host us per call (20th percentile of {args.repeats} calls, best of {args.rounds} rounds)")
        for row, value in best.items():
            print(f"{row:<56}{value:>10.1f}")
    if args.profile:
        sys.path.insert(0, str(ROOT))
        for name in [b for b in args.backends if b in ("cuda", "metal")]:
            for mode in MODES:
                print(profile(name, mode, args.repeats, args.top))


if __name__ == "__main__":
    main()

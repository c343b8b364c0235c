"""One rank of the ring-attention tests (started by tests/test_distributed.py through mlx.launch).

    python tests/ring_worker.py MODE OUT_DIR [CASES_JSON]

Every rank builds the same whole-sequence inputs from a seed, runs `ring_attention` on its shard,
and rank 0 writes what the test asserts on to OUT_DIR/MODE.json (other ranks write
OUT_DIR/MODE.rank<r>.json with what they saw, e.g. the error each raised):
    matrix: per case, relative errors of the gathered out / lse / dq / dk / dv against single-process
            `flash_attention` and against the float64 reference, and whether two gradient runs were
            bitwise equal.
    errors: the exception (type, message) each rank raised for each bad input.
    memory: per-rank peak memory of forward+backward at N_global = n * N_local, and of one process
            running `flash_attention` on N_local alone.
The backend comes from MLX_FLASH_RING_BACKEND (default "auto").
"""
from __future__ import annotations

import faulthandler
import json
import os
import sys
import traceback
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_cases import relative_error, to_numpy  # noqa: E402
from mlx_flash import flash_attention, reference  # noqa: E402
from mlx_flash.distributed import gather_sequence, ring_attention, shard_sequence  # noqa: E402
from mlx_flash.spec import check_inputs  # noqa: E402

BACKEND = os.environ.get("MLX_FLASH_RING_BACKEND", "auto")
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def inputs(case, n):
    """Whole-sequence q, k, v, d_out, d_lse (the same on every rank: one seed)."""
    rng = np.random.default_rng(case["seed"])
    dtype = DTYPES[case["dtype"]]
    B, Hkv, G, D = case.get("batch", 1), case["kv_heads"], case["group"], case["head_dim"]
    N = n * case["n_local"]

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    q, k, v = normal(B, Hkv * G, N, D), normal(B, Hkv, N, D), normal(B, Hkv, N, D)
    d_out = normal(B, Hkv * G, N, D)
    d_lse = mx.array(rng.standard_normal((B, Hkv * G, N)).astype(np.float32))
    return q, k, v, d_out, d_lse


def kwargs_of(case):
    kw = {"mask": "causal" if case.get("causal") else None}
    if case.get("window"):
        kw["window_size"] = tuple(case["window"])
    if case.get("softcap"):
        kw["softcap"] = case["softcap"]
    return kw


def loss_fn(attend, d_out, d_lse, use_lse):
    def loss(q, k, v):
        o, l = attend(q, k, v)
        total = (o.astype(mx.float32) * d_out.astype(mx.float32)).sum()
        if use_lse:
            total = total + (mx.where(mx.isinf(l), 0.0, l) * d_lse).sum()
        return total
    return loss


def run_matrix(group, cases):
    n, results = group.size(), []
    for case in cases:
        layout, kw = case["layout"], kwargs_of(case)
        q, k, v, d_out, d_lse = inputs(case, n)
        use_lse = bool(case.get("lse_gradient"))
        shard = lambda x: shard_sequence(x, group=group, layout=layout)  # noqa: E731
        gather = lambda x: gather_sequence(x, group=group, layout=layout)  # noqa: E731
        ring = lambda q_, k_, v_: ring_attention(q_, k_, v_, return_lse=True, group=group, layout=layout,  # noqa: E731
                                                 backend=BACKEND, **kw)
        local = [shard(x) for x in (q, k, v, d_out)] + [shard(d_lse[..., None])[..., 0]]
        out, lse = ring(*local[:3])
        grad = mx.grad(loss_fn(ring, local[3], local[4], use_lse), argnums=(0, 1, 2))
        grads = grad(*local[:3])
        again = grad(*local[:3])
        mx.eval(out, lse, grads, again)
        bitwise = all(np.array_equal(to_numpy(a), to_numpy(b)) for a, b in zip(grads, again))
        got = {"out": gather(out), "lse": gather(lse[..., None])[..., 0],
               "dq": gather(grads[0]), "dk": gather(grads[1]), "dv": gather(grads[2])}
        # The single-process result on the whole sequence, and the float64 reference.
        whole = lambda q_, k_, v_: flash_attention(q_, k_, v_, return_lse=True, backend=BACKEND, **kw)  # noqa: E731
        f_out, f_lse = whole(q, k, v)
        f_grads = mx.grad(loss_fn(whole, d_out, d_lse, use_lse), argnums=(0, 1, 2))(q, k, v)
        want = {"out": f_out, "lse": f_lse, "dq": f_grads[0], "dk": f_grads[1], "dv": f_grads[2]}
        spec, _ = check_inputs(q, k, v, mask=kw["mask"], window_size=kw.get("window_size"),
                               softcap=kw.get("softcap"))
        qn, kn, vn = (to_numpy(x) for x in (q, k, v))
        r_out, r_lse = reference.attention_forward(qn, kn, vn, spec)
        r_d_lse = np.where(np.isinf(r_lse), 0.0, np.array(d_lse)) if use_lse else None
        r_grads = reference.attention_backward(qn, kn, vn, to_numpy(d_out), spec, d_lse=r_d_lse)
        ref = {"out": r_out, "lse": r_lse, "dq": r_grads[0], "dk": r_grads[1], "dv": r_grads[2]}
        roundtrip = all(np.array_equal(to_numpy(gather(shard(x))), to_numpy(x)) for x in (q, k))
        entry = {"case": case, "bitwise": bitwise, "roundtrip": roundtrip, "vs_flash": {}, "vs_reference": {},
                 "calls": [len(calls) for calls in last_calls(group, case, kw)]}
        for name in got:
            g = to_numpy(got[name])
            if name == "lse":
                finite = np.isfinite(ref[name])
                entry["inf_rows_match"] = bool(np.array_equal(np.isinf(g), ~finite))
                entry["vs_flash"][name] = relative_error(g[finite], to_numpy(want[name])[finite])
                entry["vs_reference"][name] = relative_error(g[finite], ref[name][finite])
            else:
                entry["vs_flash"][name] = relative_error(g, to_numpy(want[name]).astype(np.float64))
                entry["vs_reference"][name] = relative_error(g, ref[name])
        results.append(entry)
    return results


def last_calls(group, case, kw):
    """The per-step backend calls this rank plans (checks that zigzag needs few calls per step)."""
    from mlx_flash.distributed import plan as plan_module, segments
    n, r, N = group.size(), group.rank(), case["n_local"]
    q = mx.zeros((1, case["kv_heads"] * case["group"], N, case["head_dim"]))
    k = mx.zeros((1, case["kv_heads"], N, case["head_dim"]))
    spec, _ = check_inputs(q, k, k, mask=kw["mask"], window_size=kw.get("window_size"))
    mine = segments(case["layout"], r, n, N)
    return [plan_module.plan_pair(spec, mine, segments(case["layout"], (r - t) % n, n, N), n * N, n * N)
            for t in range(n)]


def run_errors(group):
    """Bad inputs, some of them on one rank only; every rank must raise (none may hang)."""
    rank, n = group.rank(), group.size()
    x = mx.zeros((1, 2, 8, 16))
    odd = mx.zeros((1, 2, 7, 16))
    longer = mx.zeros((1, 2, 10, 16))
    bad = {
        "layout": lambda: ring_attention(x, x, x, group=group, layout="spiral"),
        "layout_one_rank": lambda: ring_attention(x, x, x, group=group, layout="spiral" if rank == 1 else "zigzag"),
        "lengths_differ": lambda: ring_attention(longer if rank == n - 1 else x, longer if rank == n - 1 else x,
                                                 longer if rank == n - 1 else x, group=group, layout="contiguous"),
        "zigzag_odd": lambda: ring_attention(odd, odd, odd, group=group, layout="zigzag"),
        "array_mask": lambda: ring_attention(x, x, x, group=group, mask=mx.ones((8, 8), dtype=mx.bool_)),
        "mask_differs": lambda: ring_attention(x, x, x, group=group, mask="causal" if rank == 0 else None),
        "dtype_one_rank": lambda: ring_attention(x, x, x.astype(mx.float16) if rank == 0 else x, group=group),
    }
    seen = {}
    for name, call in bad.items():
        try:
            mx.eval(call())
            seen[name] = None
        except (ValueError, TypeError) as e:
            seen[name] = [type(e).__name__, str(e)]
    # After all that, the ring still works (nobody is left waiting inside a half-done call).
    seen["works_after"] = bool(np.isfinite(np.array(ring_attention(x, x, x, group=group))).all())
    return seen


def run_memory(group, case):
    """Peak memory of fwd+bwd per rank (N_global = n * N_local) vs one process at N_local."""
    n, layout, kw = group.size(), case["layout"], kwargs_of(case)
    q, k, v, d_out, _ = (x for x in inputs(case, n))
    local = [shard_sequence(x, group=group, layout=layout) for x in (q, k, v, d_out)]
    del q, k, v, d_out
    mx.eval(local)
    ring = lambda q_, k_, v_: ring_attention(q_, k_, v_, group=group, layout=layout, backend=BACKEND, **kw)  # noqa: E731
    alone = lambda q_, k_, v_: flash_attention(q_, k_, v_, backend=BACKEND, **kw)  # noqa: E731
    peaks = {}
    for name, attend in (("alone", alone), ("ring", ring), ("alone_again", alone)):
        grad = mx.grad(lambda q_, k_, v_: (attend(q_, k_, v_) * local[3]).sum(), argnums=(0, 1, 2))
        mx.eval(grad(*local[:3]))  # warm (kernel compilation, caches)
        mx.synchronize()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        mx.eval(grad(*local[:3]))
        mx.synchronize()
        peaks[name] = mx.get_peak_memory() - base
    return peaks


def main():
    mode, out_dir = sys.argv[1], Path(sys.argv[2])
    # A hang shows where it is: every thread's stack after the deadline, then exit.
    faulthandler.dump_traceback_later(float(os.environ.get("RING_WORKER_DEADLINE", "200")), exit=True)
    group = mx.distributed.init()
    rank = group.rank()
    try:
        if mode == "matrix":
            result = run_matrix(group, json.loads(Path(sys.argv[3]).read_text()))
        elif mode == "errors":
            result = run_errors(group)
        elif mode == "memory":
            result = run_memory(group, json.loads(Path(sys.argv[3]).read_text()))
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    except Exception:
        result = {"crash": traceback.format_exc()}
    name = f"{mode}.json" if rank == 0 else f"{mode}.rank{rank}.json"
    (out_dir / name).write_text(json.dumps(result, indent=1))
    if isinstance(result, dict) and "crash" in result:
        print(result["crash"], file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

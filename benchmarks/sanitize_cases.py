"""Small calls of every CUDA kernel for every GPU family's plans (run under compute-sanitizer).

    compute-sanitizer --tool memcheck python benchmarks/sanitize_cases.py 80 86 120 native
    compute-sanitizer --tool racecheck python benchmarks/sanitize_cases.py native --head-dims 96 160 200 --n 150

Each argument is a compute capability to plan for (MLX_FLASH_CUDA_CAPABILITY) or "native" (the
GPU's own, which on an H100 runs the wgmma kernels). Per capability: forward and backward at head
dims across the family's block-table rows, with causal, bool and additive masks, softcap, a
window and GQA; every call is also checked against the "mlx" backend in fp32.

--layout lays q, k and v out as mlx-lm does ("token_major": transposed views of [B, N, H, D]
buffers, the kernels' 16-byte path at another row stride) or at an odd offset into wider rows
("offset": the element-wise path); default "row". --cotangent broadcast takes the loss as
out.sum() in out's dtype, whose gradient reaches the backward as a stride-0 broadcast (the
kernels' gathered loads of dO); default "dense" (out.astype(float32).sum(): a row-contiguous one).

--head-dims keeps only the cases of those head dims (96, 160 and 200 are the wgmma dK/dV
kernel's three schemes on an H100: a bool mask with softcap, causal at BN = 32, additive with
column groups). --n replaces every case's query length (keys: n + 3): the default lengths give
the dK/dV kernel's D = 200 CTA only STAGES = 2 query blocks, so its pipeline never refills a
stage; n = 150 refills every stage of all three.

--fused-dq runs the backward with Tuning(fused_query=True): where the dK/dV kernel can take it
(D <= 128, no window) it accumulates dQ itself through its ordered bulk adds, which the block
table turns on only for long calls. With --n 400 a case has 4 key blocks and 4-7 query blocks,
so both chains of the walk without a causal mask (attention_backward_key_value_wgmma.cu) and the
causal one take several adds.
--group G gives every case G query heads on its one kv head (default 2). --head-splits S splits
them over S dK/dV CTAs (Tuning.head_splits: the head_split kernels and the parts kernel; with
--group 3 --head-splits 2 the splits are uneven, 2 + 1 heads); the block table's
head_splits_to<W> does so for these small calls anyway where its row has the option.
"""
import argparse
import os
import sys

import mlx.core as mx
import numpy as np

from mlx_flash import flash_attention
from mlx_flash.backends.cuda import CAPABILITY_VARIABLE, CUDABackend
from mlx_flash.backends.cuda_source import Tuning

# (head dim, mask, N): head dims in every row range of blocks_cuda.txt (<= 64, <= 128, <= 192,
# <= 256, <= 448, <= 512); N not a multiple of any block.
# 224 without a mask: the D = 193..256 forward's T = 80 (array masks take T = 64 there); 48 with a
# bool mask: the D <= 64 forward's T = 64 for array masks (128 otherwise). 128 without a mask:
# the D = 113..128 rows (the forward's interior tiles with the scale fold at 300 queries, two
# whole key blocks of 128; `--fused-dq` runs that row's fused dQ). 448 with a bool mask: the
# D = 385..512 dK/dV row's split by role (roles: no causal mask or window). Keys are n + 3: even
# for 48 and 200, odd for 96 and 128.
CASES = ((64, "causal", 100), (48, "bool", 81), (96, "bool", 70), (128, None, 300), (160, "causal", 50),
         (200, "additive", 41), (224, None, 90), (320, "window", 40), (448, "bool", 37), (512, "causal", 33))


LAYOUTS = ("row", "token_major", "offset")
COTANGENTS = ("dense", "broadcast")


def laid_out(x: mx.array, layout: str) -> mx.array:
    """x's values in `layout` (see the module docstring)."""
    if layout == "token_major":
        return mx.contiguous(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    if layout == "offset":
        return mx.contiguous(mx.pad(x, [(0, 0)] * 3 + [(1, 2)]))[..., 1:x.shape[-1] + 1]
    return x


def run(capability: str, cases=CASES, n_override=None, layout: str = "row", fused_dq: bool = False,
        head_splits=None, group: int = 2, cotangent: str = "dense") -> float:
    """Worst relative error of out / dq / dk / dv against the mlx backend over `cases`.

    Args:
        capability: a compute capability ("80") or "native".
        cases: (head dim, mask, N) triples, a subset of CASES.
        n_override: N for every case instead of its own (None: each case's).
        layout: how q, k and v lie in memory (LAYOUTS).
        fused_dq: force the dK/dV kernel's fused dQ where it fits (Tuning.fused_query).
        head_splits: Tuning.head_splits (None: the table's).
        group: query heads on the one kv head.
        cotangent: "dense" or "broadcast" (COTANGENTS: how d_out reaches the backward).
    """
    if capability == "native":
        os.environ.pop(CAPABILITY_VARIABLE, None)
    else:
        os.environ[CAPABILITY_VARIABLE] = capability
    # reads the capability per call
    backend = CUDABackend(tuning=Tuning(fused_query=True if fused_dq else None, head_splits=head_splits))
    worst = 0.0
    for head_dim, mask, n in cases:
        n = n_override or n
        mx.random.seed(head_dim)
        q = mx.random.normal((1, group, n, head_dim)).astype(mx.bfloat16)
        k = mx.random.normal((1, 1, n + 3, head_dim)).astype(mx.bfloat16)
        v = mx.random.normal((1, 1, n + 3, head_dim)).astype(mx.bfloat16)
        q, k, v = (laid_out(x, layout) for x in (q, k, v))
        kwargs = dict(mask=mask, softcap=20.0 if head_dim == 96 else None)
        if mask == "bool":
            kwargs["mask"] = mx.random.uniform(shape=(1, 1, n, n + 3)) < 0.7
        elif mask == "additive":
            kwargs["mask"] = mx.random.normal((1, group, n, n + 3)).astype(mx.bfloat16)
        elif mask == "window":
            kwargs.update(mask="causal", window_size=(17, 0))

        def loss(chosen, dtype):
            def f(q_, k_, v_):
                o = flash_attention(q_.astype(dtype), k_.astype(dtype), v_.astype(dtype), backend=chosen, **kwargs)
                return (o.sum() if cotangent == "broadcast" else o.astype(mx.float32).sum()), o
            return mx.value_and_grad(f, argnums=(0, 1, 2))

        (_, out), grads = loss(backend, mx.bfloat16)(q, k, v)
        (_, ref), ref_grads = loss("mlx", mx.float32)(*(x.astype(mx.float32) for x in (q, k, v)))
        mx.eval(out, grads, ref, ref_grads)
        for x, r in zip((out, *grads), (ref, *ref_grads)):
            x, r = np.array(x.astype(mx.float32), np.float64), np.array(r, np.float64)
            worst = max(worst, float(np.linalg.norm(x - r) / max(np.linalg.norm(r), 1e-30)))
    family = backend.family()
    print(f"capability {capability}: family {family.name if family else None}, {layout} layout, {len(cases)} cases "
          f"(head dims {', '.join(str(c[0]) for c in cases)}){', fused dQ' if fused_dq else ''}"
          f"{f', head splits {head_splits}' if head_splits else ''}, {group} query heads, {cotangent} cotangent, "
          f"worst relative error vs mlx fp32 {worst:.2e}",
          flush=True)
    return worst


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("capabilities", nargs="*", default=["native"],
                        help='compute capabilities to plan for ("80", "86", "120") or "native"')
    parser.add_argument("--head-dims", type=int, nargs="+", choices=[c[0] for c in CASES],
                        help="only the cases of these head dims (default: every case)")
    parser.add_argument("--n", type=int, help="query length of every case (keys: n + 3) instead of its own")
    parser.add_argument("--layout", choices=LAYOUTS, default="row", help="how q, k and v lie in memory")
    parser.add_argument("--cotangent", choices=COTANGENTS, default="dense",
                        help="how d_out reaches the backward (broadcast: out.sum()'s)")
    parser.add_argument("--fused-dq", action="store_true", help="force the dK/dV kernel's fused dQ where it fits")
    parser.add_argument("--head-splits", type=int, help="Tuning.head_splits (default: the table's)")
    parser.add_argument("--group", type=int, default=2, help="query heads on the one kv head (default 2)")
    args = parser.parse_args(argv)
    for capability in args.capabilities:
        if capability != "native" and not capability.isdigit():
            parser.error(f'capabilities must be numbers like 86 or "native", got {capability!r}')
    if args.n is not None and args.n < 1:
        parser.error(f"--n must be a positive query length, got {args.n}")
    cases = [c for c in CASES if args.head_dims is None or c[0] in args.head_dims]
    if args.head_splits is not None and args.head_splits < 1:
        parser.error(f"--head-splits must be >= 1, got {args.head_splits}")
    if args.group < 1:
        parser.error(f"--group must be >= 1, got {args.group}")
    errors = [run(c, cases, args.n, args.layout, args.fused_dq, args.head_splits, args.group, args.cotangent)
              for c in args.capabilities]
    print("sanitize cases done" + (" (ERROR over 6e-2)" if max(errors) > 6e-2 else ""), flush=True)
    return 1 if max(errors) > 6e-2 else 0


if __name__ == "__main__":
    sys.exit(main())

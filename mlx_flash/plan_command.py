"""`python -m mlx_flash plan`: print how each GPU kernel of a call is planned (mlx_flash.inspect).

    python -m mlx_flash plan --backend cuda --capability 86 --head-dim 128 --dtype bfloat16 [--mask causal] [--json]
    python -m mlx_flash plan --backend cuda --capability 90 --head-dim 128 --mask causal --seq-len 8192
    python -m mlx_flash plan --backend cuda --capability 90 --head-dim 128 --mask causal --group 4
    python -m mlx_flash plan --backend cuda --capability 90 --head-dim 128 --mask causal --seq-len 2048 --group 4 \
        --kv-heads 4 --sm-count 132
    python -m mlx_flash plan --backend metal --family m1 --head-dim 96 --dtype float16

Per kernel: the GPU family, instruction family (wgmma / mma.sync / simdgroup_matrix / fallback),
block sizes P / T / H, warps, threads, shared memory bytes and the family's limit. For cuda, also
whether backend="auto" routes such a call to mx.fast (kernels/dispatch_cuda.txt) and by which
row: at --seq-len (and --kv-len), or the N ranges where it does, for --group query heads per kv
head (the table's rows are per head layout: MHA, GQA); and with --group, how many dK/dV CTAs
share a kv head's query heads (--kv-heads, --batch) on a GPU of --sm-count SMs (default: this
machine's).
"""
from __future__ import annotations

import argparse
import json
import sys

from . import inspect
from .cli import dtype_argument, positive_int


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `plan` subcommand on an argparse subparsers object (it runs run_plan)."""
    parser = subparsers.add_parser("plan", help="print each kernel's plan for a GPU, head dim, dtype and mask",
                                   description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("cuda", "metal"), default="cuda")
    parser.add_argument("--capability", type=int,
                        help="cuda: compute capability as 10 * major + minor, e.g. 80, 86, 90, 120 (default: this "
                             "machine's, or MLX_FLASH_CUDA_CAPABILITY)")
    parser.add_argument("--family", help="metal: m1 or m3 (default: this machine's, or MLX_FLASH_METAL_FAMILY)")
    parser.add_argument("--head-dim", type=positive_int, required=True, help="D")
    parser.add_argument("--dtype", default="bfloat16", type=dtype_argument,
                        help="float32/fp32, float16/fp16 or bfloat16/bf16 (default: %(default)s)")
    parser.add_argument("--mask", default="none", choices=inspect.MASKS)
    parser.add_argument("--seq-len", type=positive_int, help="cuda: Nq, for the backend='auto' routing line "
                        "and the dK/dV kernel's fused dQ by length (default: list the N ranges that route)")
    parser.add_argument("--kv-len", type=positive_int, help="cuda: Nk, for the forward's T for long calls "
                        "(default: --seq-len)")
    parser.add_argument("--group", type=positive_int, default=1,
                        help="cuda: query heads per kv head, for the routing and head-split lines (default: "
                             "%(default)s, MHA)")
    parser.add_argument("--kv-heads", type=positive_int, default=1,
                        help="cuda: kv heads of the call, for the head-split line (default: %(default)s)")
    parser.add_argument("--batch", type=positive_int, default=1,
                        help="cuda: batch of the call, for the head-split line (default: %(default)s)")
    parser.add_argument("--sm-count", type=positive_int,
                        help="cuda: the GPU's SMs, for the dK/dV kernel's head splits (default: this machine's GPU's)")
    parser.add_argument("--json", action="store_true", help="print JSON (one object per kernel)")
    parser.set_defaults(run=run_plan)
    return parser


def run_plan(args) -> int:
    """Print the plans of `args` (parsed by add_plan_parser's parser); 2 on a bad argument."""
    try:
        rows = inspect.plans(args.backend, args.head_dim, args.dtype, args.mask, capability=args.capability,
                             family=args.family, q_len=args.seq_len or 1, kv_len=args.kv_len, group=args.group,
                             kv_heads=args.kv_heads, batch=args.batch, sm_count=args.sm_count)
    except ValueError as error:
        print(f"python -m mlx_flash plan: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=1))
        return 0
    lines = [inspect.format_table(rows)]
    if args.backend == "cuda":
        lines += inspect.auto_route(args.head_dim, args.dtype, args.mask, args.capability, args.seq_len, args.kv_len,
                                    args.group)
        lines += inspect.head_splits_line(args.head_dim, args.dtype, args.mask, args.capability, args.seq_len or 1,
                                          args.kv_len, args.group, args.kv_heads, args.batch, args.sm_count)
    print("\n".join(lines))
    return 0


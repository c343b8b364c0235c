"""Compile every CUDA kernel variant of every GPU family with nvcc (no GPU needed).

    python benchmarks/cuda_compile.py [--families sm80 sm86 ...] [--head-dims 64 128 ...] [--out DIR]

Each variant is rendered exactly as the backend renders it (cuda_source.source), wrapped in a
__global__ signature like the one mx.fast.cuda_kernel generates, and compiled for its family's
architecture (sm_80, sm_86, sm_90a, sm_100a, sm_120a). Prints registers, stack and spills per
kernel (ptxas --resource-usage; NVRTC, which MLX runs, allocates the same way up to small
differences) and exits 1 on a compile error or a serialized wgmma. With --out, writes each
kernel's PTX there (the entry is always mlxflash_kernel), to compare two versions of the templates.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile

import mlx.core as mx

from mlx_flash import inspect, planner
from mlx_flash.backends import cuda_source
from mlx_flash.planner import KERNELS

ARCHES = {"sm80": "sm_80", "sm86": "sm_86", "sm90": "sm_90a", "sm100": "sm_100a", "sm120": "sm_120a"}
POINTER_TYPES = {"params": "int64_t", "fparams": "float", "lse2": "float", "delta": "float", "lse": "float",
                 "d_sinks_part": "float", "tensor_map": "uint32_t", "tensor_maps": "uint8_t", "dq_acc": "float",
                 "dq_order": "int32_t", "acc": "float", "counts": "int32_t", "d_lse": "float",
                 "dk_parts": "float", "dv_parts": "float", "sinks": "float"}


def translation_unit(variant: cuda_source.KernelVariant) -> str:
    return wrapped(cuda_source.source(variant), variant.input_type, variant.mask_type)


def wrapped(source, input_type: str, mask_type: str = "bool") -> str:
    """A kernel's (header, body, inputs, outputs) as one translation unit, its __global__ signature
    as mx.fast.cuda_kernel generates it."""
    header, body, inputs, outputs = source

    def pointer_type(name: str) -> str:  # a bool mask's elements are bool, not the input type
        return POINTER_TYPES.get(name, mask_type if name == "mask" else input_type)

    # As MLX: an input's strides follow it when the body names them (Strides: 10 int64, by value).
    signature = ", ".join([f"const {pointer_type(n)}* {n}" + (f", const __grid_constant__ Strides {n}_strides"
                                                              if f"{n}_strides" in body else "")
                           for n in inputs] + [f"{pointer_type(n)}* {n}" for n in outputs])
    return ("#include <cstdint>\n#include <cuda/std/array>\n#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n"
            "using Strides = cuda::std::array<int64_t, 10>;\n" + header
            + f"\n__global__ void mlxflash_kernel({signature}) {{\n{body}\n}}\n")


def compile_unit(name: str, text: str, arch: str, tmp: str) -> str:
    """nvcc's resource line for one translation unit ("ERROR ..." with the log when it fails)."""
    path = os.path.join(tmp, name + ".cu")
    with open(path, "w") as f:
        f.write(text)
    r = subprocess.run(["nvcc", f"-gencode=arch={arch.replace('sm_', 'compute_')},code={arch}", "-O3",
                        "--resource-usage", "-cubin", path, "-o", path + ".cubin"], capture_output=True, text=True)
    text = r.stdout + r.stderr
    return f"ERROR {name} ({arch}): {text[-800:]}" if r.returncode != 0 else text


def compile_variant(variant, arch: str, tmp: str, ptx_dir=None) -> str:
    """One line: the variant, its resources, or the compile error."""
    text = compile_unit(variant.name, translation_unit(variant), arch, tmp)
    if text.startswith("ERROR"):
        return text
    if ptx_dir:
        path = os.path.join(tmp, variant.name + ".cu")
        subprocess.run(["nvcc", f"-arch={arch}", "-O3", "-ptx", path, "-o",
                        os.path.join(ptx_dir, f"{variant.name}.{arch}.ptx")], check=True, capture_output=True)
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    serialized = " SERIALIZED" if "serialized" in text else ""
    return (f"{variant.name} ({arch}): P={variant.parallel_block} T={variant.traversal_block} H={variant.head_block} "
            f"warps={variant.warps} smem={variant.shared_memory} regs={regs.group(1) if regs else '?'} "
            f"stack/spill-st/spill-ld={'/'.join(spill.groups()) if spill else '?'}{serialized}")


def main(argv=None) -> int:
    from cli_args import parse_tuning  # benchmarks/cli_args.py (here: tests import this module by path)

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=list(ARCHES))
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 192, 256, 512])
    parser.add_argument("--masks", nargs="+", default=["causal"], choices=inspect.MASKS)
    parser.add_argument("--mma-only", action="store_true", help="sm90: the mma.sync kernels instead of wgmma")
    parser.add_argument("--seq-len", type=int, default=4096,
                        help="N of the call (an array mask is shaped [1, 1, N, N])")
    parser.add_argument("--fused-dq", choices=["table", "on", "off"], default="table",
                        help="sm90: the wgmma dK/dV kernel accumulates dQ as the table says for --seq-len, or forced on / off")
    parser.add_argument("--sinks", action="store_true",
                        help="calls with attention sinks (the forward and dQ kernels compile them in)")
    parser.add_argument("--head-splits", type=int, default=None,
                        help="compile the dK/dV kernels for a call of 4 query heads per kv head split over this many "
                             "CTAs (the head_split variant; default: the table's choice for one MHA call)")
    parser.add_argument("--tuning", nargs="+", type=parse_tuning, default=[],
                        help="fields of cuda_source.Tuning on top of the others, e.g. "
                             "\"blocks={'backward_key_value_wgmma': (192, 64, 64, 12)}\"")
    parser.add_argument("--out", help="write each kernel's PTX here")
    args = parser.parse_args(argv)
    if shutil.which("nvcc") is None:
        print("no nvcc")
        return 2
    fused = {"table": None, "on": True, "off": False}[args.fused_dq]
    tuning = (cuda_source.Tuning(wgmma_forward=False, wgmma_backward=False, head_splits=args.head_splits)
              if args.mma_only else cuda_source.Tuning(fused_query=fused, head_splits=args.head_splits))
    if args.tuning:
        tuning = dataclasses.replace(tuning, **dict(args.tuning))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.families:
            family = cuda_source.family_named(name)
            for head_dim in args.head_dims:
                for mask in args.masks:
                    spec = dataclasses.replace(inspect.make_spec(head_dim, "bfloat16", mask, q_len=args.seq_len,
                                                                 group=4 if args.head_splits else 1),
                                               has_sinks=args.sinks)
                    mask_dtype = {"bool": mx.bool_, "additive": mx.bfloat16}.get(mask)
                    variants = cuda_source.length_sets(cuda_source.VariantFeatures.of(spec), mask_dtype, family,
                                                       tuning, True, planner.active_table("cuda", family.name))
                    for kernel in KERNELS:
                        variant = getattr(variants.pick(spec), kernel)
                        line = compile_variant(variant, ARCHES[name], tmp, args.out)
                        failed |= line.startswith("ERROR") or "SERIALIZED" in line
                        print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

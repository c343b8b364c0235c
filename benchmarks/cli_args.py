"""Command-line argument types shared by the GPU tools (ab_versions.py, ncu_profile.py)."""
from __future__ import annotations

import argparse


def parse_shape(text: str, array_masks: bool = False):
    """"B,H,N,D,mask" or "B,H,N,D,mask,KV_HEADS" (mask: none or causal; with array_masks also bool
    or additive, benchmark.random_mask's [1, 1, N, N] mask) -> a BenchCase of bf16."""
    from mlx_flash import benchmark as bm
    parts = text.split(",")
    masks = ("none", "causal") + (("bool", "additive") if array_masks else ())
    if len(parts) not in (5, 6) or parts[4] not in masks:
        raise argparse.ArgumentTypeError(f"--shapes takes B,H,N,D,mask[,KV_HEADS] with mask one of "
                                         f"{', '.join(masks)}, got {text!r}")
    try:
        b, h, n, d = (int(p) for p in parts[:4])
        kv = int(parts[5]) if len(parts) == 6 else h
        return bm.BenchCase(b, h, kv, n, n, d, "bfloat16", causal=parts[4] == "causal",
                            array_mask=parts[4] if parts[4] in ("bool", "additive") else "none")
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"--shapes {text!r}: {error}") from None


def parse_tuning(text: str):
    """KEY=VALUE with VALUE a Python literal (True, False, None, a number)."""
    import ast
    key, sep, value = text.partition("=")
    try:
        if not sep or not key.isidentifier():
            raise ValueError
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(f"--tuning takes KEY=VALUE with VALUE a Python literal (e.g. "
                                         f"scale_fold=True), got {text!r}") from None


def cuda_backend(tuning):
    """flash_attention's backend for the "cuda" backend with [(KEY, VALUE)] of cuda_source.Tuning
    (parse_tuning's pairs): the name where there are none, else a CUDABackend with them."""
    if not tuning:
        return "cuda"
    from mlx_flash.backends import cuda, cuda_source
    return cuda.CUDABackend(tuning=cuda_source.Tuning(**dict(tuning)))

"""Argument types shared by the `python -m mlx_flash` subcommands: a bad value is an argparse
usage error (exit 2, no traceback)."""
from __future__ import annotations

import argparse

from . import benchmark as bm


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (a bad value is a usage error, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def dtype_argument(text: str) -> str:
    """argparse type: a dtype name or alias (float32/fp32, float16/fp16, bfloat16/bf16)."""
    try:
        return bm.dtype_name(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None

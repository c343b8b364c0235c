"""``#include`` of MLX's shipped Metal headers in kernel sources.

The MLX wheel ships Apple's Metal kernel sources as headers under
``<mlx package>/include/mlx/backend/metal/kernels/`` (sdpa_vector.h, steel
attention and GEMM, softmax, reductions, ...). A kernel body or header may
``#include "mlx/backend/metal/kernels/<file>.h"``; metalsim expands such
includes in place (each file once per kernel, as ``#pragma once``) before the
MSL -> C++ rewrite, so Apple's templates go through the same rewrite as the
kernel's own code. ``#line`` directives keep compiler diagnostics on the
included file's own lines, and :class:`Origins` maps a line of the expanded
text back to (file, line) for metalsim's own errors.

A few MLX headers wrap Metal compiler intrinsics (``__metal_*``) or
overload on address spaces; metalsim's runtime supplies their content
instead (:data:`PROVIDED`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

__all__ = ["expand", "mlx_include_dir", "Origins", "PROVIDED", "IncludeError", "UTILS"]

_KERNELS = "mlx/backend/metal/kernels/"
UTILS = _KERNELS + "utils.h"
# Headers whose content metalsim.hpp provides, and why.
PROVIDED = {
    _KERNELS + "bf16_math.h": "bfloat overloads of the math and SIMD functions through "
                              "Metal compiler intrinsics (__metal_*); metalsim.hpp defines "
                              "them for bfloat",
    _KERNELS + "logging.h": "mlx::os_log (address-space-qualified member functions); "
                            "metalsim.hpp defines a no-op mlx::os_log",
}
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
_PRAGMA_ONCE_RE = re.compile(r"^\s*#\s*pragma\s+once\b")


class IncludeError(ValueError):
    """An #include that cannot be resolved; `line` is 1-based in `file`."""

    def __init__(self, msg: str, file: str, line: int):
        super().__init__(msg)
        self.msg = msg
        self.file = file
        self.line = line


@lru_cache(maxsize=None)
def mlx_include_dir() -> Path | None:
    """``<mlx package>/include``, or None if the installed mlx ships no headers."""
    try:
        import mlx
    except ImportError:  # pragma: no cover - mlx is a dependency
        return None
    for p in getattr(mlx, "__path__", []):
        d = Path(p) / "include"
        if (d / _KERNELS).is_dir():
            return d
    return None


@dataclass
class Origins:
    """(file, line) of every line of an expanded text (1-based lines)."""

    lines: list[tuple[str, int]] = field(default_factory=list)
    files: set[str] = field(default_factory=set)  # MLX headers expanded

    def of(self, line: int) -> tuple[str, int]:
        if 0 < line <= len(self.lines):
            return self.lines[line - 1]
        return ("?", line)


def _resolve(name: str, including: str | None) -> tuple[str, Path] | None:
    root = mlx_include_dir()
    if root is None:
        return None
    cands = [name]
    if including is not None and "/" in including:
        cands.append(os.path.normpath(os.path.join(os.path.dirname(including), name)))
    for c in cands:
        p = root / c
        if p.is_file():
            return c, p
    return None


@lru_cache(maxsize=None)
def _read(path: Path) -> str:
    return path.read_text()


def expand(src: str, label: str, seen: set[str] | None = None) -> tuple[str, Origins]:
    """Expands MLX header includes in `src` (a kernel's header or body).

    `label` names `src` in ``#line`` directives (``kernel_header`` or
    ``kernel_source``); `seen` carries the headers already expanded (header
    and body of one kernel share it). ``#include <metal_*>`` lines are left
    to the rewriter. Raises IncludeError for an include that is neither a
    Metal standard header nor found in MLX's include directory.
    """
    if "include" not in src:
        o = Origins([(label, i + 1) for i in range(src.count("\n") + 1)])
        return src, o
    seen = set() if seen is None else seen
    out: list[str] = []
    org = Origins()
    _expand_into(src, label, None, seen, out, org)
    return "\n".join(out), org


def _expand_into(src: str, label: str, rel: str | None, seen: set[str], out: list[str],
                 org: Origins) -> None:
    lines = src.split("\n")
    for i, line in enumerate(lines):
        m = _INCLUDE_RE.match(line)
        if rel is not None and _PRAGMA_ONCE_RE.match(line):
            out.append("")
            org.lines.append((label, i + 1))
            continue
        if not m or m.group(2).startswith("metal_"):
            out.append(line)
            org.lines.append((label, i + 1))
            continue
        r = _resolve(m.group(2), rel)
        if r is None:
            where = ("" if mlx_include_dir() is not None
                     else " (the installed mlx ships no Metal headers)")
            raise IncludeError(f"cannot find include {m.group(1)}{m.group(2)}"
                               f"{'>' if m.group(1) == '<' else chr(34)}: metalsim resolves "
                               f"MLX's Metal headers (mlx/backend/metal/kernels/...){where}",
                               label, i + 1)
        name, path = r
        # The directive's own line becomes the jump into the file and back.
        if name in seen or name in PROVIDED:
            seen.add(name)
            out.append("")
            org.lines.append((label, i + 1))
            continue
        seen.add(name)
        org.files.add(name)
        out.append(f'#line 1 "{name}"')
        org.lines.append((label, i + 1))
        _expand_into(_read(path), name, name, seen, out, org)
        out.append(f'#line {i + 2} "{label}"')
        org.lines.append((label, i + 1))

"""``metalsim.metal_kernel``: the drop-in for ``mx.fast.metal_kernel``.

A call converts the inputs to numpy buffers (zero-copy where possible),
compiles the kernel variant for the call's dtypes/template arguments (cached
in memory and on disk), launches it on the fiber runtime and wraps the output
buffers back into ``mx.array``s.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from . import compiler, includes, rules
from .rewrite import UnsupportedError, lex, rewrite
from .signature import (MAX_CONSTANT_ARRAY_SIZE, METAL_ATTRIBUTES, InputSpec, KernelSpec, generate,
                        metal_source)
from . import fault  # MLX_FLASH_METALSIM_FAULT (fault.py)

__all__ = ["metal_kernel", "MetalKernel", "MetalSimError", "MetalSimUnsupportedError",
           "MetalSimLanguageError"]

MAX_THREADS_PER_THREADGROUP = 1024
MAX_THREADGROUP_MEMORY = 32768


class MetalSimError(RuntimeError):
    """A kernel failed at run time (out-of-bounds access in bounds-check mode,
    too much threadgroup memory, deadlock)."""


class MetalSimUnsupportedError(compiler.CompileError):
    """The kernel uses MSL that metalsim does not support."""


class MetalSimLanguageError(compiler.CompileError):
    """The kernel breaks a rule of the Metal Shading Language that Apple's compiler enforces
    (rules.py): it would not compile on a Mac."""


# mx dtype -> (MLX type string, numpy storage dtype)
_DTYPES: dict[Any, tuple[str, Any]] = {
    mx.float32: ("float", np.float32),
    mx.float16: ("float16_t", np.float16),
    mx.bfloat16: ("bfloat16_t", np.uint16),
    mx.bool_: ("bool", np.bool_),
    mx.int8: ("int8_t", np.int8),
    mx.int16: ("int16_t", np.int16),
    mx.int32: ("int32_t", np.int32),
    mx.int64: ("int64_t", np.int64),
    mx.uint8: ("uint8_t", np.uint8),
    mx.uint16: ("uint16_t", np.uint16),
    mx.uint32: ("uint32_t", np.uint32),
    mx.uint64: ("uint64_t", np.uint64),
}


def _dtype_info(dt) -> tuple[str, Any]:
    try:
        return _DTYPES[dt]
    except KeyError:
        raise ValueError(f"[metal_kernel] metalsim: unsupported dtype {dt} (Metal has no "
                         "float64/complex kernel arguments)") from None


class _Desc(ctypes.Structure):
    _fields_ = [
        ("thunk", ctypes.c_void_p),
        ("args", ctypes.c_void_p),
        ("grid", ctypes.c_uint * 3),
        ("tg", ctypes.c_uint * 3),
        ("reversed", ctypes.c_int),
        ("nworkers", ctypes.c_int),
        ("stack_size", ctypes.c_size_t),
        ("tg_mem_limit", ctypes.c_size_t),
        ("kernel_name", ctypes.c_char_p),
        ("tg_names", ctypes.c_void_p),
    ]


@dataclass
class _Variant:
    lib: ctypes.CDLL
    thunk: int
    tg_names: int
    spec: KernelSpec
    cpp: str


def _env_flag(name: str) -> str:
    return os.environ.get(name, "").strip().lower()


def _check_mode(check) -> bool:
    if check is None:
        return _env_flag("MLX_FLASH_METALSIM_CHECK") in ("bounds", "1", "true", "yes", "on")
    if isinstance(check, str):
        if check not in ("bounds", "none", "off"):
            raise ValueError(f"metalsim: check must be 'bounds' or None, got {check!r}")
        return check == "bounds"
    return bool(check)


def _metal_version(v) -> int:
    """"3.0" / "3.1" / (3, 1) / 310 -> 310. Default: MLX_FLASH_METALSIM_METAL_VERSION, else
    3.1 (macOS 14, the oldest system MLX >= 0.30 runs on)."""
    if v is None:
        v = os.environ.get("MLX_FLASH_METALSIM_METAL_VERSION", "").strip() or "3.1"
    if isinstance(v, tuple):
        v = f"{v[0]}.{v[1]}"
    if isinstance(v, int) and v >= 200:
        n = v
    else:
        try:
            major, minor = str(v).split(".")
            n = int(major) * 100 + int(minor) * 10
        except ValueError:
            n = -1
    if not 200 <= n <= 400:
        raise ValueError(f"metalsim: metal_version must be a Metal language version such as "
                         f"'3.0' or '3.1', got {v!r}")
    return n


def _reversed_order(order) -> bool:
    o = order if order is not None else (_env_flag("MLX_FLASH_METALSIM_ORDER") or "forward")
    if o not in ("forward", "reversed"):
        raise ValueError(f"metalsim: thread order must be 'forward' or 'reversed', got {o!r}")
    return o == "reversed"


def _parse_compile_options(opts) -> dict:
    if opts is None:
        return {}
    if not isinstance(opts, dict):
        raise ValueError("[metal_kernel] Expected `compile_options` to be a dict.")
    for k, v in opts.items():
        if k != "math_mode":
            raise ValueError(f"[metal_kernel] Unknown compile option `{k}`.")
        if v not in ("safe", "relaxed", "fast"):
            raise ValueError("[metal_kernel] Expected math_mode to be 'safe', 'relaxed', or 'fast'.")
    return dict(opts)


def _as_mx(x) -> mx.array:
    if isinstance(x, mx.array):
        return x
    if isinstance(x, (bool, int, float, np.generic, np.ndarray)):
        return mx.array(x)
    raise TypeError(f"[metal_kernel] inputs must be arrays or scalars, got {type(x).__name__}")


def _read_input(a: mx.array, kernel_name: str) -> np.ndarray:
    """The input's values as numpy (evaluating it). Under mx.compile or mx.vmap MLX cannot
    evaluate while tracing, and the simulator has nothing else to run on: say so clearly."""
    try:
        return np.asarray(a)
    except ValueError as e:
        if "function transformations" not in str(e):
            raise
        raise MetalSimError(
            f"metalsim: kernel '{kernel_name}' was called inside mx.compile or mx.vmap. The "
            "simulator runs a kernel eagerly on numpy copies of its inputs, which MLX cannot "
            "evaluate while it traces a function; call the kernel outside mx.compile / mx.vmap "
            f"(MLX's message: {e})") from None


def _poison(buf: np.ndarray, dt) -> None:
    """Fills an output buffer with a recognisable garbage pattern (MLX leaves
    outputs uninitialised): NaN for floating types, 0xDEADBEEF for ints."""
    if dt in (mx.float32, mx.float16):
        buf.fill(np.nan)
    elif dt == mx.bfloat16:
        buf.fill(0x7FC0)  # bfloat16 NaN
    elif dt == mx.bool_:
        buf.fill(True)
    else:
        size = buf.dtype.itemsize
        pattern = {1: 0xEF, 2: 0xBEEF, 4: 0xDEADBEEF, 8: 0xDEADBEEFDEADBEEF}[size]
        buf.view(f"u{size}").fill(pattern)


def _fill(buf: np.ndarray, dt, value: float) -> None:
    if dt == mx.bfloat16:
        bits = mx.array(value, mx.float32).astype(mx.bfloat16).view(mx.uint16).item()
        buf.fill(bits)
    else:
        buf.fill(np.asarray(value).astype(buf.dtype))


class MetalKernel:
    """A kernel built from an MSL body; call it like an MLX metal_kernel."""

    def __init__(self, name: str, input_names: Sequence[str], output_names: Sequence[str],
                 source: str, header: str = "", ensure_row_contiguous: bool = True,
                 atomic_outputs: bool = False, compile_options: dict | None = None,
                 thread_order: str | None = None, check: str | bool | None = None,
                 function_constants: dict | None = None, metal_version=None):
        if not output_names:
            raise ValueError("[metal_kernel] Must specify at least one output.")
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.ensure_row_contiguous = ensure_row_contiguous
        self.atomic_outputs = atomic_outputs
        self.compile_options = _parse_compile_options(compile_options)
        self.thread_order = thread_order
        self.check = check
        self.function_constants = dict(function_constants or {})
        self.metal_version = metal_version
        _reversed_order(thread_order)
        _metal_version(metal_version)  # validate early
        # MLX's rules: substring search in the body only.
        self._shape_info = [(n + "_shape" in source, n + "_strides" in source, n + "_ndim" in source)
                            for n in self.input_names]
        self._attributes = tuple((a, t) for a, t in METAL_ATTRIBUTES if a in source)
        self._variants: dict[tuple, _Variant] = {}
        self._lock = threading.Lock()
        self._rewritten: dict[tuple, tuple[str, str, list[str], bool]] = {}

    # -- compilation ---------------------------------------------------------
    def _rewrite(self, check: bool, version: int) -> tuple[str, str, list[str], bool]:
        """(header C++, body C++, threadgroup site names, whether MLX's utils.h
        was included) for bounds checking `check` and Metal `version`."""
        r = self._rewritten.get((check, version))
        if r is None:
            seen: set[str] = set()
            parts = []
            site_base = 0
            for label, what, src in (("kernel_header", "header", self.header),
                                     ("kernel_source", "source", self.source)):
                try:
                    text, org = includes.expand(src, label, seen)
                except includes.IncludeError as e:
                    raise MetalSimUnsupportedError(
                        f"metalsim: kernel '{self.name}' {what} line {e.line}: {e.msg}") from None
                try:
                    toks = lex(text)
                    rules.check(text, kernel_scope=label == "kernel_source", tokens=toks,
                                metal_version=version)
                except UnsupportedError as e:
                    f, ln = org.of(e.line)
                    where = {"kernel_header": "header", "kernel_source": "source"}.get(f, f)
                    raise MetalSimUnsupportedError(
                        f"metalsim: kernel '{self.name}' {where} line {ln}: {e.msg}") from None
                except rules.MSLRuleError as e:
                    f, ln = org.of(e.line)
                    where = {"kernel_header": "header", "kernel_source": "source"}.get(f, f)
                    raise MetalSimLanguageError(
                        f"metalsim: kernel '{self.name}' {where} line {ln}: {e}") from None
                try:
                    res = rewrite(text, check=check, site_base=site_base,
                                  function_constants=self.function_constants, tokens=toks)
                except UnsupportedError as e:
                    f, ln = org.of(e.line)
                    where = {"kernel_header": "header", "kernel_source": "source"}.get(f, f)
                    raise MetalSimUnsupportedError(
                        f"metalsim: kernel '{self.name}' {where} line {ln}: {e.msg}") from None
                site_base += len(res.tg_sites)
                parts.append(res)
            h, b = parts
            bound = set(h.function_constants + b.function_constants)
            unknown = set(self.function_constants) - bound
            if unknown:
                raise ValueError(
                    f"metalsim: kernel '{self.name}': function_constants {sorted(unknown)} are "
                    "not declared (`constant T name [[function_constant(i)]];`) in its header "
                    "or source")
            r = (h.text, b.text, h.tg_sites + b.tg_sites, includes.UTILS in seen)
            self._rewritten[(check, version)] = r
        return r

    def _variant(self, key: tuple, spec: KernelSpec) -> _Variant:
        v = self._variants.get(key)
        if v is not None:
            return v
        with self._lock:
            v = self._variants.get(key)
            if v is None:
                version = key[-1]
                header_cpp, body_cpp, tg_names, mlx_utils = self._rewrite(spec.check, version)
                cpp = generate(spec, body_cpp, header_cpp, tg_names, mlx_utils=mlx_utils,
                               metal_version=version)
                lib = compiler.compile_kernel(cpp, self.name, self.source, self.header)
                thunk = ctypes.cast(lib.msim_thunk, ctypes.c_void_p).value
                names = ctypes.addressof(ctypes.c_void_p.in_dll(lib, "msim_tg_names"))
                v = _Variant(lib, thunk, names, spec, cpp)
                self._variants[key] = v
        return v

    # -- call ----------------------------------------------------------------
    def __call__(self, *, inputs: Sequence[Any], output_shapes: Sequence[Sequence[int]],
                 output_dtypes: Sequence[Any], grid: Sequence[int], threadgroup: Sequence[int],
                 template: Sequence[tuple[str, Any]] | None = None,
                 init_value: float | None = None, verbose: bool = False, stream=None):
        def check_size(actual, expected, what):
            if actual != expected:
                raise ValueError(f"[metal_kernel] Expected `{what}` to have size {expected} "
                                 f"but got size {actual}.")

        check_size(len(inputs), len(self.input_names), "inputs")
        check_size(len(output_shapes), len(self.output_names), "output_shapes")
        check_size(len(output_dtypes), len(self.output_names), "output_dtypes")
        grid = tuple(int(g) for g in grid)
        tg = tuple(int(t) for t in threadgroup)
        if len(grid) != 3 or len(tg) != 3:
            raise ValueError("[metal_kernel] grid and threadgroup must be 3-tuples")
        check = _check_mode(self.check)

        # Inputs -> numpy views (kept alive in `keep` until the launch ends).
        arrs = [_as_mx(x) for x in inputs]
        tmpl = []
        for tname, val in template or ():
            if isinstance(val, (bool, np.bool_)):
                tmpl.append((tname, "bool", "true" if val else "false"))
            elif isinstance(val, (int, np.integer)):
                tmpl.append((tname, "int", str(int(val))))
            elif isinstance(val, mx.Dtype):
                tmpl.append((tname, "typename", _dtype_info(val)[0]))
            else:
                raise ValueError("[metal_kernel] Invalid template argument. Must be "
                                 "`mlx.core.Dtype`, `int` or `bool`.")
        in_specs = []
        for n, a, (sh, st, nd) in zip(self.input_names, arrs, self._shape_info):
            # Only "0-d or not" and "fewer than 8 elements or not" shape the generated
            # code, so the variant cache key keeps just that (new lengths reuse a variant).
            in_specs.append(InputSpec(n, _dtype_info(a.dtype)[0], min(a.ndim, 1),
                                      min(a.size, MAX_CONSTANT_ARRAY_SIZE), sh, st, nd))
        out_ct = tuple((n, _dtype_info(d)[0]) for n, d in zip(self.output_names, output_dtypes))
        spec = KernelSpec(self.name, tuple(in_specs), out_ct, tuple(tmpl), self._attributes,
                          self.atomic_outputs, check)
        key = (spec.inputs, spec.outputs, spec.template, check,
               _metal_version(self.metal_version))
        if verbose:
            print(f"Generated source code for `{self.name}`:\n```\n"
                  f"{metal_source(spec, self.source, self.header)}\n```")
        fault.before_compile(self.name, self.source)  # MLX_FLASH_METALSIM_FAULT=compile:...
        variant = self._variant(key, spec)

        tg_size = tg[0] * tg[1] * tg[2]
        if tg_size > MAX_THREADS_PER_THREADGROUP:
            raise ValueError(
                f"[metal_kernel] Thread group size ({tg_size}) is greater than  the maximum "
                f"allowed threads per threadgroup ({MAX_THREADS_PER_THREADGROUP}).")
        if min(tg) <= 0 and min(grid) > 0:
            raise ValueError("[metal_kernel] threadgroup dimensions must be positive")

        keep: list[np.ndarray] = []
        ptrs: list[int] = []
        bounds: list[int] = []

        def add(buf: np.ndarray, lo: int = 0, hi: int | None = None):
            keep.append(buf)
            ptrs.append(buf.ctypes.data)
            bounds.extend((lo, buf.nbytes if hi is None else hi))

        for a, inp in zip(arrs, in_specs):
            src = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
            # numpy's view of an MLX array is MLX's own layout: its data at the array's offset and
            # its element strides, which is what MLX binds and passes as <name>_strides when
            # ensure_row_contiguous is False (custom_kernel.cpp). Bounds [lo, hi) below are the
            # bytes the view can reach from that pointer, not the buffer under it.
            buf = _read_input(src, self.name)
            if self.ensure_row_contiguous or a.ndim == 0:
                buf = np.ascontiguousarray(buf)
            if inp.ndim == 0:
                add(buf)
                continue
            item = buf.itemsize
            estrides = [s // item for s in buf.strides]
            lo = sum(s * (d - 1) for s, d in zip(buf.strides, buf.shape) if s < 0 and d > 0)
            hi = sum(s * (d - 1) for s, d in zip(buf.strides, buf.shape) if s > 0 and d > 0) + item
            if buf.size == 0:
                lo = hi = 0
            add(buf, lo, hi)
            if inp.shape:
                add(np.asarray(buf.shape, dtype=np.int32))
            if inp.strides:
                add(np.asarray(estrides, dtype=np.int64))
            if inp.ndim_ref:
                add(np.asarray(a.ndim, dtype=np.int32))
        outs: list[np.ndarray] = []
        for shape, dt in zip(output_shapes, output_dtypes):
            o = np.empty(tuple(int(s) for s in shape), dtype=_dtype_info(dt)[1])
            if init_value is not None:
                _fill(o, dt, init_value)
            else:
                _poison(o, dt)
            outs.append(o)
            add(o)
        bnd = np.asarray(bounds, dtype=np.int64)
        keep.append(bnd)
        args = (ctypes.c_void_p * (len(ptrs) + 1))(*ptrs, bnd.ctypes.data)

        # MLX clamps each threadgroup dimension to the grid (dispatchThreads).
        tgc = tuple(min(t, g) for t, g in zip(tg, grid))
        if min(grid) > 0:
            self._launch(variant, args, grid, tgc)
            threadgroups = int(np.prod([-(-g // t) for g, t in zip(grid, tgc)]))
            fault.after_launch(self.name, outs, output_dtypes, threadgroups)  # ...=corrupt:...
        res = []
        for o, dt in zip(outs, output_dtypes):
            r = mx.array(o)
            if dt == mx.bfloat16:
                r = r.view(mx.bfloat16)
            res.append(r)
        return res

    def _launch(self, v: _Variant, args, grid, tg) -> None:
        rt = compiler.load_runtime()
        nworkers = int(os.environ.get("MLX_FLASH_METALSIM_THREADS", "0") or 0) or (os.cpu_count() or 1)
        stack_kb = int(os.environ.get("MLX_FLASH_METALSIM_STACK_KB", "0") or 0) or 128
        d = _Desc()
        d.thunk = v.thunk
        d.args = ctypes.cast(args, ctypes.c_void_p).value
        d.grid[:] = grid
        d.tg[:] = tg
        d.reversed = 1 if _reversed_order(self.thread_order) else 0
        d.nworkers = nworkers
        d.stack_size = stack_kb * 1024
        d.tg_mem_limit = MAX_THREADGROUP_MEMORY
        d.kernel_name = self.name.encode()
        d.tg_names = v.tg_names
        err = ctypes.create_string_buffer(2048)
        if rt.msim_rt_launch(ctypes.byref(d), err, len(err)) != 0:
            raise MetalSimError(err.value.decode(errors="replace"))


def metal_kernel(name: str, input_names: Sequence[str], output_names: Sequence[str], source: str,
                 header: str = "", ensure_row_contiguous: bool = True, atomic_outputs: bool = False,
                 compile_options: dict | None = None, *, thread_order: str | None = None,
                 check: str | bool | None = None,
                 function_constants: dict | None = None, metal_version=None) -> MetalKernel:
    """Same arguments as ``mx.fast.metal_kernel`` plus metalsim options:

    thread_order: ``"forward"`` (default) or ``"reversed"``: the order in
        which the threads of a threadgroup run between synchronisation points.
        Reversed order exposes missing barriers. Default from
        ``MLX_FLASH_METALSIM_ORDER``.
    check: ``"bounds"`` compiles device pointers and threadgroup arrays as
        bounds-checked wrappers; an out-of-bounds access raises
        :class:`MetalSimError`. Default from ``MLX_FLASH_METALSIM_CHECK``.
    function_constants: values of the program-scope function constants
        (``constant bool name [[function_constant(i)]];``) that the kernel's
        header declares, by name (Metal sets them on the pipeline, which
        ``mx.fast.metal_kernel`` does not expose; Apple's kernels from MLX's
        headers use them).
    metal_version: the Metal language version to compile for, ``"3.1"`` (macOS 14, the
        default; from ``MLX_FLASH_METALSIM_METAL_VERSION``) or ``"3.0"`` (macOS 13: no native
        ``bfloat``, ``bfloat16_t`` is MLX's portable 16-bit struct), ``"3.2"``, ...
    """
    return MetalKernel(name, input_names, output_names, source, header, ensure_row_contiguous,
                       atomic_outputs, compile_options, thread_order=thread_order, check=check,
                       function_constants=function_constants, metal_version=metal_version)

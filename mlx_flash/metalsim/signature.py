"""Kernel signature generation, following MLX's ``mx.fast.metal_kernel``.

MLX builds a full Metal function around the user's body (see
mlx/backend/common/metal_kernel.cpp, ``write_signature``):

* the template parameters (``template <typename T, int N, bool B>``);
* each input as ``const device T* name`` (``const constant T* name`` when it
  has fewer than 8 elements, ``const constant T& name`` for a 0-d array),
  followed by ``const constant int* name_shape``, ``const constant int64_t*
  name_strides`` and ``const constant int& name_ndim`` when the *body*
  mentions them (a plain substring search, as MLX does) and the input is not
  0-d;
* each output as ``device T* name`` (``device atomic<T>* name`` with
  ``atomic_outputs``);
* the thread attributes the body mentions (substring search again).

This module produces that Metal text (shown by ``verbose=True``) and the C++
translation compiled by metalsim, plus the ``msim_thunk`` entry point that
unpacks the launch arguments for each fiber.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["METAL_ATTRIBUTES", "InputSpec", "KernelSpec", "generate"]

# (name, type) exactly as MLX lists them.
METAL_ATTRIBUTES = [
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
]

MAX_CONSTANT_ARRAY_SIZE = 8  # MLX: smaller inputs go to the constant space


@dataclass(frozen=True)
class InputSpec:
    name: str
    ctype: str  # MLX type string: float, float16_t, bfloat16_t, int32_t, ...
    ndim: int
    size: int
    shape: bool  # body mentions name_shape
    strides: bool
    ndim_ref: bool


@dataclass(frozen=True)
class KernelSpec:
    name: str  # user's kernel name
    inputs: tuple[InputSpec, ...]
    outputs: tuple[tuple[str, str], ...]  # (name, ctype)
    template: tuple[tuple[str, str, str], ...]  # (name, kind: typename/int/bool, value text)
    attributes: tuple[tuple[str, str], ...]  # (name, type) used by the body
    atomic_outputs: bool
    check: bool


def kernel_function_name(spec: KernelSpec) -> str:
    """MLX's generated name: custom_kernel_<name>[_<template hash>]_<dtypes>."""
    n = "custom_kernel_" + spec.name
    if spec.template:
        n += "_" + "_".join(v for _, _, v in spec.template)
    for i in spec.inputs:
        n += "_" + i.ctype + ("s" if i.ndim == 0 else ("c" if i.size < MAX_CONSTANT_ARRAY_SIZE else ""))
    for _, ct in spec.outputs:
        n += "_" + ct
    return n


def _params(spec: KernelSpec, metal: bool) -> list[str]:
    """Parameter declarations in MLX's order (Metal text or metalsim C++)."""
    ps: list[str] = []
    idx = 0

    def ptr(t: str, space: str, const: bool) -> str:
        if metal:
            return f"{'const ' if const else ''}{space} {t}*"
        if spec.check:
            return f"msim::dptr<{'const ' if const else ''}{t}>"
        return f"{'const ' if const else ''}{t}*"

    def attr(i: int) -> str:
        return f" [[buffer({i})]]" if metal else ""

    for inp in spec.inputs:
        space = "constant" if inp.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        if inp.ndim == 0:
            t = f"const constant {inp.ctype}&" if metal else f"const {inp.ctype}&"
            ps.append(f"{t} {inp.name}{attr(idx)}")
        else:
            ps.append(f"{ptr(inp.ctype, space, True)} {inp.name}{attr(idx)}")
        idx += 1
        if inp.ndim > 0:
            if inp.shape:
                ps.append(f"{ptr('int', 'constant', True)} {inp.name}_shape{attr(idx)}")
                idx += 1
            if inp.strides:
                ps.append(f"{ptr('int64_t', 'constant', True)} {inp.name}_strides{attr(idx)}")
                idx += 1
            if inp.ndim_ref:
                t = "const constant int&" if metal else "const int&"
                ps.append(f"{t} {inp.name}_ndim{attr(idx)}")
                idx += 1
    for name, ct in spec.outputs:
        t = f"atomic<{ct}>" if spec.atomic_outputs else ct
        ps.append(f"{ptr(t, 'device', False)} {name}{attr(idx)}")
        idx += 1
    for name, typ in spec.attributes:
        ps.append(f"{typ} {name}" + (f" [[{name}]]" if metal else ""))
    return ps


def _template_head(spec: KernelSpec) -> str:
    if not spec.template:
        return ""
    return "template <" + ", ".join(f"{kind} {name}" for name, kind, _ in spec.template) + ">\n"


def _template_args(spec: KernelSpec) -> str:
    if not spec.template:
        return ""
    return "<" + ", ".join(v for _, _, v in spec.template) + ">"


def metal_source(spec: KernelSpec, source: str, header: str) -> str:
    """The Metal source MLX would compile (for verbose=True)."""
    fname = kernel_function_name(spec)
    out = header + _template_head(spec)
    out += f"[[kernel]] void {fname}(\n  " + ",\n  ".join(_params(spec, True)) + ") {\n"
    out += source + "\n}\n"
    if spec.template:
        inst = fname + _template_args(spec)
        out += (f'\ntemplate [[host_name("{fname}")]] [[kernel]] decltype({inst}) {inst};\n')
    return out


def generate(spec: KernelSpec, body_cpp: str, header_cpp: str, tg_names: list[str],
             mlx_utils: bool = False, metal_version: int = 310) -> str:
    """The C++ translation unit metalsim compiles for one kernel variant.

    `body_cpp`/`header_cpp` are already rewritten (rewrite.py); #line
    directives map diagnostics back to the user's source lines. `mlx_utils`:
    the header includes MLX's kernels/utils.h (its Limits, elem_to_loc, ...
    replace metalsim's subset). `metal_version`: the Metal language version compiled for
    (e.g. 300 = Metal 3.0: bfloat16_t is then MLX's portable struct, not native bfloat).
    """
    fname = kernel_function_name(spec)
    params = _params(spec, False)
    # With MLX's own utils.h included, metalsim.hpp leaves out its subset of it.
    lines = [f"#define MSIM_METAL_VERSION {metal_version}"] + (
        ["#define MSIM_MLX_UTILS 1"] if mlx_utils else []) + [
        '#include "metalsim.hpp"', '#line 1 "kernel_header"', header_cpp, ""]
    gen: list[str] = []
    gen.append(_template_head(spec).rstrip("\n"))
    gen.append(f"void {fname}(\n    " + ",\n    ".join(params) + ") {")
    lines.append('#line 1 "metalsim_generated"')
    lines.extend(x for x in gen if x)
    lines.append('#line 1 "kernel_source"')
    lines.append(body_cpp)
    lines.append('#line 1 "metalsim_generated_thunk"')
    lines.append("}")
    # The thunk: b[i] are the argument pointers in parameter order; in
    # bounds-check mode b[nargs] points at [lo, hi) byte bounds per argument.
    nbuf = len(params) - len(spec.attributes)
    args: list[str] = []
    k = 0

    def buf(ct: str, const: bool, name: str) -> str:
        nonlocal k
        c = "const " if const else ""
        if spec.check:
            s = (f'msim::dptr<{c}{ct}>(({c}{ct}*)b[{k}], b[{k}], bnd[{2 * k}], bnd[{2 * k + 1}], '
                 f'"{name}")')
        else:
            s = f"({c}{ct}*)b[{k}]"
        k += 1
        return s

    def ref(ct: str) -> str:
        nonlocal k
        s = f"*(const {ct}*)b[{k}]"
        k += 1
        return s

    for inp in spec.inputs:
        if inp.ndim == 0:
            args.append(ref(inp.ctype))
            continue
        args.append(buf(inp.ctype, True, inp.name))
        if inp.shape:
            args.append(buf("int", True, inp.name + "_shape"))
        if inp.strides:
            args.append(buf("int64_t", True, inp.name + "_strides"))
        if inp.ndim_ref:
            args.append(ref("int"))
    for name, ct in spec.outputs:
        args.append(buf(f"atomic<{ct}>" if spec.atomic_outputs else ct, False, name))
    assert k == nbuf
    for name, _ in spec.attributes:
        args.append(f"a->{name}")
    lines.append(
        'extern "C" __attribute__((visibility("default"))) void msim_thunk('
        "void* const* b, const msim_attrs* a) {")
    lines.append(f"  const long long* bnd = (const long long*)b[{nbuf}];")
    lines.append("  (void)bnd;")
    lines.append(f"  {fname}{_template_args(spec)}(\n      " + ",\n      ".join(args) + ");")
    lines.append("}")
    names = ", ".join('"' + n + '"' for n in tg_names) or '"?"'
    lines.append(
        'extern "C" __attribute__((visibility("default"))) const char* const '
        f"msim_tg_names[] = {{{names}, nullptr}};")
    return "\n".join(lines) + "\n"

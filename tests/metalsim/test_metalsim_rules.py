"""MSL language rules (rules.py): each rejects code Apple's compiler rejects, naming the kernel
and line; Apple's kernels from MLX's headers and the project's kernels pass them all."""

from types import SimpleNamespace

import mlx.core as mx
import pytest

from mlx_flash import metalsim
from mlx_flash.backends import metal_source
from mlx_flash.metalsim import includes, rules

# (rule, header, body, line of the violation in the header (h) or body (b))
NEGATIVE = [
    ("double", "", "double x = inp[0];\nout[0] = x;", ("source", 1)),
    ("double", "", "out[0] = inp[0];\nlong double y = 0;", ("source", 2)),
    ("double", "", "long long n = 3;\nout[0] = inp[0] * n;", ("source", 1)),
    ("allocation", "", "float* p = new float[4];", ("source", 1)),
    ("allocation", "inline void f(thread float* p) {\n  delete p;\n}", "out[0] = inp[0];",
     ("header", 2)),
    ("allocation", "", "thread float* p = (thread float*)malloc(16);", ("source", 1)),
    ("virtual", "struct A {\n  virtual float f() { return 0; }\n};", "out[0] = inp[0];",
     ("header", 2)),
    ("exceptions", "", "if (inp[0] < 0) throw 1;\nout[0] = inp[0];", ("source", 1)),
    ("exceptions", "", "try { out[0] = inp[0]; } catch (...) {}", ("source", 1)),
    ("goto", "", "goto done;\ndone:\nout[0] = inp[0];", ("source", 1)),
    ("rtti", "struct A {};\nstruct B : A {};", "\nauto t = typeid(B());", ("source", 2)),
    ("storage", "", "thread_local int n = 0;", ("source", 1)),
    ("storage", "", "register int n = 0;", ("source", 1)),
    ("main", "\nvoid main() {}", "out[0] = inp[0];", ("header", 2)),
    ("recursion", "inline float fact(float n) {\n  return n <= 1 ? 1 : n * fact(n - 1);\n}",
     "out[0] = fact(inp[0]);", ("header", 2)),
    ("address_space", "inline float first(const float* p) { return p[0]; }",
     "out[0] = first(inp);", ("header", 1)),
    ("address_space", "", "uint i = thread_position_in_grid.x;\nconst float* p = inp + i;\n"
     "out[i] = p[0];", ("source", 2)),
    ("threadgroup_scope", "inline void stage(float x) {\n  threadgroup float buf[32];\n"
     "  buf[0] = x;\n}", "stage(inp[0]);\nout[0] = inp[0];", ("header", 2)),
]


@pytest.mark.parametrize("rule,header,body,where", NEGATIVE,
                         ids=[f"{r[0]}-{i}" for i, r in enumerate(NEGATIVE)])
def test_rule_rejects(rule, header, body, where):
    k = metalsim.metal_kernel(name=f"bad_{rule}", input_names=["inp"], output_names=["out"],
                              header=header, source=body)
    with pytest.raises(metalsim.MetalSimLanguageError) as e:
        k(inputs=[mx.ones(4)], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(4,)],
          output_dtypes=[mx.float32])
    msg = str(e.value)
    assert f"kernel 'bad_{rule}' {where[0]} line {where[1]}:" in msg, msg
    assert rules.RULES[rule][1] in msg and "Metal Shading Language Specification" in msg


def test_allowed_lookalikes():
    """Code that resembles a violation but is Metal: multiplications, deleted functions,
    overloads calling each other, threadgroup memory in the kernel, qualified pointers."""
    header = """
struct NoCopy { NoCopy() = default; NoCopy(const thread NoCopy&) = delete; };
inline float twice(float x) { return 2 * x; }
inline float twice(int x) { return twice(float(x)); }
inline float get(const device float* p, int i) { return p[i]; }
"""
    body = """
uint i = thread_position_in_grid.x;
threadgroup float tile[32];
const device float* p = inp + i;
float scale = twice(int(2)) * p[0];
short2 v(i * 2, i);
tile[i] = get(inp, i) * scale + float(v.y) * 0;
threadgroup_barrier(mem_flags::mem_threadgroup);
out[i] = tile[i];
"""
    k = metalsim.metal_kernel(name="fine", input_names=["inp"], output_names=["out"],
                              header=header, source=body)
    x = mx.arange(4, dtype=mx.float32)
    out = k(inputs=[x], grid=(4, 1, 1), threadgroup=(4, 1, 1), output_shapes=[(4,)],
            output_dtypes=[mx.float32])[0]
    assert out.tolist() == (x * x * 4).tolist()


APPLE_HEADERS = [
    ["utils.h", "softmax.h"], ["utils.h", "logsumexp.h"],
    ["utils.h", "reduce_utils.h", "reduce.h"], ["utils.h", "sdpa_vector.h"],
    ["utils.h", "steel/attn/kernels/steel_attention.h"],
    ["utils.h", "steel/gemm/gemm.h", "steel/gemm/kernels/steel_gemm_fused.h"],
]


@pytest.mark.skipif(includes.mlx_include_dir() is None, reason="mlx ships no Metal headers")
@pytest.mark.parametrize("headers", APPLE_HEADERS, ids=lambda h: h[-1])
def test_apples_kernels_pass_the_rules(headers):
    src = "".join(f'#include "mlx/backend/metal/kernels/{h}"\n' for h in headers)
    text, _ = includes.expand(src, "kernel_header", set())
    rules.check(text, kernel_scope=False)


@pytest.mark.parametrize("kernel", sorted(metal_source.TEMPLATES))
@pytest.mark.parametrize("head_dim,dtype,family", [(64, mx.float16, "m3"), (128, mx.bfloat16, "m1"),
                                                   (96, mx.float32, "m3"), (256, mx.float16, "m1")])
@pytest.mark.parametrize("features", [dict(mask_kind="additive", causal=True, window=4,
                                           softcap=30.0),
                                      dict(mask_kind="bool", causal=False, window=None,
                                           softcap=None)], ids=["additive", "bool"])
def test_our_kernels_pass_the_rules(kernel, head_dim, dtype, family, features):
    spec = SimpleNamespace(head_dim=head_dim, dtype=dtype, has_sinks=kernel != "backward_key_value", **features)
    body, header = metal_source.source(metal_source.make_variant(kernel, spec, family))
    for version in (300, 310):  # bf16 too: only MLX's bfloat16_t, never native bfloat
        rules.check(header, kernel_scope=False, metal_version=version)
        rules.check(body, kernel_scope=True, metal_version=version)

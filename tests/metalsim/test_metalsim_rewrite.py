"""metalsim tokenizer and source rewriter (pure Python, no compiler needed)."""

import pytest

from mlx_flash.metalsim.rewrite import UnsupportedError, rewrite
from mlx_flash.metalsim.tokenizer import tokenize


def squash(s: str) -> str:
    return " ".join(s.split())


SAMPLE = r'''
#include <metal_stdlib>
#define TWICE(x) ((x) * 2.0)
// comment with float4(1, 2) and threadgroup float x[3];
/* block
   comment */ const char* s = "float4(1,2) \" 1.5";
threadgroup float tile[32][33], acc;
uint i = thread_position_in_grid.x;  float y = 1.5h + .5 + 1e-3 + 0x1p-2 + 2.0f + 3;
float4 a = float4(1.0, v.xy, 2), b(1, 2, 3, 4), c{a.x, 1, 2, 3};
half4 h = (half4)a + static_cast<half4>(b);
vec<float, 2> w = vec<float, 2>(1.0f, 2.f);
const device float4* p = (const device float4*)inp;
const constant float& k = scale;
auto q = reinterpret_cast<device float*>(out);
threadgroup float* tp = &tile[0][0];
constant constexpr int BM = 32;
'''


def test_tokenizer_round_trip_and_lines():
    toks = tokenize(SAMPLE)
    assert "".join(t.text for t in toks) == SAMPLE
    kinds = {t.kind for t in toks}
    assert {"pp", "define", "ppend", "comment", "string", "number", "ident", "punct"} <= kinds
    tile = next(t for t in toks if t.text == "tile")
    assert tile.line == SAMPLE[: SAMPLE.index("tile")].count("\n") + 1


def test_rewrite_preserves_line_count():
    for check in (False, True):
        out = rewrite(SAMPLE, check=check).text
        assert out.count("\n") == SAMPLE.count("\n")
        for a, b in zip(out.split("\n"), SAMPLE.split("\n")):  # same content on the same line
            if "comment" in b or b.startswith("#"):
                continue
            if "tile" in b:
                assert "tile" in a


def test_rewrite_unchecked():
    out = rewrite(SAMPLE).text
    lines = out.split("\n")
    assert lines[1] == ""  # metal_stdlib include dropped
    assert "#define TWICE(x) ((x) * 2.0f)" in out
    assert "comment with float4(1, 2) and threadgroup float x[3];" in out  # comments untouched
    assert '"float4(1,2) \\" 1.5"' in out  # strings untouched
    assert ("auto& tile = msim::tg_ref<float[32][33]>(msim::tg_alloc(0, sizeof(float[32][33]), "
            "alignof(float[32][33])))") in out
    assert "auto& acc = msim::tg_ref<float>(msim::tg_alloc(1, sizeof(float), alignof(float)))" in out
    assert "((half)1.5f) + .5f + 1e-3f + 0x1p-2f + 2.0f + 3;" in out
    assert ("float4 a = msim::vctor<float4>(1.0f, v.xy, 2), b = msim::vctor<float4>(1, 2, 3, 4), "
            "c = msim::vctor<float4>(a.x, 1, 2, 3);") in squash(out)
    assert "half4 h = msim::vctor<half4>(a) + msim::vctor<half4>(b);" in squash(out)
    assert "vec<float, 2> w = msim::vctor<vec<float, 2>>(1.0f, 2.f);" in out
    assert "const float4* p = (const float4*)inp;" in squash(out)
    assert "const float& k = scale;" in squash(out)
    assert "auto q = reinterpret_cast< float*>(out);" in squash(out)
    assert "float* tp = &tile[0][0];" in squash(out)
    assert "constexpr int BM = 32;" in squash(out)


def test_rewrite_checked_pointers():
    out = squash(rewrite(SAMPLE, check=True).text)
    assert 'auto tile = msim::tg_check<float[32][33]>(' in out and '"tile")' in out
    assert "msim::dptr<const float4> p = msim::ptr_cast<const float4>( inp);" in out
    assert "auto q = msim::ptr_cast<float> (out);" in out
    assert "msim::dptr<float> tp = &tile[0][0];" in out
    assert "const float& k = scale;" in out  # references stay references


def test_threadgroup_site_numbering_and_names():
    r = rewrite("threadgroup half a[4];\nthreadgroup atomic<int> n;\n", site_base=3)
    assert r.tg_sites == ["a", "n"]
    assert "tg_alloc(3," in r.text and "tg_alloc(4," in r.text
    assert "msim::tg_ref<atomic<int>>" in r.text


def test_function_prototypes_are_not_constructor_calls():
    src = "float4 f(float4 a, float b);\nfloat4 g(float4 a) { return a; }\nvoid h() { float4 v(a); }\n"
    out = rewrite(src).text
    assert "float4 f(float4 a, float b);" in out
    assert "float4 g(float4 a) { return a; }" in out
    assert "float4 v = msim::vctor<float4>(a);" in out


@pytest.mark.parametrize("src,line,what", [
    ("int a;\ntexture2d<float> t;", 2, "textures"),
    ("sampler s;", 1, "samplers"),
    ("\n\nfloat4x4 m;", 3, "matrix types"),
    ("uint i [[thread_position_in_grid]];", 1, "attribute"),
    ("threadgroup float x = 0;", 1, "initializer"),
    ("imageblock<T> b;", 1, "imageblocks"),
    ("constant bool f [[function_constant(0)]];", 1, "has no value"),
])
def test_unsupported(src, line, what):
    with pytest.raises(UnsupportedError) as e:
        rewrite(src)
    assert e.value.line == line and what in str(e.value)


def test_standard_attributes_allowed():
    out = rewrite("[[maybe_unused]] int x = 1;\n[[clang::always_inline]] inline void f() {}").text
    assert "[[maybe_unused]]" in out

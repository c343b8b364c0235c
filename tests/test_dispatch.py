"""The dispatch table: backend="auto" on CUDA routes a call to mx.fast only where a recorded run
measured mx.fast faster (kernels/dispatch_cuda.txt), only where mx.fast serves the call exactly
and fused, only on the measured GPU family; backend="cuda" always runs ours. Routed calls are
counted once per call in route_counts(), not warned, and their results equal the float64
reference. The table is written by benchmarks/dispatch_table.py from a bench.py JSON."""
import dataclasses
import importlib.util
import json
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_flash
from mlx_flash import backends, flash_attention, reference
from mlx_flash.backends import cuda, dispatch, guard
from mlx_flash.backends.dispatch import DispatchRow, format_dispatch_row, parse_dispatch
from mlx_flash.spec import check_inputs

from attention_cases import FORWARD_TOLERANCE, GRADIENT_TOLERANCE, relative_error, to_numpy

pytestmark = pytest.mark.usefixtures("on_cpu")

ROOT = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location("dispatch_table", ROOT / "benchmarks" / "dispatch_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOOL = _tool()


# ---------------------------------------------------------------------------------------------
# The tool: bench.py JSON -> rows


def bench_rows(dtype, head_dim, mask, n, ours, theirs, kv_heads=4, **extra):
    """bench.py rows of one case: `ours` / `theirs` = (forward, forward_backward) median ms; mask
    one of none, causal, bool, additive."""
    case = dict(batch=1, q_heads=4, kv_heads=kv_heads, q_len=n, kv_len=n, head_dim=head_dim, dtype=dtype,
                causal=mask == "causal", array_mask=mask if mask in ("bool", "additive") else "none")
    rows = []
    for implementation, times in (("mlx-flash", ours), ("mx.fast", theirs)):
        for pass_name, ms in zip(("forward", "forward_backward"), times):
            row = dict(case, implementation=implementation, status="ok", median_ms=ms, **{"pass": pass_name})
            if implementation == "mlx-flash":
                row.update(backend="cuda", **extra)
            rows.append(row)
    return rows


def synthetic():
    """bf16 D=128 causal (MHA): mx.fast faster at 1024..4096 except 2048's forward (noise-level
    win), then ours from 8192; bf16 D=64 non-causal: faster at 512, 1024 in both layouts, at 2048
    under MHA only (the GQA forward loses 1.5x beside a fwd+bwd win of 10 %); fp16 D=256: faster
    but unfused (never routes); fp16 D=64 causal: our row fell back."""
    rows = []
    for n, ours, theirs in ((1024, (1.0, 3.0), (0.8, 2.0)), (2048, (2.0, 6.0), (1.97, 4.0)),
                            (4096, (4.0, 12.0), (3.0, 9.0)), (8192, (8.0, 24.0), (7.0, 30.0)),
                            (16384, (16.0, 48.0), (20.0, 60.0))):
        rows += bench_rows("bfloat16", 128, "causal", n, ours, theirs)
    rows += bench_rows("bfloat16", 128, "causal", 512, (1.0, 2.0), (0.5, 1.0))  # measured after, sorted by N
    for n in (512, 1024, 2048):
        rows += bench_rows("bfloat16", 64, "none", n, (1.0, 2.0), (0.5, 1.5), kv_heads=4)
        rows += bench_rows("bfloat16", 64, "none", n, (1.0, 2.0), (0.6, 1.2) if n < 2048 else (1.5, 1.8), kv_heads=1)
    rows += bench_rows("float16", 256, "none", 4096, (2.0, 4.0), (1.0, 2.0))
    rows += bench_rows("float16", 64, "causal", 4096, (2.0, 4.0), (1.0, 2.0), fallbacks={"x": 1})
    rows += [dict(r, status="skipped: budget") for r in bench_rows("float16", 64, "none", 4096, (2.0, 4.0), (1.0, 2.0))]
    rows += bench_rows("float32", 64, "none", 4096, (2.0, 4.0), (1.0, 2.0))  # fp32: no cuDNN
    return rows


def test_tool_rows_from_a_synthetic_recording():
    rows = TOOL.table_rows("sm90", TOOL.decide(synthetic(), margin=0.05))
    assert [(r.dtype, r.head_dim, r.heads, r.mask, r.min_n, r.max_n) for r in rows] == [
        ("bfloat16", 64, "gqa", "none", 512, 1024),      # 2048: the GQA forward loses: not routed
        ("bfloat16", 64, "mha", "none", 512, 2048),      # ... while MHA routes there
        ("bfloat16", 128, "mha", "causal", 512, 4096),   # 2048: a forward tie (0.985) beside a clear
    ]                                                    # fwd+bwd win routes; 8192: fwd+bwd slower
    assert [(r.forward, r.forward_backward) for r in rows[:2]] == [(0.6, 0.6), (0.5, 0.75)]  # worst over N
    assert all(r.family == "sm90" for r in rows)


def test_tool_rows_for_array_masks():
    """Bool and additive points are their own rows beside none / causal at the same N: here the
    bool mask routes (fwd+bwd a clear win, forward within the margin), the additive one does not
    (our forward 1.7x faster, our fwd+bwd 1.6x slower), the unmasked point neither."""
    rows = (bench_rows("bfloat16", 128, "bool", 4096, (2.0, 8.0), (2.08, 5.0))
            + bench_rows("bfloat16", 128, "additive", 4096, (2.0, 8.0), (3.4, 5.0))
            + bench_rows("bfloat16", 128, "none", 4096, (1.0, 4.0), (1.0, 4.0)))
    verdicts = TOOL.decide(rows)
    assert verdicts == {("bfloat16", 128, "mha", "bool", 4096): (1.04, 0.625),
                        ("bfloat16", 128, "mha", "additive", 4096): None,
                        ("bfloat16", 128, "mha", "none", 4096): None}
    assert [(r.mask, r.min_n) for r in TOOL.table_rows("sm90", verdicts)] == [("bool", 4096)]
    assert parse_dispatch(format_dispatch_row(TOOL.table_rows("sm90", verdicts)[0]))[0].mask == "bool"


def test_tool_does_not_route_a_tie_in_both_passes():
    rows = bench_rows("bfloat16", 64, "causal", 4096, (2.0, 4.0), (1.98, 3.96))  # 1% faster in both
    assert TOOL.decide(rows, margin=0.05) == {("bfloat16", 64, "mha", "causal", 4096): None}
    assert TOOL.decide(rows, margin=0.0)[("bfloat16", 64, "mha", "causal", 4096)] is not None


def test_tool_routes_a_clear_win_beside_a_tie_within_the_margin():
    """mx.fast 3 % slower in the forward and 15 % faster in the forward+backward routes (margin
    0.05); and with the roles swapped the same."""
    point = ("bfloat16", 128, "mha", "none", 4096)
    assert TOOL.decide(bench_rows("bfloat16", 128, "none", 4096, (2.0, 4.0), (2.06, 3.4)))[point] == (1.03, 0.85)
    assert TOOL.decide(bench_rows("bfloat16", 128, "none", 4096, (2.0, 4.0), (1.7, 4.12)))[point] is not None


def test_tool_routes_where_the_worse_pass_loses_less():
    """Past the margin, a loss in one pass routes only when it is smaller than ours in the other:
    mx.fast 8 % slower in the forward and 15 % faster in the forward+backward routes (routed, the
    forward takes 1.08x our time; kept, the forward+backward took 1 / 0.85 = 1.18x mx.fast's), 20 %
    slower does not (1.2 against 1.18); the H200's bf16 D=128 MHA point without a mask at N=4096
    (our forward 0.93x cuDNN's time, our forward+backward 1.11x) routes; our forward at 0.66x
    beside a forward+backward at 1.15x does not; roles swapped, the same."""
    point = ("bfloat16", 128, "mha", "none", 4096)
    decide = lambda ours, theirs: TOOL.decide(bench_rows("bfloat16", 128, "none", 4096, ours, theirs))[point]
    assert decide((2.0, 4.0), (2.16, 3.4)) == (1.08, 0.85)
    assert decide((2.0, 4.0), (2.4, 3.4)) is None
    assert decide((0.93, 1.11), (1.0, 1.0)) == (1.0 / 0.93, 1.0 / 1.11)
    assert decide((0.66, 1.15), (1.0, 1.0)) is None
    assert decide((2.0, 4.0), (1.7, 4.4)) == (0.85, 1.1)
    assert decide((2.0, 4.0), (1.7, 4.8)) is None


def test_tool_markdown_shows_the_ratios_and_verdicts():
    """--markdown: per dtype and mask group, a row per (D, mask, N), our time / mx.fast's per
    layout and pass ("-" where a layout was not measured), and the verdict of each class."""
    rows = (bench_rows("bfloat16", 128, "none", 4096, (0.93, 1.11), (1.0, 1.0))               # MHA: routes
            + bench_rows("bfloat16", 128, "none", 4096, (1.0, 2.0), (1.0, 2.0), kv_heads=1)   # GQA: a tie
            + bench_rows("bfloat16", 64, "causal", 2048, (2.0, 4.0), (1.0, 2.0))
            + bench_rows("bfloat16", 64, "bool", 2048, (1.0, 2.0), (2.0, 4.0)))
    text = TOOL.markdown(rows)
    assert text.splitlines()[0] == "bfloat16, masks none, causal (our time / mx.fast's):"
    assert ("| D | mask | N | fwd 4/4 | fwd+bwd 4/4 | fwd 4/1 | fwd+bwd 4/1 | auto runs MHA / GQA |" in text)
    assert "| 64 | causal | 2048 | 2.00 | 2.00 | - | - | mx.fast / - |" in text
    assert "| 128 | none | 4096 | 0.93 | 1.11 | 1.00 | 1.00 | mx.fast / ours |" in text
    assert "bfloat16, masks additive, bool (our time / mx.fast's):" in text
    assert "| 64 | bool | 2048 | 0.50 | 0.50 | ours |" in text
    assert text.index("| 64 | causal") < text.index("| 128 | none")  # by head dim, then mask, then N


def test_tool_margin_zero_joins_the_noise_level_point():
    rows = TOOL.table_rows("sm90", TOOL.decide(synthetic(), margin=0.0))
    assert ("bfloat16", 128, "causal", 512, 4096) in [(r.dtype, r.head_dim, r.mask, r.min_n, r.max_n) for r in rows]


def test_tool_keeps_the_head_layout_classes_apart():
    """MHA measured faster under mx.fast and GQA's fwd+bwd 1.5x slower at one point: only the MHA
    row routes, and a call routes by its own class (dispatch.heads_of)."""
    rows = (bench_rows("bfloat16", 128, "causal", 4096, (2.0, 4.0), (1.5, 3.9), kv_heads=4)
            + bench_rows("bfloat16", 128, "causal", 4096, (2.0, 4.0), (1.5, 6.0), kv_heads=1))
    table = TOOL.table_rows("sm90", TOOL.decide(rows))
    assert [(r.heads, r.min_n, r.max_n) for r in table] == [("mha", 4096, 4096)]
    assert dispatch.heads_of(8, 8) == "mha" and dispatch.heads_of(8, 2) == "gqa" and dispatch.heads_of(8, 1) == "gqa"


def test_tool_updates_one_family_and_keeps_the_others(tmp_path, capsys):
    payload = {"environment": {"device_name": "NVIDIA H100 80GB HBM3", "device_type": "gpu", "git_commit": "a" * 40,
                               "git_dirty": False, "date": "2026-11-23T00:00:00+00:00", "mlx_version": "0.32.4",
                               "device_info": {"architecture": "sm_90a"}, "mlx_compiled": True},
               "arguments": ["--backend", "cuda", "--compiled", "--name", "dispatch h100"], "rows": synthetic()}
    recorded = tmp_path / "dispatch_h100.json"
    recorded.write_text(json.dumps(payload))
    table = tmp_path / "dispatch_cuda.txt"
    other = DispatchRow("sm80", "float16", 64, "mha", "none", 1024, 2048, 0.5, 0.6)
    table.write_text(TOOL.render({"sm80": ["# recorded sm80: an A100 run"]}, [other]))
    assert TOOL.main([str(recorded), "--table", str(table)]) == 0
    text = table.read_text()
    rows = parse_dispatch(text)
    assert other in rows and sum(r.family == "sm90" for r in rows) == 3
    assert "# recorded sm80: an A100 run" in text
    line = next(l for l in text.splitlines() if l.startswith("# recorded sm90:"))
    assert "NVIDIA H100" in line and "aaaaaaaaaaaa" in line and "2026-11-23" in line
    assert "python3 benchmarks/bench.py --backend cuda --compiled --name 'dispatch h100'" in line
    # Re-running replaces sm90's rows, never duplicates them.
    assert TOOL.main([str(recorded), "--table", str(table)]) == 0
    assert table.read_text() == text
    # A recording of calls timed one by one (graph building included) is refused, naming the file.
    eager = tmp_path / "eager.json"
    eager.write_text(json.dumps(dict(payload, environment=dict(payload["environment"], mlx_compiled=False))))
    with pytest.raises(SystemExit):
        TOOL.main([str(eager), "--table", str(table)])
    assert "eager.json: not recorded with bench.py --compiled" in capsys.readouterr().err
    assert table.read_text() == text
    # --markdown prints the recording's tables and writes nothing.
    assert TOOL.main([str(recorded), "--table", str(table), "--markdown"]) == 0
    assert capsys.readouterr().out.startswith("bfloat16, masks none, causal") and table.read_text() == text


def test_shipped_table_is_the_tools_output_and_parses():
    text = (ROOT / "kernels" / dispatch.TABLE_NAME).read_text()
    assert TOOL.update(text, None, [], TOOL.DEFAULT_MARGIN) == text  # header current, rows as written
    families = {f.name for f in __import__("mlx_flash.backends.cuda_source", fromlist=["x"]).families()}
    assert {r.family for r in dispatch.shipped_dispatch()} <= families
    assert dispatch.shipped_dispatch() == parse_dispatch(text)


def test_format_and_parse_round_trip():
    rows = (DispatchRow("sm90", "bfloat16", 128, "gqa", "causal", 4096, 16384, 0.812, 0.9),
            DispatchRow("sm100", "float16", 64, "mha", "none", 512, 512, 0.5, 0.123))
    text = "\n".join(format_dispatch_row(r) for r in rows)
    assert parse_dispatch(text) == rows
    assert all(not line.endswith(" ") for line in text.splitlines())


@pytest.mark.parametrize("line, message", [
    ("sm90 bfloat16 128 causal 4096 16384 0.8 0.9", "9 columns"),
    ("sm90 float32 128 mha causal 4096 16384 0.8 0.9", "dtype"),
    ("sm90 bfloat16 128 mqa causal 4096 16384 0.8 0.9", "heads"),
    ("sm90 bfloat16 128 mha window 4096 16384 0.8 0.9", "mask"),
    ("sm90 bfloat16 128 gqa causal 8192 4096 0.8 0.9", "min_n <= max_n"),
    ("sm90 bfloat16 12x mha causal 4096 8192 0.8 0.9", "integers"),
    ("sm90 bfloat16 128 mha causal 4096 8192 2.2 0.9", r"\(0, 2\), one below 1"),
    ("sm90 bfloat16 128 mha causal 4096 8192 1.02 1.01", r"\(0, 2\), one below 1"),
])
def test_bad_lines_are_named(line, message):
    with pytest.raises(ValueError, match=f"dispatch_cuda.txt line 2: .*{message}"):
        parse_dispatch("# header\n" + line)


# ---------------------------------------------------------------------------------------------
# select_backend


ROW = DispatchRow("sm90", "bfloat16", 16, "mha", "causal", 128, 256, 0.8, 0.9, line=17)
ROW_NONE = DispatchRow("sm90", "float16", 16, "mha", "none", 128, 128, 0.8, 0.9, line=18)
ROW_GQA = DispatchRow("sm90", "bfloat16", 16, "gqa", "causal", 256, 256, 0.8, 0.9, line=19)
ROW_BOOL = DispatchRow("sm90", "float16", 16, "mha", "bool", 128, 128, 1.02, 0.6, line=20)


@pytest.fixture
def cuda_auto(monkeypatch):
    """"auto" resolves to a CUDA backend (kernels never built: a routed call does not need them)
    whose family MLX_FLASH_CUDA_CAPABILITY picks; the dispatch table holds ROW and ROW_NONE."""
    backend = cuda.CUDABackend(kernel_factory=lambda **kwargs: None)
    real = backends.get_backend
    monkeypatch.setattr(backends, "auto_backend_name", lambda device: "cuda")
    monkeypatch.setattr(backends, "get_backend", lambda name: backend if name == "cuda" else real(name))
    monkeypatch.setattr(dispatch, "shipped_dispatch", lambda: (ROW, ROW_NONE, ROW_GQA, ROW_BOOL))
    monkeypatch.setenv(cuda.CAPABILITY_VARIABLE, "90")
    # A call that is not routed would build our kernels: the guard's verdict says "serve it".
    monkeypatch.setattr(guard.GUARD, "verdict", lambda *args: None)
    mlx_flash.reset_fallback_counts()
    yield backend
    mlx_flash.reset_fallback_counts()


def call(q_len=128, kv_len=None, dtype=mx.bfloat16, head_dim=16, kv_heads=2, **kwargs):
    kv_len = q_len if kv_len is None else kv_len
    q = mx.zeros((1, 2, q_len, head_dim), dtype)
    k = mx.zeros((1, kv_heads, kv_len, head_dim), dtype)
    kwargs.setdefault("mask", "causal")
    return q, k, kwargs


def selected(q_len=128, kv_len=None, dtype=mx.bfloat16, head_dim=16, backend="auto", lse=False, kv_heads=2,
             **kwargs):
    q, k, kwargs = call(q_len, kv_len, dtype, head_dim, kv_heads, **kwargs)
    spec, mask = check_inputs(q, k, k, **kwargs)
    return backends.select_backend(backend, spec, None, None if mask is None else mask.dtype, lse_is_used=lse).name


def test_matching_call_routes_under_auto_only(cuda_auto):
    assert selected() == "fast" and selected(256) == "fast" and selected(256, kv_heads=1) == "fast"
    assert selected(backend="cuda") == "cuda"        # explicit: always ours
    assert selected(backend=cuda_auto) == "cuda"     # a backend object is explicit too
    assert selected(dtype=mx.float16, mask=None) == "fast"
    counts = mlx_flash.route_counts()
    assert sum(counts.values()) == 4 and mlx_flash.fallback_counts() == {}
    assert any("dispatch_cuda.txt line 17" in r and "sm90 bfloat16 D=16 mha causal N=128..256" in r for r in counts)
    assert any("line 19" in r and "D=16 gqa causal N=256..256" in r for r in counts)


def test_array_masked_call_routes_by_its_mask_kind_and_shape(cuda_auto):
    """A bool mask shaped [1, 1, N, N] (given as [N, N] too: it broadcasts) routes by the bool row;
    an additive one, or one per head, does not (ROW_BOOL only)."""
    for mask in (mx.ones((1, 1, 128, 128), mx.bool_), mx.ones((128, 128), mx.bool_)):
        assert selected(dtype=mx.float16, kv_heads=2, mask=mask) == "fast"
    assert selected(dtype=mx.float16, kv_heads=2, mask=mx.zeros((1, 1, 128, 128), mx.float16)) == "cuda"
    assert selected(dtype=mx.float16, kv_heads=1, mask=mx.ones((1, 1, 128, 128), mx.bool_)) == "cuda"  # gqa
    counts = mlx_flash.route_counts()
    assert sum(counts.values()) == 2 and all("line 20" in r and "mha bool N=128..128" in r for r in counts)


@pytest.mark.parametrize("kwargs", [
    dict(q_len=384),                        # past the range's max_n
    dict(q_len=128, kv_len=512),            # Nk past it
    dict(q_len=128, kv_len=256),            # both in range, but only square problems were measured
    dict(q_len=64),                         # below min_n (and not a multiple of 128: unfused backward)
    dict(dtype=mx.float16),                 # the row is bf16
    dict(head_dim=24),                      # head dims match exactly
    dict(kv_heads=1),                       # GQA: the gqa row covers N=256 only
    dict(mask=None),                        # the bf16 row is causal
    dict(window_size=(8, 0)),
    dict(softcap=5.0),
    dict(lse=True),
    dict(mask=mx.ones((1, 1, 128, 128), mx.bool_)),      # the bool row is float16
    dict(mask=mx.zeros((1, 1, 128, 128), mx.bfloat16)),  # no additive row
    dict(dtype=mx.float16, mask=mx.ones((1, 2, 128, 128), mx.bool_)),  # per-head masks: never measured
    dict(dtype=mx.float16, mask=mx.ones((256, 256), mx.bool_), q_len=256),  # bool row: N = 128 only
], ids=lambda k: ",".join(f"{a}={v if not isinstance(v, mx.array) else 'array'}" for a, v in k.items()))
def test_no_route_where_the_table_or_exactness_says_no(cuda_auto, kwargs):
    assert selected(**kwargs) == "cuda"
    assert mlx_flash.route_counts() == {}


def test_sinks_and_shifted_diagonal_never_route(cuda_auto):
    q, k, kwargs = call()
    spec, _ = check_inputs(q, k, k, **kwargs)
    assert backends.dispatch_route(cuda_auto, spec, False) == ROW
    for changed in (dataclasses.replace(spec, has_sinks=True), dataclasses.replace(spec, diagonal_shift=64)):
        assert backends.dispatch_route(cuda_auto, changed, False) is None


@pytest.mark.parametrize("capability", ["80", "86", "120"])
def test_other_families_route_nothing(cuda_auto, monkeypatch, capability):
    monkeypatch.setenv(cuda.CAPABILITY_VARIABLE, capability)
    assert selected() == "cuda" and mlx_flash.route_counts() == {}


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "bool mask"])
def test_routed_call_counted_once_and_equal_to_the_reference(cuda_auto, masked):
    """value_and_grad through a routed call: one count, no warning, out and gradients within the
    tolerance of the float64 reference (causal bf16 GQA; an fp16 bool mask [1, 1, N, N] with an
    empty row, which mx.fast alone would not give as ours: output and gradients 0 there)."""
    rng = np.random.default_rng(0)
    dtype = mx.float16 if masked else mx.bfloat16
    n, kv_heads = (128, 2) if masked else (256, 1)
    q, k, v, d_out = (mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype)
                      for s in ((1, 2, n, 16), (1, kv_heads, n, 16), (1, kv_heads, n, 16), (1, 2, n, 16)))
    if masked:
        keep = rng.random((1, 1, n, n)) < 0.9
        keep[0, 0, 5] = False
        mask = mx.array(keep)
    else:
        mask = "causal"
    spec, _ = check_inputs(q, k, v, mask=mask)

    def loss(q_, k_, v_):
        o = flash_attention(q_, k_, v_, mask=mask)
        return (o.astype(mx.float32) * d_out.astype(mx.float32)).sum(), o

    with warnings.catch_warnings():
        warnings.simplefilter("error", mlx_flash.FallbackWarning)
        (_, out), grads = mx.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert sum(mlx_flash.route_counts().values()) == 1 and mlx_flash.fallback_counts() == {}
    arrays = [to_numpy(x) for x in (q, k, v, d_out)]
    ref_mask = keep if masked else None
    ref_out, _ = reference.attention_forward(*arrays[:3], spec, ref_mask)
    ref_grads = reference.attention_backward(*arrays, spec, ref_mask)
    name = "float16" if masked else "bfloat16"
    assert relative_error(to_numpy(out), ref_out) <= FORWARD_TOLERANCE[name]
    for got, want in zip(grads, ref_grads):
        assert relative_error(to_numpy(got), want) <= GRADIENT_TOLERANCE[name]
    if masked:
        assert not np.any(to_numpy(out)[0, :, 5])  # the empty row: 0, as ours


# ---------------------------------------------------------------------------------------------
# The plan inspector says where "auto" routes


def test_plan_inspector_names_the_routing_row(monkeypatch, capsys):
    from mlx_flash import __main__ as cli, inspect

    monkeypatch.setattr(dispatch, "shipped_dispatch", lambda: (ROW, ROW_NONE, ROW_GQA))
    routed = inspect.auto_route(16, "bfloat16", "causal", capability=90, q_len=256)
    assert len(routed) == 1 and "routes Nq=256 Nk=256 to mx.fast" in routed[0] and "line 17" in routed[0]
    assert "runs these kernels at Nq=128 Nk=256" in inspect.auto_route(16, "bfloat16", "causal", 90, 128, 256)[0]
    assert "runs these kernels at Nq=512" in inspect.auto_route(16, "bfloat16", "causal", capability=90, q_len=512)[0]
    assert "runs these kernels at every N" in inspect.auto_route(16, "bfloat16", "causal", capability=86)[0]
    assert "sliding window" in inspect.auto_route(16, "bfloat16", "window", capability=90, q_len=128)[0]
    assert inspect.auto_route(16, "float32", "causal", capability=90) == []  # no kernels: the fallback rule
    args = ["plan", "--backend", "cuda", "--capability", "90", "--head-dim", "16", "--mask", "causal"]
    parsed = cli.build_parser().parse_args(args)
    assert parsed.run(parsed) == 0
    out = capsys.readouterr().out
    assert "backend='auto' routes Nq = Nk = N in 128..256 to mx.fast" in out and "line 17" in out
    # GQA calls (--group) route by the gqa rows only.
    assert "line 19" in inspect.auto_route(16, "bfloat16", "causal", capability=90, q_len=256, group=2)[0]
    assert "runs these kernels at Nq=128" in inspect.auto_route(16, "bfloat16", "causal", 90, 128, group=4)[0]
    parsed = cli.build_parser().parse_args(args + ["--group", "4"])
    assert parsed.run(parsed) == 0
    out = capsys.readouterr().out
    assert "N in 256..256 to mx.fast" in out and "line 19" in out and "line 17" not in out
    with pytest.raises(ValueError, match=r"\[plan\] group must be a positive int, got 0"):
        inspect.make_spec(16, group=0)


def test_report_names_routes_and_what_auto_would_route(monkeypatch):
    from mlx_flash import benchmark as bm, report
    from mlx_flash.report_markdown import render_markdown

    monkeypatch.setattr(dispatch, "shipped_dispatch", lambda: (ROW, ROW_NONE, ROW_GQA))
    monkeypatch.setenv(cuda.CAPABILITY_VARIABLE, "90")
    case = bm.BenchCase(batch=1, q_heads=2, kv_heads=2, q_len=256, kv_len=256, head_dim=16, dtype="bfloat16",
                        causal=True)
    assert "line 17" in report._auto_route("cuda", case)
    assert report._auto_route("cuda", dataclasses.replace(case, q_len=512, kv_len=512)) is None
    assert report._auto_route("metal", case) is None
    text = render_markdown({"environment": {}, "backend": "cuda", "backend_requested": "cuda", "correctness": [],
                            "quick": True, "correctness_setup": {"q_len": 1, "kv_len": 1, "window": [1, 0]},
                            "routes": {"dispatch_cuda.txt line 17: ...; using mx.fast": 3}})
    assert "## Routed" in text and "| 3 | dispatch_cuda.txt line 17" in text


def test_tool_needs_every_layout_at_a_point_and_merges_runs(tmp_path):
    """A run cut short timed GQA 2:1 at 4096 but not 4:1: 4096 does not route. Two runs of one GPU
    (bf16 and fp16) give one table; runs of two families are refused."""
    rows = []
    for n in (1024, 2048, 4096):
        rows += bench_rows("bfloat16", 64, "none", n, (1.0, 2.0), (0.5, 1.0), kv_heads=2)
    for n in (1024, 2048):
        rows += bench_rows("bfloat16", 64, "none", n, (1.0, 2.0), (0.5, 1.0), kv_heads=1)
    assert [(r.min_n, r.max_n) for r in TOOL.table_rows("sm90", TOOL.decide(rows))] == [(1024, 2048)]
    env = {"device_type": "gpu", "device_info": {"architecture": "sm_90a"}, "mlx_compiled": True}
    paths = []
    for name, dtype in (("bf16", "bfloat16"), ("fp16", "float16")):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"environment": env, "arguments": ["--dtypes", name],
                                    "rows": bench_rows(dtype, 128, "causal", 4096, (2.0, 4.0), (1.0, 2.0))}))
        paths.append(str(path))
    table = tmp_path / "t.txt"
    assert TOOL.main([*paths, "--table", str(table)]) == 0
    text = table.read_text()
    assert {r.dtype for r in parse_dispatch(text)} == {"bfloat16", "float16"}
    assert sum(l.startswith("# recorded sm90:") for l in text.splitlines()) == 2
    other = tmp_path / "a100.json"
    other.write_text(json.dumps({"environment": dict(env, device_info={"architecture": "sm_80"}), "rows": []}))
    with pytest.raises(SystemExit):
        TOOL.main([paths[0], str(other), "--table", str(table)])
    with pytest.raises(SystemExit):
        TOOL.main([paths[0], "--family", "sm99", "--table", str(table)])
    # One file holding both runs (as results/h100_dispatch.json) writes the same table.
    both = tmp_path / "both.json"
    both.write_text(json.dumps([json.loads(Path(p).read_text()) for p in paths]))
    from_list = tmp_path / "from_list.txt"
    assert TOOL.main([str(both), "--table", str(from_list)]) == 0
    assert from_list.read_text() == text
    # ... and so does a dict holding them as "recording" beside other data (results/h200_dispatch.json).
    both.write_text(json.dumps({"recording": [json.loads(Path(p).read_text()) for p in paths],
                                "back_to_back_8": {"runs": [{"rows": []}]}}))
    from_dict = tmp_path / "from_dict.txt"
    assert TOOL.main([str(both), "--table", str(from_dict)]) == 0
    assert from_dict.read_text() == text
    for bad in ([], [{"environment": env}], {"environment": env}, {"recording": []}):
        both.write_text(json.dumps(bad))
        with pytest.raises(SystemExit):
            TOOL.main([str(both), "--table", str(from_list)])


# ---------------------------------------------------------------------------------------------
# On a CUDA GPU (python3 -m pytest tests/test_dispatch.py -k gpu on the H100)


@pytest.mark.skipif(not cuda.cuda_available(), reason="no CUDA GPU: mx.cuda.is_available() is False")
def test_gpu_auto_routes_and_cuda_runs_ours(monkeypatch):
    """On the GPU with a row for its own family: "auto" runs mx.fast (one route), "cuda" our kernels
    (no route), both equal to the float64 reference."""
    monkeypatch.delenv(cuda.CAPABILITY_VARIABLE, raising=False)
    family = cuda.CUDABackend().family().name
    row = DispatchRow(family, "bfloat16", 64, "mha", "causal", 256, 256, 0.5, 0.5, line=1)
    monkeypatch.setattr(dispatch, "shipped_dispatch", lambda: (row,))
    rng = np.random.default_rng(1)
    q, k, v = (mx.array(rng.standard_normal((1, 4, 256, 64)).astype(np.float32)).astype(mx.bfloat16)
               for _ in range(3))
    spec, _ = check_inputs(q, k, v, mask="causal")
    ref, _ = reference.attention_forward(*(to_numpy(x) for x in (q, k, v)), spec)
    mlx_flash.reset_fallback_counts()
    for backend, routes in (("auto", 1), ("cuda", 1)):
        out = flash_attention(q, k, v, mask="causal", backend=backend, stream=mx.gpu)
        assert relative_error(to_numpy(out), ref) <= FORWARD_TOLERANCE["bfloat16"], backend
        assert sum(mlx_flash.route_counts().values()) == routes, backend
    mlx_flash.reset_fallback_counts()

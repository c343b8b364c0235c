"""Benchmark mlx-flash against MLX's attention, a plain unfused MLX attention and, optionally,
PyTorch's FlashAttention-2 and cuDNN attention, all in the same run.

    python benchmarks/bench.py --seq-lens 256 512 --masks none   # ~1 min on a 2-core CPU
    python benchmarks/bench.py                                   # CPU default sweep: ~10 min on 2 cores
    python benchmarks/bench.py --preset gpu                      # the published GPU table: ~6 min on an H100
    python benchmarks/bench.py --dtypes bf16 --head-dims 64 128 256 --seq-lens 1024 16384 --torch
    python benchmarks/bench.py --replot DIR/bench.json          # plots from a recorded JSON
    python benchmarks/bench.py --markdown DIR/bench.json        # its rows as Markdown tables

Every row: median milliseconds (and IQR, min/max in the JSON), TFLOP/s, G instructions/s,
peak memory, and the time and memory of the row as a multiple of mx.fast's (lower is better).
What each pass times, and the metric formulas, are in mlx_flash/benchmark.py's docstring.
Outputs: the table on stdout, <out>/<name>.json (rows + environment, rewritten after every
case so an interrupted run keeps what it measured) and <out>/<name>_d<D>_<dtype>.png. <out> is
outside the source tree unless you name one (--out); published results are copied into
benchmarks/results/ by hand, one JSON per table (the plots are redrawn from runs, not kept).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx

from mlx_flash import benchmark as bm
from mlx_flash.backends import BACKEND_NAMES, auto_backend_name, get_backend
from mlx_flash.cli import dtype_argument, positive_int
from mlx_flash.fallback import fallback_counts, route_counts

IMPLEMENTATIONS = ("mlx-flash", "mx.fast", "unfused", "torch-fa2", "torch-cudnn")
DEFAULT_OUT = Path(tempfile.gettempdir()) / "mlx-flash-bench"
BASELINE = "mx.fast"


# ---------------------------------------------------------------------------------------------
# Optional PyTorch FlashAttention-2


class TorchFlash:
    """torch.nn.functional.scaled_dot_product_attention restricted to one of its fused kernels
    on a CUDA device: FlashAttention-2 ("torch-fa2") or cuDNN's attention ("torch-cudnn", the
    library MLX's own CUDA attention calls too). `unavailable` says why it cannot run here (or
    is None).

    device="cpu" runs torch's CPU flash-attention kernel instead; it exists so the code path
    can be tested without a GPU (peak memory is then not measured)."""

    KERNELS = {"torch-fa2": "FLASH_ATTENTION", "torch-cudnn": "CUDNN_ATTENTION"}

    def __init__(self, device: str = "cuda", name: str = "torch-fa2"):
        if name not in self.KERNELS:
            raise ValueError(f"name must be one of {tuple(self.KERNELS)}, got {name!r}.")
        self.name = name
        self.unavailable: Optional[str] = None
        self.device = device
        try:
            import torch
        except ImportError as error:
            self.unavailable = f"torch is not importable ({error})"
            return
        self.torch = torch
        self.version = torch.__version__
        if device == "cuda" and not torch.cuda.is_available():
            self.unavailable = f"torch {torch.__version__} sees no CUDA device"
            return
        self.device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"

    def unsupported_reason(self, case: bm.BenchCase) -> Optional[str]:
        if self.unavailable:
            return self.unavailable
        if case.dtype == "float32":
            return f"{self.name} needs fp16/bf16"
        # Both take D <= 256 on Hopper (torch 2.11 with cuDNN 9.19 ran cuDNN's kernel at D = 160, 192
        # and 256 forward and backward: sdpa_kernel(CUDNN_ATTENTION) did not refuse them).
        if case.head_dim > 256:
            return f"{self.name} needs head_dim <= 256"
        if case.causal and case.q_len != case.kv_len:
            return "torch's is_causal is top-left aligned; only Nq == Nk compares"
        if case.array_mask != "none":
            return f"{self.name} is compared without array masks"
        return None

    def finish(self, result) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def memory_probe(self):
        torch = self.torch
        if self.device != "cuda":
            class NoProbe:
                def start(self):
                    pass

                def peak(self):
                    return None

            return NoProbe()

        class Probe:
            def start(self):
                torch.cuda.synchronize()
                self.baseline = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()

            def peak(self):
                torch.cuda.synchronize()
                return max(0, torch.cuda.max_memory_allocated() - self.baseline)

        return Probe()

    def passes(self, case: bm.BenchCase, seed: int):
        """{pass: (prepare, run)} on fresh random CUDA inputs of the case's shapes."""
        torch = self.torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[case.dtype]
        generator = torch.Generator(device=self.device).manual_seed(seed)

        def normal(*shape):
            return torch.randn(*shape, generator=generator, device=self.device, dtype=dtype)

        q = normal(case.batch, case.q_heads, case.q_len, case.head_dim)
        k = normal(case.batch, case.kv_heads, case.kv_len, case.head_dim)
        v = normal(case.batch, case.kv_heads, case.kv_len, case.head_dim)
        d_out = normal(case.batch, case.q_heads, case.q_len, case.head_dim)
        gqa = case.q_heads != case.kv_heads

        kernel = getattr(SDPBackend, self.KERNELS[self.name] if self.device == "cuda" else "FLASH_ATTENTION")

        def attend(q_, k_, v_):
            with sdpa_kernel(kernel):
                return torch.nn.functional.scaled_dot_product_attention(
                    q_, k_, v_, is_causal=case.causal, scale=case.scale, **({"enable_gqa": True} if gqa else {}))

        def with_grad():
            return [x.detach().requires_grad_(True) for x in (q, k, v)]

        def forward(_):
            with torch.no_grad():
                return attend(q, k, v)

        def forward_backward(_):
            leaves = with_grad()
            out = attend(*leaves)
            return out, torch.autograd.grad(out, leaves, d_out)

        def prepare_backward():
            leaves = with_grad()
            out = attend(*leaves)
            self.finish(out)
            return out, leaves

        def backward(state):
            out, leaves = state
            return torch.autograd.grad(out, leaves, d_out)

        return {"forward": (None, forward), "forward_backward": (None, forward_backward),
                "backward": (prepare_backward, backward)}


# ---------------------------------------------------------------------------------------------
# The sweep


def memory_budget(args) -> Tuple[Optional[float], str]:
    """(bytes, how it was chosen) for the out-of-memory guard."""
    if args.max_memory_gb is not None:
        return args.max_memory_gb * (1 << 30), f"--max-memory-gb {args.max_memory_gb}"
    total = bm.device_memory_bytes()
    if total is None:
        return None, "device memory unknown: no guard"
    return args.memory_fraction * total, f"{args.memory_fraction:.0%} of {bm.format_bytes(total)} device memory"


def mask_fields(mask: str) -> Dict[str, Any]:
    """BenchCase's fields for one of --masks."""
    return {"causal": mask == "causal", "array_mask": mask if mask in ("bool", "additive") else "none"}


def build_cases(args) -> List[bm.BenchCase]:
    """The cartesian sweep, or the preset's explicit (B, H, N, D) shapes times dtypes and masks."""
    cases = []
    if args.cases:
        for dtype in args.dtypes:
            for batch, heads, length, head_dim in args.cases:
                for mask in args.masks:
                    cases.append(bm.BenchCase(batch=batch, q_heads=heads, kv_heads=heads, q_len=length,
                                              kv_len=length, head_dim=head_dim, dtype=dtype, **mask_fields(mask)))
        return cases
    for dtype in args.dtypes:
        for head_dim in args.head_dims:
            for kv_heads in args.kv_heads or [args.heads]:
                for mask in args.masks:
                    for length in args.seq_lens:
                        batch = max(1, args.tokens // length) if args.tokens else args.batch
                        cases.append(bm.BenchCase(batch=batch, q_heads=args.heads, kv_heads=kv_heads,
                                                  q_len=length, kv_len=length, head_dim=head_dim,
                                                  dtype=dtype, **mask_fields(mask)))
    return cases


class FlashBackend:
    """The mlx-flash backend this run measures, resolved once ("auto" by the default device)."""

    def __init__(self, requested: str):
        self.requested = requested
        self.name = auto_backend_name(mx.default_device()) if requested == "auto" else requested
        self.error: Optional[str] = None
        try:
            reason = get_backend(self.name).unavailable_reason(mx.default_device())
            if reason is not None:
                self.error = f"backend {self.name!r} unavailable: {reason}"
        except ValueError as error:
            self.error = str(error)


def warm_up_clocks(seconds: float) -> None:
    """Matrix products on the default device for `seconds`: a GPU left idle during a kernel
    compile drops its clocks (an H100 to 345 MHz), and a few ~1 ms warm-up calls do not ramp
    them back (the first timed forward of a case once measured 2x slow)."""
    if seconds <= 0:
        return
    a = mx.random.normal((4096, 4096)).astype(mx.bfloat16)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        mx.eval(a @ a)
    mx.synchronize()


def run_case(case: bm.BenchCase, seed: int, args, flash: FlashBackend, torch_impls: Dict[str, TorchFlash],
             budget: Optional[float]) -> List[Dict[str, Any]]:
    """All implementations and passes of one case, timed interleaved, with the ratios to mx.fast.

    Args:
        torch_impls: the PyTorch implementations asked for, by name ("torch-fa2", "torch-cudnn").
    """
    inputs = bm.random_inputs(case, seed=seed)
    mask = bm.random_mask(case, seed=seed)
    settings = bm.Settings(warmup=args.warmup, min_repeats=args.min_repeats, max_repeats=args.max_repeats,
                           target_seconds=args.target_seconds)
    attention: Dict[str, Callable] = {"mlx-flash": bm.flash_attention_with(flash.name),
                                      "mx.fast": bm.fast_attention, "unfused": bm.unfused_attention}
    rows: Dict[Tuple[str, str], Dict[str, Any]] = {}
    items = {}
    torch_passes: Dict[str, Any] = {}
    for implementation in args.impls:
        for pass_name in args.passes:
            row: Dict[str, Any] = {"implementation": implementation, "pass": pass_name, **bm.as_dict(case)}
            if implementation == "mlx-flash":
                row["backend"] = flash.name
            rows[implementation, pass_name] = row
            estimate = bm.score_memory_estimate(implementation, case, pass_name)
            skip = None
            if implementation == "mlx-flash" and flash.error:
                skip = flash.error
            elif implementation in torch_impls:
                skip = torch_impls[implementation].unsupported_reason(case)
            if skip is None and budget is not None and estimate > budget:
                skip = f"estimated {bm.format_bytes(estimate)} > budget {bm.format_bytes(budget)}"
            if skip is not None:
                row["status"] = f"skipped: {skip}"
                continue
            try:
                if implementation in torch_impls:
                    torch_flash = torch_impls[implementation]
                    if implementation not in torch_passes:
                        torch_passes[implementation] = torch_flash.passes(case, seed)
                    prepare, run = torch_passes[implementation][pass_name]
                    call = bm.Call(run, prepare, torch_flash.finish, back_to_back=args.back_to_back,
                                   launch=lambda result: None)  # torch launches as it goes
                    items[implementation, pass_name] = (call, case, pass_name, torch_flash.memory_probe())
                else:
                    prepare, run = bm.mlx_pass(attention[implementation], case, inputs, pass_name,
                                               compiled=args.compiled, mask=mask)
                    items[implementation, pass_name] = (bm.Call(run, prepare, back_to_back=args.back_to_back),
                                                        case, pass_name, None)
            except Exception as error:  # e.g. torch failing to allocate its inputs
                row["status"] = f"error: {type(error).__name__}: {str(error)[:200]}"
    warm_up_clocks(args.warm_up_clocks_s)
    before, routes_before = fallback_counts(), route_counts()
    measured = bm.measure_many(items, settings)
    fallbacks = {r: n - before.get(r, 0) for r, n in fallback_counts().items() if n > before.get(r, 0)}
    # Never expected: the resolved backend is passed by name, and an explicit backend is never routed.
    fallbacks.update({r: n - routes_before.get(r, 0) for r, n in route_counts().items()
                      if n > routes_before.get(r, 0)})
    for key, result in measured.items():
        row = rows[key]
        if "error" in result:  # an OOM or a kernel failure must not end the sweep
            row["status"] = f"error: {result['error']}"
            continue
        row.update(result, status="ok")
        if fallbacks and key[0] == "mlx-flash":  # only mlx-flash calls can fall back
            row["fallbacks"] = fallbacks
    del inputs, mask, items, torch_passes
    mx.clear_cache()  # MLX's buffer cache would otherwise keep this case's blocks from the next
    for torch_flash in torch_impls.values():
        if torch_flash.device == "cuda" and not torch_flash.unavailable:
            torch_flash.torch.cuda.empty_cache()
    rows_list = list(rows.values())
    add_ratios(rows_list)
    return rows_list


def add_ratios(rows: List[Dict[str, Any]]) -> None:
    """time_vs_mx_fast and memory_vs_mx_fast: this row's median time and peak memory divided by
    mx.fast's for the same case and pass (lower is better)."""
    baseline = {r["pass"]: r for r in rows if r["implementation"] == BASELINE and r.get("status") == "ok"}
    for row in rows:
        base = baseline.get(row["pass"])
        if row.get("status") != "ok" or base is None:
            continue
        row["time_vs_mx_fast"] = row["median_ms"] / base["median_ms"]
        if row["peak_memory_bytes"] is not None and base["peak_memory_bytes"] > 0:
            row["memory_vs_mx_fast"] = row["peak_memory_bytes"] / base["peak_memory_bytes"]


def row_cells(row: Dict[str, Any]) -> List[Any]:
    name = row["implementation"] + (f"[{row['backend']}]" if row.get("backend") else "")
    if row.get("status") != "ok":
        return [name, bm.PASS_LABELS[row["pass"]]] + ["-"] * 7 + [row.get("status", "")]
    note = "; ".join(f"FALLBACK x{n}: {r}" for r, n in row.get("fallbacks", {}).items())
    ratio = (lambda key: f"{row[key]:.2f}x" if key in row else "-")
    return [name, bm.PASS_LABELS[row["pass"]], bm.format_ms(row["median_ms"]),
            f"{bm.format_ms(row['q1_ms'])}-{bm.format_ms(row['q3_ms'])}",
            bm.format_rate(row["tflops"] * 1e12, RATE_UNIT),
            f"{row['ginstrs']:.3g}",
            bm.format_bytes(row["peak_memory_bytes"]), ratio("time_vs_mx_fast"), ratio("memory_vs_mx_fast"), note]


# The terminal table's rate unit: a CPU reaches a few GFLOP/s, where TFLOP/s would read 0.00x.
# The JSON always holds TFLOP/s ("tflops").
RATE_UNIT = "TFLOP/s" if mx.default_device().type == mx.gpu else "GFLOP/s"
TABLE_HEADERS = ["implementation", "pass", "ms", "IQR ms", RATE_UNIT, "GINSTRS/s", "peak mem",
                 "time/mx.fast", "mem/mx.fast", "note"]


def markdown(payload: Dict[str, Any]) -> str:
    """A recorded run as Markdown: the environment line, then one table per case. Ratios are
    to mx.fast, by median and by fastest run (the latter is less sensitive to a loaded machine)."""
    env = payload["environment"]
    lines = [f"{env.get('device_name')} ({env.get('device')}), MLX {env.get('mlx_version')}, mlx-flash "
             f"{env.get('mlx_flash_version')} @ {(env.get('git_commit') or 'unknown')[:10]}, backend "
             f"{env.get('backend')!r}, {env.get('date')}, {env.get('platform')}, {env.get('cpu_count')} CPUs, "
             f"load average {env.get('load_average')} at start, {env.get('load_average_end')} at end"]
    lines.append(f"timing: {timing_mode(env)}")
    cases: Dict[str, List[Dict[str, Any]]] = {}
    for row in payload["rows"]:
        label = bm.case_of(row).label()
        cases.setdefault(label, []).append(row)
    for label, rows in cases.items():
        base = {r["pass"]: r for r in rows if r["implementation"] == BASELINE and r.get("status") == "ok"}
        lines += ["", f"**{label}**", "",
                  "| implementation | pass | ms median (IQR) | TFLOP/s | GINSTRS/s | peak memory | time / mx.fast "
                  "(median; fastest) | memory / mx.fast |", "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            name = r["implementation"] + (f"[{r['backend']}]" if r.get("backend") else "")
            if r.get("status") != "ok":
                lines.append(f"| {name} | {bm.PASS_LABELS[r['pass']]} | {r.get('status')} | | | | | |")
                continue
            b = base.get(r["pass"])
            speed = (f"{r['median_ms'] / b['median_ms']:.2f}x; {r['min_ms'] / b['min_ms']:.2f}x" if b else "-")
            memory = (f"{r['peak_memory_bytes'] / b['peak_memory_bytes']:.2f}x"
                      if b and r.get("peak_memory_bytes") is not None and b["peak_memory_bytes"] else "-")
            lines.append(f"| {name} | {bm.PASS_LABELS[r['pass']]} | {bm.format_ms(r['median_ms'])} "
                         f"({bm.format_ms(r['q1_ms'])}-{bm.format_ms(r['q3_ms'])}) | {r['tflops']:.3g} | "
                         f"{r['ginstrs']:.3g} | {bm.format_bytes(r.get('peak_memory_bytes'))} | {speed} | {memory} |")
    return "\n".join(lines)


def timing_mode(env: Dict[str, Any]) -> str:
    """How a recording's calls were timed, in words (its environment's mlx_compiled and back_to_back)."""
    k = env.get("back_to_back") or 1
    each = "each call waited for alone" if k == 1 else f"{k} calls back to back per sample, waited for once"
    return each + ("; MLX's passes mx.compile'd" if env.get("mlx_compiled") else "")


def case_table(case: bm.BenchCase, rows: List[Dict[str, Any]]) -> str:
    return f"== {case.label()}\n" + bm.format_table(TABLE_HEADERS, [row_cells(r) for r in rows])


# ---------------------------------------------------------------------------------------------
# Outputs


def write_json(path: Path, payload: Dict[str, Any]) -> None:
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(payload, indent=1))
    os.replace(temporary, path)  # atomic: a run killed mid-write keeps the previous file


def plot(payload: Dict[str, Any], out_dir: Path, name: str) -> List[Path]:
    """One PNG per (head dim, dtype): TFLOP/s and peak memory vs sequence length, one row of
    panels per (mask, kv heads), lines per implementation (colour) and pass (line style)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = [r for r in payload["rows"] if r.get("status") == "ok"]
    env = payload["environment"]
    styles = {"forward": "-", "backward": ":", "forward_backward": "--"}
    markers = {"forward": "o", "backward": "v", "forward_backward": "s"}
    colours = {impl: f"C{i}" for i, impl in enumerate(IMPLEMENTATIONS)}
    paths = []
    for head_dim, dtype in sorted({(r["head_dim"], r["dtype"]) for r in rows}):
        group = [r for r in rows if r["head_dim"] == head_dim and r["dtype"] == dtype]
        # By mask (none, causal, bool, additive), full heads before GQA.
        panels = sorted({(bm.case_of(r).mask, r["q_heads"], r["kv_heads"]) for r in group},
                        key=lambda p: (bm.MASKS.index(p[0]), -p[2], p[1]))
        figure, axes = plt.subplots(len(panels), 2, figsize=(12, 4.2 * len(panels)), squeeze=False)
        for (mask, q_heads, kv_heads), (ax_speed, ax_memory) in zip(panels, axes):
            panel = [r for r in group if (bm.case_of(r).mask, r["q_heads"], r["kv_heads"]) == (mask, q_heads, kv_heads)]
            for implementation in IMPLEMENTATIONS:
                for pass_name in bm.PASSES:
                    line = sorted((r for r in panel if r["implementation"] == implementation
                                   and r["pass"] == pass_name), key=lambda r: r["q_len"])
                    if not line:
                        continue
                    label = implementation + (f"[{line[0]['backend']}]" if line[0].get("backend") else "")
                    label += f" {bm.PASS_LABELS[pass_name]}"
                    x = [r["q_len"] for r in line]
                    style = dict(color=colours[implementation], linestyle=styles[pass_name],
                                 marker=markers[pass_name], label=label)
                    ax_speed.plot(x, [r["tflops"] for r in line], **style)
                    if all(r["peak_memory_bytes"] is not None for r in line):
                        ax_memory.plot(x, [r["peak_memory_bytes"] / (1 << 20) for r in line], **style)
            heads = f"H={q_heads}" if q_heads == kv_heads else f"H={q_heads}/{kv_heads} (GQA)"
            title = f"D={head_dim} {dtype} {heads} " + {"none": "non-causal", "causal": "causal"}.get(mask, f"{mask} mask")
            lengths = sorted({r["q_len"] for r in panel})
            for ax, ylabel in ((ax_speed, "TFLOP/s"), (ax_memory, "peak memory above inputs (MiB)")):
                ax.set_xscale("log", base=2)
                ax.set_xticks(lengths, [str(n) for n in lengths])
                ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
                ax.set_xlabel("sequence length N")
                ax.set_ylabel(ylabel)
                ax.set_title(title, fontsize=10)
                ax.grid(True, which="both", alpha=0.3)
            ax_memory.set_yscale("log")
            ax_memory.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
            ax_memory.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax_speed.legend(fontsize=7)
        commit = (env.get("git_commit") or "unknown")[:10]
        figure.suptitle(f"{env.get('device_name')} ({env.get('device')}), MLX {env.get('mlx_version')}, "
                        f"mlx-flash {env.get('mlx_flash_version')} @ {commit}, {env.get('date')}", fontsize=10)
        figure.tight_layout(rect=(0, 0, 1, 1 - 0.3 / (4.2 * len(panels))))
        path = out_dir / f"{name}_d{head_dim}_{dtype}.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------------------------
# Command line


# Named argument sets. "cases" lists (B, H, N, D) shapes explicitly instead of the cartesian
# sweep (masks and dtypes still multiply). "gpu" is the published GPU table of RESULTS.md.
_GPU_SHAPES = [(4, 16, 4096, 64), (4, 16, 4096, 128), (1, 16, 16384, 128), (1, 16, 4096, 160),
               (1, 16, 4096, 192), (1, 16, 4096, 256), (1, 16, 4096, 512)]
_GPU_SETTINGS = dict(dtypes=["bfloat16"], masks=["none", "causal"], passes=["forward", "forward_backward"],
                     impls=["mlx-flash", "mx.fast", "torch-fa2", "torch-cudnn"], warm_up_clocks_s=1.0)
PRESETS = {
    "gpu": dict(_GPU_SETTINGS, cases=_GPU_SHAPES, warmup=2, min_repeats=5, max_repeats=20, target_seconds=0.3),
    "gpu-quick": dict(_GPU_SETTINGS, cases=[_GPU_SHAPES[i] for i in (0, 1, 5)], warmup=2, min_repeats=3,
                      max_repeats=5, target_seconds=0.1),
}


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="a named argument set; options given as well override it. gpu: bf16, "
                             "(B, H, N, D) = " + ", ".join(map(str, _GPU_SHAPES)) + ", causal and not, "
                             "fwd and fwd+bwd, mlx-flash / mx.fast / torch-fa2 / torch-cudnn (the published "
                             "GPU table); gpu-quick: three of those shapes, fewer repeats")
    sweep = parser.add_argument_group("sweep (the cartesian product is run)")
    sweep.add_argument("--seq-lens", type=positive_int, nargs="+", default=[512, 1024, 2048], help="Nq = Nk values")
    sweep.add_argument("--head-dims", type=positive_int, nargs="+", default=[64], help="head dims D")
    sweep.add_argument("--dtypes", type=dtype_argument, nargs="+", default=["float32"],
                       help="float32/fp32, float16/fp16, bfloat16/bf16")
    sweep.add_argument("--masks", nargs="+", choices=list(bm.MASKS), default=["none", "causal"],
                       help="masks: none, causal, or a random array mask [1, 1, N, N] (bool / additive, "
                            f"{bm.MASK_KEEP * 100:.0f}%% of keys kept; mlx_flash.benchmark.random_mask)")
    sweep.add_argument("--heads", type=positive_int, default=8, help="query heads Hq")
    sweep.add_argument("--kv-heads", type=positive_int, nargs="+", default=None,
                       help="kv heads Hkv values (GQA when < --heads); None: --heads")
    sweep.add_argument("--batch", type=positive_int, default=1, help="batch B")
    sweep.add_argument("--tokens", type=positive_int, default=None,
                       help="batch = max(1, tokens // N) instead of --batch (same work per token across N)")
    what = parser.add_argument_group("what to run")
    what.add_argument("--backend", default="auto", choices=BACKEND_NAMES, help="mlx-flash backend")
    what.add_argument("--impls", nargs="+", choices=IMPLEMENTATIONS, default=["mlx-flash", "mx.fast", "unfused"],
                      help="implementations; torch-* need PyTorch with CUDA and are skipped with the reason "
                           "elsewhere")
    what.add_argument("--torch", action="store_true", help="add torch-fa2 (PyTorch FlashAttention-2 on CUDA)")
    what.add_argument("--passes", nargs="+", choices=bm.PASSES, default=list(bm.PASSES), help="passes")
    what.add_argument("--compiled", action="store_true",
                      help="time the MLX implementations' forward and forward+backward as mx.compile'd functions, "
                           "as a compiled training step runs them (no per-call graph building; torch's unchanged)")
    timing = parser.add_argument_group("timing")
    timing.add_argument("--back-to-back", type=positive_int, default=1, metavar="K",
                        help="calls per timed sample, issued back to back and waited for once (MLX: "
                             "mx.async_eval per call); the sample is its time / K. 1 (default): every "
                             "call waited for alone")
    timing.add_argument("--warmup", type=int, choices=range(0, 101), metavar="{0..100}", default=1,
                        help="untimed runs after the (untimed) peak-memory run, which is the first warm-up")
    timing.add_argument("--min-repeats", type=positive_int, default=3, help="timed runs at least")
    timing.add_argument("--max-repeats", type=positive_int, default=10, help="timed runs at most")
    timing.add_argument("--target-seconds", type=non_negative_float, default=1.0,
                        help="stop repeating once this much time is measured (after --min-repeats)")
    timing.add_argument("--warm-up-clocks-s", type=non_negative_float, default=0.0,
                        help="seconds of matrix products before each case, to bring GPU clocks up")
    timing.add_argument("--seed", type=int, default=0, help="random inputs' seed")
    timing.add_argument("--time-budget-s", type=non_negative_float, default=None,
                        help="start no new case after this many seconds (the rest is listed as skipped)")
    guard = parser.add_argument_group("out-of-memory guard (unfused N^2 arrays)")
    guard.add_argument("--max-memory-gb", type=non_negative_float, default=None,
                       help="memory budget; overrides the fraction")
    guard.add_argument("--memory-fraction", type=non_negative_float, default=bm.MEMORY_GUARD_FRACTION,
                       help="budget as a fraction of device memory")
    out = parser.add_argument_group("output")
    out.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the JSON and PNGs")
    out.add_argument("--name", default="bench", help="file name prefix")
    out.add_argument("--no-plots", action="store_true", help="write no PNGs")
    out.add_argument("--replot", type=Path, default=None, help="only redraw the plots of this JSON")
    out.add_argument("--markdown", type=Path, default=None, help="only print this JSON's rows as Markdown")
    parser.set_defaults(cases=None)
    return parser


def parse_args(argv=None):
    parser = build_parser()
    preset = parser.parse_known_args(argv)[0].preset
    if preset is not None:
        parser.set_defaults(**PRESETS[preset])  # explicit options still win
    args = parser.parse_args(argv)
    given = sys.argv[1:] if argv is None else list(argv)
    shape_options = ("--seq-lens", "--head-dims", "--heads", "--kv-heads", "--batch", "--tokens")
    if any(a.split("=")[0] in shape_options for a in given):
        args.cases = None  # shapes given: the sweep replaces the preset's shape list
    if args.torch and "torch-fa2" not in args.impls:
        args.impls.append("torch-fa2")
    if args.max_repeats < args.min_repeats:
        parser.error(f"--max-repeats ({args.max_repeats}) must be >= --min-repeats ({args.min_repeats})")
    if args.compiled and "backward" in args.passes:
        parser.error("--compiled times the forward and forward_backward passes; drop 'backward' from --passes")
    if args.back_to_back > 1 and "backward" in args.passes:
        parser.error("--back-to-back times the forward and forward_backward passes; drop 'backward' from --passes")
    for kv in args.kv_heads or []:
        if args.heads % kv:
            parser.error(f"--kv-heads {kv} must divide --heads {args.heads}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.markdown is not None:
        print(markdown(json.loads(args.markdown.read_text())))
        return 0
    if args.replot is not None:
        payload = json.loads(args.replot.read_text())
        for path in plot(payload, args.replot.parent, args.replot.stem):
            print(f"wrote {path}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    flash = FlashBackend(args.backend)
    torch_impls = {name: TorchFlash(name=name) for name in args.impls if name in TorchFlash.KERNELS}
    budget, budget_reason = memory_budget(args)
    env = bm.environment(args.backend, flash.name)
    for name, torch_flash in torch_impls.items():
        env[name] = torch_flash.unavailable or f"torch {torch_flash.version} on {torch_flash.device_name}"
    env["memory_budget_bytes"], env["memory_budget"] = budget, budget_reason
    env["cuda_capability_override"] = os.environ.get("MLX_FLASH_CUDA_CAPABILITY") or None  # the planned family
    env["mlx_compiled"] = args.compiled  # MLX implementations timed as mx.compile'd functions
    env["back_to_back"] = args.back_to_back  # calls per timed sample (1: each call synchronized)
    payload = {"environment": env, "arguments": sys.argv[1:] if argv is None else list(argv), "rows": []}
    json_path = args.out / f"{args.name}.json"
    print(f"mlx-flash {env['mlx_flash_version']} ({(env['git_commit'] or 'unknown commit')[:10]}"
          f"{' +changes' if env['git_dirty'] else ''}), MLX {env['mlx_version']}, {env['device_name']} "
          f"({env['device']}), backend {flash.name!r}{' (auto)' if args.backend == 'auto' else ''}"
          f"{': ' + flash.error if flash.error else ''}")
    print(f"memory guard: {budget_reason}; load average {env['load_average']}")
    for name in torch_impls:
        print(f"{name}: {env[name]}")
    print("ms = median of timed runs (IQR: middle half); " + RATE_UNIT + " = 4·B·H·N²·D per forward, 2.5x per "
          "backward, 3.5x per fwd+bwd, halved if causal, over the time; GINSTRS/s = G instructions/s by MFA's count "
          "((a·D + b) per query-key pair); peak mem = bytes allocated above the inputs; time/mx.fast and "
          "mem/mx.fast: this row divided by mx.fast's (lower is better)\n", flush=True)
    start = time.perf_counter()
    cases = build_cases(args)
    for index, case in enumerate(cases):
        if args.time_budget_s is not None and time.perf_counter() - start > args.time_budget_s:
            payload["skipped_cases"] = [c.label() for c in cases[index:]]
            print(f"time budget of {args.time_budget_s:.0f} s spent: skipped {len(cases) - index} cases: "
                  + ", ".join(payload["skipped_cases"]))
            break
        rows = run_case(case, args.seed + index, args, flash, torch_impls, budget)
        payload["rows"].extend(rows)
        payload["environment"]["elapsed_s"] = round(time.perf_counter() - start, 1)
        write_json(json_path, payload)
        print(case_table(case, rows) + "\n", flush=True)
    env["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    write_json(json_path, payload)
    print(f"wrote {json_path.resolve()}")
    if not args.no_plots:
        for path in plot(payload, args.out, args.name):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

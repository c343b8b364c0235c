"""report.md from a report's data (mlx_flash/report.py): GitHub-flavoured markdown tables.

Everything comes from the report dict (what report.json holds), so a saved report.json can be
rendered again: `render_markdown(json.load(open("report.json")))`.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Sequence

from . import benchmark as bm, reference

IMPLEMENTATIONS = ("mlx-flash", "mx.fast", "unfused")
# Where a report goes (the README gives the repository address).
WHERE_TO_SEND = "open an issue on the mlx-flash repository with report.md attached (report.json next to it)"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table (pipes in cells escaped, numbers right-aligned)."""
    def cell(value) -> str:
        return "-" if value is None else str(value).replace("|", "\\|").replace("\n", " ")

    align = ["---:" if rows and all(bm._numeric(cell(r[i])) or cell(r[i]) == "-" for r in rows) else ":---"
             for i in range(len(headers))]
    lines = ["| " + " | ".join(cell(h) for h in headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _error_text(value) -> str:
    """A relative error; report.json holds a non-finite one as a string ("inf")."""
    if isinstance(value, str) or not math.isfinite(value):
        return str(value)
    return f"{value:.1e}"


def render_markdown(report: Dict[str, Any]) -> str:
    env = report["environment"]
    lines = [f"# mlx-flash report: {env.get('device_name')} ({env.get('gpu_architecture') or env.get('device')})", ""]
    simulated = env.get("metal_simulated") and report["backend"] == "metal"
    if simulated:
        lines += ["**The Metal kernels ran in the CPU simulator (MLX_FLASH_METAL_SIM=1)**: the correctness "
                  "results are the simulator's and the mlx-flash times are the simulator's, not a GPU's.", ""]
    if simulated and env.get("metalsim_fault"):
        lines += [f"**Fault injected on purpose: MLX_FLASH_METALSIM_FAULT={env['metalsim_fault']}** "
                  "(docs/metalsim.md).", ""]
    summary = report.get("summary", {})
    lines += [f"**Correctness: {summary.get('verdict', 'incomplete')}** "
              f"({summary.get('passed', 0)} pass, {summary.get('fallback', 0)} fallback, "
              f"{summary.get('failed', 0)} fail, {summary.get('error', 0)} error of {summary.get('cases', 0)} cases; "
              f"{'complete' if report.get('complete') else 'INCOMPLETE: the run stopped early'})", ""]
    facts = [("device", f"{env.get('device_name')} ({env.get('device')})"),
             ("architecture (MLX)", env.get("gpu_architecture")),
             ("GPU cores", env.get("gpu_core_count") or "not reported by MLX"),
             ("memory", bm.format_bytes(env.get("device_memory_bytes"))),
             ("OS", env.get("os")), ("Python", env.get("python")),
             ("MLX", env.get("mlx_version")), ("mlx-flash", env.get("mlx_flash_version")),
             ("commit", f"{env.get('git_commit') or '-'}{' (modified)' if env.get('git_dirty') else ''}"),
             ("backend", f"{report['backend']} (asked: {report['backend_requested']})"),
             ("Metal block table", env.get("metal_block_family")), ("first-use self-check", env.get("self_check")),
             ("tuned block table", env.get("tuned_table") or ("none (shipped tables)" if "tuned_table" in env else None)),
             ("mode", "quick" if report["quick"] else "full"), ("date", env.get("date")),
             ("duration", f"{report.get('seconds', 0):.0f} s")]
    lines += ["## Environment", "", markdown_table(["", ""], [(k, v) for k, v in facts if v is not None]), ""]
    extra = {k: v for k, v in env.get("device_info", {}).items() if k not in ("device_name", "architecture")}
    if extra:
        lines += ["MLX device info: " + ", ".join(f"`{k}` = {v}" for k, v in sorted(extra.items())), ""]

    if env.get("tuned_table_text"):
        lines += ["## Tuned block table (`python -m mlx_flash tune`)", "", "```", env["tuned_table_text"].rstrip(), "```", ""]

    setup = report["correctness_setup"]
    lines += ["## Correctness against the float64 reference", "",
              f"Relative error ||x - ref|| / ||ref|| of each output; q [1, H, {setup['q_len']}, D] and k, v "
              f"[1, Hkv, {setup['kv_len']}, D] unless noted; window = causal with window_size="
              f"{tuple(setup['window'])}; array = "
              "boolean mask [1, 1, Nq, Nk]. FALLBACK: right numbers, but served by the fallback path "
              "(the reason is listed below).", ""]
    rows = []
    for r in report["correctness"]:
        e = r.get("errors", {})
        standard = (r["q_len"], r["kv_len"]) == (setup["q_len"], setup["kv_len"])
        shape = "" if standard else f" Nq={r['q_len']} Nk={r['kv_len']}"
        tolerance = r.get("tolerance")
        rows.append([r["head_dim"], r["dtype"], r["mask"] + shape, f"{r['q_heads']}/{r['kv_heads']}"]
                    + [_error_text(e[n]) if n in e else "-" for n in ("out", "lse", "dq", "dk", "dv")]
                    + [f"{tolerance['forward']:.0e} / {tolerance['gradient']:.0e}" if tolerance else "-",
                       f"**{r['status']}**" if r["status"] != "PASS" else r["status"]])
    lines += [markdown_table(["D", "dtype", "mask", "H/Hkv", "out", "lse", "dq", "dk", "dv", "tol fwd / grad",
                              "result"], rows), ""]
    if any(r.get("reduced_float32") for r in report["correctness"]):
        lines += [f"float32 rows served by MLX's own operations are held to {reference.REDUCED_FLOAT32_LIMITS}'s "
                  "limits: MLX runs float32 matmuls on this device at reduced precision (TF32-like, its default; "
                  "MLX_ENABLE_TF32=0 keeps them at float32's).", ""]
    direct = [r for r in report["correctness"] if "kernel" in r]
    if direct:
        lines += ["The kernels of the FALLBACK cases, called directly (what the fallback hid):", ""]
        rows = []
        for r in direct:
            e = r["kernel"].get("errors", {})
            rows.append([r["case"]] + [_error_text(e[n]) if n in e else "-" for n in ("out", "lse", "dq", "dk", "dv")]
                        + ["PASS" if r["kernel"]["passed"] else f"**FAIL** {r['kernel'].get('error', '')[:300]}"])
        lines += [markdown_table(["case", "out", "lse", "dq", "dk", "dv", "result"], rows), ""]
    for r in report["correctness"]:
        if r["status"] == "ERROR":
            lines += [f"ERROR in {r['case']}:", "", "```", r["error"], "```", ""]

    performance = report.get("performance", [])
    if performance:
        p = report["performance_setup"]
        batched = p.get("back_to_back", 1)
        lines += ["## Speed and memory", "",
                  f"B=1 H={p['heads']} D={p['head_dim']} {p['dtype']}, Nq = Nk = N. Median ms per call of warm runs "
                  + ("(timed interleaved), " if batched == 1 else
                     f"(timed interleaved; each sample up to {batched} calls issued back to back and waited for once, "
                     "as a training step issues them; fewer for long calls), ")
                  + "peak memory above the inputs; ratio = mlx-flash / that implementation "
                  "(below 1: mlx-flash is faster / smaller). GINSTRS/s: MFA's work count (forward 2D+5, "
                  "forward+backward 9D+15 per query-key pair) per second.", ""]
        groups: Dict[tuple, Dict[str, Dict[str, Any]]] = {}
        for r in performance:
            groups.setdefault((r["N"], r["causal"], r["pass"]), {})[r["implementation"]] = r
        rows = []
        for (n, causal, pass_name), by_name in groups.items():
            def get(name, key, fmt):
                value = by_name.get(name, {}).get(key)
                return "-" if value is None else fmt(value)

            ratio = lambda x: f"{x:.2f}x"  # noqa: E731
            notes = "; ".join([f"{name}: {r['error']}" for name, r in by_name.items() if r.get("error")]
                              + [f"mlx-flash served by the FALLBACK ({r['fallback']})"
                                 for name, r in by_name.items() if r.get("fallback")]
                              + [f"backend='auto' routes this to mx.fast ({r['auto_route']})"
                                 for name, r in by_name.items() if r.get("auto_route")])
            rows.append([n, "yes" if causal else "no", bm.PASS_LABELS.get(pass_name, pass_name),
                         " / ".join(get(name, "median_ms", bm.format_ms) for name in IMPLEMENTATIONS),
                         get("mx.fast", "time_ratio", ratio), get("unfused", "time_ratio", ratio),
                         get("mlx-flash", "ginstrs", lambda x: f"{x:.3g}"),
                         " / ".join(get(name, "peak_memory_bytes", bm.format_bytes) for name in IMPLEMENTATIONS),
                         get("mx.fast", "memory_ratio", ratio), get("unfused", "memory_ratio", ratio), notes])
        lines += [markdown_table(["N", "causal", "pass", "ms: mlx-flash / mx.fast / unfused", "time vs mx.fast",
                                  "time vs unfused", "mlx-flash GINSTRS/s",
                                  "peak memory: mlx-flash / mx.fast / unfused",
                                  "memory vs mx.fast", "memory vs unfused", "note"], rows), ""]

    lines += ["## First contact (kernel variants built, run and self-checked once per process)", ""]
    contacts = report.get("first_contact", [])
    if contacts:
        lines += [markdown_table(["backend", "variants", "seconds (build, run, check)", "verdict"],
                                 [[c["backend"], c["variants"], f"{c['seconds']:.2f}", c["verdict"] or "ok"]
                                  for c in contacts]), ""]
        for c in contacts:
            if c.get("detail"):
                lines += [f"Whole error of {c['variants']}:", "", "```", c["detail"].strip(), "```", ""]
    else:
        lines += ["None (the backend has no compiled kernels).", ""]
    lines += ["## Fallbacks", ""]
    fallbacks = report.get("fallbacks", {})
    if fallbacks:
        lines += [markdown_table(["calls", "reason"], [[n, reason] for reason, n in fallbacks.items()]), ""]
    else:
        lines += ["None: every call ran on the backend that was asked for.", ""]
    routes = report.get("routes", {})
    if routes:
        lines += ["## Routed (backend='auto' chose mx.fast where kernels/dispatch_cuda.txt measured it faster)", "",
                  markdown_table(["calls", "reason"], [[n, reason] for reason, n in routes.items()]), ""]
    lines += [f"To share this result: {WHERE_TO_SEND}.", ""]
    return "\n".join(lines)

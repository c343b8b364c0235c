"""Where a wgmma forward CTA's time goes: clock stamps at its phases, on the GPU (sm_90).

    python benchmarks/cta_phases.py [--against REV|FOLDER] [--shapes 4,16,4096,128,none 1,16,16384,128,causal ...]
        [--out FILE.json]

A copy of a version's mlx_flash/ and kernels/ (this checkout's by default; --against as in
ab_versions.py) gets clock64 stamps in kernels/attention_forward_wgmma.cu (STAMPS below: text
inserted after fixed lines of the template, which must still be there), and a process that imports
that copy runs the forward on each shape (B,H,N,D,mask[,KV_HEADS] in bf16 as in ab_versions.py,
mask none or causal; backend "cuda", the table's plan) and reads the stamps back. The stamps
overwrite lse: this is a probe, never a kernel to use.

Each consumer warpgroup's thread 0 writes 16 words over lse[b, h, first row of its 64 .. + 15]
after its epilogue: the SM, its entry clock (64 bits), the global timer at entry (64 bits), and
the cycles from entry to each of CONSUMER_PHASES; the producer's thread 0 stamps PRODUCER_PHASES
into shared memory, which warp 1 of each consumer warpgroup writes over rows 16 .. 18.

Printed per shape, medians over CTAs in microseconds from entry (cycles / the SM clock, fitted
from the entry clocks against the global timer): when each phase ended, the step loop's time per
key block, the idle time between CTAs on an SM and each SM's idle time at the kernel's end.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import versions  # noqa: E402
from cli_args import parse_shape  # noqa: E402

ROOT = HERE.parent
TEMPLATE = "kernels/attention_forward_wgmma.cu"
# When each stamp is taken (the consumer's, then the producer's).
CONSUMER_PHASES = ("parameters read", "barriers ready", "registers raised", "Q issued", "Q landed", "first K landed",
                   "first softmax done", "step loop done", "last P V done", "epilogue math done", "end")
PRODUCER_PHASES = ("producer registers lowered", "tensor maps published", "first K issued")
RECORD_WORDS = 19  # 5 + len(CONSUMER_PHASES) words by warp 0, len(PRODUCER_PHASES) by warp 1
SHAPES = ("4,16,4096,128,none", "1,16,16384,128,none", "4,16,4096,64,none", "4,16,4096,128,causal")

_WRITE = """{ probe[11] = clock64(); __syncwarp();
    const int prow = q0 + (warpgroup / CG) * 64;
    if (tid % 128 == 0 && prow + 19 <= Nq && warpgroup % CG == 0) {
      unsigned* w = reinterpret_cast<unsigned*>(lse + bh * Nq + prow);
      w[0] = probe_sm; w[1] = (unsigned)probe_e; w[2] = (unsigned)(probe_e >> 32);
      w[3] = (unsigned)probe_g; w[4] = (unsigned)(probe_g >> 32);
      for (int i = 1; i < 12; ++i) w[4 + i] = (unsigned)(probe[i] - probe_e);
    }
    if (tid % 128 == 32 && prow + 19 <= Nq && warpgroup % CG == 0) {
      unsigned* w = reinterpret_cast<unsigned*>(lse + bh * Nq + prow);
      for (int i = 1; i < 4; ++i) w[15 + i] = (unsigned)(probe_p[i] - probe_e);
    } }
"""
_STAGED_STORE = ("      store_tile_staged<HEAD_DIM>(o_out, inv, Qs + row_group * Q_GROUP_BYTES, warp, lane, Nq - q_row, "
                 "og.from(q_row));\n")
_OUTPUT_STORE = ("  store_output_tile<HEAD_DIM>(o_out, row_max, row_sum, row0, Nq, col0, og, col0 == 0 ? lse + bh * Nq : "
                 "nullptr, tq);\n")
_PRODUCER_CALL = ("    produce_key_value_tiles<BN, PANELS, HEAD_DIM, STAGES>(ring, Ks, Vs, kg, vg, kb_begin, steps, Nk, "
                  "vec, tma,\n")
# (file, line of the template, what goes before it, what goes after it). Every line must occur once.
STAMPS = (
    (TEMPLATE, "  const i64 bid = linear_block();\n",
     "  const unsigned long long probe_e = clock64();\n"
     "  unsigned long long probe_g;\n  asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(probe_g));\n", ""),
    (TEMPLATE, "  if (bid >= ip[P_TOTAL]) return;\n", "",
     "  volatile unsigned long long probe[12];\n  __shared__ volatile unsigned long long probe_p[4];\n"
     "  unsigned probe_sm;\n  asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(probe_sm));\n"),
    (TEMPLATE, "  if (tid == 0) ring.init(4 * CONSUMERS, tma ? 1 : 128);\n", "  probe[1] = clock64();\n", ""),
    (TEMPLATE, "  __syncthreads();  // the barriers are initialized (and the ones written) before anyone uses them\n", "",
     "  probe[2] = clock64();\n"),
    (TEMPLATE, "    registers_decrease<PRODUCER_REGS>();\n", "",
     "    if (tid == 128 * CONSUMERS) probe_p[1] = clock64();\n"),
    (TEMPLATE, _PRODUCER_CALL, "",
     "        probe_p,\n"),
    (TEMPLATE, "  registers_increase<CONSUMER_REGS>();\n", "", "  probe[3] = clock64();\n"),
    (TEMPLATE, "    resident_rows_ready(warpgroup);\n", "    probe[4] = clock64();\n", "    probe[5] = clock64();\n"),
    (TEMPLATE, "    wait_full(ring.full_keys(0), 0);\n", "", "    probe[6] = clock64();\n"),
    (TEMPLATE, "    for (int it = 0; it + 1 < steps; ++it) {\n", "    probe[7] = clock64();\n", ""),
    (TEMPLATE, "    wait_full(ring.full_values((steps - 1) % STAGES), steps - 1);\n", "    probe[8] = clock64();\n", ""),
    (TEMPLATE, "    turns.pass(true);  // the last warpgroup's last turn has no taker\n", "",
     "    wgmma_wait<0>();\n    probe[9] = clock64();\n"),
    (TEMPLATE, _STAGED_STORE, "      probe[10] = clock64();\n", "      " + _WRITE),
    (TEMPLATE, _OUTPUT_STORE, "  probe[10] = clock64();\n", "  " + _WRITE),
    ("kernels/wgmma_common.cuh",
     "                                                        bool vec, bool tma, const TensorMapSource& maps, "
     "int ptid,\n",
     "", ""),  # replaced below: the producer takes the stamp array
    ("kernels/wgmma_common.cuh", "    if (ptid != 0) return;\n    for (int j = 0; j < steps; ++j) {\n",
     "", ""),
    ("kernels/wgmma_common.cuh", "      mbarrier_arrive_expect_bytes(ring.full_keys(stage), TILE_BYTES);\n",
     "      if (j == 0 && probe_p) probe_p[3] = clock64();\n", ""),
    ("kernels/attention_backward_query_wgmma.cu",
     "    produce_key_value_tiles<BN, TILE_PANELS, HEAD_DIM, STAGES>(ring, Ks, Vs, kg, vg, kb_begin, steps, Nk, vec, "
     "tma,\n", "", "        nullptr,\n"),
)
# Lines replaced outright (the producer's signature gains the stamp array; its maps stamp).
REPLACE = {
    ("kernels/wgmma_common.cuh",
     "                                                        bool vec, bool tma, const TensorMapSource& maps, "
     "int ptid,\n"):
    "                                                        bool vec, bool tma, volatile unsigned long long* probe_p,\n"
    "                                                        const TensorMapSource& maps, int ptid,\n",
    ("kernels/wgmma_common.cuh", "    if (ptid != 0) return;\n    for (int j = 0; j < steps; ++j) {\n"):
    "    if (ptid != 0) return;\n    if (probe_p) probe_p[2] = clock64();\n    for (int j = 0; j < steps; ++j) {\n",
}


def stamp_tree(tree: str) -> None:
    """Insert STAMPS into the copy at `tree` (its kernels/ files are rewritten in place; its
    mlx_flash/kernels must be the link to them that the package reads its templates through)."""
    if Path(tree, "mlx_flash", "kernels").resolve() != Path(tree, "kernels").resolve():
        raise SystemExit(f"{tree}: mlx_flash/kernels is not a link to kernels/, so the stamps would not be used")
    texts = {}
    for path, line, before, after in STAMPS:
        text = texts.setdefault(path, Path(tree, path).read_text())
        if text.count(line) != 1:
            raise SystemExit(f"{path}: the line {line.strip()!r} occurs {text.count(line)} times, not once: the "
                             f"template changed, so update cta_phases.STAMPS")
        new = REPLACE.get((path, line), before + line + after)
        texts[path] = text.replace(line, new)
    for path, text in texts.items():
        Path(tree, path).write_text(text)


def decode(words, parallel_block: int):
    """Records of one call from lse's words (uint32 [B * H, N]): one per consumer warpgroup of 64 rows."""
    import numpy as np
    words = np.asarray(words, dtype=np.uint64)
    records = []
    for bh in range(words.shape[0]):
        for row in range(0, words.shape[1] - RECORD_WORDS + 1, 64):
            r = words[bh, row:row + RECORD_WORDS]
            records.append(dict(sm=int(r[0]), entry=int(r[1] | (r[2] << np.uint64(32))),
                                timer=int(r[3] | (r[4] << np.uint64(32))), warpgroup=(row % parallel_block) // 64,
                                cta=(bh, row // parallel_block), consumer=[int(x) for x in r[5:16]],
                                producer=[int(x) for x in r[16:19]]))
    return records


def summarize(records, steps):
    """Medians over CTAs (us from entry), the loop's time per key block (where every CTA walks
    `steps` key blocks; None: they differ, as under a causal mask), gaps between CTAs on an SM."""
    import numpy as np
    by_sm = {}
    for r in records:
        by_sm.setdefault(r["sm"], []).append(r)
    slopes = [np.polyfit([x["timer"] for x in rs], [x["entry"] for x in rs], 1)[0]
              for rs in by_sm.values() if len({x["timer"] for x in rs}) >= 2]
    ghz = float(np.median(slopes))  # cycles per ns
    to_us = 1.0 / ghz / 1e3
    consumer = np.array([r["consumer"] for r in records], float) * to_us
    first = [r for r in records if r["warpgroup"] == 0]
    producer = np.array([r["producer"] for r in first], float) * to_us
    ctas = {}
    for r in records:
        c = ctas.setdefault(r["cta"], dict(sm=r["sm"], entry=r["entry"], timer=r["timer"], end=0))
        c["end"] = max(c["end"], r["entry"] + r["consumer"][-1])
    per_sm = {}
    for c in ctas.values():
        per_sm.setdefault(c["sm"], []).append(c)
    gaps = []
    for cs in per_sm.values():
        cs.sort(key=lambda c: c["entry"])
        gaps += [b["entry"] - a["end"] for a, b in zip(cs, cs[1:])]
    ends = [max(c["timer"] + (c["end"] - c["entry"]) / ghz for c in cs) for cs in per_sm.values()]
    start = min(c["timer"] for c in ctas.values())
    phases = {name: float(np.median(consumer[:, i])) for i, name in enumerate(CONSUMER_PHASES)}
    phases.update({name: float(np.median(producer[:, i])) for i, name in enumerate(PRODUCER_PHASES)})
    loop = phases["step loop done"] - phases["first softmax done"]
    return dict(sm_clock_ghz=ghz, ctas=len(ctas), sms=len(per_sm), kernel_us=(max(ends) - start) / 1e3,
                phase_end_us=phases, steps=steps, loop_us_per_step=loop / max(steps - 1, 1) if steps else None,
                gap_between_ctas_us=float(np.median(gaps)) * to_us if gaps else None,
                sm_idle_at_end_us=float(np.mean([max(ends) - e for e in ends])) / 1e3)


def measure(shapes) -> dict:
    """In the stamped copy's process: each shape's forward, its stamps decoded and summarized."""
    import mlx.core as mx
    from mlx_flash import benchmark as bm
    from mlx_flash import flash_attention
    from mlx_flash.backends import cuda
    from mlx_flash.spec import check_inputs
    results = {}
    for case in shapes:
        b, h, n, d, causal = case.batch, case.q_heads, case.q_len, case.head_dim, case.causal
        q, k, v, _ = bm.random_inputs(case, seed=0)
        mask = "causal" if causal else None
        for _ in range(3):  # compile, warm up; the last call's stamps are read
            out, lse = flash_attention(q, k, v, mask=mask, return_lse=True, backend="cuda")
            mx.eval(out, lse)
        variant = cuda.CUDABackend().variant("forward", check_inputs(q, k, v, mask=mask)[0])
        records = decode(mx.view(lse, mx.uint32).reshape(b * h, n), variant.parallel_block)
        label = f"B={b} H={h}{f'/{case.kv_heads}' if case.kv_heads != h else ''} N={n} D={d}" + (
            " causal" if causal else "")
        steps = None if causal else -(-n // variant.traversal_block)  # (causal: each query block its own)
        results[label] = dict(kernel=variant.name, **summarize(records, steps))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default=None, help="a git revision or a folder with mlx_flash/ and kernels/ "
                                                        "(default: this checkout)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES),
                        help=f"B,H,N,D,mask[,KV_HEADS] (bf16, mask none or causal), default {' '.join(SHAPES)}")
    parser.add_argument("--out", help="write the summaries as JSON here")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # in the stamped copy
    args = parser.parse_args(argv)
    try:
        cases = [parse_shape(text) for text in args.shapes]
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    if args.measure:
        print(json.dumps(measure(cases)))
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        tree = str(ROOT) if args.against is None else versions.version_tree(args.against, scratch)
        if tree != scratch:  # a copy to stamp (symlinks kept: mlx_flash/kernels -> ../kernels)
            for part in ("mlx_flash", "kernels"):
                shutil.copytree(Path(tree, part), Path(scratch, part), symlinks=True,
                                ignore=shutil.ignore_patterns("__pycache__"))
        stamp_tree(scratch)
        run = subprocess.run([sys.executable, __file__, "--measure", "--shapes", *args.shapes], cwd=scratch, text=True,
                             capture_output=True, env=versions.tree_env(scratch))
        if run.returncode != 0:
            sys.stderr.write(run.stderr)
            return run.returncode
    results = json.loads(run.stdout.strip().splitlines()[-1])
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    names = ("parameters read", "barriers ready", "first K issued", "first K landed", "first softmax done",
             "step loop done", "last P V done", "end")
    print("| shape | " + " | ".join(names) + " | per key block | between CTAs | SM idle at the end | kernel |")
    print("|---" * (len(names) + 5) + "|")
    for label, r in results.items():
        p = r["phase_end_us"]
        print(f"| {label} | " + " | ".join(f"{p[n]:.2f}" for n in names)
              + (f" | {r['loop_us_per_step']:.3f}" if r["loop_us_per_step"] is not None else " | -")
              + f" | {r['gap_between_ctas_us'] or 0:.2f} | {r['sm_idle_at_end_us']:.1f} "
              f"| {r['kernel_us']:.0f} |")
    print("(us from a CTA's entry, medians over CTAs; per key block: the step loop's time / its steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

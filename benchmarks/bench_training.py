"""An mlx-lm Llama training step with MLX's attention and with mlx-flash patched in.

The model is mlx-lm's own `mlx_lm.models.llama` (RoPE, GQA, SwiGLU, tied embeddings), built from
a `ModelArgs` here (no weights are downloaded); the step is the one of MLX's examples: a
`nn.value_and_grad` of the mean next-token cross entropy and an `optim.AdamW` update, compiled
with `mx.compile` over the model's and the optimizer's state. One model and one optimizer serve
both variants (so the resident memory is the same); each variant has its own compiled step:

    mlx-lm     mlx-lm's attention (mx.fast.scaled_dot_product_attention; cuDNN on CUDA)
    mlx-flash  the same step traced under `mlx_flash.integrations.mlx_lm.patched(backend)`

For each sequence length: warm-up steps of both, then interleaved rounds (the order alternates)
of --steps timed steps each; the time is the median over all timed steps, and the speed's spread
the quartiles of the per-round ratios (mlx-lm's median step in a round over mlx-flash's: both met
the same clocks and neighbours). The gpu preset times 16 rounds of 8 steps: with 3 rounds of 4
the 2K step's ratio moved 0.96-1.07x from run to run on an H200, with 128 steps 1.01-1.03x. Peak memory is
mx.get_peak_memory() over one step after mx.clear_cache() and mx.reset_peak_memory(), with the
other variant idle (resident: weights, gradients-to-be, AdamW state; "resident" in the JSON is
the active memory before the step), measured over --memory-steps such steps per variant, the
variants alternating; the table gives the median (one step's peak on a GPU varies by up to 10%:
MLX's CUDA backend frees a command buffer's temporaries when the buffer completes, and how far
the host runs ahead of the GPU decides how many are alive at once).

    python3 benchmarks/bench_training.py                      # H100: 2K, 8K, 16K tokens, bf16
    python3 benchmarks/bench_training.py --preset cpu         # a tiny model in seconds (CPU)
    python3 benchmarks/bench_training.py --seq-lens 4096 --steps 5 --out train.json

MLX_FLASH_TREE=<folder> runs the mlx_flash of another version's tree (a folder holding its
mlx_flash/ and kernels/, e.g. from `git archive REV mlx_flash kernels`) instead of this
repository's; the header line and the JSON name the package that ran ("mlx_flash_path").

Only `mlx_lm.models.*` is imported (never mlx_lm's top level, which pulls in transformers and
huggingface_hub), so a copy of mlx_lm whose __init__.py is empty works where those are missing.
The table is printed last; --out writes the JSON (environment, settings, per-length rows).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, os.environ.get("MLX_FLASH_TREE") or str(ROOT))  # this repository's mlx_flash unless told

from mlx_lm.models import llama  # noqa: E402

import mlx_flash  # noqa: E402
from mlx_flash import benchmark as bm  # noqa: E402
from mlx_flash.cli import positive_int  # noqa: E402
from mlx_flash.integrations import mlx_lm as flash_mlx_lm  # noqa: E402

# Model sizes and step settings per preset; command-line options override them.
PRESETS = {
    # Llama-style block at head dim 128, GQA 4:1 (16 query heads, 4 kv heads), 4 layers.
    "gpu": dict(hidden_size=2048, intermediate_size=5632, heads=16, kv_heads=4, head_dim=128, layers=4,
                vocab_size=32000, seq_lens=[2048, 8192, 16384], dtype="bfloat16", warmup=3, rounds=16,
                steps=8, memory_steps=7),
    # The same structure, tiny: runs in seconds on a 2-core CPU (the path, not a speed figure).
    "cpu": dict(hidden_size=128, intermediate_size=256, heads=4, kv_heads=1, head_dim=32, layers=2,
                vocab_size=512, seq_lens=[64, 128], dtype="bfloat16", warmup=1, rounds=2, steps=2, memory_steps=2),
}
VARIANTS = ("mlx-lm", "mlx-flash")
MIB = 1 << 20


def build_model(settings) -> llama.Model:
    args = llama.ModelArgs(
        model_type="llama", hidden_size=settings.hidden_size, num_hidden_layers=settings.layers,
        intermediate_size=settings.intermediate_size, num_attention_heads=settings.heads,
        num_key_value_heads=settings.kv_heads, head_dim=settings.head_dim, rms_norm_eps=1e-5,
        vocab_size=settings.vocab_size, tie_word_embeddings=True)
    model = llama.Model(args)
    model.set_dtype(getattr(mx, settings.dtype))
    mx.eval(model.parameters())
    return model


def loss_fn(model, inputs, targets):
    logits = model(inputs)
    return nn.losses.cross_entropy(logits, targets, reduction="mean")


def make_step(model, optimizer):
    """A compiled training step over (model, optimizer) state, as in MLX's examples."""
    state = [model.state, optimizer.state]
    loss_and_grad = nn.value_and_grad(model, loss_fn)

    @partial(mx.compile, inputs=state, outputs=state)
    def step(inputs, targets):
        loss, grads = loss_and_grad(model, inputs, targets)
        optimizer.update(model, grads)
        return loss

    return step, state


class Runner:
    """The two compiled steps over one model; `run(variant)` executes one step and waits for it."""

    def __init__(self, settings, backend: str):
        self.model = build_model(settings)
        self.optimizer = optim.AdamW(learning_rate=1e-5)
        self.optimizer.init(self.model.trainable_parameters())
        self.backend = backend
        self.steps = {}
        for variant in VARIANTS:
            self.steps[variant], self.state = make_step(self.model, self.optimizer)
        mx.eval(self.state)

    def mode(self, variant: str):
        """The context a variant's steps run in: patched for mlx-flash (entered once per block of
        steps, outside the timed region: a patch + unpatch walks every loaded module, ~5 ms),
        checked unpatched for mlx-lm. The flash step is only ever called while patched, so a
        retrace (a new shape) keeps the flash path."""
        return flash_mlx_lm.patched(self.backend) if variant == "mlx-flash" else _Unpatched()

    def run(self, variant: str, inputs, targets) -> float:
        """One step of `variant` (inside `mode(variant)`), evaluated; returns the loss."""
        loss = self.steps[variant](inputs, targets)
        mx.eval(loss, self.state)
        return loss


class _Unpatched:
    def __enter__(self):
        if flash_mlx_lm.is_patched():
            raise RuntimeError("[bench_training] the mlx-lm variant must run unpatched")

    def __exit__(self, *exc):
        return False


def measure_length(runner: Runner, seq_len: int, settings, seed: int):
    """Time and peak memory of both variants at one sequence length (batch 1)."""
    tokens = mx.random.randint(0, settings.vocab_size, (1, seq_len + 1), key=mx.random.key(seed))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    mx.eval(inputs, targets)
    losses = {}
    for variant in VARIANTS:  # the first call traces and compiles
        with runner.mode(variant):
            for _ in range(settings.warmup):
                losses[variant] = runner.run(variant, inputs, targets).item()
    memory = {variant: dict(peaks=[], resident=[]) for variant in VARIANTS}
    for r in range(settings.memory_steps):
        for variant in VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS)):
            with runner.mode(variant):
                mx.synchronize()
                mx.clear_cache()
                memory[variant]["resident"].append(mx.get_active_memory())
                mx.reset_peak_memory()
                runner.run(variant, inputs, targets)
                memory[variant]["peaks"].append(mx.get_peak_memory())
    times = {variant: [] for variant in VARIANTS}
    round_ratios = []  # mlx-lm's median step over mlx-flash's, per round
    for r in range(settings.rounds):
        order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
        for variant in order:
            with runner.mode(variant):
                for _ in range(settings.steps):
                    start = time.perf_counter()
                    runner.run(variant, inputs, targets)
                    times[variant].append(time.perf_counter() - start)
        base, flash = (statistics.median(times[v][-settings.steps:]) for v in VARIANTS)
        round_ratios.append(base / flash)
    row = {"seq_len": seq_len, "tokens_per_step": seq_len}
    for variant in VARIANTS:
        ms = statistics.median(times[variant]) * 1e3
        row[variant] = dict(step_ms=ms, step_ms_all=[t * 1e3 for t in times[variant]],
                            tokens_per_s=seq_len / ms * 1e3,
                            peak_bytes=int(statistics.median(memory[variant]["peaks"])),
                            peak_bytes_all=memory[variant]["peaks"],
                            resident_bytes=int(statistics.median(memory[variant]["resident"])),
                            warmup_loss=losses[variant])
    flash, base = row["mlx-flash"], row["mlx-lm"]
    row["speed_ratio"] = base["step_ms"] / flash["step_ms"]  # > 1: patched is faster
    spread = bm.Timing(round_ratios)
    row["speed_ratio_rounds"] = round_ratios
    row["speed_ratio_quartiles"] = [spread.quantile(0.25), spread.quantile(0.75)]
    row["peak_ratio"] = flash["peak_bytes"] / base["peak_bytes"]  # < 1: patched uses less
    above = [row[v]["peak_bytes"] - row[v]["resident_bytes"] for v in ("mlx-flash", "mlx-lm")]
    row["peak_above_resident_ratio"] = above[0] / above[1] if above[1] > 0 else None
    return row


def table(rows) -> str:
    lines = ["| tokens | mlx-lm ms | mlx-flash ms | speed (mlx-lm / flash; rounds q1-q3) | mlx-lm peak MiB | "
             "mlx-flash peak MiB | peak (flash / mlx-lm) | above resident (flash / mlx-lm) |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        base, flash = row["mlx-lm"], row["mlx-flash"]
        above = row["peak_above_resident_ratio"]
        q1, q3 = row["speed_ratio_quartiles"]
        lines.append(f"| {row['seq_len']} | {bm.format_ms(base['step_ms'])} | {bm.format_ms(flash['step_ms'])} | "
                     f"{row['speed_ratio']:.2f}x ({q1:.2f}-{q3:.2f}) | {base['peak_bytes'] / MIB:.0f} | {flash['peak_bytes'] / MIB:.0f} | "
                     f"{row['peak_ratio']:.3f}x | {'-' if above is None else f'{above:.3f}x'} |")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    on_gpu = mx.default_device().type == mx.gpu
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpu" if on_gpu else "cpu",
                        help="model size and step counts (default: gpu on a GPU, else cpu)")
    parser.add_argument("--seq-lens", type=positive_int, nargs="+", help="tokens per step (batch 1)")
    for name in ("hidden-size", "intermediate-size", "heads", "kv-heads", "head-dim", "layers", "vocab-size",
                 "warmup", "rounds", "steps", "memory-steps"):
        parser.add_argument(f"--{name}", type=positive_int, help="overrides the preset's value")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--backend", default="auto", choices=("auto", "mlx", "metal", "cuda"),
                        help="mlx_flash backend of the patched step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the JSON here")
    args = parser.parse_args(argv)
    settings = dict(PRESETS[args.preset])
    for key in list(settings):
        value = getattr(args, key, None)
        if value is not None:
            settings[key] = value
    settings = argparse.Namespace(**settings)
    if settings.heads % settings.kv_heads:
        parser.error(f"--heads ({settings.heads}) must be a multiple of --kv-heads ({settings.kv_heads})")
    return args, settings


def main(argv=None) -> int:
    args, settings = parse_args(argv)
    mx.random.seed(args.seed)
    env = bm.environment(args.backend, None)
    env["mlx_flash_path"] = str(Path(mlx_flash.__file__).resolve().parent)
    print(f"# {env['device_name']} ({env['device']}), mlx {env['mlx_version']}, mlx-flash {env['mlx_flash_version']}, "
          f"commit {env['git_commit']}, package {env['mlx_flash_path']}")
    print(f"# llama: hidden {settings.hidden_size}, {settings.layers} layers, {settings.heads} q heads / "
          f"{settings.kv_heads} kv heads, head dim {settings.head_dim}, MLP {settings.intermediate_size}, "
          f"vocab {settings.vocab_size} (tied), {settings.dtype}, batch 1; AdamW; mx.compile; "
          f"flash backend {args.backend!r}")
    runner = Runner(settings, args.backend)
    flash_mlx_lm.reset_call_counts()
    rows = []
    for i, seq_len in enumerate(settings.seq_lens):
        row = measure_length(runner, seq_len, settings, args.seed + i)
        rows.append(row)
        print(f"# {seq_len} tokens: mlx-lm {bm.format_ms(row['mlx-lm']['step_ms'])} ms, mlx-flash "
              f"{bm.format_ms(row['mlx-flash']['step_ms'])} ms ({row['speed_ratio']:.2f}x); peak "
              f"{row['mlx-lm']['peak_bytes'] / MIB:.0f} / {row['mlx-flash']['peak_bytes'] / MIB:.0f} MiB "
              f"({row['peak_ratio']:.3f}x)", flush=True)
    calls = flash_mlx_lm.call_counts()
    fallbacks = mlx_flash.fallback_counts()
    print(f"# patched attention calls per trace: {calls}; fallbacks: {fallbacks or 'none'}")
    payload = dict(environment=env, settings=vars(settings), backend=args.backend, rows=rows,
                   call_counts=calls, fallback_counts={str(k): v for k, v in fallbacks.items()})
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=1, default=str) + "\n")
        print(f"# wrote {args.out}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

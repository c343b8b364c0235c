"""LoRA fine-tuning of a Llama model through mlx-lm's tuner, with flash attention patched in.

Runs offline by default: it trains a BPE tokenizer (the `tokenizers` package) on the Python
documentation text that ships with CPython (`pydoc_data.topics`), builds a small Llama from
`mlx_lm.models.llama.ModelArgs`, pre-trains it briefly on most of the topics and then
LoRA-fine-tunes it on the held-out topics. Both phases run `mlx_lm.tuner.trainer.train`
(a compiled training step, optional gradient checkpointing) while
`mlx_flash.integrations.mlx_lm.patched()` routes every attention call to
`mlx_flash.flash_attention`.

    python examples/finetune_llm.py                  # about 2 minutes of 2-core CPU time
    python examples/finetune_llm.py --compare        # then: the same steps with MLX's
                                                     # attention and with flash attention
    python examples/finetune_llm.py --quick          # a few steps (CI)
    python examples/finetune_llm.py --sinks          # a gpt-oss model: learnable attention sinks
    python examples/finetune_llm.py --model PATH [--data DIR]   # a local Hugging Face model

A couple of CPU minutes teach a model this small little more than word frequencies: the point
is the pipeline (mlx-lm's tuner, compiled steps, LoRA, checkpointing, saved adapters) running
on flash attention, with the same losses as MLX's attention. At the default 256 tokens the
attention scores are small next to everything else, so both attentions use about the same
memory; the difference shows once the score matrix outgrows flash attention's blocks, e.g.
`--seq-len 2048 --batch-size 1 --pretrain-steps 0 --steps 2 --compare`.

The offline model has head dim 64 (--head-dim; real models use 64 or 128). With --sinks it is a
small gpt-oss (mlx-lm's gpt_oss: attention sinks, alternating sliding-window and full layers,
mixture of experts) and the sinks are trained in both phases (LoRA leaves them trainable), so
the sink gradient of the fused backward runs end to end through mlx-lm's trainer.

--data takes a folder with train.jsonl / valid.jsonl ({"text": ...} per line) as mlx-lm's
own `mlx_lm.lora` does. The adapters (and, for the offline model, the pre-trained base model
with its tokenizer, in <adapter-path>/base_model) are saved so that
`mlx_lm.load(<adapter-path>/base_model, adapter_path=<adapter-path>)` loads the result.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
import types
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map

from mlx_lm.models import llama
from mlx_lm.tuner.datasets import CacheDataset, load_local_dataset
from mlx_lm.tuner.trainer import TrainingArgs, default_loss, grad_checkpoint, iterate_batches, train
from mlx_lm.tuner.utils import linear_to_lora_layers, print_trainable_parameters
from mlx_lm.utils import load as load_pretrained
from mlx_lm.utils import save_config

import mlx_flash
from mlx_flash.integrations import mlx_lm as flash_mlx_lm

EOS = "<eos>"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="Local Hugging Face-format model directory "
                        "(no download). Default: a small Llama built and pre-trained here.")
    parser.add_argument("--data", type=Path, help="Folder with train.jsonl and valid.jsonl "
                        "({\"text\": ...} lines). Default: CPython's pydoc topics.")
    parser.add_argument("--adapter-path", type=Path, default=Path("finetune_llm_adapters"),
                        help="Where adapters.safetensors and adapter_config.json are saved.")
    parser.add_argument("--pretrain-steps", type=int, default=40,
                        help="Pre-training steps of the offline model (ignored with --model).")
    parser.add_argument("--steps", type=int, default=24, help="LoRA fine-tuning steps.")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256, help="Tokens per training sequence.")
    parser.add_argument("--hidden-size", type=int, default=128, help="Offline model width.")
    parser.add_argument("--head-dim", type=int, default=64, help="Offline model head dim (64 or 128 in "
                        "real models); query heads = max(2, hidden size / head dim), half as many kv heads.")
    parser.add_argument("--sinks", action="store_true", help="Offline model: a small gpt-oss with learnable "
                        "attention sinks (trained in both phases) instead of a Llama.")
    parser.add_argument("--num-layers", type=int, default=2, help="Offline model depth.")
    parser.add_argument("--vocab-size", type=int, default=1024, help="Offline BPE vocabulary.")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--lora-layers", type=int, default=None,
                        help="Blocks (from the top) that get LoRA layers. Default: all.")
    parser.add_argument("--lora-scale", type=float, default=20.0, help="LoRA scale (mlx-lm's default).")
    parser.add_argument("--learning-rate", type=float, default=2e-4, help="LoRA learning rate.")
    parser.add_argument("--pretrain-learning-rate", type=float, default=3e-3)
    parser.add_argument("--grad-checkpoint", action="store_true",
                        help="Gradient checkpointing (mlx-lm's grad_checkpoint) in every phase.")
    parser.add_argument("--compare", action="store_true",
                        help="After training: run the same LoRA steps with MLX's attention and "
                        "with flash attention and report time/step and peak memory side by side.")
    parser.add_argument("--compare-steps", type=int, default=6,
                        help="Steps per side in --compare (the first, which compiles, is untimed).")
    parser.add_argument("--backend", default="auto", choices=("auto", "mlx", "metal", "cuda"),
                        help="mlx_flash backend for the patched attention.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="A few short steps of everything (seconds; for CI).")
    args = parser.parse_args(argv)
    if args.quick:
        args.pretrain_steps, args.steps, args.compare_steps = 3, 3, 3
        args.batch_size, args.seq_len = 2, 64
        args.hidden_size, args.num_layers, args.vocab_size = 64, 2, 384
    if args.head_dim < 1:
        parser.error(f"--head-dim must be positive, got {args.head_dim}")
    if args.sinks and args.model is not None:
        parser.error("--sinks builds the offline gpt-oss model; it does not combine with --model")
    for name in ("pretrain_steps", "steps", "batch_size", "seq_len", "compare_steps"):
        if getattr(args, name) < (0 if name == "pretrain_steps" else 1):
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.compare_steps < 2 and args.compare:
        parser.error(f"--compare-steps must be at least 2 (the first is untimed), got {args.compare_steps}")
    if args.model is not None and not (args.model / "config.json").is_file():
        parser.error(f"--model must be a local model directory with a config.json, got {args.model}")
    if args.data is not None and not (args.data / "train.jsonl").is_file():
        parser.error(f"--data must be a folder with train.jsonl (and valid.jsonl), got {args.data}")
    return args


# ---------------------------------------------------------------- data

def pydoc_corpus():
    """(pre-training texts, fine-tuning texts): CPython's pydoc topics, every fourth topic
    held out for fine-tuning so that LoRA adapts the model to text it has not seen."""
    from pydoc_data.topics import topics
    names = sorted(topics)
    pretrain = [topics[n] for i, n in enumerate(names) if i % 4 != 0]
    finetune = [topics[n] for i, n in enumerate(names) if i % 4 == 0]
    return pretrain, finetune


def train_tokenizer(texts, vocab_size: int):
    """A byte-level BPE tokenizer trained on `texts`, wrapped as a transformers tokenizer (what
    mlx-lm's datasets and mlx_lm.load expect)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS)


class TokenWindows:
    """Documents tokenized, joined with EOS and cut into windows of `length` tokens.

    mlx-lm's TextDataset makes one example per document; the pydoc topics are long documents,
    so they are cut into equal windows instead (language-model pre-training style). The class
    has the protocol mlx-lm's CacheDataset and iterate_batches use (len, getitem, process).
    """

    def __init__(self, texts, tokenizer, length: int):
        tokens = []
        for text in texts:
            tokens += tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        self._windows = [tokens[i:i + length] for i in range(0, len(tokens) - length + 1, length)]

    def __getitem__(self, index):
        return self._windows[index]

    def __len__(self):
        return len(self._windows)

    def process(self, window):
        return window, 0  # (tokens, offset of the first token counted in the loss)

    def split(self, valid_fraction: float):
        """(train, valid) views: the last windows are validation."""
        n_valid = max(1, int(len(self) * valid_fraction))
        train_part, valid_part = TokenWindows.__new__(TokenWindows), TokenWindows.__new__(TokenWindows)
        train_part._windows, valid_part._windows = self._windows[:-n_valid], self._windows[-n_valid:]
        return train_part, valid_part


def load_data(data_dir, tokenizer, texts, args):
    """(train, valid) datasets: mlx-lm's loader for a --data folder, else token windows of `texts`."""
    if data_dir is not None:
        config = types.SimpleNamespace()  # mlx-lm's defaults: "text" key, no prompt masking
        train_set, valid_set, _ = load_local_dataset(data_dir, tokenizer, config)
        if len(valid_set) == 0:
            raise SystemExit(f"{data_dir} has no valid.jsonl (mlx-lm validates during training)")
    else:
        train_set, valid_set = TokenWindows(texts, tokenizer, args.seq_len + 1).split(0.1)
    for name, dataset in (("train", train_set), ("valid", valid_set)):
        if len(dataset) < args.batch_size:
            raise SystemExit(f"the {name} set has {len(dataset)} examples, fewer than "
                             f"--batch-size {args.batch_size}")
    return CacheDataset(train_set), CacheDataset(valid_set)


# ---------------------------------------------------------------- model and training

def build_model(args, vocab_size: int):
    """A small Llama (GQA: half as many kv heads as query heads), or with --sinks a small gpt-oss
    (learnable sinks, sliding-window and full layers, 4 experts), and its config dict."""
    heads = max(2, args.hidden_size // args.head_dim)
    config = dict(hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
                  intermediate_size=2 * args.hidden_size, num_attention_heads=heads, head_dim=args.head_dim,
                  num_key_value_heads=max(1, heads // 2), rms_norm_eps=1e-5, vocab_size=vocab_size,
                  rope_theta=10000.0)
    if args.sinks:
        from mlx_lm.models import gpt_oss
        config.update(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2,
                      sliding_window=min(128, args.seq_len // 2),
                      layer_types=["sliding_attention", "full_attention"] * (args.num_layers // 2)
                      + ["sliding_attention"] * (args.num_layers % 2))
        model = gpt_oss.Model(gpt_oss.ModelArgs.from_dict(config))
        for layer in model.layers:  # gpt-oss starts its sinks at 0; learned ones are a few units
            layer.self_attn.sinks = mx.random.normal(layer.self_attn.sinks.shape)
    else:
        config.update(model_type="llama", max_position_embeddings=4096, tie_word_embeddings=True)
        model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model, config


def sinks_of(model):
    """{layer index: sinks} of a model with attention sinks (empty otherwise)."""
    return {i: layer.self_attn.sinks for i, layer in enumerate(model.layers)
            if hasattr(getattr(layer, "self_attn", None), "sinks")}


def run_trainer(model, train_set, valid_set, args, iters: int, learning_rate: float, weights_file: Path):
    """mlx-lm's trainer: compiled step, validation, progress (loss, tokens/s), final save of
    the trainable parameters to `weights_file`."""
    training_args = TrainingArgs(
        batch_size=args.batch_size, iters=iters, val_batches=2 if args.quick else 4,
        steps_per_report=max(1, iters // 8), steps_per_eval=iters,  # validate at the start and end
        steps_per_save=iters + 1,  # no intermediate checkpoints; the final save still happens
        max_seq_length=args.seq_len + 1, adapter_file=str(weights_file),
        grad_checkpoint=args.grad_checkpoint)
    optimizer = optim.Adam(learning_rate=learning_rate)
    with restored_block_call(model):
        train(model=model, optimizer=optimizer, train_dataset=train_set, val_dataset=valid_set,
              args=training_args, loss=default_loss, iterate_batches=iterate_batches)


@contextlib.contextmanager
def restored_block_call(model):
    """mlx-lm's grad_checkpoint replaces the block class's __call__ for good; putting it back
    after each phase keeps the next phase from checkpointing a checkpoint."""
    block_class = type(model.layers[0])
    call = block_class.__call__
    try:
        yield
    finally:
        block_class.__call__ = call


# ---------------------------------------------------------------- flash vs MLX attention

def run_compare_step(model, sides, batch, lengths, make_step, args):
    """One step of each side on the same batch, each from its own weights and optimizer state."""
    for name, side in sides.items():
        model.update(side["weights"])
        with flash_mlx_lm.patched(args.backend) if name == "flash" else contextlib.nullcontext():
            if side["step"] is None:
                side["step"] = make_step(side["optimizer"])  # traced (compiled) on first call
            mx.eval(model.state, side["optimizer"].state)
            mx.reset_peak_memory()
            tic = time.perf_counter()
            loss = side["step"](batch, lengths)
            mx.eval(loss, model.state, side["optimizer"].state)
            elapsed = time.perf_counter() - tic
        side["peaks"].append(mx.get_peak_memory())
        side["times"].append(elapsed)
        side["losses"].append(loss.item())
        side["weights"] = tree_map(lambda x: x, model.trainable_parameters())


def compare(model, train_set, args):
    """Run the same LoRA steps (same start weights, batches and optimizer) with MLX's attention
    and with flash attention, one step of each in turn; per step: wall time and peak memory.

    The step is the trainer's (value_and_grad of default_loss, optimizer update, mx.compile);
    mlx-lm's train() reports no per-step memory, so it is rebuilt here from the same parts.
    """
    start = tree_map(lambda x: x, model.trainable_parameters())
    batches = list(zip(range(args.compare_steps),
                       iterate_batches(train_set, args.batch_size, args.seq_len + 1, loop=True, seed=args.seed)))
    sides = {}
    for name in ("mlx", "flash"):
        optimizer = optim.Adam(learning_rate=args.learning_rate)
        sides[name] = dict(weights=start, optimizer=optimizer, step=None, times=[], peaks=[], losses=[])

    def make_step(optimizer):
        loss_and_grad = nn.value_and_grad(model, default_loss)
        state = [model.state, optimizer.state]

        @partial(mx.compile, inputs=state, outputs=state)
        def step(batch, lengths):
            (loss, tokens), grad = loss_and_grad(model, batch, lengths)
            optimizer.update(model, grad)
            return loss

        return step

    print(f"\n== compare: {args.compare_steps} identical LoRA steps per side "
          f"(the first compiles and is not timed)")
    print("  step   loss mlx / flash        time mlx / flash      peak mlx / flash")
    with restored_block_call(model):
        if args.grad_checkpoint:
            grad_checkpoint(model.layers[0])
        for index, (batch, lengths) in batches:
            run_compare_step(model, sides, batch, lengths, make_step, args)
            m, f = sides["mlx"], sides["flash"]
            print(f"  {index + 1:>4}   {m['losses'][-1]:.4f} / {f['losses'][-1]:.4f}      "
                  f"{m['times'][-1]:6.3f} s / {f['times'][-1]:6.3f} s   "
                  f"{m['peaks'][-1] / 2**20:6.1f} / {f['peaks'][-1] / 2**20:6.1f} MiB")
    model.update(sides["flash"]["weights"])

    tokens = args.batch_size * args.seq_len
    print(f"\n== flash attention vs MLX attention: batch {args.batch_size} x {args.seq_len} tokens, "
          f"{'with' if args.grad_checkpoint else 'no'} gradient checkpointing, device {mx.default_device()}")
    print(f"  {'':28}{'MLX attention':>16}{'flash attention':>18}")
    medians = {n: statistics.median(s["times"][1:]) for n, s in sides.items()}
    peaks = {n: max(s["peaks"][1:]) for n, s in sides.items()}
    print(f"  {'time/step (median)':28}{medians['mlx']:>14.3f} s{medians['flash']:>16.3f} s")
    print(f"  {'tokens/s':28}{tokens / medians['mlx']:>16.0f}{tokens / medians['flash']:>18.0f}")
    print(f"  {'peak memory (max of steps)':28}{peaks['mlx'] / 2**20:>12.1f} MiB"
          f"{peaks['flash'] / 2**20:>14.1f} MiB")
    diff = max(abs(a - b) for a, b in zip(sides["mlx"]["losses"], sides["flash"]["losses"]))
    print(f"  {'max |loss difference|':28}{diff:>16.2e}")
    return dict(median_step_s=medians, peak_memory_bytes=peaks, max_loss_difference=diff)


# ---------------------------------------------------------------- main

def main(argv=None):
    args = parse_args(argv)
    mx.random.seed(args.seed)
    np.random.seed(args.seed)  # mlx-lm's iterate_batches shuffles with numpy's global generator
    args.adapter_path.mkdir(parents=True, exist_ok=True)
    pretrain_texts, finetune_texts = pydoc_corpus()
    started = time.perf_counter()

    with flash_mlx_lm.patched(args.backend):
        if args.model is not None:
            print(f"== loading {args.model}")
            model, tokenizer = load_pretrained(str(args.model))
        else:
            tokenizer = train_tokenizer(pretrain_texts + finetune_texts, args.vocab_size)
            model, config = build_model(args, len(tokenizer))
            n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
            print(f"== a {'gpt-oss with attention sinks' if args.sinks else 'Llama'} ({args.num_layers} layers, "
                  f"width {args.hidden_size}, {config['num_attention_heads']} heads / "
                  f"{config['num_key_value_heads']} kv heads of dim {args.head_dim}, "
                  f"{n_params / 1e6:.2f}M parameters, vocabulary {len(tokenizer)}): pre-training on "
                  f"{len(pretrain_texts)} pydoc topics, {args.pretrain_steps} steps")
            base_path = args.adapter_path / "base_model"
            base_path.mkdir(parents=True, exist_ok=True)
            pre_train, pre_valid = load_data(None, tokenizer, pretrain_texts, args)
            if args.pretrain_steps > 0:
                # The trainer saves the trainable parameters at the end; while pre-training that
                # is every weight, i.e. the model.safetensors that mlx_lm.load reads.
                run_trainer(model, pre_train, pre_valid, args, args.pretrain_steps,
                            args.pretrain_learning_rate, base_path / "model.safetensors")
            else:
                mx.save_safetensors(str(base_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
            save_config(dict(config), base_path / "config.json")
            tokenizer.save_pretrained(str(base_path))

        train_set, valid_set = load_data(args.data, tokenizer, finetune_texts, args)
        source = args.data if args.data is not None else f"{len(finetune_texts)} held-out pydoc topics"
        print(f"\n== LoRA fine-tuning on {source}: {len(train_set)} training examples, {args.steps} steps")
        model.freeze()
        lora_layers = args.lora_layers or len(model.layers)
        lora_parameters = {"rank": args.lora_rank, "scale": args.lora_scale, "dropout": 0.0}
        if args.sinks:  # LoRA on the attention projections; the sinks stay trainable
            lora_parameters["keys"] = [f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        linear_to_lora_layers(model, lora_layers, lora_parameters)
        sinks_before = {i: mx.array(s) for i, s in sinks_of(model).items()}
        for i in sinks_before:
            model.layers[i].self_attn.unfreeze(keys=["sinks"], recurse=False)
        print_trainable_parameters(model)
        run_trainer(model, train_set, valid_set, args, args.steps, args.learning_rate,
                    args.adapter_path / "adapters.safetensors")
        # What mlx_lm.load(..., adapter_path=...) and mlx_lm.tuner.utils.load_adapters read.
        save_config({"fine_tune_type": "lora", "num_layers": lora_layers,
                     "lora_parameters": lora_parameters, "model": str(args.model or base_path),
                     "attention": "mlx_flash.integrations.mlx_lm"},
                    args.adapter_path / "adapter_config.json")
    trained = time.perf_counter() - started
    counts = flash_mlx_lm.call_counts()
    print(f"\n== trained in {trained:.1f} s; attention calls traced: {counts['flash']} by flash attention, "
          f"{counts['original']} by mlx-lm's own (fallbacks: {mlx_flash.fallback_counts() or 'none'})")
    print(f"   adapters saved in {args.adapter_path}")

    summary = {"train_seconds": trained, "attention_calls": counts}
    if sinks_before:
        change = max(mx.abs(model.layers[i].self_attn.sinks - s).max().item() for i, s in sinks_before.items())
        print(f"   attention sinks trained by LoRA fine-tuning: largest change {change:.2e}")
        summary["sinks_max_change"] = change
    if args.compare:
        summary["compare"] = compare(model, train_set, args)
    with open(args.adapter_path / "finetune_summary.json", "w") as f:
        json.dump(summary, f, indent=2)
    return summary


if __name__ == "__main__":
    main()

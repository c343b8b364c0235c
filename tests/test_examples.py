"""examples/finetune_llm.py end to end with --quick: offline pre-training + LoRA through
mlx-lm's tuner with flash attention patched in, the --compare run, the saved adapters loaded
back by mlx-lm, and the --model / --data path on what the first run saved."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("tokenizers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "finetune_llm.py"


def run_example(*args):
    result = subprocess.run([sys.executable, str(EXAMPLE), "--quick", *map(str, args)],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


def test_finetune_example_quick_offline_compare_and_reload(tmp_path):
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_flatten

    adapters = tmp_path / "adapters"
    output = run_example("--compare", "--adapter-path", adapters)
    assert "flash attention vs MLX attention" in output and "peak memory" in output
    summary = json.loads((adapters / "finetune_summary.json").read_text())
    # Every attention call of both phases was traced on the flash path, none fell back.
    assert summary["attention_calls"]["flash"] > 0 and summary["attention_calls"]["original"] == 0
    # The same steps with MLX's attention and with flash attention give the same losses.
    assert summary["compare"]["max_loss_difference"] < 1e-4

    model, tokenizer = mlx_lm.load(str(adapters / "base_model"), adapter_path=str(adapters))
    saved = mx.load(str(adapters / "adapters.safetensors"))
    loaded = dict(tree_flatten(model.parameters()))
    assert saved and all(name.endswith(("lora_a", "lora_b")) for name in saved)
    for name, value in saved.items():
        assert mx.array_equal(loaded[name], value), name
    assert tokenizer.eos_token_id is not None and len(tokenizer.encode("def f(x): return x")) > 0

    # --model / --data: the base model saved above, a jsonl folder as mlx-lm expects.
    data = tmp_path / "data"
    data.mkdir()
    for split, count in (("train", 8), ("valid", 4)):
        with open(data / f"{split}.jsonl", "w") as f:
            for i in range(count):
                f.write(json.dumps({"text": f"Example {i}: the assert statement checks a condition."}) + "\n")
    output = run_example("--model", adapters / "base_model", "--data", data, "--adapter-path", tmp_path / "second")
    assert "LoRA fine-tuning on" in output and (tmp_path / "second" / "adapters.safetensors").is_file()


def test_finetune_example_trains_sinks_through_flash(tmp_path):
    """--sinks: a gpt-oss model whose learnable sinks train in both phases, every attention call
    (sinks included) on the flash path, and the sink gradient reaching the optimizer."""
    import json
    output = run_example("--sinks", "--head-dim", 32, "--pretrain-steps", 2, "--adapter-path", tmp_path / "a")
    assert "gpt-oss with attention sinks" in output
    summary = json.loads((tmp_path / "a" / "finetune_summary.json").read_text())
    assert summary["attention_calls"]["flash"] > 0 and summary["attention_calls"]["original"] == 0
    assert summary["sinks_max_change"] > 0

"""The README's "Using it" example runs as written and prints what it promises (a few seconds)."""
import subprocess
import sys
from pathlib import Path

from child_env import child_env

ROOT = Path(__file__).resolve().parents[1]


def test_readme_example_runs_as_written(tmp_path):
    readme = (ROOT / "README.md").read_text()
    example = readme.split("## Using it", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert "mx.eval(" in example
    script = tmp_path / "example.py"
    script.write_text(example)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env=child_env())
    assert done.returncode == 0, done.stdout + done.stderr
    first, second = done.stdout.strip().splitlines()
    difference = float(first.rsplit(" ", 1)[1])
    assert first.startswith("output (1, 8, 512, 64)") and difference < 1e-5, first
    assert second.startswith("loss ") and "(1, 2, 512, 64)" in second, second

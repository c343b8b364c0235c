"""The environment of a child Python process a test starts: this checkout first on PYTHONPATH,
then whatever PYTHONPATH already holds (MLX installed with `pip install --target` is found only
through it, as on the GPU machines), so the child imports this tree's mlx_flash and the same mlx."""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child_env(**overrides: str) -> dict:
    """os.environ with overrides, and ROOT put in front of PYTHONPATH."""
    environment = dict(os.environ, **overrides)
    environment["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), environment.get("PYTHONPATH")) if p)
    return environment

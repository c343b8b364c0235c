"""Kernel templates: kernels/<name> files rendered at call time.

A template marks its compile-time constants as {{name}}. Rendering substitutes every one and
fails loudly on a placeholder left without a value or a value no placeholder uses, so a
template and the planner cannot drift apart silently.
"""
from __future__ import annotations

import functools
import re
from importlib import resources

_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


@functools.lru_cache(maxsize=None)
def template_text(name: str) -> str:
    """The raw text of kernels/<name>."""
    return resources.files("mlx_flash.kernels").joinpath(name).read_text()


def render(name: str, **constants) -> str:
    """kernels/<name> with each {{key}} replaced by str(constants[key]).

    Raises:
        KeyError: a placeholder has no value, or a value names no placeholder.
    """
    text = template_text(name)
    used = set(_PLACEHOLDER.findall(text))
    missing = used - constants.keys()
    unused = constants.keys() - used
    if missing or unused:
        raise KeyError(f"[render] {name}: placeholders without a value {sorted(missing)}, "
                       f"values without a placeholder {sorted(unused)}.")
    return _PLACEHOLDER.sub(lambda m: _format(constants[m.group(1)]), text)


def _format(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) + "f" if value == value and abs(value) != float("inf") else str(value)
    return str(value)

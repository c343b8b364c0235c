"""Tuned block tables: measured on the user's own GPU by `python -m mlx_flash tune`, kept in the
user's cache directory, read by the planner (planner.active_table).

A tuned table is a block table in the shipped tables' text format (kernels/blocks_<target>.txt)
whose header says what it was measured on:

    # target: metal
    # family: m3
    # device: Apple M3 Max
    # architecture: applegpu_g15s
    # mlx: 0.32.4
    # mlx_flash: 0.1.0

It lives at $XDG_CACHE_HOME/mlx_flash/tuned/blocks_<target>_<family>_<device>.txt (XDG_CACHE_HOME
defaults to ~/.cache). The planner uses it when target, family, device, architecture and both
versions match this process; a table for other versions (stale) or one that does not parse
(malformed) is ignored with one warning per file and reason, counted like every fallback
(mlx_flash.fallback_counts()); it is never an error in the user's program.

Environment:
    MLX_FLASH_TUNED: "0" ignores tuned tables (the shipped ones plan every call).
"""
from __future__ import annotations

import functools
import os
import re
import time
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx

from . import call_cache, planner
from .backends import metal_simulated
from .fallback import record_fallback

HEADER_KEYS = ("target", "family", "device", "architecture", "mlx", "mlx_flash")
TITLE = "# mlx-flash tuned block table, measured by `python -m mlx_flash tune`"


def enabled() -> bool:
    """MLX_FLASH_TUNED: unset or "1" -> tuned tables are used; "0" -> ignored."""
    value = os.environ.get("MLX_FLASH_TUNED", "1").strip()
    if value not in ("0", "1", ""):
        raise ValueError(f"[mlx_flash] MLX_FLASH_TUNED must be 0 or 1, got {value!r}.")
    return value != "0"


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/mlx_flash/tuned (XDG_CACHE_HOME defaults to ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(base) if base else Path.home() / ".cache") / "mlx_flash" / "tuned"


def device_identity(target: str) -> Tuple[str, str]:
    """(device name, architecture) of the GPU a target's kernels run on in this process.

    The Metal simulator (MLX_FLASH_METAL_SIM=1) is a device of its own: tables measured through it
    never serve a real Mac, and a Mac's never the simulator.
    """
    return _identity(target, target == "metal" and metal_simulated())


@functools.lru_cache(maxsize=None)
def _identity(target: str, simulated: bool) -> Tuple[str, str]:
    if target == "metal":
        if simulated:
            return "metalsim", "metalsim"
        if mx.metal.is_available():
            info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
            return str(info.get("device_name", "apple gpu")), str(info.get("architecture", "unknown"))
        return "no metal device", "none"
    if target == "cuda":
        from .benchmark import device_description

        description = device_description()
        info = description["device_info"]
        return str(description["device_name"]), str(info.get("architecture", info.get("compute_capability", "")))
    raise ValueError(f"[tuned] target must be 'metal' or 'cuda', got {target!r}.")


def header(target: str, family: str) -> Dict[str, str]:
    """What a table tuned in this process for `family` says about itself (HEADER_KEYS)."""
    from . import __version__

    device, architecture = device_identity(target)
    return {"target": target, "family": family, "device": device, "architecture": architecture or "-",
            "mlx": mx.__version__, "mlx_flash": __version__}


def table_path(target: str, family: str, directory: Optional[Path] = None) -> Path:
    """Where this device's tuned table for `family` lives."""
    device = re.sub(r"[^A-Za-z0-9]+", "-", device_identity(target)[0]).strip("-").lower() or "gpu"
    return (directory or cache_dir()) / f"blocks_{target}_{family}_{device}.txt"


def read_header(text: str) -> Dict[str, str]:
    """The `# key: value` lines of a table's header (HEADER_KEYS only)."""
    found = {}
    for line in text.splitlines():
        match = re.match(r"#\s*([a-z_]+):\s*(.*?)\s*$", line)
        if match and match.group(1) in HEADER_KEYS and match.group(1) not in found:
            found[match.group(1)] = match.group(2)
    return found


def parse(text: str, origin: str, target: str, family: str) -> planner.Table:
    """A tuned table's text as a Table, checked against this process.

    Raises:
        ValueError: malformed (rows that do not parse, rows of other targets' families, a
            header key missing) or stale (a header value differing from this process's: the
            message names the key and both values).
    """
    found = read_header(text)
    missing = [key for key in HEADER_KEYS if key not in found]
    if missing:
        raise ValueError(f"malformed: header lacks {missing}")
    rows = planner.parse_rows(text, origin)
    if not rows:
        raise ValueError("malformed: no rows")
    foreign = sorted({r.family for r in rows} - {family, family + "_wgmma"})
    if foreign:
        raise ValueError(f"malformed: rows of families {foreign} in a table for {family!r}")
    expected = header(target, family)
    for key in HEADER_KEYS:
        if found[key] != expected[key]:
            raise ValueError(f"stale: {key} is {found[key]!r}, this process has {expected[key]!r}")
    return planner.Table(target, origin, rows)


def table_for(target: str, family: str) -> Optional[planner.Table]:
    """The tuned table that plans `family`'s kernels here, or None (none, disabled, or ignored
    with a warning).

    Runs on every planned call, so the answer (environment, file) is kept for RECHECK_S: a table
    that `write` puts down in this process is seen at once, one written by another process or an
    environment change within RECHECK_S (forget() drops the kept answers)."""
    now = time.monotonic()
    kept = _answers.get((target, family))
    if kept is not None and now - kept[0] <= RECHECK_S:
        return kept[1]
    answer = None
    if enabled():
        path = _path(target, family, os.environ.get("XDG_CACHE_HOME", ""), target == "metal" and metal_simulated())
        try:
            answer = _load(path, os.stat(path).st_mtime_ns, target, family)
        except OSError:
            answer = None
    _answers[(target, family)] = (now, answer)
    return answer


# (target, family) -> (time.monotonic() when answered, table_for's answer).
_answers: Dict[Tuple[str, str], Tuple[float, Optional[planner.Table]]] = {}
RECHECK_S = 1.0


def forget() -> None:
    """Drop table_for's kept answers: the next call reads the environment and the file again
    (and makes its decisions again: call_cache)."""
    _answers.clear()
    call_cache.forget()


@functools.lru_cache(maxsize=64)
def _path(target: str, family: str, xdg_cache_home: str, simulated: bool) -> str:
    return str(table_path(target, family))


@functools.lru_cache(maxsize=64)
def _load(path: str, stamp: int, target: str, family: str) -> Optional[planner.Table]:
    """Read and check a tuned table once per (file, modification time)."""
    try:
        return parse(Path(path).read_text(), path, target, family)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        record_fallback(f"tuned block table {path} ignored ({error}); planning from "
                        f"kernels/blocks_{target}.txt (run `python -m mlx_flash tune` again)")
        return None


def write(target: str, family: str, table: planner.Table, notes: Tuple[str, ...] = (),
          directory: Optional[Path] = None) -> Path:
    """Write `family`'s rows of `table` as this device's tuned table; returns its path.

    Args:
        target, family: what the rows plan.
        table: rows of `family` (and `family`_wgmma) are written, the others left out.
        notes: comment lines (without '#') after the header: how it was measured, what moved.
        directory: default cache_dir().
    """
    path = table_path(target, family, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [TITLE, f"# Same columns as kernels/blocks_{target}.txt; rows not measured are the shipped ones."]
    lines += [f"# {key}: {value}" for key, value in header(target, family).items()]
    lines += [f"# {note}" for note in notes]
    lines += ["#", "# kernel              precision family max_d  P    T    H    cached     warps"]
    ordered = sorted((r for r in table.rows if r.family in (family, family + "_wgmma")),
                     key=lambda r: (planner.KERNELS.index(r.kernel), r.family, r.precision, r.max_head_dim))
    lines += [planner.format_row(r) for r in ordered]
    temporary = path.with_suffix(".tmp")
    temporary.write_text("\n".join(lines) + "\n")
    os.replace(temporary, path)  # a reader sees the old table or the new one, never half of one
    forget()
    return path

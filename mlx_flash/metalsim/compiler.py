"""Compiling metalsim C++ into shared libraries, cached on disk.

The compiler is the clang bundled with the ``ziglang`` pip package
(``zig c++``), so a fresh machine needs only pip. ``MLX_FLASH_METALSIM_CXX``
names another clang++ (a command line, e.g. ``clang++-18``) instead; it must
support ``_Float16``/``__bf16`` arithmetic on the host (clang >= 17).

Libraries are cached by a hash of the generated source, the runtime headers,
the flags and the compiler under ``$MLX_FLASH_METALSIM_CACHE`` (default
``~/.cache/mlx_flash/metalsim``). Kernels are built with ``-nostdlib``: they
need nothing but libc/libm symbols, which resolve against the running Python
process, and the scheduler runtime (``metalsim_rt``), loaded first with
RTLD_GLOBAL.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
from functools import lru_cache
from pathlib import Path

__all__ = ["CompileError", "compile_kernel", "load_runtime", "cache_dir", "RUNTIME_DIR"]

RUNTIME_DIR = Path(__file__).resolve().parent / "runtime"

# -O2 and no strict aliasing (Metal code reinterprets buffers freely);
# half/bfloat arithmetic rounds after every operation as on the GPU.
_FLAGS = [
    "-std=c++17", "-O2", "-fPIC", "-shared", "-nostdlib", "-nostdinc++",
    "-fno-exceptions", "-fno-rtti", "-fno-strict-aliasing", "-fno-math-errno",
    "-fvisibility=hidden", "-fno-stack-protector", "-fstack-clash-protection", "-w",
    "-Xclang", "-fbfloat16-excess-precision=none",
    "-Xclang", "-ffloat16-excess-precision=none",
]
_lock = threading.Lock()


class CompileError(RuntimeError):
    """A kernel failed to compile; the message maps diagnostics to the
    kernel's source/header lines."""


def cache_dir() -> Path:
    d = os.environ.get("MLX_FLASH_METALSIM_CACHE")
    p = Path(d) if d else Path.home() / ".cache" / "mlx_flash" / "metalsim"
    p.mkdir(parents=True, exist_ok=True)
    return p


@lru_cache(maxsize=None)
def _compiler(override: str | None) -> tuple[tuple[str, ...], str]:
    """(command, identity for the cache key)."""
    if override:
        cmd = tuple(shlex.split(override))
        exe = cmd[0]
        try:
            st = os.stat(_which(exe))
            ident = f"{override}:{st.st_size}:{st.st_mtime_ns}"
        except OSError:
            ident = override
        return cmd, ident
    try:
        import ziglang  # noqa: F401
    except ImportError:
        raise CompileError(
            "metalsim needs a C++ compiler: `pip install ziglang` (or set "
            "MLX_FLASH_METALSIM_CXX to a clang++ >= 17)") from None
    zdir = Path(ziglang.__file__).resolve().parent
    zig = zdir / ("zig.exe" if sys.platform == "win32" else "zig")
    st = os.stat(zig)
    return (str(zig), "c++"), f"zig:{st.st_size}:{st.st_mtime_ns}"


def _which(exe: str) -> str:
    if os.sep in exe:
        return exe
    for d in os.environ.get("PATH", "").split(os.pathsep):
        p = os.path.join(d, exe)
        if os.access(p, os.X_OK):
            return p
    return exe


@lru_cache(maxsize=None)
def _host_ident() -> str:
    """-march=native code is only valid on this kind of CPU."""
    ident = os.uname().machine
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "model name", "Features", "CPU part")):
                    ident += line
                    if line.startswith(("flags", "Features")):
                        break
    except OSError:
        pass
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


@lru_cache(maxsize=None)
def _runtime_hash() -> str:
    h = hashlib.sha256()
    for name in sorted(os.listdir(RUNTIME_DIR)):
        if name.endswith((".hpp", ".h", ".cpp")):
            h.update(name.encode())
            h.update((RUNTIME_DIR / name).read_bytes())
    return h.hexdigest()


def _compile(src: str, kind: str, extra: list[str] | None = None) -> Path:
    """Compiles `src` (C++ text) into a cached shared library; returns its path."""
    override = os.environ.get("MLX_FLASH_METALSIM_CXX") or None
    cmd, ident = _compiler(override)
    flags = _FLAGS + ["-march=native", "-I", str(RUNTIME_DIR)] + (extra or [])
    key = hashlib.sha256(
        "\0".join([src, _runtime_hash(), ident, _host_ident(), " ".join(flags)]).encode()
    ).hexdigest()[:32]
    d = cache_dir()
    so = d / f"{kind}-{key}.so"
    if so.exists():
        return so
    # Other processes may build the same library at the same time: every file
    # is written under a private name and renamed into place.
    fd, cpp_tmp = tempfile.mkstemp(prefix=f"{kind}-{key}.", suffix=".cpp", dir=d)
    with os.fdopen(fd, "w") as f:
        f.write(src)
    fd, tmp = tempfile.mkstemp(prefix=f"{kind}-{key}.", suffix=".so.tmp", dir=d)
    os.close(fd)
    try:
        r = subprocess.run(list(cmd) + flags + ["-o", tmp, cpp_tmp], capture_output=True,
                           text=True)
        if r.returncode != 0:
            raise CompileError(r.stderr or r.stdout or f"compiler exited with {r.returncode}")
        os.replace(tmp, so)
        os.replace(cpp_tmp, d / f"{kind}-{key}.cpp")  # kept next to the library for debugging
    finally:
        for p in (tmp, cpp_tmp):
            if os.path.exists(p):
                os.unlink(p)
    return so


_runtime = None


def load_runtime() -> ctypes.CDLL:
    """Builds (once, cached) and loads the scheduler runtime globally."""
    global _runtime
    with _lock:
        if _runtime is None:
            src = (RUNTIME_DIR / "metalsim_rt.cpp").read_text()
            so = _compile(f'#line 1 "{RUNTIME_DIR / "metalsim_rt.cpp"}"\n' + src, "rt")
            lib = ctypes.CDLL(str(so), mode=ctypes.RTLD_GLOBAL)
            lib.msim_rt_launch.restype = ctypes.c_int
            lib.msim_rt_launch.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
            _runtime = lib
    return _runtime


_DIAG_RE = re.compile(r"^(kernel_source|kernel_header|metalsim_generated\w*):(\d+):(\d+): (error|warning|note|fatal error): (.*)$")


def compile_kernel(cpp: str, kernel_name: str, source: str, header: str) -> ctypes.CDLL:
    """Compiles and loads one kernel variant. Compile errors are re-raised
    with the clang diagnostics mapped to the kernel's source/header lines."""
    load_runtime()
    try:
        so = _compile(cpp, "k")
    except CompileError as e:
        raise CompileError(_map_diagnostics(str(e), kernel_name, source, header)) from None
    return ctypes.CDLL(str(so))


def _map_diagnostics(diag: str, kernel_name: str, source: str, header: str) -> str:
    files = {"kernel_source": source.split("\n"), "kernel_header": header.split("\n")}
    label = {"kernel_source": "source", "kernel_header": "header"}
    mapped: list[str] = []
    for line in diag.splitlines():
        m = _DIAG_RE.match(line)
        if not m or m.group(1) not in files:
            continue
        f, ln, col, sev, msg = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4), m.group(5)
        if sev == "warning":
            continue
        text = files[f][ln - 1] if 0 < ln <= len(files[f]) else ""
        mapped.append(f"  {label[f]} line {ln}: {sev}: {msg}\n      {text.strip()}")
    head = f"metalsim: failed to compile kernel '{kernel_name}'"
    if mapped:
        # keep it readable: the first few mapped diagnostics
        body = "\n".join(mapped[:8])
        return f"{head}:\n{body}\n\nfull compiler output:\n{_trim(diag)}"
    return f"{head}:\n{_trim(diag)}"


def _trim(diag: str, n: int = 60) -> str:
    lines = diag.splitlines()
    if len(lines) > n:
        lines = lines[:n] + [f"... ({len(lines) - n} more lines)"]
    return "\n".join(lines)

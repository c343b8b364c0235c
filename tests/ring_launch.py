"""Launch a script on N local processes with `mlx.launch --backend ring`, bounded and cleaned up.

Ports: mlx.launch gives rank i port base + i; the base is chosen at random among ports that can
be bound right now, so test runs in parallel do not collide. The launcher runs in its own process
group; when it has not exited by itself (timeout, an exception while waiting) that group, the
launcher and every rank it started, is killed, so no rank is left behind.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

from child_env import child_env

ROOT = Path(__file__).resolve().parent.parent


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_base(count: int) -> int:
    """A port p such that p .. p + count - 1 are free now."""
    rng = random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little"))
    for _ in range(200):
        base = rng.randrange(20000, 60000 - count)
        if all(_bindable(base + i) for i in range(count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports found")


def launcher() -> str:
    found = shutil.which("mlx.launch")
    if found is None:
        raise RuntimeError("mlx.launch is not on PATH (it comes with the mlx package)")
    return found


def launch(n: int, script, *args, timeout: float = 240, env=None) -> subprocess.CompletedProcess:
    """Run `python script args` on n ranks over the ring backend; return the launcher's result.

    Raises:
        subprocess.TimeoutExpired (after killing every process) when it runs past `timeout` s.
    """
    command = [launcher(), "-n", str(n), "--backend", "ring", "--starting-port", str(free_port_base(n)),
               "--cwd", str(ROOT), "--python", sys.executable, "--", str(script), *map(str, args)]
    environment = child_env(**(env or {}))
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=environment, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
        return subprocess.CompletedProcess(command, process.returncode, output, None)
    except subprocess.TimeoutExpired as e:
        _kill(process)
        output, _ = process.communicate()
        raise subprocess.TimeoutExpired(command, timeout, output=output) from e
    finally:
        if process.poll() is None:  # an exception while waiting: stop everything it started
            _kill(process)


def _kill(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)  # the launcher's own group: it and the ranks it started
    except (ProcessLookupError, PermissionError):
        pass

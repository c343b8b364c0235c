"""Another version of mlx-flash beside this checkout, for the tools that compare two versions in
one run (ab_versions.py: kernel time on a GPU; host_time.py: host time per call).

A version is a folder holding its mlx_flash/ and kernels/, or a git revision, whose two folders
are extracted (git archive) into a scratch folder. Each version is measured by a server: the
calling script run again with --serve and its arguments, in a process that imports that
version's mlx_flash (its folder first on PYTHONPATH), answering one line per request line.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def version_tree(against: str, scratch: str, option: str = "--against") -> str:
    """The folder holding `against`'s mlx_flash/ and kernels/: `against` itself where it is such a
    folder, else the git revision's two folders extracted into `scratch`."""
    if os.path.isdir(against):
        for part in ("mlx_flash", "kernels"):
            if not os.path.isdir(os.path.join(against, part)):
                raise SystemExit(f"{option} {against!r}: a folder must hold mlx_flash/ and kernels/ ({part}/ missing)")
        return os.path.abspath(against)
    archive = subprocess.run(["git", "archive", against, "mlx_flash", "kernels"], cwd=ROOT, capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"{option} {against!r} is neither a folder nor a git revision here: "
                         f"{archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", scratch], input=archive.stdout, check=True)
    return scratch


def tree_env(tree: str) -> dict:
    """This process's environment with `tree` first on PYTHONPATH, then the caller's entries
    (benchmarks/gpu_env.sh puts MLX's CUDA wheels there): a child then imports that version."""
    path = [tree] + [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path))


class Server:
    """`script` --serve `arguments` importing mlx_flash from `tree`. Its first line (what it
    prints once ready) is `ready`; `ask` sends one line and returns the answer's line."""

    def __init__(self, script: Path, tree: str, arguments=()):
        self.tree = tree
        self.process = subprocess.Popen([sys.executable, str(script), "--serve", *arguments], env=tree_env(tree),
                                        cwd=tree, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.ready = self._answer("start")

    def _answer(self, what: str) -> str:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"measuring under {self.tree} failed at {what} (its error is above)")
        return line.rstrip("\n")

    def ask(self, line: str, what: str = "") -> str:
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        return self._answer(what or line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)

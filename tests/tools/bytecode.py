"""Byte-compile the project's packages beside their sources, as an installed package is.

Where PYTHONDONTWRITEBYTECODE is set (as on the development VM), Python never writes bytecode, so
every process that imports repack would compile its modules from source again (~30 ms of CPU a
command on the device machine, several times that on a loaded VM). The tests start the CLI many
hundred times and the benchmarks time it; both compile once first. The bytecode goes to the
git-ignored ``__pycache__`` folders, and a stale file is recompiled (its source's mtime and size are
checked, as Python itself does).
"""

from __future__ import annotations

import compileall
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def compile_package(packages: tuple[str, ...] = ("repack", "pipelines")) -> None:
    """Byte-compile ``packages`` (folders under the checkout); quick when nothing changed."""
    for package in packages:
        compileall.compile_dir(str(ROOT / package), quiet=1)

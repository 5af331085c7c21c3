"""Byte-compile the project's packages beside their sources, as an installed package is.

Where PYTHONDONTWRITEBYTECODE is set (as on the development VM), Python never writes bytecode, so
every process that imports repack would compile its modules from source again (~30 ms of CPU a
command on the device machine, several times that on a loaded VM). The tests start the CLI many
hundred times and the benchmarks time it; both compile once first. The bytecode goes to the
git-ignored ``__pycache__`` folders, and a stale file is recompiled (its source's mtime and size are
checked, as Python itself does).

The benchmarks also compile the third-party packages a command imports (``compile_dependencies``), as pip
does when it installs them: the device machine's Python runs with PYTHONDONTWRITEBYTECODE=1 over an
environment installed without bytecode, where each process compiled numpy from source again (``import
numpy`` 0.28-0.31 s there, 0.10-0.14 s compiled: stop 51), a cost no installed environment has.
"""

from __future__ import annotations

import compileall
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def compile_package(packages: tuple[str, ...] = ("repack", "pipelines")) -> None:
    """Byte-compile ``packages`` (folders under the checkout); quick when nothing changed."""
    for package in packages:
        compileall.compile_dir(str(ROOT / package), quiet=1)


IMPORTED_BY_COMMANDS = ("repack.cli", "repack.jobs.images", "repack.jobs.text", "repack.lifecycle.append",
                        "repack.lifecycle.remove", "repack.lifecycle.verify", "pipelines.torch_webdataset", "PIL.Image")
FOLDERS_OF_IMPORTS = """
import json, sys, sysconfig
for name in sys.argv[1:]:
    __import__(name)
stdlib = sysconfig.get_paths()["stdlib"]
folders = set()
for module in list(sys.modules.values()):
    path = getattr(module, "__file__", None) or ""
    if path.endswith(".py") and not path.startswith(stdlib) and "site-packages" in path:
        top = module.__name__.partition(".")[0]
        folders.add(path[:path.index("site-packages") + len("site-packages")] + "/" + top)
print(json.dumps(sorted(folders)))
"""


def compile_dependencies(modules: tuple[str, ...] = IMPORTED_BY_COMMANDS) -> list[str]:
    """Byte-compile the installed packages that ``modules`` import (numpy, PIL, click, ...), beside their
    sources as pip leaves them; a folder that cannot be written is left as it is. Returns the folders."""
    found = subprocess.run([sys.executable, "-c", FOLDERS_OF_IMPORTS, *modules], cwd=ROOT, capture_output=True,
                           text=True)
    folders = json.loads(found.stdout.strip().splitlines()[-1]) if found.returncode == 0 and found.stdout else []
    for folder in folders:
        if Path(folder).is_dir():
            compileall.compile_dir(folder, quiet=2, workers=0)  # on every CPU (torch holds thousands of modules)
    return folders

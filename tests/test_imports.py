"""The house has no import circles: every repack module imports on its own, in a fresh
interpreter, and the CLI modules import nothing that imports the CLI back."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module_names(package: str) -> list[str]:
    names = []
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _imports_of(module: str) -> set[str]:
    path = ROOT / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = ROOT / module.replace(".", "/") / "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.split(".")[0] in ("repack", "pipelines")}


def test_no_import_cycles_among_repack_and_pipelines_modules():
    modules = set(_module_names("repack")) | set(_module_names("pipelines"))
    graph = {m: {i for i in _imports_of(m) if i in modules} for m in modules}
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(node: str, stack: list[str]) -> bool:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle.extend(stack[stack.index(nxt):] + [node, nxt] if nxt in stack else [node, nxt])
                return True
            if nxt not in state and visit(nxt, stack + [node]):
                return True
        state[node] = 2
        return False

    for module in sorted(modules):
        if module not in state and visit(module, []):
            break
    assert not cycle, f"import circle: {' -> '.join(cycle)}"


def test_every_command_lives_in_the_commands_package():
    for module in _module_names("repack"):
        assert not module.startswith("repack.commands_"), module
    code = ("import json, repack.cli; "
            "print(json.dumps(sorted(c.callback.__module__ for c in repack.cli.cli.commands.values())))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    modules = json.loads(out)
    assert len(modules) >= 7 and all(name.startswith("repack.commands.") for name in modules), modules


@pytest.mark.parametrize("module", ["repack.cli"] + [m for m in _module_names("repack") if m.startswith("repack.commands")])
def test_cli_modules_import_alone(module):
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True, cwd=ROOT)


def test_the_folder_walk_and_the_images_command_start_without_numpy():
    """`repack images` starts SOURCE's walk before its heavy imports (``repack.sources.walk.walk_ahead``): the walk's
    module and the command's own import no numpy (0.2 s on the device machine before the walk could start)."""
    code = "import sys, repack.cli, repack.sources.walk; print('numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "False"

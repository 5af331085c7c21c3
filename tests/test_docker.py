"""Static checks of the container images (no Docker engine runs on the development machines)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from tests.conftest import ROOT

DOCKERFILES = [ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.gpu"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_copied_path_exists(dockerfile):
    copies = re.findall(r"^COPY\s+(.+)$", dockerfile.read_text(), flags=re.M)
    assert copies
    for line in copies:
        *sources, _dest = line.split()
        for source in sources:
            assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source} does not exist"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_clean(dockerfile):
    hadolint = shutil.which("hadolint") or str(Path(__import__("sys").executable).with_name("hadolint"))
    proc = subprocess.run([hadolint, "--failure-threshold", "warning", str(dockerfile)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_non_root_and_documented(dockerfile):
    text = dockerfile.read_text()
    assert re.search(r"^USER (?!root|0\b)\S+", text, flags=re.M)
    if dockerfile.name.endswith(".gpu"):
        assert "--shm-size" in text and "--gpus" in text and "requirements-gpu.txt" in text
        assert "nvidia-dali-cuda120==" in (ROOT / "docker" / "requirements-gpu.txt").read_text()


def test_versions_consistent_with_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"].startswith(">=3.")
    base = (ROOT / "docker" / "Dockerfile").read_text()
    assert re.search(r"FROM python:3\.11\.\d+-slim", base)  # matches the CI/dev Python
    version = re.search(r'^__version__ = "(.+)"', (ROOT / "repack" / "__init__.py").read_text(), flags=re.M).group(1)
    assert version == project["version"]
    assert (ROOT / ".dockerignore").read_text().count(".venv")


def test_pinned_requirements_cover_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = {}
    for name in ("requirements.txt", "requirements-ray.txt", "requirements-gpu.txt"):
        for line in (ROOT / "docker" / name).read_text().splitlines():
            if line and not line.startswith("#"):
                pkg, _, version = line.partition("==")
                pinned[re.sub(r"\[.*\]", "", pkg).lower()] = version
    for dep in project["dependencies"] + project["optional-dependencies"]["ray"]:
        name = re.split(r"[<>=\[ ]", dep, maxsplit=1)[0].lower()
        assert name in pinned and pinned[name], f"{name} is not pinned for the container images"


def pins(name: str) -> dict[str, str]:
    """docker/<name>: {distribution name (lower case, no extras): pinned version}."""
    out = {}
    for line in (ROOT / "docker" / name).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            pkg, sep, version = line.strip().partition("==")
            assert sep and version, f"{name}: {line!r} is not pinned with =="
            out[re.sub(r"\[.*\]", "", pkg).lower()] = version
    return out


def installed(dist: str) -> str:
    """The installed version without its local label (torch 2.13.0+cpu -> 2.13.0)."""
    from importlib.metadata import version

    return version(dist).split("+", 1)[0]


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "docker").glob("requirements*.txt")))
def test_every_pin_is_the_tested_version(name):
    """The images install exactly what the test environment (.venv, from the Makefile) runs."""
    for dist, version in pins(name).items():
        assert installed(dist) == version, f"{name}: {dist}=={version}, tested with {installed(dist)}"


def test_gpu_torch_pin_matches_the_makefile_and_the_extras_are_in_the_images():
    makefile = re.findall(r"torch==([\w.]+)", (ROOT / "Makefile").read_text())
    gpu = re.findall(r"torch==([\w.]+)", (ROOT / "docker" / "Dockerfile.gpu").read_text())
    assert makefile and gpu and set(gpu) == set(makefile) == {installed("torch")}
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {key: {re.split(r"[<>=\[ ]", dep, maxsplit=1)[0].lower() for dep in deps} for key, deps in extras.items()}
    assert names["text"] <= set(pins("requirements.txt"))  # repack text reads .parquet/.zst in the producer image
    assert names["pipelines"] - {"torch"} <= set(pins("requirements-gpu.txt"))

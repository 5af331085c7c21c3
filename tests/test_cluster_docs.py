"""docs/cluster.md's Kubernetes and Slurm examples hold: the YAML parses, every REPACK_ variable they
set names a real option, and their repack commands run as written, here, on one machine: each pod
of the indexed Job (its completion index filled in, the volume a temporary folder) or each task of
the Slurm array, then the merge, then `repack verify`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from repack.cli import cli
from repack.commands.envvars import bind_envvars
from tests.conftest import ROOT, read_manifest_json, run_repack
from tests.test_readme import page_blocks

PAGE = "docs/cluster.md"
INDEX_ANNOTATION = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
OPTION_VARIABLES = bind_envvars(cli)


def yaml_documents() -> list[dict]:
    return [yaml.safe_load(b.code) for b in page_blocks(PAGE) if b.language == "yaml"]


def container_of(job: dict) -> dict:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return container


def pod_env(container: dict, index: int) -> dict[str, str]:
    """The container's environment as the Job controller fills it for pod ``index``."""
    env = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
        else:
            assert item["valueFrom"]["fieldRef"]["fieldPath"] == INDEX_ANNOTATION, item
            env[item["name"]] = str(index)
    return env


def mounted(args: list[str], container: dict, volume: Path) -> list[str]:
    """``args`` with the container's mount path replaced by the folder standing in for the volume."""
    (mount,) = container["volumeMounts"]
    return [str(volume) + a[len(mount["mountPath"]):] if a.startswith(mount["mountPath"]) else a for a in args]


def photos(root: Path) -> None:
    from tests.tools.photos import make_photo_tree

    make_photo_tree(root, per_class=10, classes=3, seed=4, min_side=40, max_side=96)


def test_kubernetes_jobs_are_valid_and_run_as_written(tmp_path):
    job, merge = yaml_documents()
    for doc in (job, merge):
        assert doc["apiVersion"] == "batch/v1" and doc["kind"] == "Job"
        assert doc["spec"]["template"]["spec"]["restartPolicy"] in ("Never", "OnFailure")
        assert set(pod_env(container_of(doc), 0)) <= set(OPTION_VARIABLES), "a variable that names no option"
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    packer = container_of(job)
    assert pod_env(packer, 0)["REPACK_IMAGES_NUM_NODES"] == str(spec["completions"])
    photos(tmp_path / "src")
    shard_size = int(pod_env(packer, 0)["REPACK_IMAGES_SHARD_SIZE"])
    env = {**pod_env(packer, 0), "REPACK_IMAGES_SHARD_SIZE": "4"}  # 30 photos: shards of 4, not 1000
    assert shard_size == 1000
    for index in range(spec["completions"]):
        env["REPACK_IMAGES_NODE_RANK"] = pod_env(packer, index)["REPACK_IMAGES_NODE_RANK"]
        proc = run_repack(*mounted(packer["args"], packer, tmp_path), env=env)
        assert '"event": "summary"' in proc.stderr  # REPACK_IMAGES_LOG_JSON
    out = Path(mounted(packer["args"], packer, tmp_path)[-1])
    assert not (out / "manifest.json").exists()  # partitions write no manifest
    merger = container_of(merge)
    assert mounted(merger["args"], merger, tmp_path) == ["merge", str(out)]
    proc = run_repack(*mounted(merger["args"], merger, tmp_path), env=pod_env(merger, 0))
    assert '"totals"' in proc.stdout  # REPACK_MERGE_JSON
    manifest = read_manifest_json(out)
    assert manifest["totals"]["samples"] == 30 and len(manifest["shards"]) == 8
    run_repack("verify", out)


def slurm_scripts() -> tuple[str, str]:
    array, merge = [b.code for b in page_blocks(PAGE) if b.language == "bash" and "#SBATCH" in b.code]
    return array, merge


def run_script(script: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """A job script as Slurm runs it: bash, this checkout's repack first on PATH, /shared -> cwd."""
    bin_dir = cwd / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "repack").write_text(f"#!/bin/sh\nexec {sys.executable} -m repack \"$@\"\n")
    (bin_dir / "repack").chmod(0o755)
    environ = {**os.environ, **env, "PYTHONPATH": str(ROOT), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-c", script.replace("/shared/", f"{cwd}/")], cwd=cwd, env=environ,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{script}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc


def test_slurm_array_and_merge_scripts_run_as_written(tmp_path):
    array, merge = slurm_scripts()
    exported = set(re.findall(r"\b(REPACK_\w+)=", array + merge))
    assert exported and exported <= set(OPTION_VARIABLES)
    first, last = map(int, re.search(r"^#SBATCH --array=(\d+)-(\d+)$", array, re.M).groups())
    photos(tmp_path / "src")
    array = array.replace("REPACK_IMAGES_SHARD_SIZE=1000", "REPACK_IMAGES_SHARD_SIZE=4")  # 30 photos
    for task in range(first, last + 1):
        run_script(array, tmp_path, {"SLURM_ARRAY_TASK_ID": str(task), "SLURM_ARRAY_TASK_COUNT": str(last - first + 1)})
    proc = run_script(merge, tmp_path, {})
    assert "OK, every file matches the manifest" in proc.stdout
    manifest = read_manifest_json(tmp_path / "photos-wds")
    assert manifest["totals"]["samples"] == 30 and len(manifest["shards"]) == 8

"""Static partitions survive a lost pod: docs/cluster.md's Kubernetes indexed Job runs as written (all
pods side by side, the volume a temporary folder), one pod is SIGKILLed with every process it
started once some of its shards are written, that index is run again (as the Job controller does
for a failed pod), then the merge Job: OUT equals the single-machine run byte for byte (every file
outside the job state, the manifest but its run section) and holds no leftover temp file."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_repack
from tests.test_cluster_docs import container_of, mounted, pod_env, yaml_documents



@pytest.fixture(scope="module")
def jpegs(tmp_path_factory) -> Path:
    """480 small distinct JPEGs (seeded noise) in two classes: 120 shards of 4, 30 per pod."""
    import numpy as np
    from PIL import Image

    root = tmp_path_factory.mktemp("pods")
    rng = np.random.default_rng(29)
    for i in range(480):
        folder = root / ("a" if i % 2 else "b")
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)).save(folder / f"{i}.jpg", quality=80)
    return root


def dataset_files(out: Path) -> dict[str, bytes]:
    """Every file of OUT outside .repack/ (a stray temp included); the manifest without its run section."""
    found = {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
             if p.is_file() and ".repack" not in p.relative_to(out).parts}
    manifest = json.loads(found.pop("manifest.json"))
    manifest.pop("run")
    found["manifest.json"] = json.dumps(manifest, sort_keys=True).encode()
    return found


def start_pod(packer: dict, volume: Path, env: dict[str, str]) -> subprocess.Popen:
    """One pod of the indexed Job: its container's args as written, in a session of its own."""
    return subprocess.Popen([sys.executable, "-m", "repack", *mounted(packer["args"], packer, volume)], cwd=ROOT,
                            env={**os.environ, **env}, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def lose_pod_once_it_wrote(pod: subprocess.Popen, out: Path, rank: int, pods: int) -> list[str]:
    """SIGKILL the pod's whole process group (its node is lost) once one of its shards is in OUT;
    returns the shards of this pod that were whole by then."""
    mine = lambda p: int(p.stem.rsplit("-", 1)[1]) % pods == rank  # noqa: E731 - unit i goes to pod i % pods
    deadline = time.time() + 120
    while time.time() < deadline and pod.poll() is None and not any(mine(p) for p in out.glob("shard-*.tar")):
        time.sleep(0.002)
    assert pod.poll() is None, f"pod {rank} ended before it could be lost: {pod.stderr.read()}"
    os.killpg(pod.pid, signal.SIGKILL)
    pod.wait()
    return sorted(p.name for p in out.glob("shard-*.tar") if mine(p))


@pytest.mark.parametrize("shard_size, chunk_size", [(4, 256), (24, 4)], ids=["shards", "chunked-shards"])
def test_a_lost_pod_rerun_then_merge_equals_one_machine(jpegs, tmp_path, shard_size, chunk_size):
    """Shards of 4 (one task each), and shards of 24 written by chunk tasks of 4 (a group per shard)."""
    job, merge = yaml_documents()
    packer, merger = container_of(job), container_of(merge)
    pods = job["spec"]["completions"]
    volume = tmp_path / "volume"  # the pods' shared volume: /data/src and /data/photos-wds
    shutil.copytree(jpegs, volume / "src")
    out = Path(mounted(packer["args"], packer, volume)[-1])
    sizes = {"REPACK_IMAGES_SHARD_SIZE": str(shard_size), "REPACK_IMAGES_CHUNK_SIZE": str(chunk_size)}

    def env(rank: int) -> dict[str, str]:  # 480 photos: small shards, not 1000
        return {**pod_env(packer, rank), **sizes}

    lost, its_shards = 1, len(range(1, 480 // shard_size, pods))
    for _ in range(3):  # a pod that published all its shards before the watcher saw one was not lost mid-way: again
        running = {rank: start_pod(packer, volume, env(rank)) for rank in range(pods)}
        written = lose_pod_once_it_wrote(running[lost], out, lost, pods)
        if len(written) < its_shards:
            break
        for pod in running.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pod.pid, signal.SIGKILL)
            pod.wait()
        shutil.rmtree(out)
    assert 0 < len(written) < its_shards, written  # mid-way: some of its shards, not all
    for rank, pod in running.items():
        if rank != lost:
            assert pod.wait(120) == 0, pod.stderr.read()
    proc = run_repack(*mounted(merger["args"], merger, volume), check=False)
    assert proc.returncode == 4 and "task(s) are missing" in proc.stderr  # the lost pod's tasks, by name
    rerun = start_pod(packer, volume, env(lost))  # the Job controller's new pod
    assert rerun.wait(120) == 0, rerun.stderr.read()
    run_repack(*mounted(merger["args"], merger, volume), env=pod_env(merger, 0))
    run_repack("verify", out)
    reference = tmp_path / "one-machine"
    run_repack("images", volume / "src", reference, "--shard-size", shard_size, "--chunk-size", chunk_size, "--quiet")
    assert dataset_files(out) == dataset_files(reference)

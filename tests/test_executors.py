"""The same job is byte-identical whichever executor ran it: local pool, a real local Ray
instance, or static partitions + merge. Failing tasks are reported and resumable."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import read_manifest_json, run_repack
from tests.test_images_job import manifest_without_run, shard_bytes

ARGS = ("--shard-size", "16", "--quiet")


@pytest.fixture(scope="module")
def reference(photo_tree, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("exec") / "local"
    run_repack("images", photo_tree, out, *ARGS, "--workers", "2")
    return out


def test_ray_executor_matches_local_pool(photo_tree, reference, tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "ray"
    run_repack("images", photo_tree, out, *ARGS, "--executor", "ray", "--workers", "2")
    assert shard_bytes(out) == shard_bytes(reference)
    assert manifest_without_run(out) == manifest_without_run(reference)
    assert read_manifest_json(out)["run"]["executor"] == "ray"


def test_static_partitions_and_merge_match_local_pool(photo_tree, reference, tmp_path):
    out = tmp_path / "parts"
    first = run_repack("images", photo_tree, out, *ARGS, "--num-nodes", "3", "--node-rank", "0")
    assert "partition 0 of 3" in first.stdout and not (out / "manifest.json").exists()
    proc = run_repack("merge", out, check=False)
    assert proc.returncode == 4 and "5 of 8 task(s) are missing" in proc.stderr and "shard-000001" in proc.stderr
    for rank in (2, 1):
        run_repack("images", photo_tree, out, *ARGS, "--num-nodes", "3", "--node-rank", rank)
    run_repack("merge", out, "--quiet")
    assert shard_bytes(out) == shard_bytes(reference)
    assert manifest_without_run(out) == manifest_without_run(reference)
    assert run_repack("verify", out).returncode == 0


@pytest.mark.parametrize("executor", ["local", "ray"])
def test_failing_task_is_reported_and_resumable(photo_tree, reference, tmp_path, executor):
    if executor == "ray":
        pytest.importorskip("ray")
    out = tmp_path / executor
    (out / "shard-000003.tar").mkdir(parents=True)  # the shard cannot be renamed into place
    proc = run_repack("images", photo_tree, out, *ARGS, "--executor", executor, "--workers", "2",
                      "--retries", "1", check=False)
    assert proc.returncode == 4, proc.stderr
    assert "1 task(s) failed" in proc.stderr and "shard-000003" in proc.stderr
    assert not (out / "manifest.json").exists()
    assert len(list((out / ".repack" / "tasks").glob("*.json"))) == 7
    shutil.rmtree(out / "shard-000003.tar")
    resumed = run_repack("images", photo_tree, out, *ARGS, "--executor", executor, "--workers", "2")
    assert "1 task(s) run, 7 resumed" in resumed.stdout
    assert shard_bytes(out) == shard_bytes(reference)


def test_ray_missing_is_a_clear_error(photo_tree, tmp_path):
    """Without Ray importable, --executor ray fails with an install hint, never a fallback."""
    blocker = tmp_path / "noray"
    blocker.mkdir()
    (blocker / "ray.py").write_text("raise ImportError('ray is not installed here')\n")
    import os

    proc = run_repack("images", photo_tree, tmp_path / "o", "--executor", "ray", check=False,
                      env={"PYTHONPATH": f"{blocker}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert proc.returncode == 2 and "pip install 'repack[ray]'" in proc.stderr
    assert not (tmp_path / "o").exists()  # refused before any work


@pytest.fixture(scope="module")
def video_tree(tmp_path_factory) -> Path:
    """Six tiny clips in two classes: some compatible (copied), some 10-bit/odd-size (transcoded)."""
    from tests.tools.videos import make_index_clip

    root = tmp_path_factory.mktemp("videos")
    h264 = ("-c:v", "libx264", "-preset", "ultrafast", "-g", "10", "-bf", "0", "-pix_fmt", "yuv420p")
    for i in range(6):
        codec = h264 if i % 2 == 0 else ("-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv444p")
        make_index_clip(root / f"class{i % 2}" / f"v{i}.mp4", 12, codec, size=(64, 48))
    return root


def test_video_job_is_identical_across_executors(video_tree, tmp_path):
    """Every modality runs on every executor: video through local pool, Ray, and 2 partitions + merge."""
    pytest.importorskip("ray")
    args = ("--transcode", "--quiet", "--workers", "2")
    outs = {name: tmp_path / name for name in ("local", "ray", "parts")}
    run_repack("video", video_tree, outs["local"], *args)
    run_repack("video", video_tree, outs["ray"], *args, "--executor", "ray")
    for rank in (0, 1):
        run_repack("video", video_tree, outs["parts"], *args, "--num-nodes", "2", "--node-rank", rank)
    run_repack("merge", outs["parts"], "--quiet")

    def files(out: Path) -> dict[str, bytes]:
        return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
                if p.is_file() and ".repack" not in p.parts and p.name != "manifest.json"}

    reference = files(outs["local"])
    assert any(name.startswith("videos/") for name in reference)
    for name in ("ray", "parts"):
        assert files(outs[name]) == reference, name
        assert manifest_without_run(outs[name]) == manifest_without_run(outs["local"])

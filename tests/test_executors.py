"""The same job is byte-identical whichever executor ran it: local pool, a real local Ray
instance, or static partitions + merge. Failing tasks are reported and resumable."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
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


RAY_HEAD = """
import sys
from ray.cluster_utils import Cluster

made = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
made.wait_for_nodes()
print(made.address, flush=True)
sys.stdin.read()  # until the test module is done with it
made.shutdown()
"""


@pytest.fixture(scope="module")
def ray_cluster() -> str:
    """The address of one local Ray instance of 2 CPUs on this host (a head node) that the module's Ray jobs
    join with --ray-address, where starting one is not what a test checks: a Ray instance started by each job
    took ~5 s of its ~6 s on the 2-core VM (the jobs that start their own: the batching test's first, on 1 CPU,
    and the shared-job test, whose driver's pool must wait for Ray as it does with an instance of its own).
    Started by a process of its own: Ray's client threads in this one would be forked with the process pools
    that tests here start (a pool worker hung on a lock, and one's SIGTERM stopped the node)."""
    pytest.importorskip("ray.cluster_utils")
    from tests.conftest import ROOT

    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    head = subprocess.Popen([sys.executable, "-c", RAY_HEAD], cwd=ROOT, env={**os.environ, "PYTHONPATH": path},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        address = head.stdout.readline().strip()
        assert address, f"the Ray head did not start (exit {head.poll()})"
        yield address
    finally:
        head.stdin.close()  # the head shuts its node down
        head.wait(timeout=120)


def test_ray_on_the_drivers_host_writes_chunks_into_the_shard(photo_tree, tmp_path, ray_cluster):
    """Ray workers on the driver's host that see OUT as the same folder write their chunks straight
    into the shard's shared file, as pool workers do (no piece for the driver to copy in)."""
    pytest.importorskip("ray")
    args = ("--shard-size", "48", "--chunk-size", "8", "--quiet", "--workers", "2")
    outs = {name: tmp_path / name for name in ("local", "ray")}
    run_repack("images", photo_tree, outs["local"], *args)
    run_repack("images", photo_tree, outs["ray"], *args, "--executor", "ray", "--ray-driver-cpus", "0",
               "--ray-address", ray_cluster)
    assert_identical_outputs(outs)
    segments = {tid: segment for p in sorted((outs["ray"] / ".repack" / "tasks").glob("shard-??????.json"))
                for tid, segment in json.loads(p.read_text())["segments"].items()}  # each shard's chunks
    assert len(segments) == 15 and all("at" in segment for segment in segments.values()), segments


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


RAY_SIDES = {"local": ("--executor", "local"), "ray": ("--executor", "ray"),  # Ray: the driver's pool takes all
             "ray-workers": ("--executor", "ray", "--ray-driver-cpus", "0")}  # every task a Ray task


@pytest.mark.parametrize("executor", list(RAY_SIDES))
def test_failing_task_is_reported_and_resumable(photo_tree, reference, tmp_path, executor, request):
    """A task that fails is reported by name, the rest kept; the re-run redoes only it, and the dataset
    equals the local pool's uninterrupted run whichever executor ran it (Ray's included: one Ray
    instance proves both), on Ray whether the driver's pool or Ray's workers ran the tasks."""
    side = RAY_SIDES[executor]
    if executor != "local":
        pytest.importorskip("ray")
        side += ("--ray-address", request.getfixturevalue("ray_cluster"))
    out = tmp_path / executor
    (out / "shard-000003.tar").mkdir(parents=True)  # the shard cannot be renamed into place
    proc = run_repack("images", photo_tree, out, *ARGS, *side, "--workers", "2",
                      "--retries", "1", "--overwrite", check=False)  # --overwrite: OUT holds no repack job yet
    assert proc.returncode == 4, proc.stderr
    assert "1 task(s) failed" in proc.stderr and "shard-000003" in proc.stderr
    assert not (out / "manifest.json").exists()
    assert len(list((out / ".repack" / "tasks").glob("*.json"))) == 7
    shutil.rmtree(out / "shard-000003.tar")
    resumed = run_repack("images", photo_tree, out, *ARGS, *side, "--workers", "2")
    assert "1 task(s) run, 7 resumed" in resumed.stdout
    assert shard_bytes(out) == shard_bytes(reference)
    assert manifest_without_run(out) == manifest_without_run(reference)
    run = read_manifest_json(out)["run"]
    assert run["executor"] == RAY_SIDES[executor][1]
    if executor != "local":  # the re-run's one task ran where the options say
        assert run["tasks_ran"] == {"driver_pool": int(executor == "ray"), "ray": int(executor == "ray-workers")}


def test_ray_missing_is_a_clear_error(photo_tree, tmp_path):
    """Without Ray installed, or with one that fails to import, --executor ray fails with an install hint (and
    the import's error) before any work, never a fallback."""
    hidden, broken = tmp_path / "noray", tmp_path / "broken"
    hidden.mkdir()
    (hidden / "sitecustomize.py").write_text("import sys\nsys.modules['ray'] = None  # as if not installed\n")
    broken.mkdir()
    (broken / "ray.py").write_text("raise ImportError('a broken Ray')\n")
    for blocker in (hidden, broken):
        out = tmp_path / f"out-{blocker.name}"
        proc = run_repack("images", photo_tree, out, "--executor", "ray", check=False,
                          env={"PYTHONPATH": f"{blocker}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
        assert proc.returncode == 2 and "pip install 'repack[ray]'" in proc.stderr, proc.stderr
        assert not out.exists()  # refused before any work
    assert "a broken Ray" in proc.stderr


def run_on_every_executor(command: str, source: Path, tmp_path: Path, ray_address: str, *args) -> dict[str, Path]:
    """Run one job on the local pool, on the local Ray instance at ``ray_address``, and as 2 static partitions
    + merge."""
    outs = {name: tmp_path / name for name in ("local", "ray", "parts")}
    run_repack(command, source, outs["local"], *args)
    run_repack(command, source, outs["ray"], *args, "--executor", "ray", "--ray-driver-cpus", "0",  # Ray's workers
               "--ray-address", ray_address)
    for rank in (0, 1):
        run_repack(command, source, outs["parts"], *args, "--num-nodes", "2", "--node-rank", rank)
    run_repack("merge", outs["parts"], "--quiet")
    return outs


def output_files(out: Path) -> dict[str, bytes]:
    """Every file a job wrote, by relative path (its state folder and manifest aside)."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and ".repack" not in p.parts and p.name != "manifest.json"}


def assert_identical_outputs(outs: dict[str, Path]) -> None:
    reference = output_files(outs["local"])
    for name, out in outs.items():
        assert output_files(out) == reference, name
        assert manifest_without_run(out) == manifest_without_run(outs["local"]), name


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


def test_video_job_is_identical_across_executors(video_tree, tmp_path, ray_cluster):
    """Every modality runs on every executor: video through local pool, Ray, and 2 partitions + merge."""
    pytest.importorskip("ray")
    outs = run_on_every_executor("video", video_tree, tmp_path, ray_cluster, "--transcode", "--quiet", "--workers", "2")
    assert any(name.startswith("videos/") for name in output_files(outs["local"]))
    assert_identical_outputs(outs)


def child_pids(parent: int) -> list[int]:
    """Children of ``parent``, from /proc (no procps needed)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent:
            found.append(int(stat.parent.name))
    return found


def test_killed_worker_is_retried_on_a_new_pool(photo_tree, tmp_path):
    """A pool worker killed mid-job (as by the OOM killer) costs a retry, not the job."""
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT

    reference = tmp_path / "ref"
    run_repack("images", photo_tree, reference, "--shard-size", "2", "--workers", "1", "--quiet")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "repack", "images", str(photo_tree), str(out), "--shard-size", "2",
                             "--workers", "2", "--quiet"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    killed = None
    deadline = time.time() + 60
    while killed is None and time.time() < deadline and proc.poll() is None:
        records = list((out / ".repack" / "tasks").glob("*.json")) if (out / ".repack" / "tasks").exists() else []
        children = child_pids(proc.pid)
        if len(records) >= 2 and children:
            killed = children[0]
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.005)
    stdout, stderr = proc.communicate(timeout=120)
    assert killed is not None, "the job finished before a worker could be killed"
    assert proc.returncode == 0, stderr
    assert shard_bytes(out) == shard_bytes(reference)


def test_text_job_is_identical_across_executors(tmp_path, ray_cluster):
    """Text too: local pool, Ray and 2 partitions + merge give the same .bin/.idx and manifest."""
    import json

    pytest.importorskip("ray")
    from tests.tools.text import documents, train_bpe, write_tokenizer

    docs = documents(300, seed=5)
    tokenizer = write_tokenizer(train_bpe(docs[:100]), tmp_path / "tok")
    src = tmp_path / "corpus"
    src.mkdir()
    for part in range(3):
        (src / f"part{part}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[part::3]))
    outs = run_on_every_executor("text", src, tmp_path, ray_cluster, "--tokenizer", tokenizer, "--chunk-bytes", "20KB",
                                 "--quiet", "--workers", "2")
    assert read_manifest_json(outs["local"])["totals"]["documents"] == 300
    assert len(list((outs["parts"] / ".repack" / "tasks").glob("*.json"))) >= 4  # several tasks per node
    assert any(name.endswith(".bin") for name in output_files(outs["local"]))
    assert_identical_outputs(outs)


def test_ray_batches_many_small_tasks_and_a_failing_call_fails_alone(photo_tree, tmp_path, ray_cluster):
    """30 shards on one CPU go to Ray in batches of 3 calls: the output equals the local pool's; a call that
    keeps failing is retried as a Ray task of its own and reported by its own name while the calls beside it
    finish."""
    pytest.importorskip("ray")
    from repack.exec.ray_executor import BATCH_MAX, batch_size

    assert batch_size(30, 1) == 3 and batch_size(240, 16) == 1 and batch_size(7800, 16) == BATCH_MAX
    args = ("--shard-size", "4", "--quiet", "--workers", "1")
    local, ray_out = tmp_path / "local", tmp_path / "ray"
    run_repack("images", photo_tree, local, *args)
    (ray_out / "shard-000004.tar").mkdir(parents=True)  # the shard cannot be renamed into place
    proc = run_repack("images", photo_tree, ray_out, *args, "--executor", "ray", "--ray-driver-cpus", "0",
                      "--retries", "1", "--overwrite", check=False)
    assert proc.returncode == 4, proc.stderr
    assert "1 task(s) failed" in proc.stderr and "shard-000004" in proc.stderr
    assert len(list((ray_out / ".repack" / "tasks").glob("*.json"))) == 29  # its batch's other calls included
    shutil.rmtree(ray_out / "shard-000004.tar")
    resumed = run_repack("images", photo_tree, ray_out, *args, "--executor", "ray", "--ray-address", ray_cluster)
    assert "1 task(s) run, 29 resumed" in resumed.stdout  # (one task: no batch; the module's instance runs it)
    assert shard_bytes(ray_out) == shard_bytes(local)
    assert manifest_without_run(ray_out) == manifest_without_run(local)


def test_failing_task_sent_in_a_pair_is_retried_alone_and_reported(photo_tree, tmp_path):
    """Enough tasks that the local pool sends them in pairs (``PAIR_FROM`` per worker): the one that fails
    is retried on its own, then reported by name; its partner and the rest are kept, and a re-run redoes it."""
    from repack.exec.local import PAIR_FROM

    args = ("--shard-size", "1", "--quiet", "--workers", "2")
    out = tmp_path / "paired"
    (out / "shard-000003.tar").mkdir(parents=True)  # the shard cannot be renamed into place
    proc = run_repack("images", photo_tree, out, *args, "--retries", "1", "--overwrite", check=False)
    assert proc.returncode == 4, proc.stderr
    assert "1 task(s) failed" in proc.stderr and "shard-000003" in proc.stderr
    records = len(list((out / ".repack" / "tasks").glob("*.json")))
    assert records >= 2 * PAIR_FROM - 1
    shutil.rmtree(out / "shard-000003.tar")
    resumed = run_repack("images", photo_tree, out, *args)
    assert f"1 task(s) run, {records} resumed" in resumed.stdout
    assert run_repack("verify", out).returncode == 0


KILLED_AT = (10, 30, 50)  # the tasks whose worker is killed (once each): three kills within 2 x PAIR_FROM - 1 calls


def _crash_once_call(call):
    """A pool call whose worker is killed the first time it runs a task of KILLED_AT (then it succeeds)."""
    import signal
    import time

    index = int(call[0])
    mark = Path(call[1]) / str(index)
    if index in KILLED_AT and not mark.exists():
        mark.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.002)
    return json.dumps({"task": index}) + "\n"


def test_workers_killed_three_times_charge_only_the_calls_in_flight(tmp_path, monkeypatch):
    """A broken pool fails every future, also those still queued in the driver: only those a worker could
    have been running count an attempt, so three kills in one job (each task succeeding when retried) fail
    nothing, with the default retries, paired calls or not."""
    from repack.exec import local
    from repack.exec.base import TaskFailure

    monkeypatch.setattr(local, "_call", _crash_once_call)
    submitted = []  # the calls of each submission: 2 where the pool pairs them
    submit_calls = local.submit_calls
    monkeypatch.setattr(local, "submit_calls", lambda pool, calls: submitted.append(len(calls)) or
                        submit_calls(pool, calls))
    # paired calls (every pool paired: over PAIR_FROM per worker still left after the third kill), and single
    # calls (under PAIR_FROM per worker from the start: 100 calls on 2 workers were paired too)
    for n, paired in ((8 * 2 * local.PAIR_FROM, True), (2 * local.PAIR_FROM - 1, False)):
        marks = tmp_path / str(n)
        marks.mkdir()
        submitted.clear()
        calls = [(str(i), str(marks), "", "", False) for i in range(n)]
        out = list(local.LocalExecutor(workers=2, retries=2).run(calls, [f"t{i}" for i in range(n)]))
        assert not [r for r in out if isinstance(r, TaskFailure)]
        assert sorted(r["task"] for r in out) == list(range(n))
        assert sorted(int(p.name) for p in marks.iterdir()) == list(KILLED_AT)  # three kills
        assert max(submitted) == (2 if paired else 1), submitted


def test_ray_shares_the_job_between_the_drivers_pool_and_ray_workers(photo_tree, tmp_path):
    """On Ray the driver's node runs tasks in a local pool on the CPUs it holds from Ray (``--ray-driver-cpus``)
    while Ray's workers run the rest: 30 tasks, 1 CPU each side, both ran some (the manifest's run section
    says how many), and the output equals the local pool's."""
    pytest.importorskip("ray")
    args = ("--shard-size", "4", "--quiet", "--workers", "2")
    outs = {name: tmp_path / name for name in ("local", "ray")}
    run_repack("images", photo_tree, outs["local"], *args)
    run_repack("images", photo_tree, outs["ray"], *args, "--executor", "ray", "--ray-driver-cpus", "1")
    assert_identical_outputs(outs)
    ran = read_manifest_json(outs["ray"])["run"]["tasks_ran"]
    assert ran["driver_pool"] >= 1 and ran["ray"] >= 1 and sum(ran.values()) == 30, ran


def test_killed_driver_pool_worker_under_ray_is_retried_on_a_new_pool(photo_tree, tmp_path, ray_cluster):
    """A worker of the driver's pool under --executor ray killed mid-job (as by the OOM killer) costs a retry:
    a new pool takes over, the job ends with exit 0 and the local pool's bytes."""
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT

    pytest.importorskip("ray")
    reference = tmp_path / "ref"
    run_repack("images", photo_tree, reference, "--shard-size", "2", "--workers", "1", "--quiet")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "repack", "images", str(photo_tree), str(out), "--shard-size", "2",
                             "--workers", "2", "--quiet", "--executor", "ray", "--ray-address", ray_cluster],
                            cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    driver = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    killed = None
    deadline = time.time() + 120
    while killed is None and time.time() < deadline and proc.poll() is None:
        records = list((out / ".repack" / "tasks").glob("*.json")) if (out / ".repack" / "tasks").exists() else []
        pool = [pid for pid in child_pids(proc.pid) if _cmdline(pid) == driver]  # forked: Ray's daemons are not
        if len(records) >= 2 and pool:
            try:
                os.kill(pool[0], signal.SIGKILL)
                killed = pool[0]
            except ProcessLookupError:  # gone meanwhile (the job's end): look again
                pass
        time.sleep(0.005)
    stdout, stderr = proc.communicate(timeout=120)
    assert killed is not None, "the job finished before a worker could be killed"
    assert proc.returncode == 0, stderr
    assert shard_bytes(out) == shard_bytes(reference)
    records = len(list((out / ".repack" / "tasks").glob("*.json")))
    assert sum(read_manifest_json(out)["run"]["tasks_ran"].values()) == records  # each task once, its retry too


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""

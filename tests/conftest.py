"""Shared fixtures: generated photo trees and a helper that runs the real `repack` CLI."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.tools.bytecode import compile_package
from tests.tools.photos import make_photo_tree

ROOT = Path(__file__).resolve().parents[1]
compile_package(("repack", "pipelines", "tests"))  # the CLI is started many hundred times (tests/tools/bytecode.py)
# every S3 server of the tests is on loopback: repack's own pauses before asking again are a tenth of what
# they are by default (still taken, still growing: the fault tests check what is asked, not how long it
# waited); inherited by every process a test starts
os.environ.setdefault("REPACK_S3_BACKOFF", "0.1")


def run_repack(*args: str, check: bool = True, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python -m repack ARGS` as a user would; returns the completed process."""
    proc = subprocess.run([sys.executable, "-m", "repack", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **(env or {})}, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"repack {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def read_manifest_json(out: Path) -> dict:
    return json.loads((Path(out) / "manifest.json").read_text())


def duplicate_groups(out, report: dict) -> list[dict]:
    """Every group of a ``stats.duplicates`` report of the dataset in ``out``: its ``list``, or the side file it
    names when the manifest lists fewer (``repack.manifest.duplicate_groups``)."""
    from repack.manifest.duplicate_groups import decode

    if not report.get("file"):
        return list(report.get("list") or ())
    return list(decode((Path(out) / report["file"]).read_bytes(), f"{out}/{report['file']}"))


def sample_paths(out) -> list[str]:
    """The source path of every sample of the published version, from its shards' per-sample ``.json``."""
    import tarfile

    paths = []
    for shard in read_manifest_json(out)["shards"]:
        with tarfile.open(Path(out) / shard["path"]) as tar:
            paths += [json.loads(tar.extractfile(m).read())["path"] for m in tar if m.name.endswith(".json")]
    return paths


@pytest.fixture(scope="session")
def photo_tree(tmp_path_factory) -> Path:
    """A 10-class ImageFolder tree of 120 small real-photo crops (JPEG and PNG)."""
    root = tmp_path_factory.mktemp("photos")
    make_photo_tree(root, per_class=12, seed=1, max_side=160)
    return root


@pytest.fixture(scope="session")
def packed_photos(photo_tree, tmp_path_factory) -> Path:
    """photo_tree packed to WebDataset shards of 25 samples (read-only for tests)."""
    out = tmp_path_factory.mktemp("packed") / "out"
    run_repack("images", photo_tree, out, "--shard-size", "25", "--quiet")
    return out


@pytest.fixture()
def endpoint(monkeypatch):
    """``endpoint(url)`` points this process's repack S3 clients at ``url``: the S3 variables set, and the
    clients, listers and getters made so far forgotten (each is made once per process)."""
    from repack.store import s3_client
    from tests.tools.s3server import s3_env

    def use(url: str) -> None:
        for name, value in s3_env(url).items():
            monkeypatch.setenv(name, value)
        for cache in ("_clients", "_listers", "_getters"):
            monkeypatch.setattr(s3_client, cache, {})
    return use


def kill_after_records(args: list, out: Path, records: int, timeout: float = 60, pattern: str = "*.json") -> None:
    """Start `repack ARGS`, SIGKILL it once OUT holds ``records`` task records (or it ended); ``pattern="*.lock"``:
    once that many tasks started (a task locks itself first; a placed chunk saves no record). The job runs at
    the lowest priority, so on a loaded machine this watcher still sees the count before the job finishes."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "repack", *map(str, args)], cwd=ROOT,
                            preexec_fn=lambda: os.nice(19))
    tasks = Path(out) / ".repack" / "tasks"
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if tasks.exists() and len(list(tasks.glob(pattern))) >= records:
            break
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()



# -- one line per test file (tests/tools/file_progress.py) ---------------------------------------
_file_progress = []  # the run's FileProgress, once collection is done


def _start_progress(config, nodeids) -> None:
    from tests.tools.file_progress import FileProgress

    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and nodeids and not config.option.collectonly and not _file_progress:
        _file_progress.append(FileProgress(reporter, nodeids))


# the files of 30 s or more in a full run (junit, 2-core VM, stop 64), slowest first: handed out first, so
# that no long file starts near the end and finishes alone (xdist's --dist loadfile hands files out in
# the order collected); every other file keeps its place after them
SLOW_FILES = ("test_readme.py", "test_s3_out.py", "test_ray_cluster.py", "test_executors.py",
              "test_pull_versions.py", "test_reader_states.py", "test_versions_s3.py", "test_text_edges.py",
              "test_hostile.py", "test_readme_long_pages.py", "test_append_rules.py", "test_images_job.py",
              "test_remote_checks.py", "test_s3_reader_faults.py", "test_dali_resume.py", "test_ray_shared_lost.py",
              "test_s3_source_gets.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: in-file order kept


def pytest_collection_finish(session):
    if not hasattr(session.config, "workerinput"):  # an xdist worker reports to the controller instead
        _start_progress(session.config, [item.nodeid for item in session.items])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """The xdist controller's view: every worker collects the same test ids."""
    _start_progress(node.config, ids)


def pytest_runtest_logstart(nodeid, location):
    if _file_progress:
        _file_progress[0].start(nodeid)


def pytest_runtest_logreport(report):
    if not _file_progress:
        return
    if report.when == "call" or report.outcome != "passed":
        _file_progress[0].record(report.nodeid, "xfailed" if hasattr(report, "wasxfail") else report.outcome)
    if report.when == "teardown":
        _file_progress[0].test_done(report.nodeid)


def pytest_sessionfinish(session):
    if _file_progress:
        _file_progress[0].finish()


@contextlib.contextmanager
def thread_alive():
    """A second thread in this process while the block runs (as Ray's join thread while the driver plans)."""
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()

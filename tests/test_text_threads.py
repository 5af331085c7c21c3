"""Tokenizer threads per `repack text` worker (a pool worker's one thread: the task's own): processes x threads
<= cores (``repack.exec.cpus.cpu_share``), the settings that override it (``repack.transforms.tokenizer_threads``),
the pool telling each worker its share, the same tokens in every shape, and no deadlock in a worker forked after
the Rust thread pool ran. Real GPT-2, real process pools, the real CLI."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from repack.errors import UsageError
from repack.exec.cpus import available_cpus, cpu_share, worker_cpus
from repack.transforms import tokenizer_threads
from repack.transforms.tokenizer_threads import ENV_THREADS, TokenizerThreads
from tests.conftest import ROOT, read_manifest_json, run_repack
from tests.test_text_many_files import small_files
from tests.tools.text import gpt2_tokenizer, write_tokenizer


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    return write_tokenizer(gpt2_tokenizer(), tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(autouse=True)
def fresh_rule(monkeypatch):
    """Each test starts as a process that has not set threads yet."""
    monkeypatch.setattr(tokenizer_threads, "_applied", None)
    monkeypatch.setattr(tokenizer_threads, "_pool_pid", None)


def test_cpu_share_keeps_processes_times_threads_within_the_cores():
    assert [cpu_share(16, p) for p in (1, 2, 4, 8, 16, 32)] == [16, 8, 4, 2, 1, 1]
    assert cpu_share(2, 2) == 1 and cpu_share(16, 3) == 5 and cpu_share(1, 0) == 1
    for cpus in range(1, 33):
        for processes in range(1, 40):
            share = cpu_share(cpus, processes)
            assert share >= 1 and (processes * share <= cpus or share == 1)


def test_threads_follow_the_share_unless_a_setting_says_otherwise():
    assert TokenizerThreads.choose({}, 1) == TokenizerThreads(1, "pool share")
    assert TokenizerThreads.choose({}, 4).threads == 4
    assert TokenizerThreads.choose({ENV_THREADS: "3"}, 1) == TokenizerThreads(3, ENV_THREADS)
    assert TokenizerThreads.choose({ENV_THREADS: "3", "TOKENIZERS_PARALLELISM": "false"}, 1).threads == 3
    assert TokenizerThreads.choose({"TOKENIZERS_PARALLELISM": "false"}, 8) == \
        TokenizerThreads(None, "TOKENIZERS_PARALLELISM")
    assert TokenizerThreads.choose({"RAYON_NUM_THREADS": "2"}, 8).threads is None
    assert TokenizerThreads.choose({ENV_THREADS: "0"}, 4) == TokenizerThreads(0, ENV_THREADS)
    for bad in ("-2", "two", "1.5"):
        with pytest.raises(UsageError, match=ENV_THREADS):
            TokenizerThreads.choose({ENV_THREADS: bad}, 1)


def test_applied_settings_size_the_rust_pool_and_stay_ours():
    env: dict[str, str] = {}
    TokenizerThreads(0, ENV_THREADS).apply(env)
    assert env == {"TOKENIZERS_PARALLELISM": "false"}
    TokenizerThreads(1, "pool share", own_thread=True).apply(env)  # a pool worker's one thread: no Rust pool
    assert env == {"TOKENIZERS_PARALLELISM": "false"} and tokenizer_threads._pool_pid is None
    assert TokenizerThreads.choose({}, 1, own_thread_ok=True) == TokenizerThreads(1, "pool share", True)
    assert not TokenizerThreads.choose({}, 2, own_thread_ok=True).own_thread
    assert TokenizerThreads.choose({ENV_THREADS: "1"}, 4, own_thread_ok=True).own_thread
    TokenizerThreads(1, "pool share").apply(env)  # elsewhere (the driver, a Ray worker): one Rust pool thread
    assert env == {"TOKENIZERS_PARALLELISM": "true", "RAYON_NUM_THREADS": "1"}
    assert TokenizerThreads.choose(env, 4) == TokenizerThreads(4, "pool share")  # what we set is not the user's
    TokenizerThreads(4, "pool share").apply(env)
    assert env == {"TOKENIZERS_PARALLELISM": "true", "RAYON_NUM_THREADS": "4"}
    env["RAYON_NUM_THREADS"] = "3"  # changed since: the user's
    assert TokenizerThreads.choose(env, 4).threads is None


def test_a_share_of_one_thread_runs_the_task_on_a_thread_of_its_own(tmp_path, gpt2, monkeypatch):
    import threading

    from repack.jobs.text import TextJob, TextSpec

    src = tmp_path / "src"
    small_files(src, 40)
    job = TextJob(TextSpec(source=str(src), out=str(tmp_path / "out"), tokenizer=str(gpt2), doc_per="file"))
    task = job.plan().tasks[0]
    (job.out / ".repack" / "tasks").mkdir(parents=True)
    seen = []
    real = TextJob._tokenize_task

    def spy(self, task, threads):
        seen.append((threading.current_thread() is threading.main_thread(), threads.threads,
                     os.environ["TOKENIZERS_PARALLELISM"]))
        return real(self, task, threads)

    monkeypatch.setattr(TextJob, "_tokenize_task", spy)
    monkeypatch.setattr("repack.jobs.text.worker_cpus", lambda: 1)
    monkeypatch.setattr("repack.jobs.text.in_pool_worker", lambda: True)
    for name in ("TOKENIZERS_PARALLELISM", "RAYON_NUM_THREADS"):  # run_task sets them in this process: put back
        monkeypatch.setenv(name, "")  # (delenv alone records nothing to undo for a variable that is not set)
        monkeypatch.delenv(name)
    monkeypatch.setenv(ENV_THREADS, "")
    record = job.run_task(task)
    assert seen == [(False, 1, "false")] and record["tokenizer_threads"] == 1 and record["tokenizer_own_thread"]
    assert record["part"]["documents"] == 40
    monkeypatch.setenv(ENV_THREADS, "0")  # the worker's main thread
    assert job.run_task(task)["part"]["sha256"] == record["part"]["sha256"]
    assert seen[1] == (True, 0, "false")

    monkeypatch.setattr("repack.jobs.text.in_pool_worker", lambda: False)  # the driver, a Ray worker: a Rust thread
    monkeypatch.setenv(ENV_THREADS, "")
    assert job.run_task(task)["part"]["sha256"] == record["part"]["sha256"]
    assert seen[2] == (True, 1, "true")

    def broken(self, task, threads):
        seen.append(threading.current_thread().name)
        raise KeyboardInterrupt  # any BaseException of the task's thread is the task's

    monkeypatch.setattr(TextJob, "_tokenize_task", broken)
    monkeypatch.setattr("repack.jobs.text.in_pool_worker", lambda: True)
    with pytest.raises(KeyboardInterrupt):
        job.run_task(task)
    assert seen[3] == "repack-task"


def test_a_process_forked_after_the_rust_pool_started_runs_one_thread(monkeypatch):
    monkeypatch.setattr(tokenizer_threads, "_pool_pid", os.getpid() + 1)  # as seen by a forked child
    assert TokenizerThreads.choose({ENV_THREADS: "4", "TOKENIZERS_PARALLELISM": "true"}, 8).threads == 0
    env = {"TOKENIZERS_PARALLELISM": "true"}
    tokenizer_threads.use_tokenizer_threads(8, env)
    assert env["TOKENIZERS_PARALLELISM"] == "false"


def test_the_local_pool_tells_each_worker_its_share_of_the_cpus():
    from repack.exec.local import process_pool

    for processes in (1, 2, 3):
        with process_pool(processes) as pool:
            shares = {pool.submit(worker_cpus).result() for _ in range(processes * 2)}
        assert shares == {cpu_share(available_cpus(), processes)}


def _parts_digest(out: Path) -> str:
    return hashlib.sha256(b"".join((out / name).read_bytes() for name in
                                   ("text_document.bin", "text_document.idx", "text_document.sources"))).hexdigest()


def test_every_shape_writes_the_same_bytes_and_the_manifest_says_which_ran(tmp_path, gpt2):
    src = tmp_path / "src"
    small_files(src, 400)
    digests, threads, own = set(), [], []
    for workers, env in ((1, {}), (2, {}), (2, {ENV_THREADS: "2"}), (3, {ENV_THREADS: "0"}), (2, {ENV_THREADS: "1"})):
        out = tmp_path / f"out-{workers}-{env.get(ENV_THREADS, 'auto')}"
        run_repack("text", src, out, "--tokenizer", gpt2, "--doc-per", "file", "--chunk-bytes", "20000",
                   "--workers", workers, "--quiet", env={ENV_THREADS: "", **env})
        digests.add(_parts_digest(out))
        threads.append(read_manifest_json(out)["run"]["tokenizer_threads"])
        own.append(read_manifest_json(out)["run"]["tokenizer_own_thread"])
    assert len(digests) == 1
    assert threads == [[available_cpus()], [cpu_share(available_cpus(), 2)], [2], [0], [1]]
    # a pool worker's one thread is the task's own; the driver's inline run and bigger shares are Rust pools
    assert own == [False, cpu_share(available_cpus(), 2) == 1, False, False, True]


def test_a_bad_thread_setting_fails_before_any_work(tmp_path, gpt2):
    src = tmp_path / "src"
    small_files(src, 5)
    done = run_repack("text", src, tmp_path / "out", "--tokenizer", gpt2, env={ENV_THREADS: "many"}, check=False)
    assert done.returncode != 0 and ENV_THREADS in done.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()


FORK_AFTER_POOL = r"""
import os, sys
from pathlib import Path
os.environ["TOKENIZERS_PARALLELISM"] = "true"  # set: tokenizers itself would not turn it off after fork
os.environ["RAYON_NUM_THREADS"] = "2"
from repack.config import EngineOptions
from repack.jobs.engine import Engine
from repack.jobs.text import TextJob, TextSpec

src, out, tokenizer = sys.argv[1:4]
spec = dict(tokenizer=tokenizer, doc_per="file", chunk_bytes=20000)
# one inline run: this process's Rust thread pool starts; then a pool forked from it must not wait for it
Engine(TextJob(TextSpec(source=src, out=out + "-inline", **spec)), EngineOptions(workers=1, quiet=True)).run()
os.environ["REPACK_TOKENIZER_THREADS"] = "2"  # the children are asked for the Rust pool too
Engine(TextJob(TextSpec(source=src, out=out, **spec)), EngineOptions(workers=2, quiet=True)).run()
print("done")
"""


def test_a_pool_forked_after_the_rust_thread_pool_ran_finishes_with_the_same_tokens(tmp_path, gpt2):
    src = tmp_path / "src"
    small_files(src, 300)
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-c", FORK_AFTER_POOL, str(src), str(out), str(gpt2)], cwd=ROOT,
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(ROOT), ENV_THREADS: ""})
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr[-2000:]
    assert _parts_digest(out) == _parts_digest(Path(f"{out}-inline"))
    assert read_manifest_json(out)["run"]["tokenizer_threads"] == [0]
    assert read_manifest_json(Path(f"{out}-inline"))["run"]["tokenizer_threads"] == []  # the user's settings

"""Batch-job operation (issue 22): progress lines when stderr is not a terminal, --log-json, and
every option from a REPACK_<COMMAND>_<OPTION> environment variable."""

from __future__ import annotations

import io
import json
import re

import click
import pytest

from repack.cli import cli
from repack.commands.envvars import bind_envvars
from repack.config import EngineOptions
from repack.jobs.progress import LineProgress, NoProgress, progress_reporter
from tests.conftest import read_manifest_json, run_repack
from tests.tools.text import documents, gpt2_tokenizer, write_tokenizer

LINE = re.compile(r"^repack text: (?P<done>[\d.]+ [KMG]?B)/(?P<total>[\d.]+ [KMG]?B) \((?P<share>\d+)%\), "
                  r"[\d.]+ [KMG]?B/s, ETA (?:\d+ s|\d+m\d\ds|\?), (?P<quarantined>\d+) quarantined, \d+ s elapsed$")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """About 6 MB of JSON lines in 4 files, one malformed line among them, and the GPT-2 tokenizer:
    a job of a few seconds on one worker, cut into 0.5 MB tasks."""
    root = tmp_path_factory.mktemp("batch")
    body = "".join(json.dumps({"text": d}) + "\n" for d in documents(400, seed=2)) * 4
    (root / "corpus").mkdir()
    for i in range(4):
        (root / "corpus" / f"part-{i}.jsonl").write_text(body + ('{"text": broken\n' if i == 2 else ""))
    write_tokenizer(gpt2_tokenizer(), root / "tok")
    return root


def megabytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * {"B": 1e-6, "KB": 1e-3, "MB": 1.0, "GB": 1e3}[unit]


def test_progress_lines_when_stderr_is_a_pipe(corpus, tmp_path):
    """stderr is a pipe here: one text line per period (set by the environment variable), with
    done/total, rate, ETA and the quarantine count so far; the summary follows as before."""
    proc = run_repack("text", corpus / "corpus", tmp_path / "out", "--tokenizer", corpus / "tok", "--workers", "1",
                      "--chunk-bytes", "512KB", env={"REPACK_TEXT_PROGRESS_EVERY": "0.05"})
    lines = [line for line in proc.stderr.splitlines() if line.startswith("repack text: ")]
    assert len(lines) >= 2, proc.stderr
    matches = [LINE.match(line) for line in lines]
    assert all(matches), lines
    done = [megabytes(m["done"]) for m in matches]
    assert done == sorted(done) and done[-1] <= megabytes(matches[0]["total"])  # the last task may print 100%
    assert {m["total"] for m in matches} == {matches[0]["total"]}
    quarantined = [int(m["quarantined"]) for m in matches]
    assert quarantined == sorted(quarantined) and quarantined[-1] <= 1
    manifest = read_manifest_json(tmp_path / "out")
    assert manifest["totals"]["quarantined"] == 1
    assert "done in" in proc.stderr + proc.stdout


def test_log_json_prints_progress_and_summary_as_json_lines(corpus, tmp_path):
    proc = run_repack("text", corpus / "corpus", tmp_path / "out", "--tokenizer", corpus / "tok", "--workers", "1",
                      "--chunk-bytes", "512KB", "--progress-every", "0.05", "--log-json")
    events = [json.loads(line) for line in proc.stderr.splitlines()]  # every stderr line is JSON
    progress = [e for e in events if e["event"] == "progress"]
    summary = [e for e in events if e["event"] == "summary"]
    assert len(progress) >= 2 and len(summary) == 1
    total = progress[0]["total"]
    assert all(e["job"] == "text" and e["unit"] == "B" and e["total"] == total for e in progress)
    assert all(0 < e["done"] <= total and e["rate"] > 0 and e["eta_s"] >= 0 for e in progress)
    assert [e["done"] for e in progress] == sorted(e["done"] for e in progress)
    manifest = read_manifest_json(tmp_path / "out")
    assert summary[0]["totals"] == manifest["totals"] and summary[0]["out"] == str(tmp_path / "out")
    assert summary[0]["quarantine"] == manifest["quarantine"] and len(summary[0]["quarantine"]) == 1
    assert proc.stdout == ""


def test_line_progress_format_and_choice():
    stream = io.StringIO()
    with LineProgress(4000, "img", "images", every=1e-9, as_json=False, stream=stream) as progress:
        progress.update(1000, quarantined=2)
        progress.set_postfix({"frames/s": "12"})
        progress.update(1000)
    lines = stream.getvalue().splitlines()  # the timer thread may print the 1,000 line more than once
    first, second = lines[0], next(line for line in lines if not line.startswith("repack images: 1,000/"))
    assert first.startswith("repack images: 1,000/4,000 img (25%), ") and ", 2 quarantined, " in first
    assert second.startswith("repack images: 2,000/4,000 img (50%), ") and ", 12 frames/s, ETA " in second
    # pytest captures stderr: not a terminal, so lines; --quiet: nothing at all
    assert isinstance(progress_reporter(10, "img", "images", EngineOptions()), LineProgress)
    assert type(progress_reporter(10, "img", "images", EngineOptions(quiet=True))) is NoProgress
    with pytest.raises(Exception, match="--progress-every"):
        EngineOptions(progress_every=0)


def test_every_option_has_its_environment_variable_in_help():
    names = bind_envvars(cli)  # idempotent: the variables bound at import stay
    for name, command in cli.commands.items():
        text = command.get_help(click.Context(command, info_name=name, parent=click.Context(cli, info_name="repack")))
        flat = re.sub(r"\s+", "", text)
        for param in command.params:
            if isinstance(param, click.Option) and param.expose_value and not param.hidden:
                flag = next(o for o in param.opts if o.startswith("--"))
                assert param.envvar == f"REPACK_{name}_{flag[2:]}".upper().replace("-", "_")
                assert param.envvar in flat, (name, param.envvar)
    assert names["REPACK_IMAGES_SHARD_SIZE"] == "images" and names["REPACK_TEXT_TOKENIZER"] == "text"


def test_options_come_from_the_environment_and_the_command_line_wins(photo_tree, tmp_path):
    env = {"REPACK_IMAGES_SHARD_SIZE": "30", "REPACK_IMAGES_VERIFY": "header", "REPACK_IMAGES_QUIET": "true"}
    proc = run_repack("images", photo_tree, tmp_path / "a", env=env)
    manifest = read_manifest_json(tmp_path / "a")
    assert [s["samples"] for s in manifest["shards"]] == [30, 30, 30, 30]
    assert manifest["created_by"]["options"]["verify"] == "header"
    assert "repack images:" not in proc.stderr
    run_repack("images", photo_tree, tmp_path / "b", "--shard-size", "60", env=env)
    assert [s["samples"] for s in read_manifest_json(tmp_path / "b")["shards"]] == [60, 60]
    bad = run_repack("images", photo_tree, tmp_path / "c", env={"REPACK_IMAGES_SHARD_SIZE": "many"}, check=False)
    assert bad.returncode == 2 and "(env var: 'REPACK_IMAGES_SHARD_SIZE'): 'many'" in bad.stderr


def test_progress_counts_what_the_scan_refused_and_errors_are_json_lines(photo_tree, tmp_path):
    """An input the scan refuses (a FIFO) is counted from the first line on; with --log-json a failed
    command's error is a JSON line too."""
    import os
    import shutil

    src = tmp_path / "src"
    shutil.copytree(photo_tree, src)
    os.mkfifo(src / sorted(p.name for p in src.iterdir())[0] / "pipe.jpg")
    proc = run_repack("images", src, tmp_path / "out", "--workers", "1", "--chunk-size", "10", "--shard-size", "40",
                      "--progress-every", "0.001", "--log-json")
    events = [json.loads(line) for line in proc.stderr.splitlines()]
    progress = [e for e in events if e["event"] == "progress"]
    assert progress and all(e["quarantined"] >= 1 for e in progress)
    assert read_manifest_json(tmp_path / "out")["quarantine"][0]["reason"] == "not a regular file (FIFO)"
    failed = run_repack("images", tmp_path / "missing", tmp_path / "out2", "--log-json", check=False)
    (error,) = [json.loads(line) for line in failed.stderr.splitlines()]
    assert error == {"event": "error", "exit_code": 2, "message": f"source {str(tmp_path / 'missing')!r} does not exist"}


def test_no_project_environment_variable_sets_an_option_by_accident():
    """The variables the project itself reads (REPACK_SCRATCH, make bench's REPACK_BENCH_*) name no
    option: `REPACK_BENCH_REPEATS=3 python -m tests.gpu.cpu_scaling` must not change a `repack bench` run."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    used = {name for folder in ("repack", "pipelines", "tests") for path in (root / folder).rglob("*.py")
            if path.name not in ("test_batch_jobs.py", "test_cluster_docs.py", "test_partition_loss.py",
                                 "test_bench_cli.py", "envvars.py",
                                 "test_readme.py")  # sets repack bench's --rounds/--warmup on purpose
            for name in re.findall(r"\bREPACK_[A-Z0-9_]+\b", path.read_text(encoding="utf-8"))}
    options = set(bind_envvars(cli))
    assert "REPACK_SCRATCH" in used and {n for n in used if n.startswith("REPACK_BENCH_")}
    assert not used & options, sorted(used & options)


def test_progress_lines_stay_whole_when_threads_print_at_once():
    """The timer thread and the engine's loop may both print: every line is whole (one JSON object)."""
    import threading
    import time

    class SlowStream(io.StringIO):  # like a pipe: a thread may be switched out in the middle of a print
        def write(self, text: str) -> int:
            time.sleep(0.0001)
            return super().write(text)

    stream = SlowStream()
    with LineProgress(8000, "img", "images", every=1e-9, as_json=True, stream=stream) as progress:
        threads = [threading.Thread(target=lambda: [progress.update(1) for _ in range(2000)]) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    lines = stream.getvalue().splitlines()
    assert len(lines) > 100 and all(json.loads(line)["total"] == 8000 for line in lines)
    assert max(json.loads(line)["done"] for line in lines) == 8000

"""Help that teaches and options that mean one thing: sectioned job help with exit codes, whole
descriptions in the command list, per-command --to choices, a refused re-run that names what
differs, merge without engine options, video --probe --transcode as typed, bench --loader-workers."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from repack.errors import (VERIFICATION_EXIT_CODE, IncompleteJobError, JobLockedError, NothingPackedError,
                           StrictModeError, UsageError)
from tests.conftest import ROOT, run_repack

JOBS = ("images", "video", "text")


def flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


@pytest.mark.parametrize("command", JOBS)
def test_job_help_has_sections_and_exit_codes(command):
    helptext = run_repack(command, "--help").stdout
    headings = [line.rstrip(":") for line in helptext.splitlines() if line and not line[0].isspace()
                and line.endswith(":")]
    assert headings[:4] == ["Input options", "Output options", "Checking options", "Running options"]
    assert headings[-1] == "Exit codes"
    running = helptext.split("Running options:")[1].split("Exit codes:")[0]
    assert "--workers" in running and "--strict" not in running  # engine options; --strict is a check
    assert "--strict" in helptext.split("Checking options:")[1].split("Running options:")[0]
    codes = [line.split()[0] for line in helptext.split("Exit codes:")[1].splitlines() if line.strip()
             and line.startswith("  ") and line.split()[0].isdigit()]
    assert codes == ["0", *map(str, (UsageError.exit_code, JobLockedError.exit_code, IncompleteJobError.exit_code,
                                     VERIFICATION_EXIT_CODE, StrictModeError.exit_code,
                                     NothingPackedError.exit_code)), "130", "143"]


def test_command_list_shows_whole_descriptions():
    helptext = flat(run_repack("--help").stdout.split("Commands:")[1])
    assert "..." not in helptext
    for command in ("images", "video", "text", "verify", "inspect", "merge", "bench"):
        first = flat(run_repack(command, "--help").stdout.split("\n\n")[1].strip())
        sentence = first.split(". ")[0].rstrip(".")
        assert sentence.replace("- ", "-") in helptext.replace("- ", "-"), command


@pytest.mark.parametrize("command,valid,invalid", [("images", ["webdataset", "lmdb"], "memmap"),
                                                   ("video", ["videos", "webdataset"], "lmdb")])
def test_to_is_a_per_command_choice(command, valid, invalid, tmp_path):
    proc = run_repack(command, tmp_path, tmp_path / "out", "--to", invalid, check=False)
    assert proc.returncode == 2
    error = proc.stderr.splitlines()[-1]
    assert "--to" in error and all(f"'{v}'" in error for v in valid), error
    others = {"webdataset", "lmdb", "memmap", "videos"} - set(valid) - {invalid}
    assert not any(f"'{o}'" in error for o in others), error


def test_refused_rerun_names_the_differing_options(photo_tree, tmp_path):
    out = tmp_path / "out"
    run_repack("images", photo_tree, out, "--shard-size", "40", "--quiet")
    proc = run_repack("images", photo_tree, out, "--shard-size", "30", "--shuffle", "--seed", "3", "--quiet",
                      check=False)
    assert proc.returncode == 2
    assert "--shard-size: 40 -> 30" in proc.stderr and "--shuffle: false -> true" in proc.stderr
    assert "--seed: 0 -> 3" in proc.stderr and "--overwrite" in proc.stderr
    assert "verify" not in proc.stderr  # unchanged options are not listed


def test_merge_lists_only_what_it_uses():
    helptext = run_repack("merge", "--help").stdout.split("Options:")[1]
    for meaningless in ("--workers", "--num-nodes", "--overwrite", "--executor", "--retries"):
        assert meaningless not in helptext
    assert "--json" in helptext and "--quiet" in helptext and "--strict / --no-strict" in helptext


def test_video_probe_with_transcode_is_the_full_job(tmp_path):
    """The mission's command: --probe --transcode passes option parsing without a warning and runs
    the job (which refuses an empty source); --help says what --probe alone means (real clips:
    tests/test_video_one_codec.py)."""
    (tmp_path / "src").mkdir()
    proc = run_repack("video", tmp_path / "src", tmp_path / "out", "--probe", "--transcode", check=False)
    assert "deprecated" not in proc.stderr and "contradicts" not in proc.stderr
    assert "holds no inputs" in proc.stderr
    helptext = " ".join(run_repack("video", "--help").stdout.split())
    assert "--probe" in helptext and "Alone: probe only" in helptext


def test_bench_sweeps_loader_workers():
    helptext = run_repack("bench", "--help").stdout
    assert "--loader-workers" in helptext and not re.search(r"^\s+--workers\b", helptext, re.M)


def test_the_command_starts_numpys_openblas_with_one_thread_unless_the_user_set_it():
    """repack's processes do no BLAS work; numpy's bundled OpenBLAS would start (and spin) a thread per CPU
    at import: the entry point asks for one, and a user's own setting stands."""
    code = ("import os, sys; sys.argv = ['repack', '--version']; from repack.cli import main; main(); "
            "import numpy; print(os.environ.get('OPENBLAS_NUM_THREADS'))")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    for given, expected in ((None, "1"), ("3", "3")):
        run_env = env if given is None else {**env, "OPENBLAS_NUM_THREADS": given}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                             env=run_env).stdout
        assert out.splitlines()[-1] == expected

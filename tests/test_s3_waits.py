"""Bounded, visible waits (issue 21, item 4): against a real loopback TCP server that accepts
connections and never answers, every s3:// command ends within its limits with a one-line error
naming the URL, and reports the wait on stderr although stderr is a pipe, not a terminal."""

from __future__ import annotations

import time

import pytest

from repack.errors import UsageError
from repack.store import s3_client
from tests.conftest import run_repack
from tests.tools.s3server import SilentServer, s3_env


@pytest.fixture
def silent():
    server = SilentServer()
    yield server
    server.close()


LOW = {"REPACK_S3_READ_TIMEOUT": "1", "REPACK_S3_CONNECT_TIMEOUT": "1", "REPACK_S3_ATTEMPTS": "2",
       "REPACK_S3_RETRY_BUDGET": "2", "REPACK_S3_NOTICE": "1"}


@pytest.mark.parametrize("command", ["verify", "pull", "images"])
def test_a_silent_endpoint_ends_in_one_line_within_the_limits(silent, photo_tree, tmp_path, command):
    env = {**s3_env(silent.endpoint), **LOW, "REPACK_SCRATCH": str(tmp_path / "scratch")}
    args = {"verify": ("verify", "s3://bucket/data"), "pull": ("pull", "s3://bucket/data", tmp_path / "dest"),
            "images": ("images", photo_tree, "s3://bucket/data")}[command]
    started = time.monotonic()
    proc = run_repack(*args, env=env, check=False, timeout=60)
    took = time.monotonic() - started
    errors = [line for line in proc.stderr.splitlines() if line.startswith("repack: error:")]
    assert proc.returncode in (2, 5) and took < 30, (took, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert len(errors) == 1 and "s3://bucket/data" in errors[0] and "did not answer" in errors[0], proc.stderr
    assert "REPACK_S3_READ_TIMEOUT" in errors[0]
    waits = [line for line in proc.stderr.splitlines() if line.startswith("repack: waiting")]
    assert waits and "s3://bucket/data" in waits[0] and "not answering" in waits[0], proc.stderr
    assert silent.accepted >= 2  # each attempt of a request is a connection that got no answer
    assert not (tmp_path / "dest" / "manifest.json").exists()


def test_default_limits_end_a_request_within_two_minutes(monkeypatch):
    for name in ("REPACK_S3_READ_TIMEOUT", "REPACK_S3_CONNECT_TIMEOUT", "REPACK_S3_ATTEMPTS",
                 "REPACK_S3_RETRY_BUDGET", "REPACK_S3_NOTICE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(s3_client, "_limits", {})  # read from this environment, not a cached one
    limits = s3_client.limits()
    assert limits.request_limit_s <= 120 and limits.retry_budget <= 120 and limits.notice_after == 10
    monkeypatch.setattr(s3_client, "_limits", {})
    monkeypatch.setenv("REPACK_S3_READ_TIMEOUT", "soon")
    with pytest.raises(UsageError, match="REPACK_S3_READ_TIMEOUT='soon'"):  # a bad job: exit 2, named
        s3_client.limits()

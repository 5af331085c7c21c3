"""``repack.jobs.plan_ahead.PlanAhead``: `--executor ray` plans in a forked child while Ray starts; the plan that
comes back is the one made here (same tasks, quarantine, info, digest), a child that fails leaves the plan to
this process (which raises what it meets), and a child not waited for is stopped."""

from __future__ import annotations

import os

import pytest

from repack.config import ImagesSpec
from repack.errors import UsageError
from repack.exec.forked import can_fork
from repack.jobs.base import build_plan
from repack.jobs.images import ImagesJob
from repack.jobs.plan_ahead import PlanAhead


def _job(src, out, **options) -> ImagesJob:
    return ImagesJob(ImagesSpec(source=str(src), out=str(out), chunk_size=3, **options))


def test_the_plan_made_in_a_child_is_the_plan_made_here(photo_tree, tmp_path):
    job = _job(photo_tree, tmp_path / "out", shard_size=4)
    here = build_plan(job)
    with PlanAhead(job) as ahead:
        assert bool(ahead._pid) == can_fork()
        made = ahead.plan()
    assert made.to_json() == here.to_json() and made.digest == here.digest and made.units == here.units
    assert len(made.tasks) > 1


def test_a_child_that_fails_leaves_the_plan_here_and_its_error_is_raised_here(tmp_path):
    job = _job(tmp_path / "missing", tmp_path / "out")
    with PlanAhead(job) as ahead:
        with pytest.raises(UsageError, match="does not exist"):
            ahead.plan()


def test_a_child_not_waited_for_is_stopped(photo_tree, tmp_path):
    if not can_fork():
        pytest.skip("forks only where no other thread runs")
    ahead = PlanAhead(_job(photo_tree, tmp_path / "out"))
    pid = ahead._pid
    ahead.close()
    assert not ahead._pid
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)

"""A line per test file as the suite runs (`make test`): the file, its outcomes, its seconds and the
suite's progress, so a slow file is not mistaken for a hang. Hooks registered by tests/conftest.py.

A file's line is printed when its last test has finished, so the lines stay right when files run in
parallel (pytest-xdist's ``--dist loadfile``: each worker runs whole files; the controller knows every
test id from the workers' collection)."""

from __future__ import annotations

import time
from collections import Counter


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


class FileProgress:
    """Counts each file's outcomes and finished tests; prints its line when its last test is done."""

    def __init__(self, reporter, nodeids) -> None:
        self.reporter = reporter
        self.left = Counter(file_of(nodeid) for nodeid in nodeids)
        self.files = len(self.left)
        self.outcomes: dict[str, Counter] = {}
        self.file_started: dict[str, float] = {}
        self.started = time.monotonic()
        self.done = 0

    def start(self, nodeid: str) -> None:
        self.file_started.setdefault(file_of(nodeid), time.monotonic())

    def record(self, nodeid: str, outcome: str) -> None:
        self.outcomes.setdefault(file_of(nodeid), Counter())[outcome] += 1

    def test_done(self, nodeid: str) -> None:
        path = file_of(nodeid)
        self.left[path] -= 1
        if self.left[path] == 0:
            self._say(path)

    def finish(self) -> None:
        """Lines for files that started but did not finish (an interrupted run)."""
        for path in [p for p in self.file_started if self.left[p] > 0]:
            self._say(path)

    def _say(self, path: str) -> None:
        self.done += 1
        now = time.monotonic()
        outcomes = self.outcomes.pop(path, Counter())
        counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(outcomes.items()))
        if getattr(self.reporter._tw, "width_of_current_line", 0):  # after -q's dots: a line of its own
            self.reporter.write("\n")
        self.reporter.write_line(f"[{self.done}/{self.files} files, {(now - self.started) / 60:.1f} min] "
                                 f"{path}: {counts or 'nothing run'} in "
                                 f"{now - self.file_started.pop(path, now):.1f} s")
        self.left[path] = -1  # said

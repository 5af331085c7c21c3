"""A line per test file as the suite runs (`make test`): the file, its outcomes, its seconds and the
suite's progress, so a slow file is not mistaken for a hang. Hooks registered by tests/conftest.py."""

from __future__ import annotations

import time
from collections import Counter


class FileProgress:
    """Counts each file's outcomes; prints its line when the next file starts or the run ends."""

    def __init__(self, reporter, files: int) -> None:
        self.reporter, self.files = reporter, files
        self.current: str | None = None
        self.outcomes: Counter = Counter()
        self.started = self.file_started = time.monotonic()
        self.done = 0

    def start(self, path: str) -> None:
        if path != self.current:
            self.finish()
            self.current, self.file_started = path, time.monotonic()

    def record(self, outcome: str) -> None:
        self.outcomes[outcome] += 1

    def finish(self) -> None:
        if self.current is None:
            return
        self.done += 1
        now = time.monotonic()
        counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(self.outcomes.items()))
        if getattr(self.reporter._tw, "width_of_current_line", 0):  # after -q's dots: a line of its own
            self.reporter.write("\n")
        self.reporter.write_line(f"[{self.done}/{self.files} files, {(now - self.started) / 60:.1f} min] "
                                 f"{self.current}: {counts or 'nothing run'} in {now - self.file_started:.1f} s")
        self.current, self.outcomes = None, Counter()

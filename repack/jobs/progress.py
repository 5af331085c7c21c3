"""Progress of a running job: a tqdm bar on a terminal; in a batch job (stderr not a terminal:
Slurm, Kubernetes, CI) one line every ``progress_every`` seconds, as text or, with ``log_json``, as
a JSON line; nothing when ``quiet``.

A line gives done/total, the rate, the ETA and the inputs quarantined so far. Lines are printed
when a task finishes and, from the first finished task on, by a timer thread when no task
finished for a whole period (the local pool has forked its workers by then: no thread exists
before the fork)."""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import TextIO

from repack.config import EngineOptions


class NoProgress:
    """What the engine calls on a progress reporter, doing nothing (``--quiet``)."""

    def __enter__(self) -> "NoProgress":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def update(self, n: int = 1, quarantined: int = 0) -> None:
        return None

    def set_postfix(self, values: dict, refresh: bool = False) -> None:
        return None


class TerminalBar(NoProgress):
    """A tqdm bar on stderr (tqdm is imported only here: ~35 ms of start-up)."""

    def __init__(self, total: int, unit: str, desc: str, quarantined: int = 0, done: int = 0) -> None:
        from tqdm import tqdm

        tqdm.monitor_interval = 0  # no monitor thread: the local pool forks after this point
        self.bar = tqdm(total=total, initial=done, unit=unit, unit_scale=True, file=sys.stderr, desc=desc,
                        dynamic_ncols=True)
        self.quarantined = quarantined
        self.rates: dict = {}

    def __exit__(self, *exc) -> None:
        self.bar.close()

    def update(self, n: int = 1, quarantined: int = 0) -> None:
        if quarantined:
            self.quarantined += quarantined
            self.bar.set_postfix({**self.rates, "quarantined": self.quarantined}, refresh=False)
        self.bar.update(n)

    def set_postfix(self, values: dict, refresh: bool = False) -> None:
        self.rates = dict(values)
        extra = {"quarantined": self.quarantined} if self.quarantined else {}
        self.bar.set_postfix({**self.rates, **extra}, refresh=refresh)


def amount(value: float, unit: str) -> str:
    """``value`` of ``unit`` as a line shows it: bytes as B/KB/MB/GB (the unit included), else a number."""
    if unit != "B":
        return f"{value:,.0f}" if value >= 10 or value == int(value) else f"{value:.1f}"
    for prefix in ("", "K", "M", "G"):
        if value < 1000:
            break
        value /= 1000
    else:
        prefix = "T"
    return f"{value:.0f} B" if not prefix else f"{value:.1f} {prefix}B"


def duration(seconds: float) -> str:
    """``seconds`` as 42 s, 3m07s or 2h05m."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class LineProgress(NoProgress):
    """One progress line every ``every`` seconds on ``stream`` (text, or JSON with ``as_json``)."""

    def __init__(self, total: int, unit: str, job: str, every: float, as_json: bool,
                 stream: TextIO | None = None, quarantined: int = 0, done: int = 0) -> None:
        self.total, self.unit, self.job, self.every, self.as_json = total, unit, job, every, as_json
        self.stream = stream or sys.stderr
        self.done = self.resumed = done  # a resumed run starts at what earlier runs did (not in the rate)
        self.quarantined = quarantined
        self.rates: dict = {}
        self.started = time.monotonic()
        self.last = self.started  # when the last line was printed (or the job started)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.timer: threading.Thread | None = None

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.timer is not None:
            self.timer.join()

    def update(self, n: int = 1, quarantined: int = 0) -> None:
        with self.lock:
            self.done += n
            self.quarantined += quarantined
        if self.timer is None:  # the first finished task: the workers exist, a thread is safe now
            self.timer = threading.Thread(target=self._tick, name="repack-progress", daemon=True)
            self.timer.start()
        self._print_if_due()

    def set_postfix(self, values: dict, refresh: bool = False) -> None:
        with self.lock:
            self.rates = dict(values)

    def _tick(self) -> None:
        while not self.stop.wait(min(self.every, 1.0)):
            self._print_if_due()

    def _print_if_due(self) -> None:
        with self.lock:  # one whole line at a time: the timer thread and the engine's loop both print
            now = time.monotonic()
            if now - self.last < self.every:
                return
            self.last = now
            try:
                self.stream.write(self.line(now - self.started) + "\n")
                self.stream.flush()
            except (OSError, ValueError):  # a closed log stream never stops the job
                pass

    def fields(self, elapsed: float) -> dict:
        """The figures of one progress line."""
        rate = (self.done - self.resumed) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else None
        return {"event": "progress", "job": self.job, "done": self.done, "total": self.total, "unit": self.unit,
                "rate": round(rate, 3), "eta_s": None if eta is None else round(eta, 1),
                "quarantined": self.quarantined, "elapsed_s": round(elapsed, 1),
                **({"rates": dict(self.rates)} if self.rates else {})}  # extra rates of a job that has them

    def line(self, elapsed: float) -> str:
        """One progress line: JSON, or e.g. ``repack images: 1,200/4,000 img (30%), 412 img/s, ETA 7 s, ...``."""
        f = self.fields(elapsed)
        if self.as_json:
            return json.dumps(f, sort_keys=True)
        share = f"{100 * f['done'] / f['total']:.0f}%" if f["total"] else "-"
        eta = duration(f["eta_s"]) if f["eta_s"] is not None else "?"
        unit = "" if self.unit == "B" else f" {self.unit}"
        extra = "".join(f", {value} {name}" for name, value in f.get("rates", {}).items())
        return (f"repack {self.job}: {amount(f['done'], self.unit)}/{amount(f['total'], self.unit)}{unit} ({share}), "
                f"{amount(f['rate'], self.unit)}{unit}/s{extra}, ETA {eta}, {f['quarantined']} quarantined, "
                f"{duration(elapsed)} elapsed")


def progress_reporter(total: int, unit: str, job: str, options: EngineOptions, quarantined: int = 0,
                      done: int = 0) -> NoProgress:
    """The reporter for a job's run: nothing (``quiet``), a bar on a terminal, else progress lines;
    ``total``: the whole job's units, ``done`` of them finished by earlier runs (a resume);
    ``quarantined``: inputs the scan already refused (counted from the start)."""
    if options.quiet:
        return NoProgress()
    if sys.stderr.isatty() and not options.log_json:
        return TerminalBar(total, unit, f"repack {job}", quarantined, done)
    return LineProgress(total, unit, job, options.progress_every, options.log_json, quarantined=quarantined,
                        done=done)

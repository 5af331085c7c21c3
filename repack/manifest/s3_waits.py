"""Bounded, visible waits on an S3 endpoint: the one reading of the ``REPACK_S3_*`` variables, shared by
the commands (``repack.store.s3_client``) and the readers (``pipelines.object_store``, which may import
only ``repack.manifest``). Stdlib only.

  REPACK_S3_CONNECT_TIMEOUT  seconds to open a connection (default 10)
  REPACK_S3_READ_TIMEOUT     seconds without a byte from an open connection (default 20)
  REPACK_S3_ATTEMPTS         attempts per request, botocore's retries included (default 3)
  REPACK_S3_RETRY_BUDGET     seconds after which an operation that repack itself retries (a whole
                             upload) starts no new attempt (default 120; a reader uploads nothing)
  REPACK_S3_NOTICE           seconds after which a wait is reported on stderr (default 10)
  REPACK_S3_BACKOFF          scales every pause before a request is asked again (default 1: botocore's
                             standard backoff, a random part of 1, 2, 4 ... s up to 20 s; 0.1 for a
                             server on the same network, 0 for none)

An endpoint that accepts connections and never answers thus ends a request after about
ATTEMPTS x (CONNECT + READ) seconds, an upload after about RETRY_BUDGET (2 min), each with a one-line
error naming the URL. ``WaitWatch`` prints ``repack: waiting N s for GetObject s3://...`` on stderr (a
terminal or not) whenever one call has waited NOTICE seconds, and again every 30 s while it still waits.
"""

from __future__ import annotations

import math
import os
import random
import sys
import threading
import time
from dataclasses import dataclass

REPEAT_NOTICE_S = 30.0


def _number(name: str, default: float, minimum: float) -> float:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    try:
        value = float(raw)
    except ValueError:
        value = minimum - 1
    if not (value >= minimum and math.isfinite(value)):  # inf overflowed, nan failed, later and unnamed
        raise ValueError(f"{name}={raw!r}: expected a finite number >= {minimum:g}")
    return value


@dataclass(frozen=True)
class S3Limits:
    """Timeouts, attempts and the retry budget of every S3 request (see the module docstring)."""

    connect_timeout: float = 10.0
    read_timeout: float = 20.0
    attempts: int = 3
    retry_budget: float = 120.0
    notice_after: float = 10.0
    backoff: float = 1.0

    @classmethod
    def from_env(cls) -> "S3Limits":
        """The limits the environment sets (ValueError naming a variable with a bad value)."""
        d = cls()
        return cls(_number("REPACK_S3_CONNECT_TIMEOUT", d.connect_timeout, 0.1),
                   _number("REPACK_S3_READ_TIMEOUT", d.read_timeout, 0.1),
                   int(_number("REPACK_S3_ATTEMPTS", d.attempts, 1)),
                   _number("REPACK_S3_RETRY_BUDGET", d.retry_budget, 0),
                   _number("REPACK_S3_NOTICE", d.notice_after, 0.1),
                   _number("REPACK_S3_BACKOFF", d.backoff, 0))

    @property
    def request_limit_s(self) -> float:
        """The longest one request can wait on an endpoint that never answers (backoff aside)."""
        return self.attempts * (self.connect_timeout + self.read_timeout)

    def describe(self) -> str:
        """How long a request waits before it fails, and which variables set that (for error messages)."""
        return (f"{self.attempts} attempt(s) of {self.read_timeout:g} s each; REPACK_S3_READ_TIMEOUT and "
                "REPACK_S3_ATTEMPTS set these")


def retry_pause(attempt: int, limits: S3Limits | None = None) -> float:
    """Seconds to sleep after failed attempt ``attempt`` (from 1) before the next: botocore's standard
    backoff (a random part of 2^(attempt - 1) s, at most 20 s), times ``REPACK_S3_BACKOFF``."""
    scale = (limits or S3Limits.from_env()).backoff
    return scale * random.random() * min(20.0, 2.0 ** (attempt - 1))


def bounded_pause(attempt: int, deadline: float, limits: S3Limits | None = None) -> float:
    """Seconds to sleep before asking again an operation repack retries itself until ``deadline``
    (``time.monotonic()``): 0.5 x 2^attempt s, at most 8, times ``REPACK_S3_BACKOFF``, never past it."""
    scale = (limits or S3Limits.from_env()).backoff
    return min(scale * min(8.0, 0.5 * 2**attempt), max(0.0, deadline - time.monotonic()))


def resume_pause(resumed: int, limits: S3Limits | None = None) -> float:
    """Seconds to sleep before resuming a ranged read the ``resumed``-th time (a stream that broke, an answer
    for another range): 0.1 x 2^resumed s, times ``REPACK_S3_BACKOFF``."""
    return (limits or S3Limits.from_env()).backoff * 0.1 * 2**resumed


class WaitWatch:
    """Reports on stderr every registered wait that passes ``notice_after`` seconds: one daemon thread,
    started by a wait and ended once no wait is left, so a process that is done with S3 (a driver after
    listing its source) holds no thread and its worker pool can fork."""

    def __init__(self, limits: S3Limits) -> None:
        self.limits = limits
        self._waits: dict[int, list] = {}  # token -> [what, started, next notice at]
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when the last wait ends
        self._next = 0
        self._thread: threading.Thread | None = None

    def start(self, what: str) -> int:
        """Register a wait; returns the token ``stop`` takes."""
        now = time.monotonic()
        with self._lock:
            self._next += 1
            self._waits[self._next] = [what, now, now + self.limits.notice_after]
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="repack-s3-waits", daemon=True)
                self._thread.start()
            return self._next

    def stop(self, token: int | None) -> None:
        """End the wait ``start`` registered (a token already ended or None: nothing)."""
        with self._lock:
            self._waits.pop(token, None)
            if not self._waits:
                self._idle.notify()

    def _run(self) -> None:
        tick = min(1.0, self.limits.notice_after / 4)
        while True:
            with self._lock:
                if self._waits:
                    self._idle.wait(tick)
                if not self._waits:  # nothing to watch: the thread ends (the next wait starts another)
                    self._thread = None
                    return
                now = time.monotonic()
                lines = []
                for wait in self._waits.values():
                    if now >= wait[2]:
                        lines.append(f"repack: waiting {now - wait[1]:.0f} s for {wait[0]}: the S3 endpoint is "
                                     f"slow or not answering (giving up after {self.limits.describe()})")
                        wait[2] = now + REPEAT_NOTICE_S
            for line in lines:
                try:
                    sys.stderr.write(line + "\n")
                    sys.stderr.flush()
                except (OSError, ValueError):  # stderr closed: nothing to tell
                    return


def watch_client(s3, watch: WaitWatch) -> None:
    """Hook ``watch`` into every call of the boto3 client ``s3`` (retries included: one wait per call)."""
    def name(params, model, context, **_):
        bucket, key = params.get("Bucket", "?"), params.get("Key") or params.get("Prefix") or ""
        context["repack_what"] = f"{model.name} s3://{bucket}/{key}"

    def begin(context, **_):
        context["repack_wait"] = watch.start(context.get("repack_what", "an S3 request"))

    def end(context, **_):
        watch.stop(context.pop("repack_wait", None))

    events = s3.meta.events
    events.register("provide-client-params.s3", name)
    events.register("before-call.s3", begin)
    events.register("after-call.s3", end)
    events.register("after-call-error.s3", end)

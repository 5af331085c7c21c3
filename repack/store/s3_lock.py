"""The lock of a run on an object store: an object created with a conditional PUT."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

from repack.errors import JobLockedError
from repack.store.s3_client import client, describe_error

HEARTBEAT_S = 15    # a live lock's holder refreshes it this often
STALE_LOCK_S = 120  # a lock not refreshed this long belongs to a dead run


def _holder_is_dead(holder: dict) -> bool:
    """A lock whose holder is a dead process on this host, or that was not refreshed in time."""
    if time.time() - float(holder.get("heartbeat", 0)) > STALE_LOCK_S:
        return True
    if holder.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(holder.get("pid", 0)), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError):
        return False
    return False


class ObjectLock:
    """A lock object created with a conditional PUT (``If-None-Match: *``): only one run creates it.

    It holds {pid, host, started, heartbeat}; a thread refreshes the heartbeat. A lock left by a
    killed run is taken over when its holder is a dead process on this host, or when its
    heartbeat is older than STALE_LOCK_S (another host)."""

    def __init__(self, store, rel: str) -> None:
        self.store = store
        self.rel = rel
        self.started = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": self.started,
                           "heartbeat": time.time()}).encode()

    def _create(self) -> bool:
        from botocore.exceptions import ClientError

        try:
            client().put_object(Bucket=self.store.bucket, Key=self.store.key(self.rel), Body=self._body(),
                                IfNoneMatch="*")
            return True
        except ClientError as exc:
            if str(exc.response.get("Error", {}).get("Code")) in ("PreconditionFailed", "412",
                                                                  "ConditionalRequestConflict"):
                return False
            raise describe_error(exc, self.store.where(self.rel)) from None

    def __enter__(self) -> "ObjectLock":
        if not self._create():
            raw = self.store.read_bytes(self.rel)
            try:
                holder = json.loads(raw) if raw else {}
            except ValueError:
                holder = {}
            if not (raw is None or _holder_is_dead(holder)):
                raise JobLockedError(f"another repack process (pid {holder.get('pid', '?')} on "
                                     f"{holder.get('host', '?')}) is already running on {self.store.url}; wait for "
                                     f"it or stop it first (a lock not refreshed for {STALE_LOCK_S} s is taken over)")
            self.store.delete(self.rel)
            if not self._create():
                raise JobLockedError(f"another repack process took the lock on {self.store.url} just now")
        self._thread = threading.Thread(target=self._beat, daemon=True, name="repack-s3-lock")
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                client().put_object(Bucket=self.store.bucket, Key=self.store.key(self.rel), Body=self._body())
            except Exception:  # noqa: BLE001 - a missed heartbeat is retried at the next beat
                continue

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.store.delete(self.rel)

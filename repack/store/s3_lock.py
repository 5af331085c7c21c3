"""The lock of a run on an object store: an object created with a conditional PUT.

Who holds it is judged without trusting another host's clock or pid: a lock is stale when the server's own
clock (the ``Date`` of a HEAD of the lock) is more than ``STALE_LOCK_S`` past the lock's ``LastModified``
(the holder's last heartbeat, stamped by the server); a holder's pid is looked up only when it runs on this
host, under this boot and in this pid namespace (a container on the host's network shares the host name, not
the pids). The holder refreshes the lock with a PUT conditional on the ETag it last wrote, so a run whose lock
was taken over (its heartbeat stalled past ``STALE_LOCK_S``) learns it at its next beat, never overwrites the
new holder's lock, publishes nothing (``check_held`` before a manifest is written) and leaves the lock alone
at its exit. A server without conditional PUTs on existing objects is checked by reading the lock instead.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import socket
import threading
import time
from email.utils import parsedate_to_datetime

from repack.errors import JobLockedError, UsageError
from repack.store.s3_client import client, describe_error, error_code, is_missing

HEARTBEAT_S = 15    # a live lock's holder refreshes it this often
STALE_LOCK_S = 120  # a lock not refreshed this long (by the server's clock) belongs to a dead run


def stale_after() -> float:
    """Seconds without a heartbeat after which a lock is taken over (``REPACK_S3_STALE_LOCK_S``, default
    ``STALE_LOCK_S``; keep it well above ``HEARTBEAT_S``)."""
    raw = os.environ.get("REPACK_S3_STALE_LOCK_S", "")
    if not raw.strip():
        return float(STALE_LOCK_S)
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):  # "abc" was the default and nan 1 s, in silence
        raise UsageError(f"REPACK_S3_STALE_LOCK_S={raw!r}: expected a positive number of seconds")
    return max(1.0, value)
_REFUSED = ("PreconditionFailed", "412", "ConditionalRequestConflict")
_UNSUPPORTED = ("NotImplemented", "501", "InvalidArgument", "InvalidRequest")


def process_identity() -> dict:
    """This process as a lock records it: pid, host, the kernel's boot id and the pid namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = ""
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pidns = 0
    return {"pid": os.getpid(), "host": socket.gethostname(), "boot": boot, "pidns": pidns}


def _holder_is_dead(holder: dict, age: float | None) -> bool:
    """A lock whose heartbeat is ``age`` s old by the server's clock (None: unknown, then the holder's own
    stamp against this host's clock) past ``STALE_LOCK_S``, or whose holder is a dead process of this host,
    boot and pid namespace (a lock of an older repack, without boot and namespace: of this host). The age
    limit: ``stale_after()``."""
    if age is None:
        age = time.time() - float(holder.get("heartbeat", 0))
    if age > stale_after():
        return True
    mine = process_identity()
    if holder.get("host") != mine["host"] or any(key in holder and holder[key] != mine[key]
                                                   for key in ("boot", "pidns")):
        return False
    try:
        os.kill(int(holder.get("pid", 0)), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError):
        return False
    return False


def _code(exc) -> str:
    return str(error_code(exc))


class ObjectLock:
    """A lock object created with a conditional PUT (``If-None-Match: *``): only one run creates it. It holds
    the holder's identity, a random token and its heartbeat; a thread refreshes it (see the module docstring)."""

    def __init__(self, store, rel: str) -> None:
        self.store = store
        self.rel = rel
        self.started = time.time()
        self.token = secrets.token_hex(16)
        self.etag: str | None = None
        self.lost: str | None = None  # why this run no longer holds the lock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        return json.dumps({**process_identity(), "token": self.token, "started": self.started,
                           "heartbeat": time.time()}).encode()

    def _put(self, **condition) -> str:
        answer = client().put_object(Bucket=self.store.bucket, Key=self.store.key(self.rel), Body=self._body(),
                                     **condition)
        return answer.get("ETag", "")

    def _create(self) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.etag = self._put(IfNoneMatch="*")
            return True
        except ClientError as exc:
            if _code(exc) in _REFUSED:
                return False
            raise describe_error(exc, self.store.where(self.rel)) from None

    def _holder(self) -> tuple[dict | None, float | None]:
        """(the lock's content, or None when there is none; its age by the server's clock, None if unknown)."""
        from botocore.exceptions import ClientError

        try:
            head = client().head_object(Bucket=self.store.bucket, Key=self.store.key(self.rel))
        except ClientError as exc:
            if is_missing(exc):
                return None, None
            raise describe_error(exc, self.store.where(self.rel)) from None
        age = None
        try:
            now = parsedate_to_datetime(head["ResponseMetadata"]["HTTPHeaders"]["date"])
            age = (now - head["LastModified"]).total_seconds()
        except (KeyError, TypeError, ValueError):
            pass
        raw = self.store.read_bytes(self.rel)
        if raw is None:
            return None, None
        try:
            holder = json.loads(raw)
        except ValueError:
            holder = {}
        return (holder if isinstance(holder, dict) else {}), age

    def __enter__(self) -> "ObjectLock":
        if not self._create():
            holder, age = self._holder()
            try:
                mine = self._own_etag() if holder is not None and holder.get("token") == self.token else None
            except Exception as exc:  # noqa: BLE001 - botocore's errors: one line naming the lock
                raise describe_error(exc, self.store.where(self.rel)) from None
            if mine is not None:  # this run's own create, applied, its answer lost and the request sent again
                self.etag = mine  # (refused: the object exists)
            elif holder is not None and not _holder_is_dead(holder, age):
                raise JobLockedError(f"another repack process (pid {holder.get('pid', '?')} on "
                                     f"{holder.get('host', '?')}) is already running on {self.store.url}; wait for "
                                     f"it or stop it first (a lock not refreshed for {stale_after():g} s is taken over)")
            else:
                self.store.delete(self.rel)
                if not self._create():
                    raise JobLockedError(f"another repack process took the lock on {self.store.url} just now")
        self.store.held_locks.append(self)
        self._thread = threading.Thread(target=self._beat, daemon=True, name="repack-s3-lock")
        self._thread.start()
        return self

    def _own_etag(self) -> str | None:
        """The lock object's ETag where it holds this run's token, read from one answer (token and ETag of one
        version of it: another run's lock, written between two reads, is never taken for this run's), else None."""
        from botocore.exceptions import ClientError

        try:
            answer = client().get_object(Bucket=self.store.bucket, Key=self.store.key(self.rel))
            body = answer["Body"].read()
        except ClientError as exc:
            if is_missing(exc):
                return None
            raise
        try:
            token = json.loads(body).get("token")
        except (ValueError, AttributeError):
            return None
        return answer.get("ETag", "") if token == self.token else None

    def _still_mine(self) -> bool:
        """The lock object still holds this run's token (read back)."""
        raw = self.store.read_bytes(self.rel)
        try:
            return raw is not None and json.loads(raw).get("token") == self.token
        except (ValueError, AttributeError):
            return False

    def _beat(self) -> None:
        from botocore.exceptions import ClientError

        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.etag = self._put(IfMatch=self.etag) if self.etag else self._put()
            except ClientError as exc:
                try:
                    if self._refused(_code(exc)):
                        self.lost = "its lock was taken over by another run (its heartbeat stalled)"
                        return
                except Exception:  # noqa: BLE001 - the lock unreadable now: asked again at the next beat
                    continue
            except Exception:  # noqa: BLE001 - a missed heartbeat is retried at the next beat
                continue

    def _refused(self, code: str) -> bool:
        """After a beat answered ``code``: whether the lock is another run's now (else this run goes on: its own
        beat applied with the answer lost, or a server without conditional PUTs)."""
        if code in _REFUSED:
            mine = self._own_etag()  # this beat applied, its answer lost and the request sent again against the
            if mine is None:         # old ETag: the lock is still this run's, at the ETag it has now
                return True
            self.etag = mine
            return False
        if code in _UNSUPPORTED:
            if not self._still_mine():
                return True
            self.etag = None  # a server without conditional PUTs: read back, then write
        return False

    def check_held(self) -> None:
        """JobLockedError unless this run still holds the lock: called before a manifest is written."""
        if self.lost is None and not self._still_mine():
            self.lost = "its lock was taken over by another run (its heartbeat stalled)"
        if self.lost is not None:
            raise JobLockedError(f"{self.store.url}: {self.lost}; nothing was published by this run")

    def __exit__(self, *exc) -> None:
        """Stop the heartbeat and delete the lock. A delete the endpoint does not answer never hides the error
        that ends the run (the lock is then left to go stale, and a later run takes it over)."""
        from botocore.exceptions import BotoCoreError, ClientError

        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self in self.store.held_locks:
            self.store.held_locks.remove(self)
        if self.lost is not None:
            return  # another run's lock now: never deleted by this one
        try:
            client().delete_object(Bucket=self.store.bucket, Key=self.store.key(self.rel),
                                   **({"IfMatch": self.etag} if self.etag else {}))
        except ClientError as error:
            if _code(error) in _UNSUPPORTED and self._still_mine():
                self.store.delete(self.rel)
            elif _code(error) not in _REFUSED and not is_missing(error) and exc[0] is None:
                raise describe_error(error, self.store.where(self.rel)) from None
        except BotoCoreError as error:  # the endpoint unreachable: the run's own error, if any, is the one to tell
            if exc[0] is None:
                raise describe_error(error, self.store.where(self.rel)) from None

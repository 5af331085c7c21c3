"""Amazon S3 and S3-compatible object stores (MinIO, Ceph, R2, ...) through boto3.

Why boto3: its transfer manager (s3transfer) uploads a large file as concurrent multipart parts
and downloads with ranged GETs, botocore retries throttling and 5xx answers with backoff, and it
reads credentials and the endpoint the standard AWS way (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ``~/.aws/config``, instance
roles). ``make bench`` (tests/benchmarks/bench_s3.py) compares our per-file, checked uploads
with its own bulk upload of the same files.

Object stores have no rename: a PUT (or a completed multipart upload) makes an object visible
whole or not at all. ``publish`` uploads a finished file with its sha256 as object metadata
(``x-amz-meta-sha256``), then checks the object's size and metadata with a HEAD; only then does
the engine put the task's record. Credentials are never printed nor written anywhere.

Scratch: jobs write into a local folder, ``$REPACK_SCRATCH/<sha256 of the URL>`` (default
``~/.cache/repack/scratch``), then publish from it; a re-run on the same machine finds it again.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from pathlib import Path

from repack.errors import ConfinementError, RepackError, VerificationError
from repack.manifest.paths import PathEscapeError, check_relative
from repack.manifest.s3_waits import bounded_pause
from repack.store.s3_client import (ASK_AGAIN, AUTH_CODES, client, describe_error, error_code, is_missing, limits,
                                    parse_url, retried, transfer_config)
from repack.store.s3_lock import ObjectLock

SHA_META = "sha256"   # object metadata x-amz-meta-sha256: the content's sha256, set at upload
UPLOAD_ATTEMPTS = ASK_AGAIN  # whole-file attempts on top of botocore's per-request retries
SINGLE_COPY_BYTES = 5 << 30  # the largest object one CopyObject may copy (S3's limit); larger: copied in parts
PROBE_PREFIX = ".repack/.write-probe-"
PART_BYTES = 8 << 20  # ranged GETs of download_parts


def stored_sha256(answer: dict) -> str | None:
    """The x-amz-meta-sha256 of a HEAD/GET answer. Header names are case-insensitive and some
    S3-compatible servers (rclone serve s3) answer ``X-Amz-Meta-Sha256``, which botocore hands on as
    the key "Sha256"; S3 itself lowercases metadata names."""
    for name, value in (answer.get("Metadata") or {}).items():
        if name.lower() == SHA_META:
            return value
    return None


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def scratch_folder(url: str) -> Path:
    base = os.environ.get("REPACK_SCRATCH") or os.path.join(os.path.expanduser("~"), ".cache", "repack", "scratch")
    return Path(base) / hashlib.sha256(url.encode()).hexdigest()[:16]


class S3Store:
    """Objects under ``s3://bucket/prefix``; jobs write into a local scratch folder first."""

    remote = True

    def __init__(self, url: str) -> None:
        self.bucket, self.prefix = parse_url(url)
        self.url = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        self.scratch = scratch_folder(self.url)
        self._sizes: dict[str, int] | None = None
        self.held_locks: list[ObjectLock] = []  # the lock objects this run holds (``check_lock``)

    def key(self, rel: str) -> str:
        """The object key of ``rel``, always under the prefix: ``rel`` is a relative path without ``..``,
        NUL or backslash (ConfinementError otherwise; some S3-compatible servers map keys to files)."""
        try:
            check_relative(rel)
        except PathEscapeError as exc:
            raise ConfinementError(f"{self.url}: refused {rel!r}: {exc}") from None
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def where(self, rel: str = "") -> str:
        return f"{self.url}/{rel}" if rel else self.url

    def _call(self, rel: str, method: str, **kwargs):
        """One S3 request on ``rel`` (through ``_retried``)."""
        return self._retried(rel, lambda: getattr(client(), method)(Bucket=self.bucket, **kwargs))

    def _retried(self, rel: str, request):
        """``request()`` asked again as every S3 request is (``s3_client.retried``), errors naming the URL."""
        return retried(request, self.where(rel))

    # -- the store operations ----------------------------------------------------------------
    def check_writable(self) -> None:
        """Fail fast (exit 2) on wrong credentials, a missing bucket or a read-only prefix."""
        rel = f"{PROBE_PREFIX}{socket.gethostname()}-{os.getpid()}"
        self._call(rel, "put_object", Key=self.key(rel), Body=b"")
        self._call(rel, "delete_object", Key=self.key(rel))
        for left in self.list_sizes(PROBE_PREFIX):  # probes of commands killed between their PUT and DELETE (a
            self.delete(left)                       # live command's own DELETE then finds nothing: S3 allows it)

    def move(self, src: str, dst: str) -> None:
        """Rename ``src`` to ``dst``: a server-side copy with the object's metadata (its sha256), in parts above
        SINGLE_COPY_BYTES, each request asked again as every request of the store is; then ``src`` deleted."""
        head = self._call(src, "head_object", Key=self.key(src))
        if head["ContentLength"] <= SINGLE_COPY_BYTES:
            self._call(dst, "copy_object", Key=self.key(dst), CopySource={"Bucket": self.bucket, "Key": self.key(src)})
        else:
            extra = {"Metadata": head.get("Metadata") or {}, "MetadataDirective": "REPLACE"}
            self._retried(dst, lambda: client().copy({"Bucket": self.bucket, "Key": self.key(src)}, self.bucket,
                                                     self.key(dst), ExtraArgs=extra, Config=transfer_config()))
        if self._sizes is not None:
            self._sizes[dst] = head["ContentLength"]
        self.delete(src)

    def forget_listing(self) -> None:
        """Drop the cached listing: another store object wrote under this prefix since it was made (an --append's
        staged job); the next ``size`` lists again."""
        self._sizes = None

    def publish(self, rel: str, local: Path, sha256: str | None = None) -> None:
        """Upload a finished local file (multipart when large), then check size and sha256 by HEAD.
        ``sha256``: the digest the writer already computed (else the file is read to hash it)."""
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import BotoCoreError, ClientError

        local = Path(local)
        size = local.stat().st_size
        digest = sha256 or sha256_file(local)
        if self.holds(rel, size, digest):  # uploaded by a run killed before its record: keep it
            return
        last: BaseException | None = None
        deadline = time.monotonic() + limits().retry_budget
        tried = 0
        for attempt in range(UPLOAD_ATTEMPTS):
            if attempt and time.monotonic() >= deadline:  # the retry budget is spent: stop, say why
                break
            tried += 1
            try:
                client().upload_file(str(local), self.bucket, self.key(rel), Config=transfer_config(),
                                     ExtraArgs={"Metadata": {SHA_META: digest}})
                head = client().head_object(Bucket=self.bucket, Key=self.key(rel))
            except (BotoCoreError, ClientError, S3UploadFailedError) as exc:
                last = exc
                if error_code(exc) in AUTH_CODES:
                    raise describe_error(exc, self.where(rel)) from None
                time.sleep(bounded_pause(attempt, deadline))
                continue
            if head["ContentLength"] == size and stored_sha256(head) == digest:
                if self._sizes is not None:
                    self._sizes[rel] = size
                return
            last = RepackError(f"{self.where(rel)}: uploaded object has {head['ContentLength']} bytes / sha256 "
                               f"{stored_sha256(head)}, expected {size} / {digest}")
        if isinstance(last, RepackError):
            raise last
        raise describe_error(last, f"upload of {self.where(rel)} failed after {tried} attempt(s)")

    def holds(self, rel: str, size: int, digest: str) -> bool:
        """True when the object exists with this size and sha256 metadata (one HEAD)."""
        try:
            head = self._call(rel, "head_object", Key=self.key(rel))
        except FileNotFoundError:
            return False
        return head["ContentLength"] == size and stored_sha256(head) == digest

    def put_bytes(self, rel: str, data: bytes, durable: bool = True) -> None:
        """A small object in one PUT (atomic by nature; ``durable`` is implied)."""
        del durable
        self._call(rel, "put_object", Key=self.key(rel), Body=data,
                   Metadata={SHA_META: hashlib.sha256(data).hexdigest()})
        if self._sizes is not None:
            self._sizes[rel] = len(data)

    def read_bytes(self, rel: str) -> bytes | None:
        try:
            return self._retried(rel, lambda: client().get_object(Bucket=self.bucket, Key=self.key(rel))["Body"].read())
        except FileNotFoundError:
            return None

    def read_range(self, rel: str, start: int, length: int) -> bytes:
        """``length`` bytes of the object at ``start`` (one ranged GET; fewer at its end)."""
        if length <= 0:
            return b""
        return self._retried(rel, lambda: client().get_object(Bucket=self.bucket, Key=self.key(rel),  # body read
                                                              Range=f"bytes={start}-{start + length - 1}")["Body"].read())

    def cache_listing(self) -> None:
        """List the whole prefix once; ``size`` answers from it (kept current by this process's
        own puts and deletes)."""
        self._sizes = self.list_sizes()

    def size(self, rel: str) -> int | None:
        """Object size, from the cached listing (made on first use)."""
        if self._sizes is None:
            self.cache_listing()
        return self._sizes.get(rel)

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        """{relative path: bytes} of every object under ``prefix`` (paged listing)."""
        base = f"{self.prefix}/" if self.prefix else ""

        def listing() -> dict[str, int]:
            found: dict[str, int] = {}
            pages = client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base + prefix)
            for page in pages:
                for obj in page.get("Contents", ()):
                    found[obj["Key"][len(base):]] = obj["Size"]
            return found

        try:
            return self._retried(prefix, listing)
        except FileNotFoundError as exc:  # NoSuchBucket is not a missing key: say so as before
            raise RepackError(f"{exc}: not found") from None

    def list_names(self, prefix: str = "") -> list[str]:
        """The relative paths of ``list_sizes``, sorted (the listing holds the sizes anyway)."""
        return sorted(self.list_sizes(prefix))

    def delete(self, rel: str) -> None:
        self._call(rel, "delete_object", Key=self.key(rel))
        if self._sizes is not None:
            self._sizes.pop(rel, None)

    def clear_state(self, state_dir: str) -> None:
        """Remove the job state objects (``--overwrite``), but not the lock this run holds."""
        for rel in self.list_sizes(f"{state_dir}/"):
            if not rel.startswith(f"{state_dir}/lock"):
                self.delete(rel)
        self.abort_uploads()

    def abort_uploads(self) -> None:
        """Abort multipart uploads left under the prefix by a killed run (their parts cost storage).
        Best effort: a store or a policy without ListMultipartUploads leaves them to its lifecycle rules."""
        from botocore.exceptions import BotoCoreError, ClientError

        base = f"{self.prefix}/" if self.prefix else ""
        try:
            pages = client().get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=base)
            for page in pages:
                for upload in page.get("Uploads", ()):
                    client().abort_multipart_upload(Bucket=self.bucket, Key=upload["Key"],
                                                    UploadId=upload["UploadId"])
        except (BotoCoreError, ClientError):
            return

    def download_parts(self, rel: str, local: Path, pool, part_bytes: int = PART_BYTES
                       ) -> tuple[int, str, str | None] | None:
        """Download the object into the file ``local`` as concurrent ranged GETs: one HEAD, then parts of
        ``part_bytes`` fetched on ``pool`` (a thread pool shared by the caller's downloads, so several are
        in flight) and written at their offsets; the file is hashed once complete. (size, sha256 of the
        content, sha256 stored at upload or None); None when the object does not exist. A part cut or
        throttled is asked again (``_retried``); an object that changed meanwhile fails the caller's
        sha256 check."""
        try:
            head = self._call(rel, "head_object", Key=self.key(rel))
        except FileNotFoundError:
            return None
        size = head["ContentLength"]

        def part(fd: int, start: int) -> None:
            end = min(start + part_bytes, size) - 1
            data = self._retried(rel, lambda: client().get_object(Bucket=self.bucket, Key=self.key(rel),
                                                                  Range=f"bytes={start}-{end}")["Body"].read())
            if len(data) != end + 1 - start:
                raise RepackError(f"{self.where(rel)}: {len(data)} bytes for range {start}-{end}: the object changed")
            os.pwrite(fd, data, start)

        with open(local, "wb") as out:
            out.truncate(size)
            for future in [pool.submit(part, out.fileno(), start) for start in range(0, size, part_bytes)]:
                future.result()
        return size, sha256_file(local), stored_sha256(head)

    def fetch(self, rel: str, local: Path, sha256: str | None = None) -> None:
        """Download ``rel`` to ``local`` (temp name, then rename), checking its sha256 against
        ``sha256``, else against the sha256 stored at upload."""
        if sha256 is None:
            try:
                sha256 = stored_sha256(self._call(rel, "head_object", Key=self.key(rel)))
            except FileNotFoundError:
                raise VerificationError(f"{self.where(rel)}: missing") from None
        local = Path(local)
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".{local.name}.tmp-{os.getpid()}")
        try:
            client().download_file(self.bucket, self.key(rel), str(tmp), Config=transfer_config())
        except Exception as exc:  # noqa: BLE001
            tmp.unlink(missing_ok=True)
            if is_missing(exc):
                raise VerificationError(f"{self.where(rel)}: missing") from None
            raise describe_error(exc, self.where(rel)) from None
        if sha256 is not None and sha256_file(tmp) != sha256:
            tmp.unlink(missing_ok=True)
            raise VerificationError(f"{self.where(rel)}: sha256 mismatch after download")
        os.replace(tmp, local)

    def lock(self, name: str) -> ObjectLock:
        """A lock object ``.repack/<name>`` refusing a second live run (see ``s3_lock``)."""
        return ObjectLock(self, f".repack/{name}")

    def check_lock(self) -> None:
        """JobLockedError when a lock this run took was taken over since (``ObjectLock.check_held``): called
        before a manifest is published, so a run that lost its lock never publishes over another's."""
        for lock in list(self.held_locks):
            lock.check_held()

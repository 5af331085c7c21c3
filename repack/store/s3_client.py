"""The S3 client of repack (boto3): one per process, retries, and errors as one-line messages; and
``getter()``, the process's whole-object GETs of small source objects (``repack.store.s3_get``:
signed here, routed and configured by this boto3 client).

Credentials and the endpoint come the standard AWS way (``AWS_ENDPOINT_URL``, profiles,
environment, instance roles) and never appear in a message.
"""

from __future__ import annotations

import os
import threading
import time

from repack.errors import RepackError, UsageError
from repack.manifest.s3_waits import S3Limits, WaitWatch, bounded_pause, watch_client

MULTIPART_BYTES = 64 << 20   # files larger than this are uploaded in parts of this size
TRANSFER_THREADS = 8
AUTH_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken", "ExpiredToken",
              "InvalidClientTokenId", "UnrecognizedClientException", "403", "AllAccessDisabled"}


def parse_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix/`` -> ("bucket", "some/prefix")."""
    if not url.startswith("s3://"):
        raise UsageError(f"{url!r} is not an s3:// URL")
    bucket, _, prefix = url[5:].partition("/")
    if not bucket:
        raise UsageError(f"{url!r} names no bucket (use s3://bucket/prefix)")
    return bucket, prefix.strip("/")


_clients: dict[int, object] = {}
_listers: dict[int, object] = {}
_getters: dict[int, object] = {}
_sessions: dict[int, object] = {}
_locks: dict[int, threading.RLock] = {}  # per process: a lock held at a fork is not the child's


def _made_once(made: dict, make):
    """``made[pid]``, made by ``make()`` once per process even when its threads (a prefetch pool) ask at
    once: a boto3 client costs ~0.1 s of CPU, and 16 threads each made one."""
    pid = os.getpid()
    if pid not in made:
        with _locks.setdefault(pid, threading.RLock()):
            if pid not in made:
                made[pid] = make()
    return made[pid]


_limits: dict[int, S3Limits] = {}


def limits() -> S3Limits:
    """This process's S3 limits (read from the environment once; UsageError naming a bad variable)."""
    pid = os.getpid()
    if pid not in _limits:
        try:
            _limits[pid] = S3Limits.from_env()
        except ValueError as exc:  # a bad REPACK_S3_* value is a bad job (exit 2), named
            raise UsageError(str(exc)) from None
    return _limits[pid]


def client():
    """One boto3 S3 client per process (clients are not fork-safe: a forked worker makes its own), with
    the timeouts and attempts of ``limits()`` (botocore "standard" retries: 5xx, throttling, connection
    errors, timeouts) and every call watched (a line on stderr when one waits long)."""
    def make():
        s3, _sessions[os.getpid()] = _new_client()
        return s3
    return _made_once(_clients, make)


def lister():
    """This process's S3 client for listings: as ``client()``, and its ListObjectsV2 pages carry keys and
    sizes as columns (``repack.store.s3_listing``: 10x less CPU per listed object than botocore's parse)."""
    def make():
        from repack.store.s3_listing import fast_listing

        s3 = _new_client()[0]
        fast_listing(s3)
        return s3
    return _made_once(_listers, make)


def getter():
    """This process's whole-object GETs (``repack.store.s3_get.ObjectGetter``: ~15x less client CPU per
    GET than ``client().get_object``), routed, signed and falling back as ``client()`` would."""
    s3 = client()

    def make():
        from repack.store.s3_get import ObjectGetter

        session = _sessions[os.getpid()]
        return ObjectGetter(s3, session.get_credentials(), limits(), is_missing, _ca_bundle(session))
    made = _made_once(_getters, make)
    if made.client is not s3:  # the client was replaced (a test pointing this process at another endpoint)
        _getters.pop(os.getpid(), None)
        made = _made_once(_getters, make)
    return made


_fetchers: dict[int, object] = {}


def fetcher(slow):
    """This process's pipelined whole-object GETs (``repack.store.s3_fetch.Fetcher`` over ``getter()``;
    ``slow``: how an object its fast path cannot read is read)."""
    made = getter()
    fetch = _fetchers.get(os.getpid())
    if fetch is None or fetch.getter is not made:  # first use, or the getter was replaced (tests)
        from repack.store.s3_fetch import Fetcher

        fetch = _fetchers[os.getpid()] = Fetcher(made, slow)
    return fetch


def _ca_bundle(session) -> str | None:
    """The CA bundle botocore verifies https endpoints with (AWS_CA_BUNDLE, the profile's ca_bundle,
    else its default: certifi's where installed)."""
    from botocore.httpsession import get_cert_path

    return get_cert_path(session.get_config_variable("ca_bundle") or True)


# botocore's data loader (the service models it reads from JSON, then caches): shared by every client of
# the process and inherited by forked workers, so a client costs ~10 ms of CPU instead of ~0.1-0.2 s
_loader = None


def _new_client():
    """(a boto3 S3 client, the botocore Session it was made from)."""
    try:
        import boto3
        import botocore.session
        from botocore.config import Config
    except ImportError:
        raise UsageError("s3:// needs boto3: pip install 'repack[s3]'") from None
    bounds = limits()
    config = Config(retries={"total_max_attempts": bounds.attempts, "mode": "standard"},
                    max_pool_connections=4 * TRANSFER_THREADS, connect_timeout=bounds.connect_timeout,
                    read_timeout=bounds.read_timeout)
    session = botocore.session.get_session()
    global _loader
    if _loader is None:
        _loader = session.get_component("data_loader")
    else:
        session.register_component("data_loader", _loader)
    s3 = boto3.session.Session(botocore_session=session).client("s3", config=config)
    watch_client(s3, WaitWatch(bounds))
    return s3, session


def transfer_config():
    """Multipart above MULTIPART_BYTES; a download stream cut or stalled is retried once by s3transfer
    (each of its requests already has botocore's attempts)."""
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=MULTIPART_BYTES, multipart_chunksize=MULTIPART_BYTES,
                          max_concurrency=TRANSFER_THREADS, use_threads=True, num_download_attempts=2)


def describe_error(exc: BaseException, where: str) -> RepackError:
    """A one-line, credential-free error for a failed S3 call (auth/missing bucket: UsageError, exit 2)."""
    from botocore.exceptions import (ClientError, ConnectionClosedError, ConnectTimeoutError, EndpointConnectionError,
                                     IncompleteReadError, NoCredentialsError, ReadTimeoutError,
                                     ResponseStreamingError)

    if isinstance(exc, (ResponseStreamingError, IncompleteReadError)):
        return RepackError(f"{where}: the S3 endpoint's answer was cut short ({type(exc).__name__}), every time it "
                           "was asked")
    if isinstance(exc, (ReadTimeoutError, ConnectTimeoutError, ConnectionClosedError)):
        return RepackError(f"{where}: the S3 endpoint did not answer ({type(exc).__name__}) after "
                           f"{limits().describe()}")
    if isinstance(exc, NoCredentialsError):
        return UsageError(f"{where}: no AWS credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                          "AWS_PROFILE or an instance role)")
    if isinstance(exc, EndpointConnectionError):
        return UsageError(f"{where}: cannot reach the S3 endpoint ({exc.kwargs.get('endpoint_url', '?')}); "
                          "check AWS_ENDPOINT_URL")
    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", "?"))
        if code in AUTH_CODES:
            return UsageError(f"{where}: access refused ({code}): check the AWS credentials "
                              "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE) and their permissions")
        if code == "NoSuchBucket":
            return UsageError(f"{where}: the bucket does not exist")
        return RepackError(f"{where}: S3 error {code}")
    return RepackError(f"{where}: {type(exc).__name__}: {exc}")


TRANSIENT_CODES = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling",
                   "ThrottlingException", "RequestLimitExceeded", "500", "502", "503", "504"}


def is_transient(exc: BaseException) -> bool:
    """True for an answer worth asking again after botocore's own attempts are spent (throttling, a 5xx,
    a dropped connection); never for a missing key or refused access, nor for a timeout (an endpoint that
    does not answer keeps the bound S3Limits documents)."""
    from botocore.exceptions import ClientError, ConnectionClosedError, IncompleteReadError, ResponseStreamingError

    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return str(error.get("Code")) in TRANSIENT_CODES or (isinstance(status, int) and status >= 500)
    # a body cut mid-way (a reset while it streams, fewer bytes than its length): the request is asked again
    return isinstance(exc, (ConnectionClosedError, ResponseStreamingError, IncompleteReadError))


ASK_AGAIN = 4  # a request's attempts on top of botocore's own, for a transient failure (``retried``)

# answers about one object, not about the endpoint: an input answered so is quarantined with the reason
OBJECT_CODES = {"NoSuchKey", "404", "NotFound", "AccessDenied", "403", "InvalidObjectState", "InvalidRange"}


def retried(request, where: str):
    """``request()``; a transient failure that outlasts botocore's attempts (throttling, 5xx, a dropped
    connection) is asked again (``ASK_AGAIN`` times in all, within the retry budget), so that every command,
    reading or writing, rides out the same faults. A missing key: FileNotFoundError; anything else: a one-line
    RepackError naming ``where``."""
    deadline = time.monotonic() + limits().retry_budget
    for attempt in range(ASK_AGAIN):
        try:
            return request()
        except Exception as exc:  # noqa: BLE001 - botocore's errors become one-line RepackErrors
            if is_missing(exc):
                raise FileNotFoundError(where) from None
            if not is_transient(exc) or attempt == ASK_AGAIN - 1 or time.monotonic() >= deadline:
                raise describe_error(exc, where) from None
        time.sleep(bounded_pause(attempt, deadline))


def is_object_fault(exc: BaseException) -> bool:
    """True for an answer about the object itself (missing, access refused to it, archived): the input is
    quarantined; False for a fault of the endpoint (``repack.errors.SourceUnavailable``)."""
    return error_code(exc) in OBJECT_CODES


def error_code(exc: BaseException) -> str | None:
    """The S3 error code of a ClientError ("NoSuchKey", "503", ...); None for any other exception."""
    from botocore.exceptions import ClientError

    return str(exc.response.get("Error", {}).get("Code")) if isinstance(exc, ClientError) else None


def is_missing(exc: BaseException) -> bool:
    return error_code(exc) in ("NoSuchKey", "404", "NotFound")

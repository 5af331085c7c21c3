"""One storage seam: where a job's finished files, task records, locks and manifest live.

A store is a root (a local folder, or ``s3://bucket/prefix``) with a few operations on paths
relative to it: ``publish`` a finished local file (atomically: whole and checked, or not at all),
``put_bytes``/``read_bytes`` small state, ``size``, ``list_sizes`` (``list_names``: the paths alone),
``delete``, ``fetch`` and ``lock``. Jobs always write into a local folder, ``store.scratch``: for a
local store that is the root itself (publishing is then a no-op); for an object store it is a scratch
folder from which finished files are uploaded.

Which store a location opens is decided by its scheme only (``s3://`` -> object store), so a
worker process rebuilds the same store from the job's spec.
"""

from __future__ import annotations

from repack.store.local import LocalStore

REMOTE_SCHEMES = ("s3://",)


def is_remote(location: str) -> bool:
    """True for an object-store URL (``s3://bucket/prefix``)."""
    return str(location).startswith(REMOTE_SCHEMES)


def open_store(location: str):
    """The store for ``location``: LocalStore for a path, S3Store for ``s3://bucket/prefix``."""
    if is_remote(location):
        from repack.store.s3 import S3Store

        return S3Store(location)
    return LocalStore(location)


__all__ = ["LocalStore", "is_remote", "open_store"]

"""A finished dataset's files as verify reads them, wherever they live: one interface over a local
folder (``LocalFiles``) and an object-store prefix (``RemoteFiles``), so that ``repack verify``
has one implementation and checks the same things in both places.

``manifest()`` reads and validates the manifest; ``names()`` lists every file under the root
(the job state ``.repack/`` and the manifest aside); ``local(rels)`` gives a local folder in which
the files ``rels`` can be read, plus the problems met while fetching them. For a folder that is
the folder itself; for a prefix it is a temporary folder the objects of one verify unit (a shard,
its index, its checksums) are downloaded into, all at once as concurrent ranged GETs, removed
afterwards.

``DatasetFiles`` (``open_dataset``) is the same dataset as a report reads it: its validated manifest and
byte ranges of the files it names (ranged GETs on s3://), every path confined to the root first.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from repack.manifest import MANIFEST_NAME, Manifest, parse_manifest, read_manifest, safe_join
from repack.manifest.io import open_regular
from repack.manifest.versions import check_number, read_version

STATE_PREFIX = ".repack/"  # the job state (task records, plan, locks): not dataset files


class LocalFiles:
    """The files of a dataset in a local folder."""

    remote = False

    def __init__(self, root: str | os.PathLike, manifest: Manifest | None = None) -> None:
        self.root = Path(root)
        self.where = str(root)
        self._manifest = manifest

    def manifest(self, version: int | None = None) -> Manifest:
        return self._manifest or read_manifest(self.root, version)

    def read(self, rel: str) -> bytes | None:
        """A file's bytes (None when absent)."""
        try:
            return safe_join(self.root, rel).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def names(self) -> list[str]:
        """Every file under the root, sorted; ``.repack/`` and the manifest aside. Links are not followed:
        a link to a folder is one entry."""
        found = []
        for folder, dirs, files in os.walk(self.root):
            rel_folder = os.path.relpath(folder, self.root)
            if rel_folder == ".":
                dirs[:] = [d for d in dirs if f"{d}/" != STATE_PREFIX]
            links = [d for d in dirs if os.path.islink(os.path.join(folder, d))]  # not walked: named as entries
            for name in files + links:
                rel = name if rel_folder == "." else f"{rel_folder}/{name}"
                if rel != MANIFEST_NAME:
                    found.append(rel)
        return sorted(found)

    def irregular(self, rels: list[str]) -> list[str]:
        """A problem for each of ``rels`` that is there but no regular file (a FIFO would block every read of it,
        a folder fail it), links followed; what is missing is left to the checks that name it."""
        import stat

        from repack.sources.confine import kind_of

        found = []
        for rel in rels:
            try:
                mode = os.stat(self.root / rel).st_mode
            except (OSError, ValueError):
                continue
            if not stat.S_ISREG(mode):
                found.append(f"{rel}: not a regular file ({kind_of(mode)})")
        return found

    @contextlib.contextmanager
    def local(self, rels: list[str]) -> Iterator[tuple[Path, list[str]]]:
        del rels
        yield self.root, []


class RemoteFiles:
    """The objects of a dataset under ``s3://bucket/prefix`` (through ``S3Store``)."""

    remote = True

    def __init__(self, url: str) -> None:
        from repack.store.s3 import S3Store
        from repack.store.s3_client import TRANSFER_THREADS

        self.store = S3Store(url)
        self.where = self.store.url
        self.threads = 4  # shards checked at once; each holds its files on local disk while it is checked
        self._gets = ThreadPoolExecutor(2 * TRANSFER_THREADS, thread_name_prefix="repack-get")  # GETs in flight

    def manifest(self, version: int | None = None) -> Manifest:
        """The validated manifest, latest or ``version`` (ManifestError naming the URL when missing or bad)."""
        store = self.store
        name, raw = read_version(store.read_bytes, version, store.url)
        manifest = parse_manifest(raw, store.scratch, store.where(name), store.url)  # paths stay under the prefix
        check_number(manifest.data, version, store.where(name))
        return manifest

    def read(self, rel: str) -> bytes | None:
        """An object's bytes (None when absent)."""
        return self.store.read_bytes(rel)

    def names(self) -> list[str]:
        """Every object key under the prefix, relative to it, sorted; ``.repack/`` and the manifest aside."""
        return sorted(rel for rel in self.store.list_sizes()
                      if not rel.startswith(STATE_PREFIX) and rel != MANIFEST_NAME)

    @contextlib.contextmanager
    def local(self, rels: list[str]) -> Iterator[tuple[Path, list[str]]]:
        """Download ``rels`` into a temporary folder (``fetched``): (the folder, the problems met)."""
        with self.fetched(rels) as (root, problems, _):
            yield root, problems

    @contextlib.contextmanager
    def fetched(self, rels: list[str]) -> Iterator[tuple[Path, list[str], dict[str, str]]]:
        """Download ``rels`` into a temporary folder, all at once, each as concurrent ranged GETs
        (``S3Store.download_parts``); a missing object is left absent (the checks report it), content
        that differs from the sha256 stored at upload is a problem. (the folder, the problems, the sha256
        of each downloaded file's content, computed once as it was fetched)."""
        problems: list[str] = []
        digests: dict[str, str] = {}
        with (tempfile.TemporaryDirectory(prefix="repack-verify-") as tmp,
              ThreadPoolExecutor(max(1, len(rels))) as files):
            targets = [safe_join(tmp, rel) for rel in rels]
            for target in targets:
                target.parent.mkdir(parents=True, exist_ok=True)
            fetched = files.map(lambda rel, target: self.store.download_parts(rel, target, self._gets), rels, targets)
            for rel, got in zip(rels, list(fetched)):
                if got is not None:
                    digests[rel] = got[1]
                if got is not None and got[2] is not None and got[1] != got[2]:
                    problems.append(f"{rel}: content does not match the sha256 stored at upload")
            yield Path(tmp), problems, digests


def open_files(location: str | os.PathLike):
    """``RemoteFiles`` for an s3:// URL, else ``LocalFiles``."""
    from repack.store import is_remote

    return RemoteFiles(str(location)) if is_remote(str(location)) else LocalFiles(location)


@dataclass(frozen=True)
class DatasetFiles:
    """A dataset's validated manifest, where it is (a folder made absolute, or a URL) and its store."""

    manifest: Manifest
    where: str
    store: object | None = None  # the S3Store of a remote dataset

    @property
    def local(self) -> bool:
        return self.store is None

    def read(self, rel: str, start: int = 0, length: int | None = None) -> bytes:
        """Bytes of the manifest-relative file ``rel`` (all from ``start``, or ``length`` of them)."""
        path = self.manifest.path(rel)  # ManifestError for a path leaving the root, local or remote
        if self.store is not None:
            if length is None:
                data = self.store.read_bytes(rel)
                if data is None:
                    raise FileNotFoundError(f"{self.where}/{rel}")
                return data[start:]
            return self.store.read_range(rel, start, length)
        with open_regular(path) as f:  # a FIFO in its place is refused, never waited on
            f.seek(start)
            return f.read() if length is None else f.read(length)

    def read_if_present(self, rel: str) -> bytes | None:
        """All bytes of the manifest-relative file ``rel``; None when it is missing."""
        try:
            return self.read(rel)
        except FileNotFoundError:
            return None

    def size(self, rel: str) -> int:
        """Bytes of the manifest-relative file ``rel`` (FileNotFoundError when it is missing)."""
        path = self.manifest.path(rel)
        size = self.store.size(rel) if self.store is not None else path.stat().st_size
        if size is None:
            raise FileNotFoundError(f"{self.where}/{rel}")
        return size

    def read_text(self, rel: str) -> str:
        return self.read(rel).decode("utf-8", errors="replace")

    def read_json_lines(self, rel: str) -> list[dict]:
        """The JSON objects of a JSON-lines file (lines that do not parse are skipped)."""
        found = []
        for line in self.read_text(rel).splitlines():
            try:
                found.append(json.loads(line))
            except ValueError:
                continue
        return found


def open_dataset(root: str | Path) -> DatasetFiles:
    """The dataset in a folder or at ``s3://bucket/prefix`` (ManifestError when it has no valid manifest)."""
    from repack.store import is_remote

    if is_remote(str(root)):
        remote = RemoteFiles(str(root))
        return DatasetFiles(remote.manifest(), remote.where, remote.store)
    manifest = read_manifest(root)
    return DatasetFiles(manifest, str(Path(manifest.root).absolute()))

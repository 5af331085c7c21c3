"""The files of a finished dataset as a report reads them: its manifest and byte ranges of the
files it names, from a local folder or from ``s3://bucket/prefix`` (ranged GETs). Every path comes
from the manifest and is confined to the dataset's root first."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from repack.manifest import Manifest, read_manifest
from repack.store import is_remote


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
        with open(path, "rb") as f:
            f.seek(start)
            return f.read() if length is None else f.read(length)

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
    if is_remote(str(root)):
        from repack.store.files import RemoteFiles

        remote = RemoteFiles(str(root))
        return DatasetFiles(remote.manifest(), remote.where, remote.store)
    manifest = read_manifest(root)
    return DatasetFiles(manifest, str(Path(manifest.root).absolute()))

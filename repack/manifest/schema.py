"""Manifest schema: names, version and validation.

Top-level keys (the contract; fields may be added, never renamed)::

  schema, version            "repack.manifest", 1 (readers refuse another major version)
  modality, format           e.g. "images", "webdataset"
  created_by                 {tool, version, options} (deterministic)
  fields                     {member extension or field: type}
  classes                    {class name: index}
  shards                     [{path, samples, bytes, sha256, index?, ...}] (paths relative to the root;
                             side files: index, checksums, source_runs)
  totals                     {inputs, samples, quarantined, bytes, ...}
  quarantine                 [{source, reason}]
  stats                      deterministic statistics (sizes, dimensions, ...)
  run                        what varies between runs: command, timing, executor (excluded from
                             byte-identity comparisons)
"""

from __future__ import annotations

import functools
import os
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from repack.manifest.paths import PathEscapeError, check_dataset_path, join_under_real

SCHEMA = "repack.manifest"
VERSION = 1  # every list whole in the manifest
# a list beyond its first entries in a side file the manifest names (quarantine records, duplicate groups): a
# repack that knows only VERSION would carry the listed entries into its next version and lose the rest, so it
# refuses the dataset by its version number instead
PARTIAL_VERSION = 2
VERSIONS = (VERSION, PARTIAL_VERSION)
MANIFEST_NAME = "manifest.json"
REQUIRED_KEYS = ("schema", "version", "modality", "format", "shards", "totals", "quarantine")


class ManifestError(ValueError):
    """A manifest that cannot be trusted: wrong schema, unknown version, bad paths."""


@dataclass(frozen=True)
class Shard:
    """One output file recorded in the manifest."""

    path: str
    samples: int
    bytes: int
    sha256: str
    index: str | None = None
    extra: tuple = ()

    @classmethod
    def from_dict(cls, entry: dict) -> "Shard":
        known = {"path", "samples", "bytes", "sha256", "index"}
        return cls(entry["path"], int(entry["samples"]), int(entry["bytes"]), entry["sha256"], entry.get("index"),
                   tuple(sorted((k, v) for k, v in entry.items() if k not in known and isinstance(v, (str, int, float)))))


def format_version(data: dict) -> int:
    """The manifest version ``data`` is written as: PARTIAL_VERSION where its ``files`` name a list's side file
    (role ``quarantine``, ``duplicates``, ``duplicates-vN``), else VERSION."""
    roles = data.get("files") or {}
    return PARTIAL_VERSION if any(role == "quarantine" or role.startswith("duplicates") for role in roles) \
        else VERSION


@dataclass(frozen=True)
class Manifest:
    """A validated manifest bound to the folder it lives in (``url``: where it was read from when that
    is not the folder, e.g. ``s3://bucket/prefix``; messages name it)."""

    root: Path
    data: dict
    url: str = ""

    @property
    def where(self) -> str:
        """The dataset's location as the user named it (the URL, else the folder)."""
        return self.url or str(self.root)

    def validate(self) -> None:
        """Raise ManifestError unless schema, version, keys and every path hold."""
        data = self.data
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            found = data.get("schema") if isinstance(data, dict) else type(data).__name__
            raise ManifestError(f"{self.where}: not a repack manifest (schema {found!r})")
        version = data.get("version")
        if not isinstance(version, int) or version not in VERSIONS:
            raise ManifestError(f"{self.where}: manifest version {version!r} is not supported (this reader knows "
                                f"{', '.join(map(str, VERSIONS))})")
        missing = [k for k in REQUIRED_KEYS if k not in data]
        if missing:
            raise ManifestError(f"{self.where}: manifest lacks {', '.join(missing)}")
        shards = data["shards"]
        if not isinstance(shards, list) or not all(
                isinstance(s, dict) and isinstance(s.get("path"), str) and isinstance(s.get("samples"), int)
                and isinstance(s.get("bytes"), int) and isinstance(s.get("sha256"), str) for s in shards):
            raise ManifestError(f"{self.where}: manifest shards must be a list of {{path, samples, bytes, sha256}}")
        for key, kind in (("totals", dict), ("quarantine", list), ("classes", dict), ("fields", dict),
                          ("files", dict), ("format", str), ("modality", str), ("stats", dict), ("created_by", dict),
                          ("dataset_version", dict), ("tokenizer", dict)):
            if key in data and not isinstance(data[key], kind):
                raise ManifestError(f"{self.where}: manifest {key} must be a {kind.__name__}")
        number = data.get("dataset_version", {}).get("number", 1)
        if not isinstance(number, int) or isinstance(number, bool) or number < 1:
            raise ManifestError(f"{self.where}: manifest dataset_version.number must be a whole number from 1, "
                                f"not {number!r}")
        self._check_path_fields()
        seen: set[str] = set()
        for rel in self.relative_paths():
            same = self._check_path(rel)
            if same in seen:  # a reader would yield its samples twice; a copy would race on one file
                raise ManifestError(f"{self.where}: the manifest names {rel!r} twice (each shard, index and "
                                    "side file must be listed once)")
            seen.add(same)
        for rel in [v["path"] for v in self.data.get("videos", [])] + self.prefixes():
            self._check_path(rel)

    def _check_path(self, rel: str) -> str:
        """The one rule for a path the manifest names (``repack.manifest.paths``), normalized; ManifestError
        naming the manifest and the path."""
        try:
            same = check_dataset_path(rel)
            self.path(rel)
        except PathEscapeError as exc:
            raise ManifestError(f"{self.where}: version {self._number()}: {exc}") from None
        return same

    def _number(self) -> object:
        """The dataset version this manifest says it is (for messages; 1 without ``dataset_version``)."""
        info = self.data.get("dataset_version")
        return info.get("number", "?") if isinstance(info, dict) else 1 if info is None else "?"

    def _check_path_fields(self) -> None:
        """Every path-bearing field has the type its paths need (strings where a path goes)."""
        data = self.data
        for entry in data["shards"]:
            for key in ("index", "prefix", "checksums", "source_runs"):
                if entry.get(key) is not None and not isinstance(entry[key], str):
                    raise ManifestError(f"{self.where}: shard {entry['path']!r}: {key} must be a path string")
        if not all(isinstance(v, str) for v in data.get("files", {}).values()):
            raise ManifestError(f"{self.where}: manifest files must map names to path strings")
        videos = data.get("videos", [])
        if not isinstance(videos, list) or not all(isinstance(v, dict) and isinstance(v.get("path"), str)
                                                   for v in videos):
            raise ManifestError(f"{self.where}: manifest videos must be a list of {{path, ...}}")
        prefixes = data.get("prefixes", [])
        if not isinstance(prefixes, list) or not all(isinstance(p, str) for p in prefixes):
            raise ManifestError(f"{self.where}: manifest prefixes must be a list of path strings")

    def prefixes(self) -> list[str]:
        """The Megatron path prefixes the manifest names (top-level ``prefixes`` and per shard)."""
        return list(self.data.get("prefixes", [])) + [s["prefix"] for s in self.data["shards"] if s.get("prefix")]

    def named_files(self) -> list[str]:
        """Every file of the dataset the manifest names: ``relative_paths`` and the prepared videos
        (``videos[].path``) a video WebDataset keeps beside its shards, each in one spelling (``./a`` and
        ``a//b`` are ``a`` and ``a/b``, as the path rule reads them). What gc keeps or deletes, and what verify
        counts as named."""
        return [posixpath.normpath(rel) for rel in
                (*self.relative_paths(), *(v["path"] for v in self.data.get("videos", [])))]

    def relative_paths(self) -> Iterator[str]:
        """Every file path the manifest names (shards, index files, side files)."""
        for entry in self.data["shards"]:
            yield entry["path"]
            if entry.get("index"):
                yield entry["index"]
            if entry.get("checksums"):
                yield entry["checksums"]
            if entry.get("source_runs"):  # a token prefix's document sources (repack.manifest.source_runs)
                yield entry["source_runs"]
        for rel in self.data.get("files", {}).values():
            yield rel

    def path(self, rel: str) -> Path:
        """Absolute path of a manifest-relative path, confined to the root (each path joined and checked
        once per manifest object: a reader asks for a shard's paths several times while it opens)."""
        joined = self._joined.get(rel)
        if joined is None:
            joined = self._joined[rel] = join_under_real(self.root_real, rel)
        return joined

    @functools.cached_property
    def _joined(self) -> dict[str, Path]:
        return {}

    @functools.cached_property
    def root_real(self) -> Path:
        """The root resolved once (``os.path.realpath``): every path the manifest names is joined under it."""
        return Path(os.path.realpath(self.root))

    @property
    def modality(self) -> str:
        return self.data["modality"]

    @property
    def format(self) -> str:
        return self.data["format"]

    @property
    def shards(self) -> list[Shard]:
        return [Shard.from_dict(s) for s in self.data["shards"]]

    @property
    def classes(self) -> dict[str, int]:
        return dict(self.data.get("classes") or {})

    @property
    def fields(self) -> dict[str, str]:
        return dict(self.data.get("fields") or {})

    @property
    def totals(self) -> dict[str, Any]:
        return dict(self.data["totals"])

    @property
    def quarantine(self) -> list[dict]:
        return list(self.data["quarantine"])

    @property
    def num_samples(self) -> int:
        return sum(int(s["samples"]) for s in self.data["shards"])

"""A dataset's duplicate groups (inputs of equal content, the first of each kept) as columns in a side file.

``stats.duplicates`` listed every group in the manifest, ~250 B of JSON a group: a million groups (a crawl with
a third copies, packed with or without --dedup) made a manifest over the cap every reader refuses, and every
reader that opened a smaller one parsed them all. Now the manifest lists at most ``listed_groups()`` groups
(``REPACK_DUPLICATES_LISTED``, default 1,000: what reports show); beyond that the report names a side file
(``file``) that holds every group, and the manifest's ``files``/``file_digests`` name it with its size and sha256
(``repack verify`` checks them; gc, pull and s3:// publish move it with the version). Those that need every
group (an --append's dropped copies, a remove's takedown of one) read them through ``report_dropped``.

Layout (integers little-endian; no pickle):
  b"repack-duplicate-groups 1\\n"
  one JSON line      {"groups": G, "paths": P, "name_bytes": N}
  sha256             G x 32 bytes   each group's content digest
  group_ends         G x int64      the end (exclusive) of each group's run of paths; a group's first path is kept
  name_ends          P x int64      the end of each path's bytes in ``names``
  print_lens         P x uint8      how many fingerprint numbers ``prints`` holds for the path: 0 (none: the
                                    kept path, a report without prints), 1 (an s3:// ETag value), 2 (size, mtime)
  prints             P x 2 int64    a dropped copy's fingerprint when it was left out
  names              N bytes        the paths, UTF-8 (surrogateescape), back to back
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from repack.manifest.caps import listed_limit
from repack.manifest.schema import ManifestError
from repack.manifest.side_columns import counts_line, cut_texts

MAGIC = b"repack-duplicate-groups 1\n"
LISTED_DEFAULT = 1000


class GroupsFileError(ManifestError):
    """A duplicate-groups file that cannot be read (a dataset file damaged or missing); the message names it."""


def listed_groups() -> int:
    """How many groups a manifest lists itself (``REPACK_DUPLICATES_LISTED``, default 1,000; 0 or more); UsageError
    for another value (an images job asks before its first task: ``ImagesJob.check``)."""
    return listed_limit("REPACK_DUPLICATES_LISTED", LISTED_DEFAULT, "groups")


FILE_NAME = re.compile(r"duplicates(?:-v[0-9]+)?\.groups")  # any version's groups file


def file_name(version: int = 1) -> str:
    """The groups file of a version's report: ``duplicates.groups`` (a first job), ``duplicates-vN.groups`` (an
    append's)."""
    return "duplicates.groups" if version == 1 else f"duplicates-v{int(version)}.groups"


def role_of(name: str) -> str:
    """The manifest ``files`` role of a groups file (its name without the extension)."""
    return name.rpartition(".")[0]


def encode(groups: list[dict]) -> bytes:
    """The file of ``groups`` (dicts of ``sha256`` hex, ``paths``, optional ``prints``: one per path after the
    first)."""
    paths = [path for group in groups for path in group["paths"]]
    blobs = [path.encode("utf-8", "surrogateescape") for path in paths]
    lens = np.zeros(len(paths), np.uint8)
    prints = np.zeros((len(paths), 2), "<i8")
    at = 0
    for group in groups:
        for offset, found in enumerate(group.get("prints") or (), start=at + 1):
            if found:
                lens[offset] = len(found)
                prints[offset, :len(found)] = found
        at += len(group["paths"])
    header = {"groups": len(groups), "paths": len(paths), "name_bytes": sum(map(len, blobs))}
    return b"".join([
        MAGIC, json.dumps(header, sort_keys=True).encode() + b"\n",
        b"".join(bytes.fromhex(group["sha256"]) for group in groups),
        np.cumsum([len(group["paths"]) for group in groups], dtype="<i8").tobytes(),
        np.cumsum([len(blob) for blob in blobs], dtype="<i8").tobytes(),
        lens.tobytes(), prints.tobytes(), b"".join(blobs)])


@dataclass(frozen=True)
class GroupColumns:
    """A groups file's columns (views of its bytes; see the module docstring)."""

    digests: np.ndarray     # (G, 32) uint8
    group_ends: np.ndarray  # (G,) int64
    name_ends: np.ndarray   # (P,) int64
    lens: np.ndarray        # (P,) uint8
    prints: np.ndarray      # (P, 2) int64
    names: bytes

    def paths(self, rows: np.ndarray) -> list[str]:
        """The paths of ``rows`` (path numbers), as str."""
        starts = np.concatenate([np.zeros(1, np.int64), self.name_ends[:-1]])[rows].tolist()
        return cut_texts(self.names, starts, self.name_ends[rows].tolist())


def columns(raw: bytes, where: str) -> GroupColumns:
    """The columns of a groups file; GroupsFileError naming ``where`` when it is not one ``encode`` writes."""
    def refuse(why: str) -> GroupsFileError:
        return GroupsFileError(f"{where}: not a duplicate-groups file repack reads ({why})")

    (groups, count, name_bytes), at = counts_line(raw, MAGIC, ("groups", "paths", "name_bytes"), refuse)
    if 40 * groups + 25 * count + name_bytes != len(raw) - at:
        raise refuse(f"{len(raw)} bytes, not what {groups} groups of {count} paths take")

    def take(size: int, dtype: str) -> np.ndarray:
        nonlocal at
        column = np.frombuffer(raw, dtype, size // np.dtype(dtype).itemsize, at)
        at += size
        return column

    found = GroupColumns(take(32 * groups, "u1").reshape(groups, 32), take(8 * groups, "<i8"), take(8 * count, "<i8"),
                         take(count, "u1"), take(16 * count, "<i8").reshape(count, 2), raw[at:])
    if (np.any(np.diff(found.group_ends, prepend=0) < 1) or (groups and found.group_ends[-1] != count)
            or np.any(np.diff(found.name_ends, prepend=0) < 0) or (count and found.name_ends[-1] != name_bytes)
            or np.any(found.lens > 2)):
        raise refuse("its offsets do not add up")
    return found


def decode(raw: bytes, where: str) -> Iterator[dict]:
    """The groups a file holds, in its order (dicts as ``encode`` takes them, ``prints`` where recorded);
    GroupsFileError naming ``where`` when the file is not one ``encode`` writes."""
    cols = columns(raw, where)
    paths = cols.paths(np.arange(len(cols.name_ends)))
    lens, prints = cols.lens.tolist(), cols.prints.tolist()
    first = 0
    for group, end_path in enumerate(cols.group_ends.tolist()):
        found = [prints[path][:lens[path]] for path in range(first + 1, end_path)]
        entry = {"sha256": cols.digests[group].tobytes().hex(), "paths": paths[first:end_path]}
        if any(found):
            entry["prints"] = found
        yield entry
        first = end_path


def _checked_file(report: dict, read: Callable[[str], bytes | None], where: str, digests: dict | None) -> bytes:
    """The bytes of the side file a report names, with the size and sha256 ``digests`` (the manifest's
    ``file_digests``) records for it where given: a damaged file would make an append take a new input for a
    dropped copy and leave it out."""
    name = report["file"]
    raw = read(name)
    if raw is None:
        raise GroupsFileError(f"{where}/{name}: missing (the duplicate groups its manifest's stats.duplicates names)")
    if digests is not None:
        expected = digests.get(role_of(name))
        if not isinstance(expected, dict) or expected.get("bytes") != len(raw) or \
                expected.get("sha256") != hashlib.sha256(raw).hexdigest():
            raise GroupsFileError(f"{where}/{name}: not the duplicate groups the manifest records (its size or sha256 "
                                  "differs, or file_digests has no entry for it); `repack verify` names what else "
                                  "changed")
    return raw


def report_dropped(report: dict, read: Callable[[str], bytes | None], where: str,
                   digests: dict | None = None) -> tuple[list[str], list[str], list[list[int]]]:
    """Of a ``stats.duplicates`` report's groups (its side file's, ``file``, read with ``read`` and checked against
    ``digests`` where given; ``where`` names the dataset in errors; else its ``list``): every path after its group's
    first (a dropped copy, where the report dropped them), its group's sha256 (hex) and the fingerprint recorded
    for it ([] when none), in order; from a side file as columns (a dict per group cost ~7 s at a million
    groups)."""
    if not report.get("file"):
        rels, shas, found = [], [], []
        for group in report.get("list") or ():
            paths = group.get("paths", ())
            prints = group.get("prints")
            prints = prints if isinstance(prints, list) and len(prints) == len(paths) - 1 else [[]] * (len(paths) - 1)
            for rel, fingerprint in zip(paths[1:], prints):
                rels.append(rel)
                shas.append(group.get("sha256"))
                found.append(list(fingerprint) if isinstance(fingerprint, list) else [])
        return rels, shas, found
    cols = columns(_checked_file(report, read, where, digests), f"{where}/{report['file']}")
    sizes = np.diff(cols.group_ends, prepend=0)
    group_of = np.repeat(np.arange(len(sizes)), sizes)  # each path's group
    rows = np.flatnonzero(np.arange(len(group_of)) != (cols.group_ends - sizes)[group_of])  # all but the first
    group_of = group_of[rows]
    hexed = cols.digests.tobytes().hex()
    shas = [hexed[64 * g:64 * g + 64] for g in group_of.tolist()]
    lens, prints = cols.lens[rows], cols.prints[rows]
    if np.all(lens == 2):  # a folder's copies: (size, mtime) each
        return cols.paths(rows), shas, prints.tolist()
    return cols.paths(rows), shas, [p[:n] for p, n in zip(prints.tolist(), lens.tolist())]

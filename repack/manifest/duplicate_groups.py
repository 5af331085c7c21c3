"""A dataset's duplicate groups (inputs of equal content, the first of each kept) as columns in a side file.

``stats.duplicates`` listed every group in the manifest, ~250 B of JSON a group: a million groups (a crawl with
a third copies, packed with or without --dedup) made a manifest over the cap every reader refuses, and every
reader that opened a smaller one parsed them all. Now the manifest lists at most ``listed_groups()`` groups
(``REPACK_DUPLICATES_LISTED``, default 1,000: what reports show); beyond that the report names a side file
(``file``) that holds every group, and the manifest's ``files``/``file_digests`` name it with its size and sha256
(``repack verify`` checks them; gc, pull and s3:// publish move it with the version). Those that need every
group (an --append's dropped copies, a remove's takedown of one) read it through ``report_groups``.

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
import os
from typing import Callable, Iterator

import numpy as np

from repack.errors import UsageError
from repack.manifest.schema import ManifestError

MAGIC = b"repack-duplicate-groups 1\n"
LISTED_DEFAULT = 1000


class GroupsFileError(ManifestError):
    """A duplicate-groups file that cannot be read (a dataset file damaged or missing); the message names it."""


def listed_groups() -> int:
    """How many groups a manifest lists itself (``REPACK_DUPLICATES_LISTED``, default 1,000; 0 or more); UsageError
    for another value (an images job asks before its first task: ``ImagesJob.check``)."""
    raw = os.environ.get("REPACK_DUPLICATES_LISTED", "").strip()
    if not raw:
        return LISTED_DEFAULT
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise UsageError(f"REPACK_DUPLICATES_LISTED={raw!r}: a whole number of groups, 0 or more")
    return value


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


def decode(raw: bytes, where: str) -> Iterator[dict]:
    """The groups a file holds, in its order (dicts as ``encode`` takes them, ``prints`` where recorded);
    GroupsFileError naming ``where`` when the file is not one ``encode`` writes."""
    def refuse(why: str) -> GroupsFileError:
        return GroupsFileError(f"{where}: not a duplicate-groups file repack reads ({why})")

    if not raw.startswith(MAGIC):
        raise refuse("no repack-duplicate-groups 1 header")
    end = raw.find(b"\n", len(MAGIC))
    try:
        header = json.loads(raw[len(MAGIC):end]) if end > 0 else None
        groups, count, name_bytes = (header[key] for key in ("groups", "paths", "name_bytes"))
    except (ValueError, TypeError, KeyError, RecursionError):
        raise refuse("its counts line is damaged") from None
    if not all(type(n) is int for n in (groups, count, name_bytes)):
        raise refuse("its counts are not whole numbers")
    if min(groups, count, name_bytes) < 0 or 40 * groups + 25 * count + name_bytes != len(raw) - end - 1:
        raise refuse(f"{len(raw)} bytes, not what {groups} groups of {count} paths take")
    at = end + 1

    def take(size: int, dtype: str) -> np.ndarray:
        nonlocal at
        column = np.frombuffer(raw, dtype, size // np.dtype(dtype).itemsize, at)
        at += size
        return column

    digests = take(32 * groups, "u1")
    group_ends, name_ends = take(8 * groups, "<i8"), take(8 * count, "<i8")
    lens, prints = take(count, "u1"), take(16 * count, "<i8").reshape(count, 2)
    names = raw[at:]
    if (np.any(np.diff(group_ends, prepend=0) < 1) or (groups and group_ends[-1] != count)
            or np.any(np.diff(name_ends, prepend=0) < 0) or (count and name_ends[-1] != name_bytes)
            or np.any(lens > 2)):
        raise refuse("its offsets do not add up")
    ends, name_ends, lens, prints = group_ends.tolist(), name_ends.tolist(), lens.tolist(), prints.tolist()
    first = name_start = 0
    for group, end_path in enumerate(ends):
        paths, found = [], []
        for path in range(first, end_path):
            paths.append(names[name_start:name_ends[path]].decode("utf-8", "surrogateescape"))
            name_start = name_ends[path]
            if path > first:
                found.append(prints[path][:lens[path]])
        entry = {"sha256": bytes(digests[32 * group:32 * group + 32]).hex(), "paths": paths}
        if any(found):
            entry["prints"] = found
        yield entry
        first = end_path


def report_groups(report: dict, read: Callable[[str], bytes | None], where: str,
                  digests: dict | None = None) -> Iterator[dict]:
    """Every group of a ``stats.duplicates`` report: its side file's (``file``, read with ``read``; ``where``
    names the dataset in errors) when it names one, else its ``list``. With ``digests`` (the manifest's
    ``file_digests``) the file must have the size and sha256 recorded there: a damaged file would make an append
    take a new input for a dropped copy and leave it out."""
    name = report.get("file")
    if not name:
        yield from report.get("list") or ()
        return
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
    yield from decode(raw, f"{where}/{name}")

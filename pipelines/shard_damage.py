"""Which samples of a webdataset dataset are not the bytes repack packed, for a reader whose engine fails
without naming one (DALI's decoders: "nvImageCodec failure"), among the shards the failing reader reads. Each sample's members, in index order, are
hashed and compared with the crc32 its shard's ``.crc`` file records (the check ``ImageShardDataset``'s
``verify_samples=True`` makes as it reads); one pass over the local shards, run only after a failure."""

from __future__ import annotations

import mmap
import os
import zlib

from pipelines.manifest_access import read_checksums, read_index_columns
from repack.manifest import ManifestError


def damaged_samples(manifest, shards: list[int] | None = None, limit: int = 10) -> list[tuple[str, str, str]]:
    """(shard path, sample key or "", what is wrong) for up to ``limit`` samples or shards (of ``shards``,
    default all: numbers in the manifest) of the local dataset ``manifest`` whose bytes are not the ones
    packed; empty when every sample is intact. A shard without a ``.crc`` file (an older repack's) is skipped:
    nothing says what its samples' bytes were."""
    found: list[tuple[str, str, str]] = []
    entries = manifest.data["shards"]
    for number in range(len(entries)) if shards is None else shards:
        entry = entries[number]
        if len(found) >= limit:
            break
        if not entry.get("checksums"):
            continue
        path = str(manifest.path(entry["path"]))
        try:
            crcs = read_checksums(manifest, number)
            index = read_index_columns(manifest, [number])
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size != entry["bytes"]:
                    found.append((path, "", f"{size} bytes, the manifest says {entry['bytes']}"))
                    continue
                if not size:
                    continue
                with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as tar:
                    found += _sample_mismatches(path, memoryview(tar), index, crcs, limit - len(found))
        except (OSError, ManifestError, ValueError) as exc:
            found.append((path, "", f"cannot be checked ({exc})"))
    return found


def _sample_mismatches(path: str, view: memoryview, index, crcs, limit: int) -> list[tuple[str, str, str]]:
    """The samples of one mapped shard whose members' crc32 is not the recorded one (at most ``limit``)."""
    found = []
    offsets, sizes, first = index.offset.tolist(), index.size.tolist(), index.first_member.tolist()
    try:
        for sample, expected in enumerate(crcs.tolist()):
            crc = 0
            for member in range(first[sample], first[sample + 1]):
                at = offsets[member]
                crc = zlib.crc32(view[at:at + sizes[member]], crc)
            if crc != expected:
                found.append((path, index.key(sample), "its bytes are not the ones packed (crc32 "
                                                       f"{crc:08x}, recorded {expected:08x})"))
                if len(found) >= limit:
                    break
    finally:
        view.release()
    return found

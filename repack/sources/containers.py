"""Files that hold many inputs (other tools' tar shards, parquet files): finding and opening them.

SOURCE is one such file, a folder tree of them, or an s3:// prefix. Local files go through the
source's ``Confinement`` like any input (no symlink leaving the root, no FIFO or device); hidden
files and OS junk are skipped; files of another type (img2dataset's ``.parquet``/``_stats.json``
beside its ``.tar`` shards, say) are counted as skipped, never read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import BinaryIO

from repack.errors import UsageError
from repack.sources.base import alias_reason, pick_real_paths, quarantine_record, sort_key
from repack.sources.confine import Confinement
from repack.sources.walk import is_junk
from repack.store import is_remote


@dataclass(frozen=True)
class Container:
    """One file holding inputs: where to open it, its name relative to SOURCE, its fingerprint."""

    path: str
    rel: str
    fingerprint: tuple[int, ...]  # [size, mtime_ns, inode] (s3: [size, ETag value]): checked when a task reads it


@dataclass(frozen=True)
class Listing:
    containers: tuple[Container, ...]
    quarantine: tuple[dict, ...]
    skipped: int


def list_containers(source: str, suffixes: tuple[str, ...], refused: dict[str, str],
                    confinement: Confinement) -> Listing:
    """Every file under ``source`` ending in one of ``suffixes``, sorted by byte path; a file ending in a
    key of ``refused`` is quarantined with that reason."""
    def kind(rel: str) -> str:
        lower = rel.lower()
        if any(lower.endswith(s) for s in refused):
            return "refused"
        return "take" if any(lower.endswith(s) for s in suffixes) else "skip"

    found: list[Container] = []
    quarantine: list[dict] = []
    skipped = 0
    if is_remote(source):
        from repack.sources.s3 import list_columns

        listing = list_columns(source)  # keys that name no file quarantined, hidden/junk ones counted
        quarantine += listing.quarantine
        skipped += listing.skipped
        # an object's fingerprint: its size and ETag value (repack.sources.object_etag; a read checks the size)
        entries = [(f"{listing.root}/{rel}", rel, (size, etag))
                   for rel, size, etag in zip(listing.rels, listing.sizes.tolist(), listing.etags.tolist())]
    else:
        entries = _local_files(source, confinement, quarantine)
    for path, rel, fingerprint in entries:
        what = kind(rel)
        if what == "refused":
            reason = next(r for s, r in refused.items() if rel.lower().endswith(s))
            quarantine.append(quarantine_record(rel, reason))
        elif what == "take":
            found.append(Container(path, rel, fingerprint))
        else:
            skipped += 1
    if not found and not quarantine:
        raise UsageError(f"source {source!r} holds no {' or '.join(suffixes)} files")
    return Listing(tuple(found), tuple(quarantine), skipped)


def _local_files(source: str, confinement: Confinement, quarantine: list[dict]) -> list[tuple[str, str, tuple]]:
    if not os.path.exists(source):
        raise UsageError(f"source {source!r} does not exist")
    if os.path.isfile(source):
        root, names = os.path.dirname(os.path.abspath(source)), [os.path.basename(source)]
    else:
        root, names = os.path.abspath(source), None
    conf = confinement.rooted(root)
    found = []

    def visit(path: str, rel: str, ancestors: frozenset) -> None:
        checked = conf.check(path)
        if checked.reason is not None:
            quarantine.append(quarantine_record(rel, checked.reason))
        elif checked.is_dir:
            ident = (checked.st.st_dev, checked.st.st_ino)
            if ident in ancestors:
                quarantine.append(quarantine_record(rel, "symlink loop (folder already being scanned)"))
                return
            with os.scandir(checked.real) as it:
                for entry in sorted(it, key=lambda e: sort_key(e.name)):
                    if not is_junk(entry.name):
                        visit(entry.path, f"{rel}/{entry.name}" if rel else entry.name, ancestors | {ident})
        else:
            st = checked.st
            found.append((checked.real, rel, st))

    if names is None:
        visit(root, "", frozenset())
    else:
        visit(os.path.join(root, names[0]), names[0], frozenset())
    return _read_once(sorted(found, key=lambda f: sort_key(f[1])), root, quarantine)


def _read_once(found: list[tuple], root: str, quarantine: list[dict]) -> list[tuple[str, str, tuple]]:
    """The containers of ``found`` (real path, rel, stat; in rel order) as (real path, rel, fingerprint), each
    file read once: of several paths to it the rule of ``pick_real_paths``, the others quarantined naming it."""
    aliases = pick_real_paths([(rel, real, st) for real, rel, st in found], root)
    for real, rel, _ in found:
        if rel in aliases:
            quarantine.append(quarantine_record(rel, alias_reason(rel, real, aliases[rel], root)))
    return [(real, rel, (st.st_size, st.st_mtime_ns, st.st_ino)) for real, rel, st in found if rel not in aliases]


def open_container(container: Container) -> BinaryIO:
    """Open a container for reading (seekable), its fingerprint checked as a planned input's is."""
    from repack.sources.members import open_input

    return open_input(container.path, list(container.fingerprint), container.rel)

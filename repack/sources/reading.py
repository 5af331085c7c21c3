"""Reading planned inputs, local or in object storage, the one way every job does it.

A local path is opened through the confinement (``repack.sources.confine.open_input``: no
symlink followed, nothing but a regular file, the planned fingerprint checked). An s3:// object
is read through ranged GETs (``repack.sources.s3``); its planned size is its fingerprint: an
object of another size raises ``SourceChanged`` like a changed local file (checked from each
answer's Content-Range or length: no extra request).
"""

from __future__ import annotations

from typing import BinaryIO, Iterator

from repack.sources.confine import InputRefused, SourceChanged, read_input
from repack.sources.confine import open_input as open_local
from repack.store import is_remote


def _changed(rel: str | None, path: str) -> SourceChanged:
    return SourceChanged(f"source changed: {rel or path} differs from the planned input (size); "
                         "re-run with --overwrite to start over")


def open_input(path: str, expected: list[int] | None = None, rel: str | None = None,
               buffering: int = -1) -> BinaryIO:
    """Open a planned input for reading (see the module docstring); ``expected``: its fingerprint."""
    if not is_remote(path):
        return open_local(path, expected, rel, buffering)
    from repack.sources.s3 import open_object  # the object-store stack, imported only where an input is remote

    return open_object(path, expected[0] if expected else None)


def read_inputs(entries: list[dict], root: str = "") -> Iterator[bytes | OSError]:
    """The bytes of each planned input ({"path" (else ``root`` + "rel"), "rel", "fingerprint"}), or the
    OSError reading it, in order: local files one by one through the confinement, s3:// objects
    with many GETs in flight (``repack.sources.s3.prefetched``); entries stored inside other files (``member``) through
    ``repack.sources.members``."""
    if entries and "member" in entries[0]:
        from repack.sources.members import read_members

        yield from read_members(entries)
        return
    if any(is_remote(e.get("path") or root) for e in entries):
        from repack.sources.s3 import prefetched

        paths = [e.get("path") or root + e["rel"] for e in entries]
        sizes = [e["fingerprint"][0] if e.get("fingerprint") else None for e in entries]
        for entry, data in zip(entries, prefetched(paths, sizes)):
            expected = entry.get("fingerprint")
            if not isinstance(data, OSError) and expected and len(data) != expected[0]:
                raise _changed(entry["rel"], entry.get("path") or root + entry["rel"])
            yield data
        return
    for entry in entries:
        try:
            yield read_input(entry.get("path") or root + entry["rel"], entry.get("fingerprint"), entry["rel"])
        except OSError as exc:
            yield exc


def unreadable_reason(exc: OSError) -> str:
    """The quarantine reason of an input that could not be read."""
    return str(exc) if isinstance(exc, InputRefused) else f"unreadable: {exc.strerror or exc}"

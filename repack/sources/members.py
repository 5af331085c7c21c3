"""Reading inputs stored inside other files: tar members (an offset and a size) and parquet rows.

A task's entries carry ``member``: ``{"offset", "size"}`` (a tar member's data) or ``{"row",
"column"}`` (a parquet row's image bytes). Consecutive entries of one container share one open
file (its fingerprint checked once, as a planned input's); parquet rows are read in bounded
batches (``repack.sources.parquet_batches``). A member that cannot be read is an OSError value (the
task quarantines that input).
"""

from __future__ import annotations

from itertools import groupby
from typing import Iterator

from repack.sources.confine import open_input as open_local
from repack.store import is_remote


def open_input(path: str, expected: list[int] | None, rel: str):
    """A container, local (through the confinement, fingerprint checked) or s3:// (its planned size)."""
    if is_remote(path):
        from repack.sources.s3 import open_object

        return open_object(path, expected[0] if expected else None)
    return open_local(path, expected, rel)


def read_members(entries: list[dict]) -> Iterator[bytes | OSError]:
    """The bytes of each entry's member, in order (see the module docstring)."""
    for (path, fingerprint), run in groupby(entries, key=lambda e: (e["path"], tuple(e.get("fingerprint") or ()))):
        run = list(run)
        try:
            fh = open_input(path, list(fingerprint) or None, run[0]["rel"].rpartition("/")[0])
        except OSError as exc:
            yield from (exc for _ in run)
            continue
        with fh:
            if "row" in run[0]["member"]:
                yield from _parquet_rows(fh, path, run)
            else:
                for entry in run:
                    yield _tar_member(fh, path, entry["member"])


def _tar_member(fh, path: str, member: dict) -> bytes | OSError:
    try:
        fh.seek(member["offset"])
        data = fh.read(member["size"])
    except OSError as exc:
        return exc
    if len(data) != member["size"]:
        return OSError(5, f"tar member cut short ({len(data)} of {member['size']} bytes)", path)
    return data


def _parquet_rows(fh, path: str, run: list[dict]) -> Iterator[bytes | OSError]:
    """The image bytes of each entry's row, read in bounded batches (repack.sources.parquet_batches)."""
    from repack.sources.parquet_batches import RowCursor, open_parquet

    try:
        pf = open_parquet(fh)
        cursors: dict[str, RowCursor] = {}
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors: the rows cannot be read
        yield from (OSError(5, f"parquet file unreadable: {exc}", path) for _ in run)
        return
    for entry in run:
        row, column = entry["member"]["row"], entry["member"]["column"]
        try:
            cursor = cursors.get(column) or cursors.setdefault(column, RowCursor(pf, column))
            data = cursor.value(row)
        except Exception as exc:  # noqa: BLE001
            yield OSError(5, f"parquet row {row} unreadable: {exc}", path)
            continue
        yield data if data is not None else OSError(5, f"parquet row {row} has no image bytes", path)

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

from repack.errors import SourceUnavailable
from repack.sources.confine import open_input as open_local
from repack.store import is_remote


def open_input(path: str, expected: list[int] | None, rel: str):
    """A container, local (through the confinement, fingerprint checked) or s3:// (its planned size)."""
    if is_remote(path):
        from repack.sources.s3 import open_object

        return open_object(path, expected[0] if expected else None)
    return open_local(path, expected, rel)


REORDER_BYTES = 256 << 20  # parquet rows read ahead of their turn (in file order) and held, at most


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
    except SourceUnavailable:  # the endpoint's fault, not the file's: the task fails (a re-run reads it)
        raise
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors: the rows cannot be read
        yield from (OSError(5, f"parquet file unreadable: {exc}", path) for _ in run)
        return
    direct: dict[str, RowCursor] = {}  # a row read where it comes (past the read-ahead): the in-order cursors stay

    def read(entry: dict, cursors: dict[str, RowCursor] = cursors) -> bytes | OSError:
        row, column = entry["member"]["row"], entry["member"]["column"]
        try:
            cursor = cursors.get(column) or cursors.setdefault(column, RowCursor(pf, column))
            data = cursor.value(row)
        except SourceUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001
            return OSError(5, f"parquet row {row} unreadable: {exc}", path)
        return data if data is not None else OSError(5, f"parquet row {row} has no image bytes", path)

    # rows are read in file order (a cursor only moves forward cheaply: a row behind it restarts its row group
    # and decodes a batch again; --shuffle's order read 3,000 rows 28x slower), held until their turn, at most
    # REORDER_BYTES of them; past that a row is read where it comes
    order = iter(sorted(range(len(run)), key=lambda k: (run[k]["member"]["column"], run[k]["member"]["row"])))
    held: dict[int, bytes | OSError] = {}
    held_bytes = 0
    for k, entry in enumerate(run):
        while k not in held and held_bytes < REORDER_BYTES:
            ahead = next(order, None)
            if ahead is None:
                break
            if ahead < k:  # read where it came (the buffer was full then)
                continue
            held[ahead] = read(run[ahead])
            held_bytes += len(held[ahead]) if isinstance(held[ahead], bytes) else 0
        data = held.pop(k, None)
        if data is None:
            data = read(entry, direct)
        elif isinstance(data, bytes):
            held_bytes -= len(data)
        yield data

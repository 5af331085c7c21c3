"""Reading parquet image columns in bounded record batches (scanning and tasks alike).

A row group may hold gigabytes of image bytes; neither the scan (which needs each row's size) nor a
task (which needs some rows' bytes) reads one whole. Both go through ``pyarrow``'s ``iter_batches``
with a batch of at most ``BATCH_BYTES`` of the row group's average row (at least one row, at most
``MAX_BATCH_ROWS``), and a buffered column-chunk reader (``READ_BUFFER`` bytes at a time, no
pre-buffering of whole column chunks). Memory is then about one batch plus one parquet page: a
documented cap, ``BATCH_BYTES`` (docs/dataset-over-time.md), not a multiple of the row group.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import BinaryIO, Iterator

BATCH_BYTES = 64 * 2**20   # a record batch's bytes (by the row group's average row)
MAX_BATCH_ROWS = 1024
READ_BUFFER = 2**20        # bytes read at a time from a column chunk


def open_parquet(fh: BinaryIO):
    """A ``pyarrow.parquet.ParquetFile`` that streams column chunks (see the module docstring)."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(fh, buffer_size=READ_BUFFER, pre_buffer=False)


def batch_rows(pf, group: int) -> int:
    """Rows per batch for ``group``: BATCH_BYTES of its average row, 1..MAX_BATCH_ROWS."""
    meta = pf.metadata.row_group(group)
    average = meta.total_byte_size / max(1, meta.num_rows)
    return max(1, min(MAX_BATCH_ROWS, int(BATCH_BYTES // max(1.0, average))))


def iter_group_batches(pf, columns: list[str]) -> Iterator:
    """Every record batch of ``columns``, row group by row group, each bounded by ``batch_rows``."""
    for group in range(pf.metadata.num_row_groups):
        yield from pf.iter_batches(batch_size=batch_rows(pf, group), row_groups=[group], columns=columns)


class RowCursor:
    """The values of one column at given rows, read forward in bounded batches (rows asked in increasing
    order read each batch once; a row behind the cursor restarts its row group)."""

    def __init__(self, pf, column: str) -> None:
        self.pf, self.column = pf, column
        self.starts: list[int] = []
        at = 0
        for g in range(pf.metadata.num_row_groups):
            self.starts.append(at)
            at += pf.metadata.row_group(g).num_rows
        self.rows = at
        self.group = -1
        self.batches: Iterator | None = None
        self.first, self.values = 0, None  # the current batch's first row and its values

    def value(self, row: int):
        """The column's value at ``row`` (a Python object; the Image struct's ``bytes`` field)."""
        if not 0 <= row < self.rows:
            raise IndexError(f"row {row} is not in the file's {self.rows} rows")
        group = bisect_right(self.starts, row) - 1
        if group != self.group or row < self.first:
            self.group, self.first, self.values = group, self.starts[group], None
            self.batches = self.pf.iter_batches(batch_size=batch_rows(self.pf, group), row_groups=[group],
                                                columns=[self.column])
        while self.values is None or row >= self.first + len(self.values):
            if self.values is not None:
                self.first += len(self.values)
            values = next(self.batches).column(0)
            if hasattr(values.type, "get_field_index"):  # the Image feature's struct {bytes, path}
                values = values.field("bytes")
            self.values = values
        return self.values[row - self.first].as_py()

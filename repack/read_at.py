"""``read_at``: the bytes of a file range, whatever its length. One ``os.pread`` returns at most 0x7ffff000
bytes on Linux (2,147,479,552), so a member over 2 GiB comes back short from one call: read until the range is
whole or the file ends."""

from __future__ import annotations

import os


def read_at(fd: int, size: int, offset: int) -> bytes:
    """``size`` bytes of ``fd`` from ``offset`` (fewer only where the file ends first)."""
    data = os.pread(fd, size, offset)
    if len(data) == size or not data:
        return data
    parts, got = [data], len(data)
    while got < size:
        more = os.pread(fd, size - got, offset + got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)

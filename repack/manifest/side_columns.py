"""What repack's columnar side files share (``duplicate_groups``, ``quarantine_records``): a magic line, a JSON line of
counts that size the columns after it, and texts stored back to back with their end offsets. Stdlib only."""

from __future__ import annotations

import json
from typing import Callable


def counts_line(raw: bytes, magic: bytes, keys: tuple[str, ...],
                refuse: Callable[[str], Exception]) -> tuple[list[int], int]:
    """(the counts named ``keys``, where the columns start) of a side file's first two lines; ``refuse(why)`` is
    raised where the magic line is not ``magic`` or a count is missing or not a whole number of 0 or more."""
    if not raw.startswith(magic):
        raise refuse(f"no {magic.decode(errors='replace').strip()} header")
    end = raw.find(b"\n", len(magic))
    try:
        header = json.loads(raw[len(magic):end]) if end > 0 else None
        counts = [header[key] for key in keys]
    except (ValueError, TypeError, KeyError, RecursionError):
        raise refuse("its counts line is damaged") from None
    if not all(type(n) is int and n >= 0 for n in counts):
        raise refuse("its counts are not whole numbers")
    return counts, end + 1


def cut_texts(blob: bytes, starts: list[int], ends: list[int]) -> list[str]:
    """The strings of ``blob`` between each start and end offset (one decode, then str slices where it is ASCII;
    UTF-8 with surrogateescape otherwise, as the names were encoded)."""
    if blob.isascii():
        text = blob.decode("ascii")
        return [text[a:b] for a, b in zip(starts, ends)]
    return [blob[a:b].decode("utf-8", "surrogateescape") for a, b in zip(starts, ends)]

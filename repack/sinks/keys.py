"""The sample keys a DALI index lists, and their 8-byte hashes: what the uniqueness check of a whole
dataset compares (a numpy array, 8 bytes a key: 10M keys, 80 MB).

A key is the part of a sample's first member name before the first dot of its basename
(``tar_format.split_key``). The hash is a function of the key's bytes alone, however the index was read:
numpy over the index's bytes where it is canonical (no ``/`` in names, the same number of members on
every line), a loop over its lines otherwise. Equal hashes are only suspects: the caller compares names.
"""

from __future__ import annotations

import numpy as np

from repack.sinks.tar_format import split_key

_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)


def index_keys(raw: bytes) -> list[str]:
    """The sample keys a DALI index lists (one line per sample; the first member's name gives the key)."""
    keys = []
    for line in raw.decode("utf-8", "surrogateescape").splitlines()[1:]:
        fields = line.split(" ")
        if len(fields) >= 4:
            keys.append(split_key(fields[3])[0])
    return keys


def key_hashes(keys: list[str]) -> np.ndarray:
    """The uint64 hash of each key."""
    if not keys:
        return np.zeros(0, np.uint64)
    encoded = [key.encode("utf-8", "surrogateescape") for key in keys]
    width = max(1, max(map(len, encoded)))
    return row_hashes(np.array(encoded, dtype=f"S{width}").view(np.uint8).reshape(len(encoded), width))


def index_key_hashes(raw: bytes) -> np.ndarray:
    """``key_hashes(index_keys(raw))``, computed with numpy where the index is canonical."""
    rows = _key_rows(raw)
    return key_hashes(index_keys(raw)) if rows is None else row_hashes(rows)


def row_hashes(rows: np.ndarray) -> np.ndarray:
    """A uint64 hash of each row of a uint8 array; words of 8 NULs are skipped, so the NUL padding (the
    array's width) does not change a row's hash."""
    count, width = rows.shape
    words = np.zeros((count, -(-width // 8) * 8), np.uint8)
    words[:, :width] = rows
    state = np.zeros(count, np.uint64)
    for column in words.view(np.uint64).T:
        state = np.where(column != 0, _mix((state ^ column) * _MULTIPLIER), state)
    return state


def _mix(value: np.ndarray) -> np.ndarray:
    value = value ^ (value >> np.uint64(31))
    value = value * np.uint64(0xBF58476D1CE4E5B9)
    return value ^ (value >> np.uint64(29))


def _key_rows(raw: bytes) -> np.ndarray | None:
    """Each line's key as a uint8 row (NUL padded), or None where the index is not canonical."""
    first_newline = raw.find(b"\n")
    if first_newline < 0 or not raw.endswith(b"\n"):
        return None
    body = np.frombuffer(raw, dtype=np.uint8)[first_newline + 1:]
    if not len(body):
        return np.zeros((0, 1), np.uint8)
    if ((body < 32) & (body != 10)).any() or (body > 126).any() or (body == ord("/")).any():
        return None
    separators = np.flatnonzero((body == 32) | (body == 10))
    line_ends = np.flatnonzero(body[separators] == 10)
    per_line = int(line_ends[0]) + 1
    if per_line < 4 or not np.array_equal(line_ends, np.arange(per_line - 1, len(separators), per_line)):
        return None
    table = separators.reshape(-1, per_line)
    starts, ends = table[:, 2] + 1, table[:, 3]  # the first member's name: the fourth token
    widths = ends - starts
    width = int(widths.max())
    if width < 1 or (widths < 1).any():
        return None
    padded = np.concatenate([body, np.zeros(width, np.uint8)])
    rows = np.lib.stride_tricks.sliding_window_view(padded, width)[starts].copy()
    place = np.arange(width)
    dots = (rows == ord(".")) & (place < widths[:, None])
    key_ends = np.where(dots.any(axis=1), dots.argmax(axis=1), widths)
    rows[place >= key_ends[:, None]] = 0
    return rows

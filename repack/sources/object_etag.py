"""An s3:// object's ETag as the second column of its fingerprint (where a local file has its mtime).

A listing gives each object's size and ETag. The size alone let `--append` take an object rewritten
with other bytes of the same size for the packed one; with the ETag in the fingerprint such an object
is compared by content (and refused by name when it differs), as a local file whose mtime changed is.
The value is an int64 with ``ETAG_FLAG`` set: the ETag's first 60 bits where it is hex (an MD5, or a
multipart upload's ``<md5>-<parts>``), else a hash of its text; 0 where a listing gives none. A record
written before objects had one holds 0 there, and such a row's fingerprint is its size alone
(``repack.lifecycle.input_record``): no dataset packed from s3:// is compared again because of this.
"""

from __future__ import annotations

import hashlib

import numpy as np

ETAG_FLAG = 1 << 62  # set in every ETag value: a nanosecond mtime reaches it only in the year 2116
_LOW = (1 << 60) - 1


def etag_value(etag: str | bytes | None) -> int:
    """The fingerprint value of an ETag's text (XML entities decoded) as a listing or a GET gives it, quoted
    or not; 0 for none."""
    if etag is None:
        return 0
    text = etag.decode("utf-8", "surrogateescape") if isinstance(etag, bytes) else etag
    text = text.strip().strip('"')
    if not text:
        return 0
    try:
        return ETAG_FLAG | int(text[:15], 16)
    except ValueError:
        return ETAG_FLAG | (int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogateescape"),
                                                           digest_size=8).digest(), "big") & _LOW)


def is_etag_value(value: int) -> bool:
    """Whether a fingerprint's second column holds an ETag value (not an mtime, not 0)."""
    return value >= ETAG_FLAG


_NIBBLE = np.full(256, 255, dtype=np.uint8)
for _digits, _first in ((b"0123456789", 0), (b"abcdef", 10), (b"ABCDEF", 10)):
    _NIBBLE[np.frombuffer(_digits, np.uint8)] = np.arange(_first, _first + len(_digits), dtype=np.uint8)
_SHIFTS = np.arange(56, -4, -4, dtype=np.uint64)  # the 15 hex digits' places, first digit highest


def hex_etag_values(prefixes: list[bytes]) -> np.ndarray:
    """``etag_value`` of ETags given by their first 15 hex digits (``bytes`` each), as one int64 array."""
    if not prefixes:
        return np.zeros(0, dtype=np.int64)
    digits = _NIBBLE[np.frombuffer(b"".join(prefixes), np.uint8).reshape(len(prefixes), 15)].astype(np.uint64)
    return ((digits << _SHIFTS).sum(axis=1, dtype=np.uint64) | np.uint64(ETAG_FLAG)).astype(np.int64)

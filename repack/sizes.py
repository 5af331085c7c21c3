"""Sizes as people write them ('512MB', '1GiB', '100000'), read into bytes; a leaf module (repack.errors only), so
that the manifest readers and the options parse sizes alike."""

from __future__ import annotations

import re
from decimal import Decimal

from repack.errors import UsageError

_SIZE_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9,
               "T": 10**12, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
MAX_SIZE = 2**60  # 1 EiB: more is no size a file or shard reaches, and would overflow the plan's int64 sums


def parse_size(text: str | int | None) -> int | None:
    """Parse '512MB', '1GiB', '100000' into bytes; None stays None."""
    if text is None or isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).upper() not in _SIZE_UNITS:
        raise UsageError(f"bad size {text!r}: use a number with an optional unit, e.g. 512MB or 1GiB")
    number, unit = match.group(1), _SIZE_UNITS[match.group(2).upper()]
    value = int(Decimal(number) * unit)  # exact: '2.01MB' is 2,010,000 bytes (a float gave 2,009,999)
    if value <= 0:
        raise UsageError(f"bad size {text!r}: must be positive")
    if value > MAX_SIZE:
        raise UsageError(f"bad size {text!r}: at most 1 EiB ({MAX_SIZE} bytes)")
    return value

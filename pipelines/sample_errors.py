"""The readers' errors about one sample: they name the shard (path or URL) and the sample's key.

``ShardIntegrityError``: the shard does not hold the sample as its index says (a damaged header, a
truncated shard, a missing member, a payload whose checksum is not the recorded one).
``SampleDecodeError`` (a kind of it): the bytes are there, but decoding them or the user's transform
failed; raised ``from`` the original error. A reader's ``on_error="skip"`` skips and counts both.
"""

from __future__ import annotations


class ShardIntegrityError(ValueError):
    """A sample that its shard does not hold as its index says: ``url`` (the shard), ``key``, ``problem``.
    (Built from its message alone, as a DataLoader re-raises a worker's error, it keeps the message.)"""

    def __init__(self, url: str, key: str = "", problem: str = "") -> None:
        super().__init__(f"{url}: sample {key!r}: {problem}" if key else f"{url}: {problem}" if problem else url)
        self.url, self.key, self.problem = url, key, problem


class SampleDecodeError(ShardIntegrityError):
    """Decoding a sample's bytes, or the transform applied to it, failed (``__cause__``: the original)."""


def decode_error(url: str, key: str, stage: str, exc: BaseException) -> SampleDecodeError:
    """The error to raise ``from exc`` when ``stage`` ("decode", "transform", ...) of sample ``key``
    of shard ``url`` failed; its message keeps the original's type and text."""
    return SampleDecodeError(url, key, f"{stage} failed: {type(exc).__name__}: {exc}")

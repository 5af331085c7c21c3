"""What `repack remove`'s per-format rewriters return."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rewrite:
    """What a format's rewriter did: the version's shards, the names it found, the files it rewrote
    (old -> new, None when left empty), removed samples per class name, and more of the body
    (``totals``: counts to update)."""

    shards: list[dict]
    found: frozenset[str]
    rewritten: dict[str, str | None]
    removed_classes: dict[str, int]
    extra: dict

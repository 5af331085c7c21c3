"""What `repack remove`'s per-format rewriters return."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Rewrite:
    """What a format's rewriter did: the version's shards, the names it found, the files it rewrote
    (old -> new, None when left empty), removed samples per class name, and more of the body
    (``totals``: counts to update), and the sources whose samples are gone (None: the names found, when
    named by source; a format whose keys name part of a source leaves it None)."""

    shards: list[dict]
    found: frozenset[str]
    rewritten: dict[str, str | None]
    removed_classes: dict[str, int]
    extra: dict
    removed_sources: frozenset[str] | None = None
    removed_formats: dict[str, int] = field(default_factory=dict)  # removed samples per image format, where known
    removed_misreads: dict[str, int] = field(default_factory=dict)  # of them, those stats.dali_misreads counts

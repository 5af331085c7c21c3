"""What `repack remove`'s per-format rewriters return."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from repack.errors import VerificationError
from repack.sinks.checks import check_file


def refuse_unrecorded(root: Path, rel: str, size: int | None, sha256: str | None) -> None:
    """VerificationError naming ``rel`` (under ``root``) where it is not the file the manifest records (missing, its
    size, its sha256: ``sinks.checks.check_file``, as verify checks it): a rewrite would carry damaged bytes
    into a version that verify then vouches for."""
    problems: list[str] = []
    check_file(root, rel, size, sha256, lambda ok, problem: ok or problems.append(problem))
    if problems:
        raise VerificationError(f"{Path(root) / rel}: {problems[0]}: run `repack verify`; nothing removed")


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

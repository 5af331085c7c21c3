"""Confinement of relative paths to a dataset root."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath


class PathEscapeError(ValueError):
    """A path from a manifest or archive would leave its root."""


def safe_join(root: str | os.PathLike, rel: str) -> Path:
    """Join ``rel`` (a relative POSIX path) to ``root``, refusing anything that escapes it.

    Refuses absolute paths, ``..`` components, NUL bytes, backslashes and symlinks that
    resolve outside the root.
    """
    if not isinstance(rel, str) or not rel or "\x00" in rel or "\\" in rel:
        raise PathEscapeError(f"invalid relative path {rel!r}")
    pure = PurePosixPath(rel)
    if pure.is_absolute() or any(part in ("..", "") for part in pure.parts) or rel.startswith("/"):
        raise PathEscapeError(f"path {rel!r} escapes the dataset root")
    root_real = Path(os.path.realpath(root))
    joined = root_real.joinpath(*pure.parts)
    real = Path(os.path.realpath(joined))
    if real != root_real and root_real not in real.parents:
        raise PathEscapeError(f"path {rel!r} resolves outside the dataset root")
    return joined

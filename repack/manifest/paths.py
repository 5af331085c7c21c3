"""Confinement of relative paths to a dataset root: the one rule every path a manifest names obeys.

``check_relative`` is the pure rule (no filesystem): a non-empty relative POSIX path, no NUL, no
backslash, no absolute path, no ``..``. ``check_dataset_path`` adds what a manifest may never name:
a manifest file (``manifest.json``, ``manifest.vN.json``) or the job state under ``.repack/`` (gc and
remove delete what a version names; a version naming the live manifest would delete it).
``safe_join`` joins a checked path to a local root and refuses a symlink that resolves outside.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path, PurePosixPath

STATE_FOLDER = ".repack"
_MANIFEST_FILE = re.compile(r"manifest(\.v[0-9]+)?\.json")


class PathEscapeError(ValueError):
    """A path from a manifest or archive would leave its root."""


def check_relative(rel: object) -> str:
    """``rel`` normalized (``./a`` -> ``a``) when it is a relative POSIX path confined to its root;
    PathEscapeError naming it otherwise (absolute, ``..``, NUL, backslash, empty, not a string)."""
    if not isinstance(rel, str) or not rel or "\x00" in rel or "\\" in rel:
        raise PathEscapeError(f"invalid relative path {rel!r}")
    pure = PurePosixPath(rel)
    if pure.is_absolute() or rel.startswith("/") or any(part in ("..", "") for part in pure.parts) \
            or not pure.parts:
        raise PathEscapeError(f"path {rel!r} escapes the dataset root")
    return pure.as_posix()


def check_dataset_path(rel: object) -> str:
    """``check_relative``, and not a manifest file nor job state: what a manifest may name."""
    same = check_relative(rel)
    head = same.split("/", 1)[0]  # a file below a folder named manifest.json is no file either (the folder blocks it)
    if _MANIFEST_FILE.fullmatch(head) or head == STATE_FOLDER:
        raise PathEscapeError(f"path {rel!r} names a manifest or the job state (.repack/), not a dataset file")
    return same


def safe_join(root: str | os.PathLike, rel: str) -> Path:
    """Join ``rel`` (a relative POSIX path) to ``root``, refusing anything that escapes it.

    Refuses absolute paths, ``..`` components, NUL bytes, backslashes and symlinks that
    resolve outside the root.
    """
    return join_under_real(Path(os.path.realpath(root)), rel)


def join_under_real(root_real: Path, rel: str) -> Path:
    """``safe_join`` under a root already resolved (``os.path.realpath``): many paths of one manifest are
    checked against one resolution of its root. The whole path is resolved only when a component below the
    root is a symlink (``_first_link``; ``realpath`` costs an lstat per component of the absolute path: on
    the device machine's sandboxed filesystem ~20 ms per manifest of 62 shards)."""
    parts = PurePosixPath(check_relative(rel)).parts
    joined = root_real.joinpath(*parts)
    if _first_link(root_real, parts) is not None:
        real = Path(os.path.realpath(joined))
        if real != root_real and root_real not in real.parents:
            raise PathEscapeError(f"path {rel!r} resolves outside the dataset root")
    return joined


def no_links_below(root: str | os.PathLike, rel: str) -> Path:
    """``root/rel`` for a store about to write or delete it: ``rel`` passes ``check_relative`` and no
    component below ``root`` (the folders on the way, or the file itself) is a symbolic link (lstat:
    nothing is followed, a link to a folder inside the root is refused too)."""
    parts = PurePosixPath(check_relative(rel)).parts
    link = _first_link(Path(root), parts)
    if link is not None:
        raise PathEscapeError(f"{link}: a symbolic link inside the dataset root; repack writes and "
                              "deletes plain files only")
    return Path(root).joinpath(*parts)


def _first_link(root: Path, parts: tuple[str, ...]) -> Path | None:
    """The first of ``root/parts[0]``, ``root/parts[0]/parts[1]``, ... that is a symbolic link (one ``lstat``
    each), or None. A missing (or unreadable) component ends the walk: nothing below it can be a link yet."""
    path = root
    for part in parts:
        path = path / part
        try:
            if stat.S_ISLNK(os.lstat(path).st_mode):
                return path
        except OSError:
            return None
    return None

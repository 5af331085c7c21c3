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
    if isinstance(rel, str) and _plain_relative(rel):
        return rel  # already in normal form (every path repack writes): no PurePosixPath to build
    if not isinstance(rel, str) or not rel or "\x00" in rel or "\\" in rel:
        raise PathEscapeError(f"invalid relative path {rel!r}")
    pure = PurePosixPath(rel)
    if pure.is_absolute() or rel.startswith("/") or any(part in ("..", "") for part in pure.parts) \
            or not pure.parts:
        raise PathEscapeError(f"path {rel!r} escapes the dataset root")
    return pure.as_posix()


def _plain_relative(rel: str) -> bool:
    """Whether ``rel`` is a relative path in normal form: names of one or more characters, none ``.`` nor
    ``..``, no NUL nor backslash, joined by single slashes (``check_relative``'s fast case)."""
    return "\x00" not in rel and "\\" not in rel and all(part and part != "." and part != ".." for part in rel.split("/"))


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
    same = check_relative(rel)
    parts = same.split("/")
    joined = os.path.join(root_real, same)
    if _first_link(os.fspath(root_real), parts) is not None:
        real = os.path.realpath(joined)
        base = os.fspath(root_real)
        if real != base and not real.startswith(base.rstrip("/") + "/"):
            raise PathEscapeError(f"path {rel!r} resolves outside the dataset root")
    return Path(joined)


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


def _first_link(root: str | os.PathLike, parts: list[str] | tuple[str, ...]) -> Path | None:
    """The first of ``root/parts[0]``, ``root/parts[0]/parts[1]``, ... that is a symbolic link (one ``lstat``
    each), or None. A missing (or unreadable) component ends the walk: nothing below it can be a link yet."""
    path = os.fspath(root)
    for part in parts:
        path = os.path.join(path, part)
        try:
            if stat.S_ISLNK(os.lstat(path).st_mode):
                return Path(path)
        except OSError:
            return None
    return None

"""The local-filesystem store: the root is a folder and also the scratch jobs write into."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from repack.errors import ConfinementError
from repack.manifest import atomic_write_bytes
from repack.manifest.io import fsync_dir, open_regular
from repack.manifest.paths import PathEscapeError, no_links_below


def copy_atomically(src: Path, dst: Path) -> None:
    """Copy ``src`` to a temp name beside ``dst``, fsync, rename: ``dst`` appears only whole."""
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    try:
        shutil.copyfile(src, tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(dst.parent)


def is_lock_file(name: str) -> bool:
    """A job state folder's lock files (``.repack/lock``, ``lock-<part>``, ``workers.lock``, ``workers-<part>.lock``):
    held by flock while a run lives, so never removed under it (a second run would lock a new file beside it)."""
    return name == "lock" or name.startswith("lock-") or (name.startswith("workers") and name.endswith(".lock"))


def clear_state_folder(folder: Path) -> None:
    """Everything in a job state folder removed but its lock files (``is_lock_file``)."""
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return
    for entry in entries:
        if is_lock_file(entry.name):
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)


class LocalStore:
    """Files under a local folder. Jobs write in place, so ``publish`` only checks the file.

    Every operation goes through ``path``: a relative path without ``..`` whose components below the
    root are no symbolic links (lstat, nothing followed), so a write or delete never lands outside the
    root, whatever a manifest or record names (ConfinementError otherwise)."""

    remote = False

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.scratch = self.root
        self.url = str(self.root)

    def path(self, rel: str) -> Path:
        """``root/rel``, confined (see the class docstring)."""
        try:
            return no_links_below(self.root, rel)
        except PathEscapeError as exc:
            raise ConfinementError(f"{self.url}: refused {rel!r}: {exc}") from None

    def publish(self, rel: str, local: Path, sha256: str | None = None) -> None:
        """Make the finished file ``local`` visible as ``rel`` (a rename or copy when elsewhere);
        ``sha256`` is only used by stores that record it."""
        target = self.path(rel)
        if Path(local).resolve() != target.resolve():
            copy_atomically(Path(local), target)

    def put_bytes(self, rel: str, data: bytes, durable: bool = True) -> None:
        atomic_write_bytes(self.path(rel), data, durable)

    def read_bytes(self, rel: str) -> bytes | None:
        """The file's bytes, None when it does not exist."""
        try:
            with open_regular(self.path(rel)) as fh:  # a FIFO in its place is refused, never waited on
                return fh.read()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def size(self, rel: str) -> int | None:
        try:
            return os.path.getsize(self.path(rel))
        except OSError:
            return None

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        """{relative path: bytes} of every file whose path starts with ``prefix``."""
        found = {}
        parent, _, head = prefix.rpartition("/")
        folder = self.root / parent
        if not folder.is_dir():
            return found
        for entry in sorted(folder.iterdir()):  # only the entries the prefix names are walked
            if not entry.name.startswith(head):
                continue
            # a link to a folder is not walked (one named manifest.v9.json to / made gc walk the whole disk;
            # rglob itself follows no link below)
            below = entry.rglob("*") if entry.is_dir() and not entry.is_symlink() else ()
            for path in (entry, *below):
                if path.is_file():
                    found[path.relative_to(self.root).as_posix()] = path.stat().st_size
        return found

    def list_names(self, prefix: str = "") -> list[str]:
        """The relative paths ``list_sizes`` gives, sorted, without a stat per file: one ``os.scandir`` per
        folder (a regular file is told by its d_type; a folder of thousands of task locks costs one listing)."""
        found: list[str] = []
        parent, _, head = prefix.rpartition("/")
        folder = self.root / parent
        if not folder.is_dir():
            return found
        base = f"{parent}/" if parent else ""

        def walk(path: str, rel: str) -> None:
            with os.scandir(path) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        walk(entry.path, f"{rel}{entry.name}/")
                    elif entry.is_file():
                        found.append(rel + entry.name)

        with os.scandir(folder) as entries:
            for entry in entries:
                if not entry.name.startswith(head):
                    continue
                if entry.is_dir(follow_symlinks=False):
                    walk(entry.path, f"{base}{entry.name}/")
                elif entry.is_file():
                    found.append(base + entry.name)
        return sorted(found)

    def delete(self, rel: str) -> None:
        self.path(rel).unlink(missing_ok=True)

    def clear_state(self, state_dir: str) -> None:
        """Remove the job state (``--overwrite``), but not the lock files the run clearing it holds."""
        clear_state_folder(self.path(state_dir))

    def fetch(self, rel: str, local: Path) -> None:
        """Copy ``rel`` to the local path (nothing to do when it is the same file)."""
        if Path(local).resolve() != self.path(rel).resolve():
            copy_atomically(self.path(rel), Path(local))

    def lock(self, name: str):
        """Local runs are locked with flock on the folder itself (see the engine): nothing more."""
        return contextlib.nullcontext()

    def check_lock(self) -> None:
        """A flock is held until its process ends: nothing to check."""

"""Atomic, canonical reading and writing of JSON state (manifest, task records)."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from repack.manifest.caps import check_manifest_size, check_written_size
from repack.manifest.paths import PathEscapeError, safe_join
from repack.manifest.schema import MANIFEST_NAME, Manifest, ManifestError
from repack.manifest.versions import check_number, read_version


MANIFEST_TEMP = re.compile(r"\.manifest(\.v[0-9]+)?\.json\..+\.tmp")  # a manifest's atomic write, unfinished


# a side file's atomic write (``atomic_write_bytes``), unfinished: the names repack writes at a dataset's top
WRITE_TEMP = re.compile(r"\.(tokenizer\.json|probe(-v[0-9]+)?\.jsonl|file_list(-v[0-9]+)?\.txt|[^/]+\.sources"
                        r"|duplicates(-v[0-9]+)?\.groups|quarantine(-v[0-9]+)?\.records)"
                        r"\.[a-z0-9_]{8}\.tmp")


def sweep_write_temps(out: str | os.PathLike) -> None:
    """Remove the temp files of a job's atomic writes killed mid-way (``atomic_write_bytes``: its side files
    ``tokenizer.json``, ``*.sources``, ``probe.jsonl``, ``file_list.txt``, ``duplicates.groups``,
    ``quarantine.records``, and manifests) from the top of dataset folder ``out`` (its only writer holds OUT's lock:
    no other write is under way)."""
    for temp in Path(out).glob(".*.tmp"):
        if (WRITE_TEMP.fullmatch(temp.name) or MANIFEST_TEMP.fullmatch(temp.name)) and temp.is_file() and \
                not temp.is_symlink():
            temp.unlink(missing_ok=True)


def sweep_manifest_temps(out: str | os.PathLike) -> None:
    """Remove the temp files of manifest writes killed mid-way (``atomic_write_bytes``) from dataset folder
    ``out`` (its only writer holds OUT's lock: no other write is under way)."""
    for temp in Path(out).glob(".manifest*.tmp"):
        if MANIFEST_TEMP.fullmatch(temp.name) and temp.is_file() and not temp.is_symlink():
            temp.unlink(missing_ok=True)


def dumps_canonical(obj: Any, indent: int | None = None) -> bytes:
    """Deterministic JSON: sorted keys, ASCII only, fixed separators, trailing newline.

    Compact by default: that uses json's C encoder (an ``indent`` falls back to the pure-Python
    one, ~10x slower on large plans)."""
    separators = (",", ": ") if indent is not None else (",", ":")
    return (json.dumps(obj, sort_keys=True, ensure_ascii=True, indent=indent, separators=separators) + "\n").encode()


def atomic_write_bytes(path: str | os.PathLike, data: bytes, durable: bool = True) -> None:
    """Write ``data`` to ``path`` via a temp file in the same folder, fsync, then rename.

    ``durable=False`` skips the fsyncs: for state that is cheap to lose (a lost task record
    only means the task is redone), never for data a record vouches for."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.chmod(tmp, 0o644 & ~process_umask())  # as the data files' os.open(..., 0o644) gets it: the umask holds
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable:
        fsync_dir(path.parent)


def process_umask() -> int:
    """This process's umask (Linux: read from /proc, leaving it untouched; elsewhere set and set back)."""
    try:
        with open("/proc/self/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fsync_dir(folder: str | os.PathLike) -> None:
    """fsync a directory so a rename inside it is durable."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_json(path: str | os.PathLike, obj: Any, durable: bool = True, indent: int | None = None) -> None:
    """Atomically write ``obj`` as canonical JSON."""
    atomic_write_bytes(path, dumps_canonical(obj, indent), durable)


def write_manifest(root: str | os.PathLike, data: dict, where: str | None = None) -> Path:
    """Validate and atomically write ``root/manifest.json``; returns its path. ``where``: the manifest's
    location as the user named the dataset (an object store's URL where ``root`` is its local scratch)."""
    Manifest(Path(root), data).validate()
    path = Path(root) / MANIFEST_NAME
    raw = dumps_canonical(data, indent=1)
    check_written_size(raw, data, where or str(path))
    atomic_write_bytes(path, raw)
    return path


def parse_manifest(raw: bytes, root: str | os.PathLike, where: str, url: str = "") -> Manifest:
    """The validated ``Manifest`` in ``raw`` (the bytes of a manifest file at ``where``): refused over the
    size cap before it is parsed, then JSON, schema and the path rule; ManifestError naming ``where``."""
    check_manifest_size(len(raw), where)
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ManifestError(f"{where}: not valid JSON ({exc})") from None
    except RecursionError:  # arrays nested thousands deep: no manifest repack writes
        raise ManifestError(f"{where}: not valid JSON (nested too deep)") from None
    manifest = Manifest(Path(root), data, url)
    manifest.validate()
    return manifest


def read_capped(path: Path) -> bytes:
    """A manifest file's bytes, refused unread when it is over the cap (``repack.manifest.caps``)."""
    with open_regular(path) as fh:
        check_manifest_size(os.fstat(fh.fileno()).st_size, str(path))
        return fh.read()


def open_regular(path: str | os.PathLike):
    """``path`` opened for reading where it is a regular file; OSError (EINVAL) naming it otherwise. Opened with
    O_NONBLOCK, so a FIFO put in a dataset's place (a tar can carry one) is refused, never waited on."""
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(22, "not a regular file", str(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_manifest(root: str | os.PathLike, version: int | None = None) -> Manifest:
    """Read and validate ``root/manifest.json`` (schema, major version, confined paths); ``version=N``:
    that version's immutable file instead (``repack.manifest.versions``)."""
    path = Path(root)
    if path.is_dir() or version is not None:
        folder = path

        def read(name: str) -> bytes | None:
            try:
                target = safe_join(folder, name)  # a manifest linked to outside the root is not this dataset's
            except PathEscapeError as exc:
                raise ManifestError(f"{folder / name}: {exc}") from None
            try:
                return read_capped(target)
            except FileNotFoundError:
                return None

        name, raw = read_version(read, version, str(folder))
        path = folder / name
    else:
        try:
            raw = read_capped(path)
        except FileNotFoundError:
            raise ManifestError(f"{path}: no manifest (the job has not finished, or this is not a repack output)")
    manifest = parse_manifest(raw, path.parent, str(path))
    check_number(manifest.data, version, str(path))
    return manifest

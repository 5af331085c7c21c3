"""Versions of a dataset: each published state is an immutable manifest file.

Layout (all beside the shards, names relative to the dataset root)::

  manifest.json        the latest version (the same bytes as its manifest.vN.json), written last
  manifest.vN.json     version N, never rewritten; N >= 2 always has one, version 1 gets one (a
                       byte copy of manifest.json) when version 2 is published

A manifest's ``dataset_version`` key: ``{"number": N, "parent": N - 1 or None, "change": {...}}``
(what changed: ``kind`` create | append | remove, and counts). A manifest without the key is
version 1, as every dataset made before versions existed.

Shards are immutable and a new version's new shards get new names, so a reader that opened
version N keeps reading exactly N while N+1 is written beside it; only ``repack gc`` deletes files,
and only those no kept version names. Stdlib only (the readers use it).
"""

from __future__ import annotations

import json
import re
from typing import Callable

from repack.manifest.schema import MANIFEST_NAME, ManifestError

VERSION_KEY = "dataset_version"
_VERSION_FILE = re.compile(r"manifest\.v([1-9][0-9]{0,8})\.json")


def version_file(number: int) -> str:
    """``manifest.vN.json``."""
    if not isinstance(number, int) or isinstance(number, bool) or number < 1:
        raise ManifestError(f"dataset version must be a positive integer, got {number!r}")
    return f"manifest.v{number}.json"


def version_number(rel: str) -> int | None:
    """N for ``manifest.vN.json``, else None."""
    match = _VERSION_FILE.fullmatch(rel)
    return int(match.group(1)) if match else None


def number_of(data: dict) -> int:
    """The version a manifest's data says it is (1 when it has no ``dataset_version``)."""
    info = data.get(VERSION_KEY)
    if info is None:
        return 1
    number = info.get("number") if isinstance(info, dict) else None
    if not isinstance(number, int) or isinstance(number, bool) or number < 1:
        raise ManifestError(f"manifest {VERSION_KEY} must hold a positive integer number, got {info!r}")
    return number


def stamp(data: dict, parent: dict, change: dict) -> dict:
    """``data`` as the version after ``parent`` (its number + 1), recording ``change``."""
    number = number_of(parent) + 1
    return {**data, VERSION_KEY: {"number": number, "parent": number - 1, "change": change}}


def pick_file(number: int | None, latest_number: Callable[[], int]) -> str:
    """Which file holds version ``number`` (None: the latest, ``manifest.json``). Version 1 of a dataset
    never versioned again lives in ``manifest.json`` (``latest_number()`` says so)."""
    if number is None:
        return MANIFEST_NAME
    name = version_file(number)
    return MANIFEST_NAME if number == 1 and latest_number() == 1 else name


def read_version(read: Callable[[str], bytes | None], number: int | None, where: str) -> tuple[str, bytes]:
    """(file name, bytes) of version ``number`` (None: the latest) through ``read(name) -> bytes or None``;
    ManifestError naming ``where`` when there is no such version."""
    name = pick_file(number, lambda: load_number(read(MANIFEST_NAME)))
    raw = read(name)
    if raw is None:
        if name == MANIFEST_NAME:
            raise ManifestError(f"{where}/{MANIFEST_NAME}: no manifest (the job has not finished, or this is not "
                                "a repack output)")
        raise ManifestError(f"{where}: no version {number} ({name} is absent: never published, or removed "
                            "by repack gc)")
    return name, raw


def check_number(data: dict, number: int | None, where: str) -> None:
    """A version file must say it is the version it is named for."""
    if number is not None and number_of(data) != number:
        raise ManifestError(f"{where}: holds version {number_of(data)}, not {number}")


def load_number(raw: bytes | None) -> int:
    """The version number in a manifest's bytes (1 when unreadable: the caller's own read reports it)."""
    try:
        return number_of(json.loads(raw)) if raw else 1
    except (ValueError, ManifestError, AttributeError):
        return 1

"""What a reader's state was taken on: the dataset version and a digest of what that version holds.

A position (epoch, samples consumed) means nothing without the order it indexes, and the order is a
function of the version's shards. Every reader state therefore carries ``{"version": N, "digest": sha256
of the version's [path, samples] shard list, "content": sha256 of its shards' sha256}`` under
``"dataset"``: a dataset packed again into the same names and counts (--overwrite with --shuffle, a
train and a val set of one size) holds other samples at the same positions, and its content differs. A
state saved before states carried the content is matched on the shard list alone (``same``).
Loading a state into a reader of another version (``resolve``) names the version to continue on: the
state's, when its ``manifest.vN.json`` is still kept and holds the same shards (the reader re-opens
it), else a ValueError naming both versions. Never a silent mix. A reader that continues on an older version than
the one it was built on says so (``OlderVersionWarning``): it reads that version while it lives, also in later epochs
(samples removed since included), until a reader is built again without the state.

Stdlib only; reads manifests through ``pipelines.manifest_access`` (folders and s3://).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import warnings
from typing import Callable, Iterator

from repack.manifest import Manifest, ManifestError
from repack.manifest.versions import number_of


class OlderVersionWarning(UserWarning):
    """A loaded state makes a reader continue on an older dataset version than the one it was built on."""


def identity(manifest: Manifest) -> dict:
    """``{"version", "digest", "content"}`` of ``manifest``: its version number, the sha256 of its shard
    list (path and sample count of each shard, in order) and the sha256 of its shards' sha256 (in order)."""
    shards = manifest.data["shards"]
    listed = [[s["path"], int(s["samples"])] for s in shards]
    digest = hashlib.sha256(json.dumps(listed, separators=(",", ":")).encode()).hexdigest()
    content = hashlib.sha256(json.dumps([s.get("sha256") for s in shards], separators=(",", ":")).encode())
    return {"version": number_of(manifest.data), "digest": digest, "content": content.hexdigest()}


def same(saved, mine: dict) -> bool:
    """Whether a state's identity ``saved`` is ``mine``: the same version, shard list and content (a state
    saved by an older repack has no content: its shard list decides)."""
    return isinstance(saved, dict) and saved.get("version") == mine["version"] and \
        saved.get("digest") == mine["digest"] and saved.get("content", mine.get("content")) == mine.get("content")


def describe(ident: dict | None) -> str:
    """``ident`` in words: its version and the head of its digest."""
    if not isinstance(ident, dict):
        return "an unnamed version (a state saved by an older repack)"
    return f"version {ident.get('version')} (shards {str(ident.get('digest'))[:12]})"


def resolve(saved: dict | None, mine: dict, root: str, what: str) -> int | None:
    """The version a reader of ``mine`` (its identity) must re-open to continue a state taken on
    ``saved``: None when they are the same; the saved version when it is still kept under ``root``
    with the same shards; else a ValueError naming both versions."""
    if not isinstance(saved, dict) or "version" not in saved or "digest" not in saved:
        raise ValueError(f"{root}: this {what} state does not say which dataset version it was taken on "
                         f"(saved by an older repack?); the reader reads {describe(mine)}")
    if same(saved, mine):
        return None
    from pipelines.manifest_access import open_manifest

    try:
        kept = identity(open_manifest(root, int(saved["version"])))
    except ManifestError as exc:
        raise ValueError(f"{root}: this {what} state was taken on {describe(saved)}, the reader reads "
                         f"{describe(mine)}, and version {saved['version']} is no longer kept ({exc}); "
                         "it cannot continue: start the epoch over on the new version") from None
    if not same(saved, kept):
        raise ValueError(f"{root}: this {what} state was taken on {describe(saved)}, but version "
                         f"{saved['version']} here holds other shards ({describe(kept)}); the reader reads "
                         f"{describe(mine)}: not this dataset's state")
    if isinstance(mine.get("version"), int) and int(saved["version"]) < mine["version"]:
        warnings.warn(f"{root}: this {what} continues on version {saved['version']}, the version its loaded state "
                      f"was taken on, not version {mine['version']} that it was built on (published since: samples "
                      f"a remove took down are still read); it reads version {saved['version']} while it lives, "
                      "also in later epochs: build the reader again without this state, at an epoch's start, to "
                      f"read version {mine['version']}", OlderVersionWarning, stacklevel=3)
    return int(saved["version"])


def follow_version(saved: dict | None, mine: dict, root: str, what: str,
                   reopen: Callable[[int], None]) -> Callable[[], None] | None:
    """A reader (identity ``mine``) re-opened at the version a state of it was taken on (``saved``; ``resolve``
    refuses one no longer kept), as a DataLoader's workers re-open it when they load the state. Returns what
    re-opens the version it was on, or None where it is on the state's already."""
    version = resolve(saved, mine, root, what)
    if version is None:
        return None
    before = mine.get("version")
    reopen(version)
    return lambda: reopen(before)


@contextlib.contextmanager
def on_version(reopen: Callable[[int], None], mine: dict, version: int | None) -> Iterator[None]:
    """Around a state's checks: the reader re-opened at the state's ``version`` (``resolve``; None: it is on it
    already), and, where a check refuses the state (ValueError), re-opened at the version it was on (``mine``:
    its identity), so a caller that catches the refusal and starts fresh reads the dataset it built."""
    if version is not None:
        reopen(version)
    try:
        yield
    except ValueError:
        if version is not None and mine.get("version") is not None:
            reopen(int(mine["version"]))
        raise

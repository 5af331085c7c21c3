"""`repack remove` for a webdataset dataset: each shard holding a named sample rewritten without it
(see repack.lifecycle.remove)."""

from __future__ import annotations

import json
from pathlib import Path

from repack.lifecycle.rewrite import Rewrite
from repack.manifest import Manifest
from repack.sinks.webdataset import TarShardWriter


def _samples(path: Path):
    """(key, [(ext, bytes)], source) of every sample of a repack tar shard, in order."""
    from repack.sinks.tar_format import iter_members

    samples: list[tuple[str, list, str | None]] = []
    with open(path, "rb") as fh:
        for member in list(iter_members(fh)):
            fh.seek(member.offset)
            data = fh.read(member.size)
            key, _, ext = member.name.partition(".")
            if not samples or samples[-1][0] != key:
                samples.append((key, [], None))
            samples[-1][1].append((ext, data))
            if ext == "json":
                samples[-1] = (key, samples[-1][1], json.loads(data).get("path"))
    return samples


def rewrite_tar_shards(store, out: Path, current: dict, spec, number: int) -> Rewrite:
    """Webdataset: each shard holding a named sample rewritten as ``<stem>-vN.tar`` (+ index) without it."""
    manifest = Manifest(out, current)
    wanted = set(spec.names)
    found: set[str] = set()
    sources: set[str] = set()  # of the removed samples, also when named by key
    shards: list[dict] = []
    rewritten: dict[str, str | None] = {}
    removed_classes: dict[str, int] = {}
    names_by_index = {index: name for name, index in (current.get("classes") or {}).items()}
    for entry in current["shards"]:
        local = manifest.path(entry["path"])
        if store.remote:
            store.fetch(entry["path"], local, entry["sha256"])
        samples = _samples(local)
        if store.remote:
            local.unlink()
        hit = [s for s in samples if (s[0] if spec.by == "keys" else s[2]) in wanted]
        if not hit:
            shards.append(entry)
            continue
        found.update(s[0] if spec.by == "keys" else s[2] for s in hit)
        sources.update(s[2] for s in hit if s[2] is not None)
        for _, members, _ in hit:
            cls = dict(members).get("cls")
            name = names_by_index.get(int(cls)) if cls is not None else ""
            removed_classes[name] = removed_classes.get(name, 0) + 1
        stem = entry["path"][:-len(".tar")] + f"-v{number}"
        writer = TarShardWriter(out, stem)
        try:
            for sample in samples:
                if sample not in hit:
                    writer.add_sample(sample[0], sample[1])
            new = writer.commit()
        except BaseException:
            writer.abort()
            raise
        rewritten[entry["path"]] = new["path"] if new else None
        if new and store.remote:
            store.publish(new["path"], out / new["path"], new["sha256"])
            store.publish(new["index"], out / new["index"])
            store.publish(new["checksums"], out / new["checksums"])
        if new:
            shards.append({**{k: v for k, v in entry.items() if k not in ("path", "index")}, **new})
    totals = {"bytes": sum(s["bytes"] for s in shards), "shards": len(shards)}
    return Rewrite(shards, frozenset(found), rewritten, removed_classes, {"totals": totals}, frozenset(sources))

"""`repack remove` for a webdataset dataset: each shard holding a named sample rewritten without it
(see repack.lifecycle.remove).

Finding them reads no shard that holds none: ``repack.lifecycle.locate`` picks the shards from the
record of the inputs (named by source) or the key (named by key) and each shard's index span; where
it cannot, every shard is looked at. In a shard, the samples come from its index (the one the manifest
records, else rebuilt from the tar's headers; ``repack.lifecycle.shard_index``), and a sample's source
from its ``.json`` member, read alone (a dataset packed with ``--no-sample-json``: from the record of the
inputs, by the position its key starts with). The shards are looked at and rewritten in parallel,
one process each; a shard is rewritten by copying the byte ranges of its kept samples into
``<stem>-vN.tar`` (``repack.lifecycle.tar_copy``: in the kernel, hashed as copied, with a new index
and the kept samples' checksums); nothing is decoded or re-encoded. The pool takes the largest shards
first.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from repack.errors import UsageError, VerificationError
from repack.lifecycle.input_columns import InputColumns, decode_names
from repack.lifecycle.locate import key_position, shard_spans, wanted_positions
from repack.lifecycle.publish import refuse_names_in_use
from repack.lifecycle.record_layers import RecordLayers
from repack.lifecycle.rewrite import Rewrite
from repack.lifecycle.shard_index import ShardIndex, parse_index
from repack.lifecycle.tar_copy import CopiedPrefix, copy_kept, temp_path
from repack.manifest import Manifest
from repack.read_at import read_at
from repack.sinks.sample_checksums import HEADER, MAGIC
from repack.sinks.tar_format import index_from_tar
from repack.transforms.image_check import dali_misread_of


PREFIX_SLACK = 1 << 20  # bytes a shard's prefix is copied past its expected first cut (sample sizes vary)
# a shorter prefix is copied after the parse: it saves little, and 1,000 random names in 7 shards of 512 MB
# (their first cuts ~4 MB in) ran 0.01-0.33 s slower with one per shard (1M tiny files, 16 CPUs)
PREFIX_MIN = 32 << 20


def rewrite_tar_shards(store, out: Path, current: dict, spec, number: int,
                       known: RecordLayers | None = None) -> Rewrite:
    """Webdataset: each shard holding a named sample rewritten as ``<stem>-vN.tar`` (+ index) without it
    (``known``: the record of the inputs, to find the shards of sources without reading the others). The
    shards are looked at and rewritten in parallel, one process each (``rewrite_shard``)."""
    manifest = Manifest(out, current)
    wanted = set(spec.names)
    positions = wanted_positions(spec.by, wanted, known)
    spans = None if positions is None else shard_spans(store, current["shards"])
    sample_json = "json" in (current.get("fields") or {})
    if not sample_json and spec.by == "sources" and positions is None:
        raise UsageError(f"{store.url}: its samples have no .json member (packed with --no-sample-json), so their "
                         "sources come from the record of the inputs (.repack/inputs-v*.npz), which is missing or "
                         "holds no positions; remove them by key (--keys) instead")
    sources_at = ({} if sample_json or positions is None or known is None else
                  recorded_sources(known.whole(), positions))
    common = {"url": store.url, "by": spec.by, "wanted": sorted(wanted), "number": number,
              "sample_json": sample_json, "classes": {str(i): n for n, i in (current.get("classes") or {}).items()},
              "image_exts": sorted(ext for ext, role in (current.get("fields") or {}).items() if role == "image"),
              "misreads": bool((current.get("stats") or {}).get("dali_misreads"))}
    jobs: dict[int, dict] = {}
    for at, entry in enumerate(current["shards"]):
        span_positions = None
        if spans is not None:
            span = spans[at]
            span_positions = positions if span is None else positions[(positions >= span[0]) & (positions <= span[1])]
            if not len(span_positions):
                continue
        jobs[at] = {**common, "entry": entry, "local": str(manifest.path(entry["path"])),
                    "wanted_at": None if span_positions is None else span_positions.tolist(),
                    "first_cut": _first_cut(spans[at] if spans is not None else None, span_positions),
                    "sources_at": {str(p): sources_at[p] for p in ([] if span_positions is None else
                                                                    span_positions.tolist()) if p in sources_at}}
    refuse_names_in_use(store, current, [f"{rewritten_stem(job['entry']['path'], number)}.{ext}"
                                         for job in jobs.values() for ext in ("tar", "idx", "crc")], "remove")
    done = dict(zip(jobs, _fan_out(list(jobs.values()))))
    found: set[str] = set()
    sources: set[str] = set()  # of the removed samples, also when named by key
    shards: list[dict] = []
    rewritten: dict[str, str | None] = {}
    removed_classes: dict[str, int] = {}
    removed_formats: dict[str, int] = {}
    removed_misreads: dict[str, int] = {}
    for at, entry in enumerate(current["shards"]):
        result = done.get(at)
        if result is None or not result["found"]:
            shards.append(entry)
            continue
        found.update(result["found"])
        sources.update(result["sources"])
        for name, count in result["removed_classes"].items():
            removed_classes[name] = removed_classes.get(name, 0) + count
        for name, count in result.get("removed_formats", {}).items():
            removed_formats[name] = removed_formats.get(name, 0) + count
        for name, count in result.get("removed_misreads", {}).items():
            removed_misreads[name] = removed_misreads.get(name, 0) + count
        new = result["entry"]
        rewritten[entry["path"]] = new["path"] if new else None
        if new:
            shards.append({**{k: v for k, v in entry.items() if k not in ("path", "index")}, **new})
    totals = {"bytes": sum(s["bytes"] for s in shards), "shards": len(shards)}
    return Rewrite(shards, frozenset(found), rewritten, removed_classes, {"totals": totals}, frozenset(sources),
                   removed_formats, removed_misreads)


def _fan_out(jobs: list[dict]) -> list[dict]:
    """``rewrite_shard`` of each job, in order: on a process pool of the usable CPUs (JSON in and out),
    the largest shards handed out first (``largest_first``); in this process when there is one job or
    one CPU. A UsageError of a shard is raised here."""
    from repack.exec.cpus import available_cpus

    calls = [json.dumps(job) for job in jobs]
    workers = min(available_cpus(), len(calls))
    if workers <= 1:
        answers = [rewrite_shard(call) for call in calls]
    else:
        from repack.exec.local import process_pool

        order = largest_first([int(job["entry"].get("bytes", 0)) for job in jobs])
        answers = [""] * len(calls)
        with process_pool(workers) as pool:
            for at, answer in zip(order, pool.map(rewrite_shard, [calls[at] for at in order])):
                answers[at] = answer
    results = [json.loads(answer) for answer in answers]
    for result in results:
        if "error" in result:
            raise UsageError(result["error"])
    return results


def largest_first(sizes: list[int]) -> list[int]:
    """The job numbers by size, largest first (ties in order): with more shards than workers, the
    small ones fill in at the end instead of a large one starting last and running alone."""
    return sorted(range(len(sizes)), key=lambda at: (-sizes[at], at))


REWRITE_SUFFIX = re.compile(r"(-v[0-9]+)+$")  # what earlier rewrites added to a shard's stem


def rewritten_stem(path: str, number: int) -> str:
    """The stem of shard ``path`` rewritten by version ``number``: its stem as packed (``shard-XXXXXX``, an
    append's ``shard-vN-XXXXXX``), earlier rewrites' ``-vN`` dropped, then ``-v<number>``; one name per shard
    and version, that does not grow with every remove."""
    return REWRITE_SUFFIX.sub("", path[:-len(".tar")]) + f"-v{number}"


def rewrite_shard(call: str) -> str:
    """One shard of ``rewrite_tar_shards`` (a JSON job: the store's url, the shard's entry and local path,
    what is named): its named samples found and, when there are any, the shard rewritten without them.
    JSON: {found, sources, removed_classes, removed_formats, entry (the new shard's, or None when left empty)}, or
    {error}."""
    from repack.store import open_store

    job = json.loads(call)
    store = open_store(job["url"])
    out, entry, local = Path(store.scratch), job["entry"], Path(job["local"])
    if store.remote:
        store.fetch(entry["path"], local, entry["sha256"])
    stem = rewritten_stem(entry["path"], job["number"])
    try:
        with open(local, "rb", buffering=0) as tar, _prefix(tar.fileno(), out, stem, job["first_cut"]) as prefix:
            index = _shard_index(store, entry, tar)
            sources_at = {int(p): name for p, name in job["sources_at"].items()}
            source_of = _json_source if job["sample_json"] else (
                lambda tar, index, at: sources_at.get(key_position(index.key(at))))
            wanted_at = None if job["wanted_at"] is None else np.array(job["wanted_at"], np.int64)
            hit = _hits(tar, index, job["by"], set(job["wanted"]), wanted_at, source_of)
            result = {"found": [], "sources": [], "removed_classes": {}, "removed_formats": {},
                      "removed_misreads": {}, "entry": None}
            if not hit:
                return json.dumps(result)
            for at, source in hit.items():
                result["found"].append(index.key(at) if job["by"] == "keys" else source)
                if source is not None:
                    result["sources"].append(source)
                members = index.members(at)
                cls = _member_bytes(tar, members, "cls")
                name = job["classes"].get(str(int(cls)), "") if cls is not None and cls.strip().isdigit() else ""
                result["removed_classes"][name] = result["removed_classes"].get(name, 0) + 1
                image = next((m[0] for m in members if m[0] in job.get("image_exts", ())), None)
                if image is not None:
                    result["removed_formats"][image] = result["removed_formats"].get(image, 0) + 1
                    kind = dali_misread_of(_member_bytes(tar, members, image) or b"") \
                        if job.get("misreads") and image == "tiff" else None
                    if kind is not None:  # stats.dali_misreads goes down with it
                        result["removed_misreads"][kind] = result["removed_misreads"].get(kind, 0) + 1
            keep = np.ones(index.samples, bool)
            keep[list(hit)] = False
            new = copy_kept(tar.fileno(), index, keep, out, stem, entry["path"], _old_checksums(store, entry, index),
                            prefix)
    except UsageError as exc:
        return json.dumps({"error": str(exc)})
    finally:
        if store.remote:
            local.unlink(missing_ok=True)
    if new and store.remote:
        store.publish(new["path"], out / new["path"], new["sha256"])
        store.publish(new["index"], out / new["index"])
        store.publish(new["checksums"], out / new["checksums"])
    result["entry"] = new
    return json.dumps(result)


def _first_cut(span: tuple[int, int] | None, positions) -> float | None:
    """Where in its shard the first named sample is expected, as a fraction of the shard (its position within
    the shard's span of positions); None without a record of the inputs that puts one there."""
    if span is None or positions is None or not len(positions):
        return None
    return max(0.0, min(1.0, (int(positions.min()) - span[0]) / max(1, span[1] - span[0] + 1)))


@contextlib.contextmanager
def _prefix(tar_fd: int, out: Path, stem: str, first_cut: float | None) -> Iterator[CopiedPrefix | None]:
    """The shard's first bytes copied and hashed while its index is parsed and its named samples found
    (``repack.lifecycle.tar_copy.CopiedPrefix``), up to a little past where the record of the inputs puts
    the first named sample (``first_cut``, a fraction of the shard: bytes copied past the cut are written
    again), where that is at least PREFIX_MIN bytes in and a second CPU can do it; stopped on leaving."""
    from repack.exec.cpus import available_cpus

    prefix = None
    if first_cut is not None and available_cpus() > 1:
        limit = int(os.fstat(tar_fd).st_size * min(1.0, first_cut * 1.02)) + PREFIX_SLACK
        if limit >= PREFIX_MIN:
            prefix = CopiedPrefix(tar_fd, temp_path(out, stem), limit)
    try:
        yield prefix
    finally:
        if prefix is not None:
            prefix.close()


def _shard_index(store, entry: dict, tar) -> ShardIndex:
    """The shard's index (the manifest's, checked by its sha256; else rebuilt from the tar's headers)."""
    raw = store.read_bytes(entry["index"]) if entry.get("index") else None
    index = parse_index(raw, entry.get("index_sha256")) if raw is not None else None
    if index is None:
        with open(tar.name, "rb") as fh:
            index = parse_index(index_from_tar(fh).encode())
    if index is None or not index.adjacent():
        raise UsageError(f"{store.url}/{entry['path']}: its samples are not laid out as repack writes them (run "
                         "repack verify)")
    if index.samples != entry["samples"]:  # the version's counts (and what a remove says it removed) come from these
        raise VerificationError(f"{store.url}/{entry['path']}: holds {index.samples} samples, the manifest says "
                                f"{entry['samples']}: run `repack verify`; nothing removed")
    return index


def _old_checksums(store, entry: dict, index: ShardIndex) -> np.ndarray | None:
    """The per-sample checksums of the shard (uint32 per sample) from its ``.crc``; None for a shard packed
    without one (they are computed again). A ``.crc`` the manifest records that is not the recorded one, or does
    not count the shard's samples, is damage (VerificationError): the kept samples' bytes are checked against
    it as they are copied, and checksums computed again from damaged bytes would vouch for them."""
    if not entry.get("checksums") or not entry.get("checksums_sha256"):
        return None
    raw = store.read_bytes(entry["checksums"])
    if raw is not None and hashlib.sha256(raw).hexdigest() == entry["checksums_sha256"] and len(raw) >= HEADER.size:
        magic, count = HEADER.unpack_from(raw)
        if magic == MAGIC and count == index.samples and len(raw) == HEADER.size + 4 * count:
            return np.frombuffer(raw, "<u4", count, HEADER.size)
    raise VerificationError(f"{store.url}/{entry['checksums']}: not the checksums file the manifest records for "
                            f"{entry['path']} (missing, changed or not counting its samples): run `repack verify`; "
                            "nothing removed")


def _hits(tar, index: ShardIndex, by: str, wanted: set[str], wanted_at: np.ndarray | None,
          source_of: SourceOf) -> dict[int, str | None]:
    """{sample number: its source} of the named samples in the shard. Named with known positions
    (``wanted_at``), only the samples at those positions are looked at, and each named by source must
    name its source: a record that disagrees with the shard is an error, never a wrong removal."""
    hit: dict[int, str | None] = {}
    looked_at = (range(index.samples) if wanted_at is None else
                 np.flatnonzero(np.isin(index.key_positions(), wanted_at)).tolist())
    for at in looked_at:
        key = index.key(at)
        if by == "keys":
            if key in wanted:
                hit[at] = source_of(tar, index, at)
            continue
        source = source_of(tar, index, at)
        if source in wanted:
            hit[at] = source
        elif wanted_at is not None:
            raise UsageError(f"{tar.name}: sample {key} is the source {source!r}, the dataset's record of its "
                             "inputs says otherwise; move .repack/inputs-v*.npz aside and remove again (every "
                             "shard is then read)")
    return hit


def _member_bytes(tar, members, ext: str) -> bytes | None:
    for member_ext, offset, size, name in members:
        if member_ext == ext:
            data = read_at(tar.fileno(), size, offset)
            if len(data) != size:
                raise UsageError(f"{tar.name}: ends inside member {name} (run repack verify)")
            return data
    return None


SourceOf = Callable[[object, ShardIndex, int], "str | None"]  # (tar, index, sample number) -> its source


def recorded_sources(known: InputColumns | None, positions: np.ndarray) -> dict[int, str]:
    """{position: source} of the sorted ``positions`` the record of the inputs holds (the samples of a
    dataset without a ``.json`` member are named by it)."""
    if known is None or not len(positions):
        return {}
    rows = np.flatnonzero(np.isin(known.position, positions))
    return dict(zip(known.position[rows].tolist(), decode_names(known.names[rows])))


def _json_source(tar, index: ShardIndex, at: int) -> str | None:
    """A sample's source: the ``path`` of its ``.json`` member."""
    raw = _member_bytes(tar, index.members(at), "json")
    if raw is None:
        return None
    try:
        path = json.loads(raw).get("path")
    except (ValueError, AttributeError):
        return None
    return path if isinstance(path, str) else None

"""`repack remove` for a token memmap dataset: the prefixes holding the named documents rewritten.

A document is named by its source file (``--sources``: every document of it) or by its key
``<source>#<n>`` (``--keys``: document ``n`` of that file, numbered from 0 in file order as the job
tokenized it; each prefix's ``sources`` runs ``[source, first, count]`` say which documents it holds,
and keep their numbers across versions). Only the prefixes holding a named document are rewritten:
their other documents' token ids are copied, in order, into a new prefix ``<prefix>-vN.bin/.idx`` (a
prefix left empty is dropped); every other prefix stays as it is. The new version's ``prefixes`` and
Megatron ``data_path`` follow. Written through ``repack.sinks.megatron.PartWriter`` (temp names,
renamed whole): a re-run after kill -9 writes the same bytes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from repack.errors import UsageError
from repack.lifecycle.rewrite import Rewrite
from repack.manifest import Manifest
from repack.sinks.megatron import PartWriter, read_index


def document_names(runs: list[list], by: str) -> list[str]:
    """The name of each document of a prefix, in order: its source (``by="sources"``) or its key."""
    if by == "sources":
        return [rel for rel, _, count in runs for _ in range(count)]
    return [f"{rel}#{first + n}" for rel, first, count in runs for n in range(count)]


def kept_runs(runs: list[list], keep: np.ndarray) -> list[list]:
    """``runs`` restricted to the kept documents (``keep``: one bool per document)."""
    out: list[list] = []
    position = 0
    for rel, first, count in runs:
        for n in range(count):
            if keep[position + n]:
                if out and out[-1][0] == rel and out[-1][1] + out[-1][2] == first + n:
                    out[-1][2] += 1
                else:
                    out.append([rel, first + n, 1])
        position += count
    return out


def rewrite_token_prefixes(store, out: Path, current: dict, spec, number: int):
    """The version's prefixes without the named documents (see the module docstring)."""
    from repack.jobs.text import _token_stats

    manifest = Manifest(out, current)
    wanted = set(spec.names)
    found: set[str] = set()
    shards: list[dict] = []
    rewritten: dict[str, str | None] = {}
    for entry in current["shards"]:
        runs = entry.get("sources")
        if runs is None:
            raise UsageError(f"{store.url}: prefix {entry['prefix']} does not record which source each document "
                             "came from (packed by an older repack): tokenize the corpus again to remove from it")
        names = document_names(runs, spec.by)
        if len(names) != entry["samples"]:
            raise UsageError(f"{store.url}: prefix {entry['prefix']} lists {len(names)} documents in its sources, "
                             f"{entry['samples']} in the manifest: run `repack verify`")
        keep = np.array([name not in wanted for name in names], dtype=bool)
        if keep.all():
            shards.append(entry)
            continue
        found.update(name for name in names if name in wanted)
        shards += _rewrite(store, out, manifest, entry, keep, kept_runs(runs, keep), number, rewritten)
    lengths = [np.asarray(_index(store, out, manifest, e).lengths) for e in shards]
    doc_stats, histogram = _token_stats(np.concatenate(lengths) if lengths else np.zeros(0, np.int32))
    extra = {"prefixes": [s["prefix"] for s in shards],
             "data_path": " ".join(f"{s['tokens']} {s['prefix']}" for s in shards),
             "totals": {"documents": sum(s["samples"] for s in shards), "tokens": sum(s["tokens"] for s in shards),
                        "bytes": sum(s["bytes"] + s["index_bytes"] for s in shards), "parts": len(shards)},
             "stats": {"document_tokens": doc_stats, "document_tokens_histogram": histogram}}
    return Rewrite(shards, frozenset(found), rewritten, {}, extra)


def _index(store, out: Path, manifest: Manifest, entry: dict):
    local = manifest.path(entry["index"])
    if store.remote and not local.is_file():
        store.fetch(entry["index"], local)
    return read_index(local)


def _rewrite(store, out: Path, manifest: Manifest, entry: dict, keep: np.ndarray, runs: list[list], number: int,
             rewritten: dict) -> list[dict]:
    """Copy the kept documents of one prefix into ``<prefix>-vN``; its manifest entry ([] when empty)."""
    index = _index(store, out, manifest, entry)
    data_path = manifest.path(entry["path"])
    if store.remote:
        store.fetch(entry["path"], data_path, entry["sha256"])
    tokens = np.memmap(data_path, dtype=index.dtype.newbyteorder("<"), mode="r") if entry["tokens"] else \
        np.zeros(0, index.dtype)
    lengths = np.asarray(index.lengths, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else lengths
    stem = f"{entry['prefix']}-v{number}"
    writer = PartWriter(manifest.path(entry["path"]).parent, stem, entry["dtype"])
    try:
        position = 0
        while position < len(keep):  # one contiguous slice per run of kept documents
            if not keep[position]:
                position += 1
                continue
            end = position
            while end < len(keep) and keep[end]:
                end += 1
            first, last = int(starts[position]), int(starts[end - 1] + lengths[end - 1])
            writer.add_documents(tokens[first:last], lengths[position:end])
            position = end
        part = writer.commit()
    except BaseException:
        writer.abort()
        raise
    del tokens
    folder = Path(manifest.path(entry["path"]).parent)
    if store.remote:
        data_path.unlink(missing_ok=True)
    if not part["documents"]:
        for key in ("bin", "idx"):
            (folder / part[key]).unlink(missing_ok=True)
        rewritten[entry["path"]] = None
        return []
    prefix = str(Path(entry["prefix"]).parent / stem) if "/" in entry["prefix"] else stem
    new = {**entry, "path": f"{prefix}.bin", "index": f"{prefix}.idx", "prefix": prefix,
           "samples": part["documents"], "tokens": part["tokens"], "bytes": part["bytes"], "sha256": part["sha256"],
           "index_bytes": part["index_bytes"], "index_sha256": part["index_sha256"],
           "max_token_id": part["max_token_id"], "sources": runs}
    if store.remote:
        store.publish(new["path"], folder / part["bin"], new["sha256"])
        store.publish(new["index"], folder / part["idx"])
    rewritten[entry["path"]] = new["path"]
    return [new]

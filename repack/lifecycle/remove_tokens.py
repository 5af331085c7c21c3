"""`repack remove` for a token memmap dataset: the prefixes holding the named documents rewritten.

A document is named by its source file (``--sources``: every document of it) or by its key
``<source>#<n>`` (``--keys``: document ``n`` of that file, numbered from 0 in file order as the job
tokenized it; each prefix's source runs ``(source, first, count)``, in its side file ``<prefix>.sources``
(``repack.manifest.source_runs``; inline ``sources`` in older manifests), say which documents it holds,
and keep their numbers across versions; a rewritten prefix gets its own side file). Only the prefixes holding a named document are rewritten:
their other documents' token ids are copied, in order, into a new prefix ``<prefix>-vN.bin/.idx`` (a
prefix left empty is dropped); every other prefix stays as it is. The new version's ``prefixes`` and
Megatron ``data_path`` follow. Written through ``repack.sinks.megatron.PartWriter`` (temp names,
renamed whole): a re-run after kill -9 writes the same bytes.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import numpy as np

from repack.errors import UsageError, VerificationError
from repack.lifecycle.rewrite import Rewrite, refuse_unrecorded
from repack.manifest import Manifest, atomic_write_bytes
from repack.manifest.source_runs import SUFFIX as RUNS_SUFFIX
from repack.manifest.source_runs import SourceRunsError, encode_runs, runs_of, side_entry
from repack.sinks.megatron import PartWriter, read_index


def _document_columns(runs: list[tuple[str, int, int]]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(distinct sources, per document the index of its source, per document its number in that source)."""
    names: dict[str, int] = {}
    run_name = np.fromiter((names.setdefault(rel, len(names)) for rel, _, _ in runs), np.int64, len(runs))
    first = np.fromiter((f for _, f, _ in runs), np.int64, len(runs))
    count = np.fromiter((c for _, _, c in runs), np.int64, len(runs))
    starts = np.cumsum(count) - count
    doc_name = np.repeat(run_name, count)
    doc_number = np.repeat(first - starts, count) + np.arange(int(count.sum()), dtype=np.int64)
    return list(names), doc_name, doc_number


def named_documents(runs: list[tuple[str, int, int]], wanted: set[str], by: str) -> tuple[np.ndarray, set[str]]:
    """(one bool per document of a prefix: kept, the names of ``wanted`` it holds): ``by="sources"`` names
    a source (all its documents), ``by="keys"`` a document's key ``<source>#<n>``. Columns, not a name per
    document."""
    names, doc_name, doc_number = _document_columns(runs)
    if by == "sources":
        hit = np.fromiter((name in wanted for name in names), bool, len(names))
        keep = ~hit[doc_name] if len(names) else np.ones(0, bool)
        return keep, {name for name, h in zip(names, hit) if h}
    index = {name: i for i, name in enumerate(names)}
    asked = [(index[rel], int(n)) for rel, _, n in (key.rpartition("#") for key in wanted)
             if rel in index and n.isdigit() and str(int(n)) == n]  # a key as the job wrote it, nothing else
    keep = np.ones(len(doc_name), bool)
    if asked and len(doc_name):
        span = int(doc_number.max()) + 1  # one code per (source, number)
        want = np.array([i * span + n for i, n in asked if n < span], np.int64)
        keep = ~np.isin(doc_name * span + doc_number, want)
    found = {f"{names[i]}#{n}" for i, n in zip(doc_name[~keep].tolist(), doc_number[~keep].tolist())}
    return keep, found


def kept_runs(runs: list[tuple[str, int, int]], keep: np.ndarray) -> list[list]:
    """``runs`` restricted to the kept documents (``keep``: one bool per document)."""
    names, doc_name, doc_number = _document_columns(runs)
    doc_name, doc_number = doc_name[keep], doc_number[keep]
    if not len(doc_name):
        return []
    breaks = np.flatnonzero((doc_name[1:] != doc_name[:-1]) | (doc_number[1:] != doc_number[:-1] + 1)) + 1
    bounds = np.concatenate([[0], breaks, [len(doc_name)]])
    return [[names[int(doc_name[a])], int(doc_number[a]), int(b - a)] for a, b in zip(bounds[:-1], bounds[1:])]


def rewrite_token_prefixes(store, out: Path, current: dict, spec, number: int):
    """The version's prefixes without the named documents (see the module docstring)."""
    from repack.jobs.token_stats import token_stats

    from repack.lifecycle.publish import refuse_names_in_use

    manifest = Manifest(out, current)
    wanted = set(spec.names)
    found: set[str] = set()
    shards: list[dict] = []
    rewritten: dict[str, str | None] = {}
    planned: list[tuple[dict, np.ndarray | None, list]] = []  # (entry, documents kept or None: kept whole, runs)
    for entry in current["shards"]:
        runs = prefix_runs(store, manifest, entry)
        if runs is None:
            raise UsageError(f"{store.url}: prefix {entry['prefix']} does not record which source each document "
                             "came from (packed by an older repack): tokenize the corpus again to remove from it")
        listed = sum(count for _, _, count in runs)
        if listed != entry["samples"]:
            raise UsageError(f"{store.url}: prefix {entry['prefix']} lists {listed} documents in its sources, "
                             f"{entry['samples']} in the manifest: run `repack verify`")
        keep, hits = named_documents(runs, wanted, spec.by)
        found |= hits
        planned.append((entry, None if keep.all() else keep, runs))
    # every name the rewrites will write, refused before the first is written where a published version names it
    refuse_names_in_use(store, current, [f"{rewritten_prefix(entry, number)}{suffix}" for entry, keep, _ in planned
                                         if keep is not None for suffix in (".bin", ".idx", RUNS_SUFFIX)], "remove")
    for entry, keep, runs in planned:
        shards += [entry] if keep is None else \
            _rewrite(store, out, manifest, entry, keep, kept_runs(runs, keep), number, rewritten)
    lengths = [np.asarray(_index(store, out, manifest, e).lengths) for e in shards]
    doc_stats, histogram = token_stats(np.concatenate(lengths) if lengths else np.zeros(0, np.int32))
    files = _files_table(store, manifest, shards, lengths)
    extra = {"prefixes": [s["prefix"] for s in shards],
             "data_path": " ".join(f"{s['tokens']} {s['prefix']}" for s in shards),
             "totals": {"documents": sum(s["samples"] for s in shards), "tokens": sum(s["tokens"] for s in shards),
                        "bytes": sum(s["bytes"] + s["index_bytes"] for s in shards), "parts": len(shards)},
             # the version's whole figures: no --append run's are left to add to them (``report.collect.merged_stats``)
             "stats": {"document_tokens": doc_stats, "document_tokens_histogram": histogram, "files": files,
                       "appended": []}}
    return Rewrite(shards, frozenset(found), rewritten, {}, extra)


def prefix_runs(store, manifest: Manifest, entry: dict) -> list[tuple[str, int, int]] | None:
    """A prefix's source runs (``runs_of``; None: it records none), a side file that does not match its entry
    a UsageError naming the prefix."""
    try:
        return runs_of(entry, lambda rel: _local(store, manifest, rel).read_bytes())
    except SourceRunsError as exc:
        raise UsageError(f"{store.url}: prefix {entry['prefix']}: {exc}") from None


def files_without_documents(store, out: Path, current: dict, rels: list[str]) -> set[str]:
    """Of ``rels`` (inputs the dataset recorded), the files that gave it no document (blank lines only): no
    prefix's source runs name them. None found where a prefix does not record its runs (an older repack), or
    where `repack remove` took documents out (a file whose documents were removed by key is named by no run
    either: it is refused as changed, never packed again)."""
    if current.get("totals", {}).get("removed"):
        return set()
    manifest, wanted = Manifest(out, current), set(rels)
    named: set[str] = set()
    for entry in current["shards"]:
        runs = prefix_runs(store, manifest, entry)
        if runs is None:
            return set()
        named.update(source for source, _, count in runs if count and source in wanted)
    return wanted - named


def _files_table(store, manifest: Manifest, shards: list[dict], lengths: list[np.ndarray]) -> dict:
    """``stats.files`` of the prefixes ``shards`` (their documents' ``lengths``): tokens and documents per source
    file, from each prefix's source runs (a file may span prefixes)."""
    from repack.jobs.token_stats import file_table

    documents: dict[str, int] = {}
    tokens: dict[str, int] = {}
    for entry, doc_lengths in zip(shards, lengths):
        runs = prefix_runs(store, manifest, entry) or []
        counts = np.array([count for _, _, count in runs], dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(counts)[:-1])) if len(counts) else counts
        sums = np.add.reduceat(doc_lengths.astype(np.int64), starts) if len(counts) and len(doc_lengths) else counts
        for (name, _, count), total in zip(runs, sums.tolist()):
            documents[name] = documents.get(name, 0) + count
            tokens[name] = tokens.get(name, 0) + int(total)
    names = list(documents)
    return file_table(np.array([documents[n] for n in names], np.int64), np.array([tokens[n] for n in names], np.int64),
                      names.__getitem__)


def _local(store, manifest: Manifest, rel: str) -> Path:
    """A file of the dataset on the local disk (an object store: fetched into the scratch first)."""
    local = manifest.path(rel)
    if store.remote and not local.is_file():
        store.fetch(rel, local)
    return local


def _index(store, out: Path, manifest: Manifest, entry: dict):
    """The prefix's index (VerificationError naming it where it cannot be read)."""
    try:
        return read_index(_local(store, manifest, entry["index"]))
    except ValueError as exc:  # MegatronFormatError among them
        raise VerificationError(f"{store.url}/{entry['index']}: {exc}: run `repack verify`; nothing removed") from None


def rewritten_prefix(entry: dict, number: int) -> str:
    """The prefix a remove publishing version ``number`` writes a rewrite of ``entry``'s under (``NAME-vN``)."""
    prefix = PurePosixPath(entry["prefix"])
    return prefix.with_name(f"{prefix.name}-v{number}").as_posix()


def _rewrite(store, out: Path, manifest: Manifest, entry: dict, keep: np.ndarray, runs: list[list], number: int,
             rewritten: dict) -> list[dict]:
    """Copy the kept documents of one prefix into ``<prefix>-vN``; its manifest entry ([] when empty)."""
    # both files the manifest's, or nothing is rewritten from them (an object's tokens: checked as fetched, below)
    _local(store, manifest, entry["index"])
    refuse_unrecorded(manifest.root, entry["index"], entry.get("index_bytes"), entry.get("index_sha256"))
    if not store.remote:
        refuse_unrecorded(manifest.root, entry["path"], entry.get("bytes"), entry.get("sha256"))
    index = _index(store, out, manifest, entry)
    data_path = manifest.path(entry["path"])
    if store.remote:
        store.fetch(entry["path"], data_path, entry["sha256"])
    tokens = np.memmap(data_path, dtype=index.dtype.newbyteorder("<"), mode="r") if entry["tokens"] else \
        np.zeros(0, index.dtype)
    lengths = np.asarray(index.lengths, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else lengths
    prefix = rewritten_prefix(entry, number)
    writer = PartWriter(manifest.path(entry["path"]).parent, prefix.rpartition("/")[2], entry["dtype"])
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
    runs_data = encode_runs(runs)
    runs_rel = prefix + RUNS_SUFFIX
    atomic_write_bytes(manifest.path(runs_rel), runs_data)
    new = {**{k: v for k, v in entry.items() if k != "sources"}, "path": f"{prefix}.bin", "index": f"{prefix}.idx",
           "prefix": prefix, "samples": part["documents"], "tokens": part["tokens"], "bytes": part["bytes"],
           "sha256": part["sha256"], "index_bytes": part["index_bytes"], "index_sha256": part["index_sha256"],
           "max_token_id": part["max_token_id"], **side_entry(runs_rel, runs_data)}
    if store.remote:
        store.publish(new["path"], folder / part["bin"], new["sha256"])
        store.publish(new["index"], folder / part["idx"])
        store.publish(runs_rel, manifest.path(runs_rel), new["source_runs_sha256"])
    rewritten[entry["path"]] = new["path"]
    return [new]

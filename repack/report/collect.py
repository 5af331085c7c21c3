"""What a report says about a finished dataset, as plain JSON-able data (`repack inspect --json`,
the text summary and the HTML page all read this): everything comes from the manifest, plus, for
video, the per-file probe records in OUT/probe.jsonl."""

from __future__ import annotations

import posixpath
from collections import Counter
from pathlib import Path

from repack.store.files import DatasetFiles, open_dataset

QUARANTINE_LISTED = 50  # quarantine records shown one by one (all are counted by reason)
VIDEO_LISTED = 50  # videos not decodable as is, listed with their reasons
GOP_BUCKETS = ((0.5, "<= 0.5 s"), (1.0, "0.5-1 s"), (2.0, "1-2 s"), (5.0, "2-5 s"), (float("inf"), "> 5 s"))


def counted(values) -> dict[str, int]:
    """{value: count}, most frequent first (ties by value)."""
    return dict(sorted(Counter(values).items(), key=lambda kv: (-kv[1], str(kv[0]))))


def bar_count(row: dict) -> int:
    """A histogram row's count (text's document-length rows call it "documents")."""
    return row["count"] if "count" in row else row["documents"]


def file_unit(format_name: str) -> str:
    """What one manifest shard entry is, in words: a video of a "videos" dataset, else a shard."""
    return "video" if format_name == "videos" else "shard"


def _median(values: list[int]) -> int:
    """The median of sorted ``values`` (the mean of the middle two of an even count), 0 when empty."""
    if not values:
        return 0
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) // 2


def collect(root: str | Path | DatasetFiles) -> dict:
    """The report's data for the dataset in ``root``, a folder or s3:// URL (raises ManifestError
    when there is none)."""
    files = root if isinstance(root, DatasetFiles) else open_dataset(root)
    manifest = files.manifest
    data = manifest.data
    sizes = sorted(s["bytes"] for s in data["shards"])
    run = data.get("run", {})
    summary = {
        "root": files.where, "modality": data["modality"], "format": data["format"],
        "manifest_version": data["version"], "tool_version": data.get("created_by", {}).get("version"),
        "options": data.get("created_by", {}).get("options", {}),
        "samples": manifest.num_samples,
        "shards": {"count": len(sizes), "unit": file_unit(data["format"]), "bytes": sum(sizes), "min_bytes": sizes[0] if sizes else 0,
                   "median_bytes": _median(sizes), "max_bytes": sizes[-1] if sizes else 0},
        "fields": data.get("fields", {}), "classes": data.get("classes") or {}, "totals": data.get("totals", {}),
        "quarantine": quarantine_summary(files),
        "stats": merged_stats(data.get("stats", {})),
        "timing": run.get("timing", {}),
        "run": {k: v for k, v in run.items() if k != "timing"},
    }
    if data["modality"] == "video":
        summary["video"] = video_tables(files)
    if data["modality"] == "text":
        from repack.sinks.megatron import megatron_data_path, version_document_tokens

        if files.local:
            summary["stats"] = {**summary["stats"], "document_tokens": version_document_tokens(manifest)}

        summary["text"] = {**{k: data.get(k) for k in ("tokenizer", "dtype", "prefixes", "data_path")},
                           "megatron_data_path": megatron_data_path(data, files.where)}
    return summary


DUPLICATES_LISTED = 20  # duplicate groups kept in merged statistics


def _summed_rows(*tables: list[dict]) -> list[dict]:
    """Histogram rows ({from, to, count or documents}) of several runs summed bucket by bucket (the buckets are
    fixed edges: the same in every run)."""
    merged: dict[tuple, dict] = {}
    for rows in tables:
        for row in rows or ():
            key = (row["from"], row["to"])
            if key not in merged:
                merged[key] = dict(row)
            else:
                for name in ("count", "documents"):
                    if name in row:
                        merged[key][name] = merged[key].get(name, 0) + row[name]
    return [merged[key] for key in sorted(merged)]


def merged_stats(stats: dict) -> dict:
    """A version's statistics with every ``--append``'s (``stats.appended``) folded in: the histograms summed,
    the duplicate groups and the per-file token table merged (duplicates across two runs are not known: each
    run found its own). Counts a version keeps up to date itself (class counts, formats) are left as they are."""
    appended = stats.get("appended") or []
    if not appended:
        return stats
    merged = dict(stats)
    runs = [stats, *appended]
    names = sorted({name for run in runs for name in (run.get("histograms") or {})})
    if names:
        merged["histograms"] = {name: _summed_rows(*((run.get("histograms") or {}).get(name) for run in runs))
                                for name in names}
    if any("document_tokens_histogram" in run for run in runs):
        merged["document_tokens_histogram"] = _summed_rows(*(run.get("document_tokens_histogram") for run in runs))
    dups = [run["duplicates"] for run in runs if run.get("duplicates")]
    if dups:
        merged["duplicates"] = {key: sum(d.get(key, 0) for d in dups) for key in ("groups", "extra_copies", "dropped")}
        merged["duplicates"]["list"] = [g for d in dups for g in d.get("list", [])][:DUPLICATES_LISTED]
        if any(d.get("file") for d in dups):  # every group of those versions: their side files
            merged["duplicates"]["files"] = [d["file"] for d in dups if d.get("file")]
    files = [run["files"] for run in runs if run.get("files")]
    if files:
        from repack.jobs.token_stats import FILES_LISTED as listed
        merged["files"] = {"count": sum(f.get("count", 0) for f in files),
                           "tokens_histogram": _summed_rows(*(f.get("tokens_histogram") for f in files)),
                           "largest": sorted((e for f in files for e in f.get("largest", [])),
                                             key=lambda e: (-e["tokens"], e["source"]))[:listed]}
    return merged


def missing_files(files: DatasetFiles) -> list[str]:
    """The files the manifest names that are not there, or not of the size it records (a shard's ``bytes``, its
    index's and checksums' ``index_bytes``, ``checksums_bytes``):
    what a report would otherwise print as facts about a dataset it cannot read. One stat per file (one
    listing on s3://); no byte is read (``repack verify`` checks the bytes)."""
    recorded = {posixpath.normpath(shard[name]): shard.get(size) for shard in files.manifest.data["shards"]
                for name, size in (("path", "bytes"), ("index", "index_bytes"), ("checksums", "checksums_bytes"))
                if isinstance(shard.get(name), str)}  # a shard, its DALI index and its checksums
    if files.local:
        def size_of(rel: str) -> int | None:
            try:
                return files.manifest.path(rel).stat().st_size
            except OSError:
                return None
    else:
        listed = dict(files.store.list_sizes())
        size_of = listed.get
    problems = []
    for rel in dict.fromkeys(files.manifest.named_files()):
        size, want = size_of(rel), recorded.get(rel)
        if size is None:
            problems.append(f"{rel} is missing")
        elif want is not None and size != want:
            problems.append(f"{rel} is {size} bytes, not the {want} the manifest records")
    return problems


def video_tables(files: DatasetFiles) -> dict:
    """Decisions, reasons, codecs, resolutions and keyframe gaps of every probed video."""
    stats = files.manifest.data.get("stats", {})
    probes = probe_records(files)
    videos = [p for p in probes if p.get("width")]

    def gop_bucket(seconds: float) -> str:
        return next(label for limit, label in GOP_BUCKETS if seconds <= limit)

    return {
        "decisions": stats.get("decisions", dict(counted(p.get("decision") for p in probes))),
        "reasons": dict(sorted(stats.get("reasons", {}).items(), key=lambda kv: (-kv[1], kv[0]))),
        "codecs": counted(f"{p.get('codec')} {p.get('profile') or ''}".strip() for p in videos),
        "pixel_formats": counted(str(p.get("pix_fmt")) for p in videos),
        "resolutions": counted(f"{p['width']}x{p['height']}" for p in videos),
        "frame_rates": counted(f"{p['fps']:g} fps" for p in videos if p.get("fps")),
        "gop": {label: sum(1 for p in videos if p.get("max_gop_s") is not None
                           and gop_bucket(p["max_gop_s"]) == label) for _, label in GOP_BUCKETS},
        "not_ok": [{"source": p.get("source"), "decision": p.get("decision"),
                    "codec": p.get("codec"), "size": f"{p.get('width')}x{p.get('height')}" if p.get("width") else "",
                    "max_gop_s": p.get("max_gop_s"),
                    "reasons": [r.get("code") for r in p.get("reasons", [])]}
                   for p in probes if p.get("decision") != "ok"][:VIDEO_LISTED],
        "probed": len(probes),
    }


def quarantine_summary(files: DatasetFiles) -> dict:
    """The quarantine's count, its reasons counted and the first records: every record counted, from the side file
    where the manifest lists only the first (``repack.manifest.quarantine_records``)."""
    from repack.manifest.quarantine_records import RUN_SUFFIX, summary

    count, reasons, listed = summary(files.manifest.data, files.read_if_present, files.where, QUARANTINE_LISTED)
    grouped: dict[str, int] = {}
    for reason, n in reasons.items():  # a text run's record: its reason without how far the run goes
        key = reason.split(RUN_SUFFIX, 1)[0]
        grouped[key] = grouped.get(key, 0) + n
    return {"count": count, "reasons": dict(sorted(grouped.items(), key=lambda kv: (-kv[1], kv[0]))),
            "listed": listed}


def probe_records(files: DatasetFiles) -> list[dict]:
    """The per-video probe records of a video dataset (OUT/probe.jsonl), [] when it has none."""
    rel = files.manifest.data.get("files", {}).get("probe")
    if not rel:
        return []
    try:
        return files.read_json_lines(rel)
    except OSError:
        return []


def as_packed(summary: dict) -> str:
    """What a title of the size and dimension histograms adds once samples were removed: they count what was
    packed (a remove cannot un-count a sample's source size or dimensions); empty before any remove."""
    removed = int(summary["totals"].get("removed") or 0)
    return f" (as packed; {removed:,} sample(s) removed since)" if removed else ""


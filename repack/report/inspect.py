"""`repack inspect`: a short human summary of a finished dataset that fits its modality
(images: classes, sizes, quarantine, timing; text: documents, tokens, lengths; video: decisions
by reason, codecs, resolutions), in human units."""

from __future__ import annotations

from pathlib import Path

from repack.config import format_size
from repack.report.collect import as_packed, bar_count, collect
from repack.report.overhead import overhead_lines
from repack.store.files import DatasetFiles, open_dataset
from repack.sinks import SINKS, get_sink

LONG_SIDE_HINT = 2048  # px: beyond this, decode dominates a DataLoader step
SHOWN = 15  # rows per table


def inspect_lines(root: str | Path | DatasetFiles) -> list[str]:
    """A short human summary of a dataset (a folder, an s3:// URL or its DatasetFiles)."""
    files = root if isinstance(root, DatasetFiles) else open_dataset(root)
    s = collect(files)
    shards = s["shards"]
    lines = [f"{s['root']}: {s['modality']} / {s['format']}, manifest v{s['manifest_version']} "
             f"(repack {s['tool_version'] or '?'})",
             f"samples {s['samples']} in {shards['count']} {shards['unit']}(s), {format_size(shards['bytes'])}"]
    if shards["count"]:
        lines.append(f"{shards['unit']} size: min {format_size(shards['min_bytes'])}, median {format_size(shards['median_bytes'])}, "
                     f"max {format_size(shards['max_bytes'])}")
    if s["fields"]:
        lines.append("fields: " + ", ".join(f"{k} ({v})" for k, v in s["fields"].items()))
    lines += _classes(s)
    lines += version_lines(files)
    if files.local and s["format"] == "webdataset":  # other formats: no per-member cost to report
        lines += overhead_lines(Path(files.where), files.manifest.data)
    lines.append(f"quarantined: {s['quarantine']['count']}")
    lines += [f"  {n} x {reason}" for reason, n in list(s["quarantine"]["reasons"].items())[:SHOWN]]
    lines += {"images": _images, "video": _video}.get(s["modality"], lambda _: [])(s)
    manifest = files.manifest
    hook = getattr(get_sink(manifest.format), "inspect_lines", None) if manifest.format in SINKS else None
    if hook is not None and files.local:  # format-specific lines (e.g. text statistics, the first document decoded)
        lines += hook(manifest)
    if s["modality"] == "text":
        lines += _text(s)
    return lines


def version_lines(files: DatasetFiles) -> list[str]:
    """The dataset's version, what changed in it, and every kept version (``manifest.vN.json``)."""
    import json

    from repack.manifest.versions import VERSION_KEY, number_of, version_number

    data = files.manifest.data
    names = [p.name for p in Path(files.where).iterdir()] if files.local else list(files.store.list_sizes())
    kept = sorted(n for n in map(version_number, names) if n is not None)
    info = data.get(VERSION_KEY) or {}
    change = info.get("change") or {"kind": "create"}
    what = ", ".join(f"{k} {json.dumps(v) if isinstance(v, (dict, list)) else v}" for k, v in sorted(change.items())
                     if k not in ("kind", "rewritten", "added_shards", "source"))
    lines = [f"version {number_of(data)} (parent {info.get('parent')}): {change.get('kind')}"
             + (f", {what}" if what else "")]
    if kept:
        lines.append(f"kept versions: {', '.join(map(str, kept))} (repack verify OUT --version N)")
    return lines


def _classes(s: dict) -> list[str]:
    classes, counts = s["classes"], s["stats"].get("class_counts", {})
    if not classes:
        return []
    shown = ", ".join(f"{name}={idx}" + (f" ({counts[name]})" if name in counts else "")
                      for name, idx in list(classes.items())[:20])
    return [f"classes ({len(classes)}): {shown}{' ...' if len(classes) > 20 else ''}"]


def _histogram_line(name: str, rows: list[dict], text=str) -> list[str]:
    if not rows:
        return []
    return [f"{name}: " + ", ".join(f"{text(r['from'])}-{text(r['to'])}: {bar_count(r)}" for r in rows)]


def _images(s: dict) -> list[str]:
    stats, timing = s["stats"], s["timing"]
    hist = stats.get("histograms", {})
    since = as_packed(s)
    lines = _histogram_line(f"source file sizes{since}", hist.get("source_bytes", []), format_size)
    lines += _histogram_line(f"widths (px){since}", hist.get("width", []))
    lines += _histogram_line(f"heights (px){since}", hist.get("height", []))
    labels = {"read_ms": "read", "check_ms": "decode/check (+normalize)"}
    for name in ("read_ms", "check_ms"):
        if timing.get(name):
            t = timing[name]
            lines.append(f"{labels[name]} time per sample (ms): p50 {t['p50']} p90 {t['p90']} p99 {t['p99']} max {t['max']}")
    if timing.get("slowest"):
        lines.append("slowest inputs:")
        lines += [f"  {e['us'] / 1000:.1f} ms  {e['source']}  {format_size(e['bytes'])}  {e['width']}x{e['height']}"
                  for e in timing["slowest"][:5]]
        longest = max(max(e.get("width", 0), e.get("height", 0)) for e in timing["slowest"])
        if longest > LONG_SIDE_HINT and s["options"].get("max_side") is None:
            lines.append(f"hint: the slowest inputs are up to {longest} px on the longer side; every epoch decodes "
                         f"them in full. Repack with --normalize --max-side {LONG_SIDE_HINT // 2} to cap decode cost.")
    norm = stats.get("normalize")
    if norm:
        lines.append(f"normalize: {norm['converted']} converted, {norm['passed_through']} passed through unchanged")
        lines += [f"  {n} x {reason}" for reason, n in sorted(norm["reasons"].items(), key=lambda kv: -kv[1])]
    dups = stats.get("duplicates")
    if dups and dups.get("groups"):
        dropped = f", {dups['dropped']} dropped by --dedup" if dups.get("dropped") else " (--dedup drops them)"
        lines.append(f"exact duplicates: {dups['groups']} group(s), {dups['extra_copies']} extra cop(ies){dropped}")
        lines += [f"  {' = '.join(g['paths'][:4])}{' ...' if len(g['paths']) > 4 else ''}" for g in dups["list"][:5]]
        files = dups.get("files") or ([dups["file"]] if dups.get("file") else [])
        if files:
            lines.append(f"  every group: {', '.join(files)} (the manifest lists the first of each version's)")
    return lines


def _table(title: str, counts: dict) -> list[str]:
    if not counts:
        return []
    width = max(len(str(k)) for k in list(counts)[:SHOWN])
    return [f"{title} (videos):"] + [f"  {str(k).ljust(width)}  {n:>5}" for k, n in list(counts.items())[:SHOWN]]


def _video(s: dict) -> list[str]:
    v = s["video"]
    totals = s["totals"]
    decisions = v["decisions"]
    lines = [f"probed {v['probed'] or totals.get('inputs', 0)} for target {s['options'].get('target', '?')}: "
             f"{decisions.get('ok', 0)} GPU-decodable as is, {decisions.get('transcode', 0)} need transcoding, "
             f"{decisions.get('reject', 0)} rejected"
             + (f"; {totals.get('transcoded', 0)} transcoded, {totals.get('copied', 0)} copied"
                if s["options"].get("transcode") else "")]
    lines += _table("decisions by reason", v["reasons"])
    lines += _table("codecs", v["codecs"])
    lines += _table("resolutions", v["resolutions"])
    lines += _table("longest keyframe gap", {k: n for k, n in v["gop"].items() if n})
    return lines


def _text(s: dict) -> list[str]:
    files, lengths = s["stats"].get("files"), s["stats"].get("document_tokens")
    lines = [f"tokens per document: p50 {lengths['p50']} p90 {lengths['p90']} p99 {lengths['p99']} "
             f"max {lengths['max']} mean {lengths.get('mean')}"] if lengths else []
    lines += _histogram_line("tokens per document", s["stats"].get("document_tokens_histogram", []))
    if files:
        lines.append(f"tokens per file ({files['count']} file(s)), largest:")
        lines += [f"  {e['tokens']} tokens, {e['documents']} documents  {e['source']}" for e in files["largest"][:5]]
    return lines

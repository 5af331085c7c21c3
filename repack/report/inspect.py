"""`repack inspect`: a short human summary of a finished dataset, read from its manifest."""

from __future__ import annotations

from pathlib import Path

from repack.manifest import read_manifest
from repack.sinks import SINKS, get_sink

LONG_SIDE_HINT = 2048  # px: beyond this, decode dominates a DataLoader step


def inspect_lines(root: str | Path) -> list[str]:
    """A short human summary of a dataset."""
    manifest = read_manifest(root)
    data = manifest.data
    shards = data["shards"]
    sizes = sorted(s["bytes"] for s in shards)
    lines = [f"{manifest.root}: {data['modality']} / {data['format']}, manifest v{data['version']} "
             f"(repack {data.get('created_by', {}).get('version', '?')})",
             f"samples {manifest.num_samples} in {len(shards)} shard(s), {sum(sizes) / 1e6:.1f} MB"]
    if sizes:
        lines.append(f"shard bytes: min {sizes[0] / 1e6:.1f} MB, median {sizes[len(sizes) // 2] / 1e6:.1f} MB, "
                     f"max {sizes[-1] / 1e6:.1f} MB")
    if data.get("fields"):
        lines.append("fields: " + ", ".join(f"{k} ({v})" for k, v in data["fields"].items()))
    classes = manifest.classes
    if classes:
        shown = ", ".join(f"{name}={idx}" for name, idx in list(classes.items())[:20])
        lines.append(f"classes ({len(classes)}): {shown}{' ...' if len(classes) > 20 else ''}")
    reasons: dict[str, int] = {}
    for q in manifest.quarantine:
        reasons[q["reason"]] = reasons.get(q["reason"], 0) + 1
    lines.append(f"quarantined: {len(manifest.quarantine)}")
    lines += [f"  {n} x {reason}" for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:15]]
    timing = data.get("run", {}).get("timing", {})
    labels = {"read_ms": "read", "check_ms": "decode/check (+normalize)"}
    for name in ("read_ms", "check_ms"):
        if timing.get(name):
            t = timing[name]
            lines.append(f"{labels[name]} time per sample (ms): p50 {t['p50']} p90 {t['p90']} p99 {t['p99']} max {t['max']}")
    if timing.get("slowest"):
        lines.append("slowest inputs:")
        lines += [f"  {s['us'] / 1000:.1f} ms  {s['source']}  {s['bytes']} B  {s['width']}x{s['height']}"
                  for s in timing["slowest"][:5]]
        longest = max(max(s.get("width", 0), s.get("height", 0)) for s in timing["slowest"])
        options = data.get("created_by", {}).get("options", {})
        if longest > LONG_SIDE_HINT and options.get("max_side") is None and data.get("modality") == "images":
            lines.append(f"hint: the slowest inputs are up to {longest} px on the longer side; every epoch decodes "
                         f"them in full. Repack with --normalize --max-side {LONG_SIDE_HINT // 2} to cap decode cost.")
    lines += image_report_lines(data.get("stats", {}))
    hook = getattr(get_sink(manifest.format), "inspect_lines", None) if manifest.format in SINKS else None
    if hook is not None:  # format-specific lines (e.g. text stats and the first document decoded)
        lines += hook(manifest)
    return lines


def image_report_lines(stats: dict) -> list[str]:
    """--normalize conversions and exact duplicates, from the manifest's stats."""
    lines = []
    norm = stats.get("normalize")
    if norm:
        lines.append(f"normalize: {norm['converted']} converted, {norm['passed_through']} passed through unchanged")
        lines += [f"  {n} x {reason}" for reason, n in sorted(norm["reasons"].items(), key=lambda kv: -kv[1])]
    dups = stats.get("duplicates")
    if dups and dups.get("groups"):
        dropped = f", {dups['dropped']} dropped by --dedup" if dups.get("dropped") else " (--dedup drops them)"
        lines.append(f"exact duplicates: {dups['groups']} group(s), {dups['extra_copies']} extra cop(ies){dropped}")
        lines += [f"  {' = '.join(g['paths'][:4])}{' ...' if len(g['paths']) > 4 else ''}" for g in dups["list"][:5]]
    return lines

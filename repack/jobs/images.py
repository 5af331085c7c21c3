"""`repack images`: an image tree or list file -> checked samples in shards of the chosen format.

Plan: scan (sorted), optional seeded shuffle, then cut into shards by count and/or stat()
bytes before any decoding. Each task reads, checks and writes one shard; bad inputs become
quarantine records.

Each sample's members (WebDataset naming, key = zero-padded global position + a sanitized
short stem, ASCII, dot-free, unique): ``<key>.<jpg|png|...>`` (type from content),
``<key>.cls`` (class index as zero-padded ASCII digits, fixed width per dataset, so DALI
reads equal-length label bytes) when labeled, and ``<key>.json`` (path, class, width,
height, bytes, format).
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

from repack.config import DEFAULT_SHARD_BYTES, ImagesSpec
from repack.errors import UsageError
from repack.jobs.base import Job, Plan, Task
from repack.jobs.stats import merge_slowest, percentiles
from repack.sinks import get_sink
from repack.sinks.tar_format import BLOCK, RECORD
from repack.sources import InputItem, scan_source
from repack.transforms.image_check import BadImage, inspect_image

SLOWEST_N = 10


def sample_key(position: int, rel: str) -> str:
    """Unique, short, ASCII, dot-free key: ``00000042_cat_001``."""
    stem = rel.rsplit("/", 1)[-1]
    stem = stem.split(".", 1)[0] if not stem.startswith(".") else stem
    slug = re.sub(r"[^A-Za-z0-9_-]+", "_", stem.encode("ascii", "ignore").decode())[:40].strip("_")
    return f"{position:08d}_{slug}" if slug else f"{position:08d}"


ARCHIVE_TAIL_MAX = 2 * BLOCK + RECORD  # end-of-archive blocks + padding to the record size


def _blocks(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def sample_bytes_bound(item: InputItem) -> int:
    """Upper bound of a sample's bytes in a tar: headers, padded image, cls and json members."""
    json_bound = 256 + 6 * len(item.rel.encode("utf-8", "surrogateescape")) + 6 * len(item.label or "")
    return 3 * BLOCK + _blocks(item.size) + BLOCK + _blocks(json_bound)


def cut_into_shards(items: list[InputItem], shard_size: int | None, shard_bytes: int | None) -> list[list[int]]:
    """Group item positions into shards of at most ``shard_size`` items and ``shard_bytes`` bytes."""
    if shard_size is None and shard_bytes is None:
        shard_bytes = DEFAULT_SHARD_BYTES
    shards: list[list[int]] = []
    current: list[int] = []
    current_bytes = ARCHIVE_TAIL_MAX
    for position, item in enumerate(items):
        estimate = sample_bytes_bound(item)
        full = (shard_size is not None and len(current) >= shard_size) or (
            shard_bytes is not None and current and current_bytes + estimate > shard_bytes)
        if full:
            shards.append(current)
            current, current_bytes = [], ARCHIVE_TAIL_MAX
        current.append(position)
        current_bytes += estimate
    if current:
        shards.append(current)
    return shards


class ImagesJob(Job):
    """Plans, runs and finalizes an image repack."""

    name = "images"
    spec_type = ImagesSpec
    progress_unit = "img"

    def __init__(self, spec: ImagesSpec) -> None:
        super().__init__(spec)
        self.sink = get_sink(spec.to)

    def check(self) -> None:
        src = Path(self.spec.source)
        if not src.exists():
            raise UsageError(f"source {self.spec.source!r} does not exist")

    def plan(self) -> Plan:
        spec = self.spec
        scan = scan_source(spec.source, list_file=spec.list_file, follow_symlinks=spec.follow_symlinks)
        items = list(scan.items)
        if spec.shuffle:
            random.Random(spec.seed).shuffle(items)
        classes = scan.classes
        width = len(str(max(len(classes) - 1, 0)))
        tasks = []
        for index, positions in enumerate(cut_into_shards(items, spec.shard_size, spec.shard_bytes)):
            inputs = [{**items[p].to_json(), "key": sample_key(p, items[p].rel),
                       "cls": classes.get(items[p].label) if items[p].label is not None else None}
                      for p in positions]
            tasks.append(Task(f"shard-{index:06d}", {"index": index, "inputs": inputs, "cls_width": width}))
        info = {"classes": classes, "labeled": scan.labeled, "inputs": len(items) + len(scan.quarantine),
                "skipped_junk": scan.skipped}
        return Plan(tuple(tasks), scan.quarantine, info)

    def run_task(self, task: Task) -> dict:
        spec = self.spec
        writer = self.sink.open_shard(self.out, task.task_id)
        quarantine: list[dict] = []
        read_us: list[int] = []
        check_us: list[int] = []
        slowest: list[dict] = []
        formats: dict[str, int] = {}
        width = task.payload["cls_width"]
        try:
            for entry in task.payload["inputs"]:
                t0 = time.perf_counter()
                try:
                    with open(entry["path"], "rb") as fh:
                        data = fh.read()
                except OSError as exc:
                    quarantine.append({"source": entry["rel"], "reason": f"unreadable: {exc.strerror or exc}"})
                    continue
                t1 = time.perf_counter()
                try:
                    info = inspect_image(data, spec.verify, spec.max_pixels)
                except BadImage as exc:
                    quarantine.append({"source": entry["rel"], "reason": str(exc)})
                    continue
                t2 = time.perf_counter()
                members = [(info.ext, data)]
                if entry["cls"] is not None:
                    members.append(("cls", b"%0*d" % (width, entry["cls"])))
                meta = {"path": entry["rel"], "class": entry["label"], "width": info.width, "height": info.height,
                        "bytes": len(data), "format": info.ext}
                members.append(("json", json.dumps(meta, sort_keys=True).encode()))
                writer.add_sample(entry["key"], members)
                formats[info.ext] = formats.get(info.ext, 0) + 1
                read_us.append(round((t1 - t0) * 1e6))
                check_us.append(round((t2 - t1) * 1e6))
                slowest = merge_slowest(slowest, [{"source": entry["rel"], "us": read_us[-1] + check_us[-1],
                                                   "bytes": len(data), "width": info.width,
                                                   "height": info.height}], SLOWEST_N)
            shard = writer.commit()
        except BaseException:
            writer.abort()
            raise
        return {"shard": shard, "outputs": self.sink.outputs(shard) if shard else [], "quarantine": quarantine,
                "inputs": len(task.payload["inputs"]), "formats": formats,
                "timing": {"read_us": read_us, "check_us": check_us, "slowest": slowest}}

    def finalize(self, plan: Plan, records: list[dict]) -> dict:
        shards = [r["shard"] for r in records if r["shard"]]
        quarantine = list(plan.quarantine) + [q for r in records for q in r["quarantine"]]
        formats: dict[str, int] = {}
        for r in records:
            for ext, n in r["formats"].items():
                formats[ext] = formats.get(ext, 0) + n
        fields = {ext: "image" for ext in sorted(formats)}
        if plan.info["labeled"]:
            fields["cls"] = "int"
        fields["json"] = "metadata"
        samples = sum(s["samples"] for s in shards)
        read_us = [v for r in records for v in r["timing"]["read_us"]]
        check_us = [v for r in records for v in r["timing"]["check_us"]]
        slowest: list[dict] = []
        for r in records:
            slowest = merge_slowest(slowest, r["timing"]["slowest"], SLOWEST_N)
        return {
            "format": self.spec.to,
            "fields": fields,
            "classes": plan.info["classes"],
            "shards": shards,
            "totals": {"inputs": plan.info["inputs"], "samples": samples, "quarantined": len(quarantine),
                       "bytes": sum(s["bytes"] for s in shards), "shards": len(shards),
                       "skipped_junk": plan.info["skipped_junk"]},
            "quarantine": quarantine,
            "stats": {"formats": formats},
            "run_stats": {"timing": {"read_ms": percentiles(read_us, 1e-3), "check_ms": percentiles(check_us, 1e-3),
                                     "slowest": slowest}},
        }

    def summary_lines(self, manifest: dict) -> list[str]:
        t = manifest["totals"]
        lines = [f"{t['samples']} of {t['inputs']} inputs packed into {t['shards']} {manifest['format']} shard(s), "
                 f"{t['bytes'] / 1e6:.1f} MB; {t['quarantined']} quarantined"]
        reasons: dict[str, int] = {}
        for q in manifest["quarantine"]:
            reasons[q["reason"]] = reasons.get(q["reason"], 0) + 1
        lines += [f"  quarantined {n}: {reason}" for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:10]]
        return lines

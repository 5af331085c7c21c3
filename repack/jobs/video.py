"""`repack video`: probe every video, decide per GPU target, optionally transcode what needs it.

Plan: sorted scan (class = first folder level, or a list file), cut into shards of
``shard_size`` videos and each shard into tasks of ONE video, so probes and transcodes spread
over every worker whatever the shard size (with ``--to webdataset`` a shard's tasks form a
group: the engine's driver packs their videos into the shard in plan order, see
``VideoShardAssembly``). Each task probes its video (in-process through PyAV; ffprobe where
PyAV lacks a field, see repack.transforms.probe_pyav: streams + packet scan, no decoding;
``verify="decode"`` adds a full decode that quarantines files with decoder errors) and applies the NVDEC rule for the chosen DALI reader; with ``transcode`` it re-encodes
what needs it into ``OUT/videos/<rel>`` (``.mp4``, every frame kept: see
repack.transforms.transcode), copies or hard-links the compatible ones (an MP4/MOV whose
``moov`` follows ``mdat`` is remuxed with ``+faststart`` instead: stream copy), re-probes every
output (quarantined unless it passes the rule and has the source's frame count, within one
frame, with both numbers in the reason) and, with ``--to webdataset``, packs the task's
videos into ``shard-NNNNNN.tar`` (+ DALI ``.idx``). Every output is written to a hidden temp
name containing the task id and renamed when complete.

Outputs of a finished job::

  manifest.json     format "videos": one shards[] entry per usable video (path videos/..., samples 1,
                    bytes, sha256, label, cls, frames (= frames_out), frames_in, frame_timing
                    (keep | resample | copy), fps, duration_s, width, height, codec, transcoded,
                    remuxed, source); format "webdataset": the tar shards, and the same per-video
                    entries under "videos". A probe-only run has no shards. Top level: ``dali_reader``
                    (the reader the decisions hold for) and ``verify``.
  probe.jsonl       one JSON object per input (sorted keys): probe facts + decision + reasons
                    + target + dali_reader (+ decoded_frames/decode_errors with verify "decode")
  file_list.txt     DALI file_list: "videos/<rel> <class index>" per usable video (UTF-8; unlabeled
                    videos get 0 because DALI's file_list rejects negative labels; the readers in
                    pipelines/ give -1 for them). The paths are relative to OUT: DALI forbids
                    ``file_root`` together with ``file_list`` and resolves them against the working
                    directory, so run DALI from OUT, or use pipelines.dali_video (absolute paths
                    from the manifest, confined to OUT).

Output names: ``videos/<rel>`` (``.mp4`` when transcoded). A relative path DALI's file_list
cannot hold (whitespace, control characters, non-UTF-8 bytes) becomes
``videos/_renamed/NNNNNNNN_<ascii slug>.<ext>`` (NNNNNNNN = input position, deterministic); list
paths outside the source become ``videos/_outside/NNNNNNNN_<name>``. The entry's ``source``
keeps the original path (a non-UTF-8 byte is JSON-escaped as a lone surrogate ``\\udcXX``, as
Python's ``os.fsdecode`` gives it; ``os.fsencode`` restores the bytes).

Tar members per video (key = zero-padded position + slug): ``KEY.<ext>`` (the video bytes),
``KEY.cls`` (zero-padded ASCII class index, when labeled), ``KEY.json`` (the per-video entry).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import PurePosixPath

from repack.config import JobSpec
from repack.errors import UsageError
from repack.jobs.base import Job, Plan, Task
from repack.jobs.images import job_classes, sample_key
from repack.lifecycle.input_record import file_sha256, load_known, select_new
from repack.jobs.summary import quarantine_lines
from repack.manifest import atomic_write_bytes
from repack.manifest.paths import PathEscapeError, safe_join
from repack.sinks.checks import bytes_digest, file_and_index_outputs, sha256_file
from repack.sinks.tar_format import MAX_MEMBER_SIZE
from repack.sinks.videos import dali_file_list
from repack.sources import Confinement, scan_source
from repack.sources.confine import InputRefused, open_input
from repack.transforms.nvdec_rules import (DEFAULT_DALI_READER, ENCODABLE, LEGACY_CODEC, OK, REJECT, TRANSCODE,
                                           dataset_codec, decide, get_reader, get_target)

VIDEO_FORMATS = ("videos", "webdataset")
VERIFY_MODES = ("packets", "decode")


@dataclass(frozen=True)
class VideoSpec(JobSpec):
    """Options of `repack video` (all of them determine the output)."""

    to: str = "videos"
    list_file: bool = False
    transcode: bool = False
    link: bool = False
    target: str = "h100"
    max_gop: float = 1.0
    crf: int = 18
    preset: str = "fast"
    gop: int | None = None
    max_height: int | None = None
    bframes: int = 0
    threads: int = 1
    shard_size: int = 8
    verify: str = "packets"
    dali_reader: str = DEFAULT_DALI_READER
    follow_symlinks: bool = True
    allow_outside_source: bool = False
    # set by `--append` (repack.lifecycle.append) for the job that prepares only the new videos:
    known_inputs: str | None = None   # the record of the inputs held (repack.lifecycle.input_columns): skipped
    known_classes: tuple[tuple[str, int], ...] = ()  # the dataset's classes (kept; a new class: the next index)
    cls_width: int | None = None      # the dataset's cls member width (kept)
    known_codec: str | None = None    # the dataset's recorded one codec (kept, not decided again)
    videos_dir: str = "videos"        # the folder (relative to OUT) the prepared videos are written to

    def __post_init__(self) -> None:
        get_target(self.target)
        get_reader(self.dali_reader)
        if self.verify not in VERIFY_MODES:
            raise UsageError(f"--verify must be one of {', '.join(VERIFY_MODES)}, got {self.verify!r}")
        if self.to not in VIDEO_FORMATS:
            raise UsageError(f"--to must be one of {', '.join(VIDEO_FORMATS)}, got {self.to!r}")
        if self.to == "webdataset" and not self.transcode:
            raise UsageError("--to webdataset packs the prepared videos: add --transcode")
        if self.link and not self.transcode:
            raise UsageError("--link only applies with --transcode")
        if not 0 <= self.crf <= 51:
            raise UsageError(f"--crf must be in 0..51, got {self.crf}")
        if self.preset not in ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower",
                               "veryslow", "placebo"):
            raise UsageError(f"--preset {self.preset!r} is not an x264 preset")
        if not (self.max_gop > 0 and math.isfinite(self.max_gop)):  # a NaN passed "<= 0", then failed every transcode
            raise UsageError(f"--max-gop must be a positive number of seconds, got {self.max_gop}")
        if self.gop is not None and self.gop < 1:
            raise UsageError("--gop must be at least 1 frame")
        if self.max_height is not None and self.max_height < 16:
            raise UsageError("--max-height must be at least 16")
        if self.threads < 1 or self.shard_size < 1 or self.bframes < 0:
            raise UsageError("--threads and --shard-size must be >= 1, --bframes >= 0")

    @property
    def mode(self) -> str:
        return "transcode" if self.transcode else "probe"


def dali_safe(rel: str) -> bool:
    """True if ``rel`` can stand in DALI's file_list as is: valid UTF-8, printable, no whitespace."""
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:  # a surrogate-escaped (non-UTF-8) file name
        return False
    return all(c.isprintable() and not c.isspace() for c in rel)


def _slug(text: str, limit: int = 40) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "_", text.encode("ascii", "ignore").decode())[:limit].strip("_")


def video_member(path: str) -> str:
    """The tar member extension of a video at ``path`` (under OUT): its own, lower-cased, where that is a plain
    ASCII word and not another member's (``cls``, ``json``: a video named ``x.cls`` made a sample of two ``.cls``
    members), else ``bin``."""
    ext = PurePosixPath(path).suffix.lstrip(".").lower()
    return ext if re.fullmatch(r"[a-z0-9]{1,16}", ext) and ext not in ("cls", "json") else "bin"


NAME_BYTES = 220  # a longer file name is renamed: its temp file (``.NAME.mp4.tmp-<task id>``) must fit 255 bytes


def output_names(rels: list[str], first_position: int = 0) -> list[tuple[str, str]]:
    """Per input: (name when copied, name when transcoded), relative to OUT/videos, unique and
    confined (absolute or ``..`` list-file paths are flattened to ``_outside/NNNNNNNN_name``) and
    DALI-safe: a path with whitespace, control characters or non-UTF-8 bytes, or a file name over NAME_BYTES, becomes
    ``_renamed/NNNNNNNN_<slug>.<ext>`` (NNNNNNNN = input position; the manifest's ``source``
    keeps the original path; ``first_position``: the position of ``rels[0]``, for appends)."""
    safe = []
    for pos, rel in enumerate(rels, first_position):
        pure = PurePosixPath(rel)
        if pure.is_absolute() or ".." in pure.parts or not rel or "\\" in rel:
            rel = f"_outside/{pos:08d}_{pure.name or 'video'}"
            pure = PurePosixPath(rel)
        if not dali_safe(rel) or len(pure.name.encode("utf-8")) > NAME_BYTES or \
                pure.parts[0] in ("_renamed", "_outside") and not rel.startswith(f"_outside/{pos:08d}_"):
            ext = _slug(pure.suffix.lstrip("."), 10).lower()
            stem = _slug(pure.stem) or "video"
            rel = f"_renamed/{pos:08d}_{stem}" + (f".{ext}" if ext else "")
        safe.append(rel)
    # a transcoded name must not be a folder of another input's name either (``a.avi`` -> ``a.mp4`` beside a folder
    # ``a.mp4/``): the output could not be written, nor the other input beneath it
    taken = set(safe) | {str(parent) for rel in safe for parent in PurePosixPath(rel).parents}
    names = []
    seen_mp4: set[str] = set()
    for pos, rel in enumerate(safe, first_position):
        stem = str(PurePosixPath(rel).with_suffix(".mp4")) if PurePosixPath(rel).suffix else rel + ".mp4"
        if stem != rel and (stem in taken or stem in seen_mp4):
            stem = rel + ".mp4"
        if stem != rel and (stem in taken or stem in seen_mp4):  # e.g. ``a/clip`` beside ``a/clip.mp4``: its position's
            stem = f"_renamed/{pos:08d}_{_slug(PurePosixPath(rel).stem) or 'video'}.mp4"  # name, no other input's
        seen_mp4.add(stem)
        names.append((rel, stem))
    return names


def _encoders() -> tuple[str, ...]:
    """The codecs of ``ENCODABLE`` this ffmpeg can encode (libx264, libx265); both when ffmpeg is
    absent (a probe-only run reports what a transcode run with a full ffmpeg would do)."""
    from repack.transforms.ffmpeg_cli import encoder_names

    if shutil.which("ffmpeg") is None:
        return ENCODABLE
    have = encoder_names()
    return tuple(c for c in ENCODABLE if {"h264": "libx264", "hevc": "libx265"}[c] in have)


class VideoShardAssembly:
    """Packs the videos of a group's one-video tasks (fed in plan order) into the group's tar shard."""

    def __init__(self, job: "VideoJob", group: str) -> None:
        self.job = job
        self.group = group
        self.records: list[dict] = []

    def add(self, record: dict) -> None:
        self.records.append(record)

    def finish(self) -> dict:
        records = self.records
        entries = [v for r in records for v in r["videos"]]
        shard = self.job._pack(self.group, records[0]["cls_width"], entries) if entries else None
        outputs = [o for r in records for o in r["outputs"]]
        if shard:
            outputs += file_and_index_outputs(shard)
        timing = {k: round(sum(r["timing"][k] for r in records), 4) for k in records[0]["timing"]}
        return {"videos": entries, "probes": [p for r in records for p in r["probes"]],
                "quarantine": [q for r in records for q in r["quarantine"]], "outputs": outputs, "shard": shard,
                "digests": [d for r in records for d in r.get("digests", ())],
                "timing": timing}

    def abort(self) -> None:
        """Nothing to undo: the shard is written whole by ``finish``."""


class VideoJob(Job):
    """Plans, runs and finalizes a video probe / transcode."""

    name = "video"
    spec_type = VideoSpec
    progress_unit = "video"


    @classmethod
    def fixed_outputs(cls, spec: dict) -> set[str]:
        return {"probe.jsonl", "file_list.txt"} | super().fixed_outputs(spec)

    def check(self) -> None:
        if not os.path.exists(self.spec.source):
            raise UsageError(f"source {self.spec.source!r} does not exist")
        needed = ["ffprobe"] + (["ffmpeg"] if self.spec.transcode or self.spec.verify == "decode" else [])
        missing = [tool for tool in needed if shutil.which(tool) is None]
        if missing:
            raise UsageError(f"{' and '.join(missing)} not found on PATH: install ffmpeg "
                             "(Debian/Ubuntu: apt-get install ffmpeg; `make setup` does it)")

    def plan(self) -> Plan:
        spec = self.spec
        scan = scan_source(spec.source, list_file=spec.list_file, confinement=Confinement(
            follow_symlinks=spec.follow_symlinks, allow_outside=spec.allow_outside_source))
        items = list(scan.items)
        first = 0
        selection = None
        if spec.known_inputs:  # --append: only the videos the dataset does not hold yet (repack.lifecycle.input_record)
            known = load_known(spec.known_inputs)
            first = known.next_position
            selection = select_new(items, known, lambda item: item.rel, lambda item: item.fingerprint,
                                   lambda item: file_sha256(item.path))
            items = selection.new
        classes = job_classes(spec.known_classes, scan, bool(spec.known_inputs))
        names = output_names([i.rel for i in items], first)
        legacy_codec = spec.known_codec or self._dataset_codec(items)  # an append keeps the dataset's codec
        tasks = []
        width = spec.cls_width or len(str(max(len(classes) - 1, 0)))
        if len(str(max(classes.values(), default=0))) > width:
            raise UsageError(f"class index {max(classes.values())} needs more digits than the dataset's cls members "
                             f"({width}): repack the dataset (without --append) to widen them")
        for index, start in enumerate(range(0, len(items), spec.shard_size)):
            stem = f"shard-{index:06d}"
            positions = range(start, min(start + spec.shard_size, len(items)))
            for number, pos in enumerate(positions):
                item = items[pos]
                inputs = [{**item.to_json(), "key": sample_key(first + pos, item.rel), "out_copy": names[pos][0],
                           "out_transcode": names[pos][1],
                           "cls": classes.get(item.label) if item.label is not None else None}]
                payload = {"index": index, "inputs": inputs, "cls_width": width, "legacy_codec": legacy_codec}
                if len(positions) == 1:
                    tasks.append(Task(stem, payload))
                else:
                    tasks.append(Task(f"{stem}-c{number:04d}", {**payload, "chunk": number},
                                      group=stem if spec.to == "webdataset" else ""))
        info = {"classes": classes, "labeled": scan.labeled, "inputs": len(items) + len(scan.quarantine),
                "legacy_codec": legacy_codec, "skipped_junk": scan.skipped}
        if selection is not None:
            info.update(removed_skipped=selection.removed, same_content=selection.same_content)
        return Plan(tuple(tasks), scan.quarantine, info)

    def _dataset_codec(self, items: list) -> str:
        """The legacy reader's one codec for these inputs (nvdec_rules.dataset_codec): a header-only
        ffprobe of each input, in parallel threads, stopping at the first input that decides for
        H.264 (a second codec, or one that cannot be the dataset's). H.264 for other readers."""
        from concurrent.futures import ThreadPoolExecutor

        from repack.exec import available_cpus
        from repack.transforms.probe import probe_codec

        spec = self.spec
        if spec.dali_reader != "legacy" or not items:
            return LEGACY_CODEC
        encoders = _encoders()

        def codec_of(item) -> str | None:
            try:
                with open_input(item.path, item.fingerprint, item.rel):
                    pass
            except InputRefused:
                return None  # quarantined by its task
            return probe_codec(item.path)

        found: set[str] = set()
        batch = 4 * available_cpus()
        with ThreadPoolExecutor(max_workers=available_cpus() * 2) as pool:
            for start in range(0, len(items), batch):
                found.update(c for c in pool.map(codec_of, items[start:start + batch]) if c)
                if len(found) > 1 or dataset_codec(found, spec.target, spec.dali_reader, encoders) == LEGACY_CODEC:
                    return LEGACY_CODEC
        return dataset_codec(found, spec.target, spec.dali_reader, encoders)

    # -- one task --------------------------------------------------------------------------
    def progress_counts(self, record: dict) -> dict[str, int]:
        """frames/s on the progress bar: frames of the usable videos a task finished."""
        return {"frames": sum(v["frames"] for v in record["videos"])}

    def run_task(self, task: Task) -> dict:
        from repack.transforms.decode_check import decode_check
        from repack.transforms.probe import probe_file

        spec = self.spec
        entries, probes, quarantine, outputs = [], [], [], []
        digests: list[list[str]] = []  # [rel, sha256] of every input read (repack.lifecycle.input_record)
        timing = {"probe_s": 0.0, "decode_s": 0.0, "transcode_s": 0.0, "frames_transcoded": 0}
        for entry in task.payload["inputs"]:
            try:  # still the planned regular file (SourceChanged otherwise); never blocks. Playlists and
                # reference files are refused by ffprobe's demuxer allow-list (probe.py), never followed.
                with open_input(entry["path"], entry.get("fingerprint"), entry["rel"]) as fh:
                    digests.append([entry["rel"], hashlib.file_digest(fh, "sha256").hexdigest()])  # for --append
            except InputRefused as exc:
                quarantine.append({"source": entry["rel"], "reason": str(exc)})
                continue
            t0 = time.perf_counter()
            info = probe_file(entry["path"])
            timing["probe_s"] += time.perf_counter() - t0
            if spec.verify == "decode" and not info.get("error") and info.get("codec"):
                t0 = time.perf_counter()
                info.update(decode_check(entry["path"], info.get("stream_index")))
                timing["decode_s"] += time.perf_counter() - t0
            verdict = self._decide(info, task)
            probes.append({"source": entry["rel"], "label": entry["label"], **info, **verdict.to_json(),
                           "target": spec.target, "dali_reader": spec.dali_reader, "verify": spec.verify})
            if verdict.decision == REJECT:
                quarantine.append({"source": entry["rel"], "reason": "; ".join(r["message"] for r in verdict.reasons),
                                   "codes": verdict.codes})
                continue
            if not spec.transcode:
                continue
            result = self._prepare_output(task, entry, info, verdict.decision, timing)
            if "reason" in result:
                quarantine.append({"source": entry["rel"], **result})
                continue
            entries.append(result)
            outputs.append({"path": result["path"], "bytes": result["bytes"]})
        shard = None
        if spec.to == "webdataset" and entries and not task.group:
            shard = self._pack(task.task_id, task.payload["cls_width"], entries)
            outputs += file_and_index_outputs(shard)
        record = {"videos": entries, "probes": probes, "quarantine": quarantine, "outputs": outputs, "shard": shard,
                  "digests": digests,
                  "timing": {k: round(v, 4) for k, v in timing.items()}}
        if task.group:  # packed into the group's shard by VideoShardAssembly
            record["cls_width"] = task.payload["cls_width"]
        return record

    def _decide(self, info: dict, task: Task):
        spec = self.spec
        return decide(info, spec.target, spec.max_gop, spec.max_height, spec.dali_reader,
                      task.payload.get("legacy_codec", LEGACY_CODEC))

    def _prepare_output(self, task: Task, entry: dict, info: dict, decision: str, timing: dict) -> dict:
        """Copy/link, remux or transcode one input into OUT/videos; re-probe and count its frames;
        the manifest entry or a quarantine."""
        from repack.transforms.probe import probe_file
        from repack.transforms.transcode import (Recipe, build_command, copy_timing, frames_problem, plan_timing,
                                                 remux_command, run_ffmpeg)

        spec = self.spec
        transcoded = decision == TRANSCODE
        remuxed = not transcoded and bool(info.get("moov_after_mdat"))
        plan = plan_timing(info) if transcoded else copy_timing(info)  # the frames the output must have
        rel = f"{spec.videos_dir}/" + (entry["out_transcode"] if transcoded else entry["out_copy"])
        try:
            final = safe_join(self.out, rel)
        except PathEscapeError as exc:
            return {"reason": f"output path refused: {exc}"}
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{final.name}.tmp-{task.task_id}"
        tmp.unlink(missing_ok=True)  # a killed attempt's, or a link planted there: ffmpeg would write through it
        try:
            if transcoded:
                recipe = Recipe(crf=spec.crf, preset=spec.preset, gop=spec.gop, max_gop_s=spec.max_gop,
                                max_height=spec.max_height, bframes=spec.bframes, threads=spec.threads,
                                target=spec.target, codec=task.payload.get("legacy_codec", LEGACY_CODEC))
                t0 = time.perf_counter()
                error = run_ffmpeg(build_command(entry["path"], str(tmp), info, recipe), entry["path"], output=rel)
                timing["transcode_s"] += time.perf_counter() - t0
                if error:
                    return {"reason": f"transcode failed: {error}", "codes": ["transcode_failed"]}
            elif remuxed:
                container = "mov" if final.suffix.lower() == ".mov" else "mp4"
                error = run_ffmpeg(remux_command(entry["path"], str(tmp), container), entry["path"], output=rel)
                if error:
                    return {"reason": f"faststart remux failed: {error}", "codes": ["remux_failed"]}
            elif spec.link:
                tmp.unlink(missing_ok=True)
                try:
                    os.link(entry["path"], tmp)
                except OSError:  # another file system: fall back to a copy
                    shutil.copyfile(entry["path"], tmp)
            else:
                shutil.copyfile(entry["path"], tmp)
            after = probe_file(str(tmp))
            verdict = self._decide(after, task)
            if verdict.decision != OK:
                return {"reason": "output still not GPU-decodable: " + "; ".join(r["message"] for r in verdict.reasons),
                        "codes": ["output_fails_rule"] + verdict.codes}
            problem = frames_problem(plan, after)
            if problem:
                return {"reason": problem, "codes": ["frames_changed"], "frames_in": plan.frames_in,
                        "frames_out": after["frames"]}
            if spec.to == "webdataset" and os.path.getsize(tmp) > MAX_MEMBER_SIZE:  # its shard would fail for good
                return {"reason": f"{os.path.getsize(tmp)} bytes: more than a tar member holds (8 GiB, ustar); pack "
                                  "such videos with --to videos", "codes": ["too_big_for_tar"]}
            if transcoded:
                timing["frames_transcoded"] += after["frames"]
            digest = sha256_file(str(tmp))
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        return {"path": rel, "samples": 1, "bytes": after["bytes"], "sha256": digest, "source": entry["rel"],
                "label": entry["label"], "cls": entry["cls"], "key": entry["key"], "transcoded": transcoded,
                "remuxed": remuxed, "frames": after["frames"], "frames_in": plan.frames_in,
                "frames_out": after["frames"], "frame_timing": plan.mode, "fps": after["fps"],
                "duration_s": after["span_s"] or after["duration_s"],  # the video's, not the file's (longer audio)
                "width": after["width"], "height": after["height"], "codec": after["codec"],
                "pix_fmt": after["pix_fmt"], "max_gop_s": after["max_gop_s"]}

    def open_assembly(self, group: str) -> "VideoShardAssembly":
        return VideoShardAssembly(self, group)

    def _pack(self, stem: str, width: int, entries: list[dict]) -> dict | None:
        from repack.sinks.webdataset import TarShardWriter

        writer = TarShardWriter(self.out, stem)
        try:
            for e in entries:
                data = safe_join(self.out, e["path"]).read_bytes()
                ext = video_member(e["path"])
                members = [(ext, data)]
                if e["cls"] is not None:
                    members.append(("cls", b"%0*d" % (width, e["cls"])))
                members.append(("json", json.dumps(e, sort_keys=True).encode()))
                writer.add_sample(e["key"], members)
            return writer.commit()
        except BaseException:
            writer.abort()
            raise

    # -- manifest ----------------------------------------------------------------------------
    def finalize(self, plan: Plan, records: list[dict]) -> dict:
        spec = self.spec
        videos = [v for r in records for v in r["videos"]]
        probes = [p for r in records for p in r["probes"]]
        quarantine = list(plan.quarantine) + [q for r in records for q in r["quarantine"]]
        lines = b"".join(json.dumps(p, sort_keys=True).encode() + b"\n" for p in probes)
        atomic_write_bytes(self.out / "probe.jsonl", lines)
        files = {"probe": "probe.jsonl"}
        digests = {"probe": bytes_digest(lines)}
        if spec.transcode:
            listing = dali_file_list(videos)
            atomic_write_bytes(self.out / "file_list.txt", listing)  # paths are dali_safe (UTF-8)
            files["file_list"] = "file_list.txt"
            digests["file_list"] = bytes_digest(listing)
        decisions = {OK: 0, TRANSCODE: 0, REJECT: 0}
        reasons: dict[str, int] = {}
        for p in probes:
            decisions[p["decision"]] += 1
            for r in p["reasons"]:
                reasons[r["code"]] = reasons.get(r["code"], 0) + 1
        codecs: dict[str, int] = {}
        for p in probes:
            if p.get("codec"):
                codecs[p["codec"]] = codecs.get(p["codec"], 0) + 1
        if spec.to == "webdataset":
            shards = [r["shard"] for r in records if r.get("shard")]
            fields = {"video": "video/mp4 (or the original container when copied)", "json": "metadata"}
            if plan.info["labeled"]:
                fields["cls"] = "int"
        else:
            shards = videos
            fields = {"video": "file", "label": "class name", "cls": "int"}
        frames = sum(v["frames"] for v in videos)
        transcode_s = sum(r["timing"]["transcode_s"] for r in records)
        frames_tc = sum(r["timing"]["frames_transcoded"] for r in records)
        body = {
            "format": spec.to, "mode": spec.mode, "target": spec.target, "dali_reader": spec.dali_reader,
            "verify": spec.verify, "codec": plan.info.get("legacy_codec", LEGACY_CODEC),
            "fields": fields, "classes": plan.info["classes"], "shards": shards, "files": files,
            "file_digests": digests,
            "totals": {"inputs": plan.info["inputs"], "samples": sum(s["samples"] for s in shards),
                       "quarantined": len(quarantine), "bytes": sum(s["bytes"] for s in shards),
                       "skipped_junk": plan.info.get("skipped_junk", 0),  # hidden files, OS junk (as images')
                       "videos": len(videos), "frames": frames, "ok": decisions[OK],
                       "needs_transcode": decisions[TRANSCODE], "rejected": decisions[REJECT],
                       "transcoded": sum(1 for v in videos if v["transcoded"]),
                       "remuxed": sum(1 for v in videos if v["remuxed"]),
                       "copied": sum(1 for v in videos if not v["transcoded"] and not v["remuxed"])},
            "quarantine": quarantine,
            "stats": {"decisions": decisions, "reasons": dict(sorted(reasons.items())), "codecs": codecs},
            "run_stats": {"timing": {"probe_s": round(sum(r["timing"]["probe_s"] for r in records), 3),
                                     "decode_s": round(sum(r["timing"]["decode_s"] for r in records), 3),
                                     "transcode_s": round(transcode_s, 3),
                                     "transcode_fps": round(frames_tc / transcode_s, 1) if transcode_s else None}},
        }
        if spec.to == "webdataset":
            body["videos"] = videos
        return body

    def packed(self, manifest: dict) -> int:
        """Usable videos: prepared ones with --transcode, else the probed ones a GPU can take (as is or transcoded)."""
        t = manifest["totals"]
        return t["videos"] if self.spec.transcode else t["ok"] + t["needs_transcode"]

    def strict_problem(self, manifest: dict) -> str | None:
        """Any quarantined input; in a probe-only run also any video that needs transcoding."""
        problems = [super().strict_problem(manifest)]
        if not self.spec.transcode and manifest["totals"]["needs_transcode"]:
            problems.append(f"{manifest['totals']['needs_transcode']} video(s) need transcoding (see probe.jsonl)")
        return "; ".join(p for p in problems if p) or None

    def summary_lines(self, manifest: dict) -> list[str]:
        t, stats = manifest["totals"], manifest["stats"]
        lines = [f"{t['inputs']} input(s) probed for target {manifest['target']} and DALI reader "
                 f"{manifest['dali_reader']}: {t['ok']} GPU-decodable as is, "
                 f"{t['needs_transcode']} need transcoding, {t['rejected']} rejected"]
        if manifest["mode"] == "transcode":
            fps = manifest.get("run", {}).get("timing", {}).get("transcode_fps")
            lines.append(f"{t['videos']} usable video(s), {t['frames']} frames: {t['transcoded']} transcoded"
                         f"{f' ({fps} frames/s)' if fps else ''}, {t['remuxed']} remuxed (faststart), "
                         f"{t['copied']} copied; {t['quarantined']} quarantined")
        lines.append(f"  {'reason':<24}{'videos':>7}")
        lines += [f"  {code:<24}{n:>7}" for code, n in sorted(stats["reasons"].items(), key=lambda kv: (-kv[1], kv[0]))]
        return lines + quarantine_lines(manifest["quarantine"], counts=False)

"""Probe a video file: container, streams and a packet scan of the main video stream, without decoding.

Two tools give the same JSON shape (format, streams, packets), turned into one flat record by
``summarize``: PyAV in-process (``repack.transforms.probe_pyav``, 9-57x faster per CPU-second:
no process start, no JSON text) where it gives every field the NVDEC/DALI decision needs, else
one ffprobe subprocess (``ffprobe_probe``). ``probe_file`` picks; the record's ``probe_tool``
says which ran (and ``probe_fallback`` why not PyAV). probe_pyav's docstring lists where ffprobe is used instead (libavformat
errors, AVI, a rotation PyAV cannot read).

Both read only the file (repack.transforms.ffmpeg_cli: file protocol, allow-listed
single-file containers); a refused container (an HLS playlist, a concat list, ...) gives a
record with ``error_code`` ``format_refused`` naming the demuxer. For MP4/MOV,
``moov_after_mdat`` tells whether the index follows the media (a copy is then remuxed with
faststart); ``packets_before_key`` counts the packets before the first keyframe (no decoder can
output them).

From the packets of the first video stream we derive what the header fields cannot be
trusted for: keyframe spacing (GOP), B-frame reordering, timestamp regularity (VFR), missing
timestamps, whether the first packet is a keyframe, and truncation (packets past the end of
the file, fewer packets than the container declares, or a packet span shorter than the
Matroska/WebM header's duration). ``duration_s`` is the container's declared duration (the
packet span only when none is declared); ``span_s`` is what the packets cover.

``probe_file`` returns a flat, JSON-able record; an unreadable file gives a record with
``error`` set.
"""

from __future__ import annotations

import os
import re
import statistics
from fractions import Fraction

from repack.transforms.container_facts import moov_after_mdat



def _rate(text: str | None) -> float | None:
    try:
        value = Fraction(text) if text else None
    except (ValueError, ZeroDivisionError):
        return None
    return float(value) if value else None


def bit_depth(pix_fmt: str | None, raw_bits: str | int | None = None) -> int | None:
    """Bits per component of ``pix_fmt`` ('yuv420p10le' -> 10, 'p010le' -> 10, 'yuv420p' -> 8)."""
    if not pix_fmt:
        return None
    match = re.search(r"p(\d{2})(le|be)?$", pix_fmt) or re.match(r"p0(\d{2})", pix_fmt)
    if match:
        return int(match.group(1))
    if raw_bits and str(raw_bits).isdigit():
        return int(raw_bits)
    return 8


def chroma(pix_fmt: str | None) -> str | None:
    """Chroma subsampling of ``pix_fmt``: '420', '422', '444', '440', '411', '400' or 'rgb'."""
    if not pix_fmt:
        return None
    match = re.match(r"(?:yuvj?|yuva)(4\d\d)", pix_fmt)
    if match:
        return match.group(1)
    if pix_fmt.startswith(("nv12", "nv21", "p010", "p016", "p012")):
        return "420"
    if pix_fmt.startswith(("nv16", "p210", "p216")):
        return "422"
    if pix_fmt.startswith("gray"):
        return "400"
    if pix_fmt.startswith(("rgb", "bgr", "gbr", "argb", "abgr", "rgba", "bgra", "0rgb", "rgb0", "pal8")):
        return "rgb"
    return pix_fmt


def rotation(stream: dict) -> int:
    """Display rotation in degrees (0, 90, 180, 270) from the display matrix or the rotate tag."""
    degrees = 0.0
    for side in stream.get("side_data_list") or ():
        if "rotation" in side:
            degrees = float(side["rotation"])
    if not degrees and (stream.get("tags") or {}).get("rotate"):
        degrees = float(stream["tags"]["rotate"])
    return int(round(degrees)) % 360


def mirrored(stream: dict) -> bool:
    """Whether the stream's display matrix mirrors the picture (see ``container_facts.is_mirror``): from
    ffprobe's printed matrix, or the flag the PyAV probe sets."""
    for side in stream.get("side_data_list") or ():
        if "mirrored" in side:
            return bool(side["mirrored"])
        text = side.get("displaymatrix")
        if isinstance(text, str):
            values = [int(v) for line in text.strip().splitlines() for v in line.split(":", 1)[-1].split()]
            if len(values) == 9:
                return values[0] * values[4] - values[1] * values[3] < 0
    return False


def packet_stats(packets: list[dict], time_base: Fraction, file_size: int) -> dict:
    """GOP, B-frame, timestamp and truncation facts from one stream's packets (decode order). A packet the
    decoder drops (flag D: before an MP4 edit list's start) is no frame: left out of the frame and timestamp
    counts (its keyframe still starts the GOP the kept frames decode from); a corrupt one (flag C: a cut
    fragment) is counted as damage."""
    truncated_packets = sum(1 for p in packets if p.get("pos") is not None and p.get("size") is not None
                            and int(p["pos"]) + int(p["size"]) > file_size)
    # the evidence of a cut where no packet points past the end (a fragment's last one, read short: PyAV
    # flags it, ffprobe's packet list does not)
    corrupt_packets = sum(1 for p in packets if "C" in (p.get("flags") or ""))
    dropped = ["D" in (p.get("flags") or "") for p in packets]
    all_keys = [i for i, p in enumerate(packets) if "K" in (p.get("flags") or "")]
    first_key = all_keys[0] if all_keys else len(packets)
    before_key = first_key - sum(dropped[:first_key])  # frames output before a keyframe: none decodes
    leading = 0  # after the first keyframe in decode order, shown before it: an open GOP's leading pictures
    if all_keys and packets[first_key].get("pts") is not None:
        key_pts = int(packets[first_key]["pts"])
        leading = sum(1 for p, gone in zip(packets[first_key + 1:all_keys[1] if len(all_keys) > 1 else None],
                                           dropped[first_key + 1:])
                      if not gone and p.get("pts") is not None and int(p["pts"]) < key_pts)
    all_packets, packets = packets, [p for p, gone in zip(packets, dropped) if not gone]
    n = len(packets)
    pts = [p.get("pts") for p in packets]
    missing_pts = sum(1 for v in pts if v is None)
    keys = [i for i, p in enumerate(packets) if "K" in (p.get("flags") or "")]
    reordered = False
    highest = None
    for v in pts:
        if v is None:
            continue
        if highest is not None and v < highest:
            reordered = True
            break
        highest = v if highest is None else max(highest, v)
    stats = {"packets": n, "discarded_packets": len(all_packets) - n, "corrupt_packets": corrupt_packets,
             "keyframes": len(keys), "first_packet_key": first_key == 0 and bool(all_keys),
             "packets_before_key": before_key, "leading_packets": leading,
             "missing_pts": missing_pts, "b_frames": reordered, "packets_past_eof": truncated_packets,
             "max_gop_frames": None, "max_gop_s": None, "frame_interval_s": None, "irregular_intervals": 0,
             "span_s": None, "fps_measured": None, "first_pts_s": None, "grid_drift_frames": 0.0}
    present = sorted(int(v) for v in pts if v is not None)
    if len(present) >= 2:
        deltas = [b - a for a, b in zip(present, present[1:])]
        median = statistics.median(deltas)
        tolerance = max(1.5, 0.2 * median)
        stats["irregular_intervals"] = sum(1 for d in deltas if abs(d - median) > tolerance)
        stats["frame_interval_s"] = round(float(median * time_base), 6)
        span = (present[-1] - present[0] + median) * time_base
        stats["span_s"] = round(float(span), 6)
        stats["first_pts_s"] = round(float(present[0] * time_base), 6)  # where the span starts (not always 0)
        stats["fps_measured"] = round(len(present) / float(span), 4) if span > 0 else None
        if median > 0 and len(present) > 2:  # how far the frames stray from one constant rate over the stream
            step = (present[-1] - present[0]) / (len(present) - 1)  # (a rate change within 20%: no odd interval)
            stray = max(abs(v - present[0] - i * step) for i, v in enumerate(present))
            stats["grid_drift_frames"] = round(stray / step, 3) if step > 0 else 0.0
        if keys:
            key_pts = sorted(int(packets[i]["pts"]) for i in keys if packets[i].get("pts") is not None)
            bounds = key_pts + [present[-1] + median]
            gaps = [b - a for a, b in zip(bounds, bounds[1:])]
            if gaps:
                stats["max_gop_s"] = round(float(max(gaps) * time_base), 6)
    if keys:
        bounds = keys + [n]
        stats["max_gop_frames"] = max(b - a for a, b in zip(bounds, bounds[1:]))
    return stats


def summarize(data: dict, path: str) -> dict:
    """Turn ffprobe's JSON (streams, format, packets) into the flat probe record."""
    fmt = data.get("format") or {}
    streams = data.get("streams") or []
    videos = [s for s in streams if s.get("codec_type") == "video"]
    record = {"container": fmt.get("format_name"), "bytes": os.path.getsize(path),
              "duration_s": _float(fmt.get("duration")), "bit_rate": _int(fmt.get("bit_rate")),
              "video_streams": [{"index": s["index"], "codec": s.get("codec_name"), "width": s.get("width"),
                                 "height": s.get("height"),
                                 "attached_pic": bool((s.get("disposition") or {}).get("attached_pic"))}
                                for s in videos],
              "audio_streams": sum(1 for s in streams if s.get("codec_type") == "audio"),
              "other_streams": sum(1 for s in streams if s.get("codec_type") not in ("video", "audio")),
              "error": None}
    main = next((s for s in videos if not (s.get("disposition") or {}).get("attached_pic")), None)
    if main is None:
        return record
    pix_fmt = main.get("pix_fmt")
    time_base = Fraction(main.get("time_base") or "1/1")
    packets = [p for p in data.get("packets") or () if p.get("stream_index") == main["index"]]
    record.update({
        "stream_index": main["index"], "codec": main.get("codec_name"), "profile": main.get("profile"),
        "pix_fmt": pix_fmt, "bit_depth": bit_depth(pix_fmt, main.get("bits_per_raw_sample")),
        "chroma": chroma(pix_fmt), "width": main.get("width"), "height": main.get("height"),
        "sar": main.get("sample_aspect_ratio"), "field_order": main.get("field_order") or "unknown",
        "rotation": rotation(main), "mirrored": mirrored(main), "r_frame_rate": _rate(main.get("r_frame_rate")),
        "avg_frame_rate": _rate(main.get("avg_frame_rate")), "time_base": str(time_base),
        "nb_frames": _int(main.get("nb_frames")), "stream_duration_s": _float(main.get("duration")),
        "has_b_frames": _int(main.get("has_b_frames")),
    })
    record.update(packet_stats(packets, time_base, record["bytes"]))
    record["frames"] = record["packets"]
    fps = record["fps_measured"] or record["avg_frame_rate"] or record["r_frame_rate"]
    record["fps"] = round(fps, 4) if fps else None
    record["declared_duration_s"] = declared_duration(record["container"], main, record)
    if record["duration_s"] is None:
        record["duration_s"] = record["span_s"]
    return record


def _clock(text) -> float | None:
    """Seconds of a Matroska ``DURATION`` tag ('00:00:02.003000000')."""
    try:
        h, m, sec = str(text).split(":")
        return round(int(h) * 3600 + int(m) * 60 + float(sec), 6)
    except (TypeError, ValueError):
        return None


def declared_duration(container: str | None, stream: dict, record: dict) -> float | None:
    """The video stream's duration as the container header declares it, for the truncation check.

    Only Matroska/WebM, whose header (written when the file is finalized) survives a cut tail:
    the stream's ``DURATION`` tag, else the segment duration when the file has no other stream
    (an audio track may be longer than the video). None elsewhere (MP4 and friends are checked
    through packets past the end of the file and the declared frame count)."""
    if "matroska" not in (container or "") and "webm" not in (container or ""):
        return None
    tags = {k.upper(): v for k, v in (stream.get("tags") or {}).items()}
    value = _clock(tags.get("DURATION"))
    if value is None and not record.get("audio_streams") and not record.get("other_streams") \
            and len(record.get("video_streams") or ()) == 1:
        value = record.get("duration_s")
    return value


def _float(text) -> float | None:
    try:
        return round(float(text), 6)
    except (TypeError, ValueError):
        return None


def _int(text) -> int | None:
    try:
        return int(text)
    except (TypeError, ValueError):
        return None


def probe_file(path: str, ffprobe: str = "ffprobe", timeout: float | None = None) -> dict:
    """Probe ``path`` in-process with PyAV where it gives every field, else with one ffprobe run.

    Never raises for bad input; ``probe_tool`` in the record names the tool that ran, and
    ``probe_fallback`` why ffprobe ran instead of PyAV."""
    try:
        from repack.transforms.probe_pyav import demux
    except ImportError:  # PyAV missing: every file goes to ffprobe
        demux = None
    data = demux(path, timeout) if demux and os.path.isfile(path) and os.path.getsize(path) else None
    if not isinstance(data, dict):
        why = data or ("PyAV is not installed" if demux is None else "empty or not a file")
        return {**ffprobe_probe(path, ffprobe, timeout), "probe_tool": "ffprobe", "probe_fallback": why}
    return {**_with_layout(summarize(data, path), path), "probe_tool": "pyav"}


def _with_layout(record: dict, path: str) -> dict:
    """``record`` plus ``moov_after_mdat`` (MP4/MOV only; False elsewhere)."""
    record["moov_after_mdat"] = "mov" in (record.get("container") or "").split(",") and moov_after_mdat(path)
    return record


def ffprobe_probe(path: str, ffprobe: str = "ffprobe", timeout: float | None = None) -> dict:
    """Probe ``path`` with one ffprobe run (streams, format, video packets); never raises for bad input.

    ffprobe reads only ``path`` (repack.transforms.ffmpeg_cli: file protocol, allow-listed
    containers; a refused container gives ``error_code`` ``format_refused``) and dies with
    its worker (PR_SET_PDEATHSIG)."""
    import json

    from repack.transforms.ffmpeg_cli import ffprobe_args, refusal_message, run

    try:
        size = os.path.getsize(path)
    except OSError as exc:
        return {"error": f"unreadable: {exc.strerror}", "error_code": "probe_failed", "bytes": None}
    if size == 0:
        return {"error": "empty file (0 bytes)", "error_code": "empty", "bytes": 0}
    # ffmpeg-python models ffmpeg graphs only; for ffprobe it has ``ffmpeg.probe`` (format and
    # streams, run by its own Popen). The packet scan (``-show_entries packet=...``) cannot be
    # expressed as a graph: it goes through the same keyword converter ``ffmpeg.probe`` uses,
    # and the run is ours (PR_SET_PDEATHSIG, timeout).
    result = run(ffprobe_args(path, ffprobe, show_entries="packet=stream_index,pts,dts,flags,pos,size"), timeout)
    demuxer = result.refused_format()
    if demuxer:
        return {"error": refusal_message(demuxer), "error_code": "format_refused", "bytes": size,
                "container": demuxer}
    if result.returncode != 0:
        return {"error": f"ffprobe: {result.error_line(path)}", "error_code": "probe_failed", "bytes": size}
    try:
        data = json.loads(result.stdout.decode("utf-8", errors="replace"))
    except ValueError as exc:
        return {"error": f"ffprobe: unreadable JSON: {exc}", "error_code": "probe_failed", "bytes": size}
    return _with_layout(summarize(data, path), path)


def probe_codec(path: str, ffprobe: str = "ffprobe", timeout: float | None = 60.0) -> str | None:
    """The codec of ``path``'s main video stream (the one ``probe_file`` judges) from the container
    header only (no packet scan), or None when it has none or cannot be read; confined as
    ``probe_file``: PyAV in-process, ffprobe where PyAV cannot open the file. Used to choose a
    dataset's one codec before the per-file probes."""
    try:
        from repack.transforms.probe_pyav import header_codec
    except ImportError:
        header_codec = None
    codec = header_codec(path) if header_codec and os.path.isfile(path) and os.path.getsize(path) else None
    if codec is not None:
        return codec or None  # "": a picture, no video
    import json

    from repack.transforms.ffmpeg_cli import ffprobe_args, run

    result = run(ffprobe_args(path, ffprobe), timeout)
    if result.returncode != 0:
        return None
    try:
        streams = json.loads(result.stdout.decode("utf-8", errors="replace")).get("streams") or []
    except ValueError:
        return None
    main = next((s for s in streams if s.get("codec_type") == "video"
                 and not (s.get("disposition") or {}).get("attached_pic")), None)
    return main.get("codec_name") if main else None

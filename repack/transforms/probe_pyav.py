"""The in-process probe: PyAV (libavformat in this process) demuxes the file and yields the
same JSON shape ffprobe prints (format, streams, video packets), which
``repack.transforms.probe.summarize`` turns into the probe record.

Confinement is ffprobe's: the input is opened as ``file:<absolute path>`` with the same
``protocol_whitelist`` and ``format_whitelist`` (repack.transforms.ffmpeg_cli), so a playlist
or reference container is refused before it opens anything else.

PyAV does not give every field the NVDEC/DALI decision needs, or gives it differently from
the ffprobe the rule was built on. ``demux`` then returns ``None`` with the reason, and the
caller runs ffprobe (``repack.transforms.probe.probe_file``):

- any libavformat error (refused container, truncated index, unreadable data): ffprobe's
  error text and ``format_refused`` detection are the quarantine reasons;
- AVI: AVI stores no timestamps; the packet parser in PyAV's libavformat (8.x) derives them
  for packed MPEG-4 B-frames where ffprobe reports them missing (the ``missing_timestamps``
  fact), so the packet facts would differ;
- rotation that PyAV does not expose (it has no reader of a stream's display matrix): read
  from the MP4/MOV track headers here (``container_facts.mp4_rotations``); a Matroska/WebM
  file with a ``Projection`` element, or a header that cannot be walked, goes to ffprobe.
"""

from __future__ import annotations

from repack.transforms import container_facts
from repack.transforms.ffmpeg_cli import SAFE_INPUT_OPTIONS, file_url

FIELD_ORDERS = {0: "unknown", 1: "progressive", 2: "tt", 3: "bb", 4: "tb", 5: "bt"}  # AVFieldOrder
FALLBACK_CONTAINERS = ("avi",)
# elementary streams without a container's timestamps: PyAV's base rate of a raw H.264 stream is its field rate
# (50 for 25 fps), where ffprobe declares the frame rate; their rate and frame count are ffprobe's
RAW_STREAMS = ("h264", "hevc", "mpegvideo", "m4v", "vc1", "obu", "cavsvideo", "dirac")


class Fallback(Exception):
    """PyAV cannot give a field the decision needs; ``str(exc)`` says which and why."""


def _video_stream(s, av) -> dict:
    cc = s.codec_context
    sar = s.sample_aspect_ratio or cc.sample_aspect_ratio
    duration = s.duration * s.time_base if s.duration is not None and s.time_base else None
    return {"codec_name": getattr(cc.codec, "canonical_name", cc.name), "profile": cc.profile,
            "pix_fmt": cc.format.name if cc.format else None, "width": cc.width, "height": cc.height,
            "sample_aspect_ratio": f"{sar.numerator}:{sar.denominator}" if sar else None,
            "field_order": FIELD_ORDERS.get(cc.field_order, "unknown"),
            "r_frame_rate": str(s.base_rate) if s.base_rate else None,
            "avg_frame_rate": str(s.average_rate) if s.average_rate else None,
            "nb_frames": s.frames or None, "duration": float(duration) if duration is not None else None,
            "has_b_frames": getattr(cc, "reorder_depth", int(bool(cc.has_b_frames))),
            "disposition": {"attached_pic": int(bool(s.disposition & av.stream.Disposition.attached_pic))}}


def _rotation_side_data(path: str, container_name: str, stream) -> list[dict]:
    """ffprobe's ``side_data_list`` rotation entry for ``stream`` (empty when unrotated)."""
    families = container_name.split(",")
    if "mov" in families or "mp4" in families:
        orientations = container_facts.mp4_orientations(path)
        if orientations is None or stream.id not in orientations:
            raise Fallback("MP4/MOV track header not readable for the display rotation")
        degrees, mirrored = orientations[stream.id]
        if mirrored:
            return [{"rotation": degrees, "mirrored": True}]
    elif "matroska" in families or "webm" in families:
        projection = container_facts.matroska_has_projection(path)
        if projection is not False:
            raise Fallback("Matroska header with a Projection element (or not walkable): rotation via ffprobe")
        degrees = 0
    else:
        degrees = 0  # libavformat stores a display rotation only for MP4/MOV and Matroska
    return [{"rotation": degrees}] if degrees else []


def demux(path: str, timeout: float | None = None) -> dict | str:
    """ffprobe-shaped JSON (``format``, ``streams``, ``packets``) for ``path``, or the reason to fall back."""
    import av

    try:
        with av.open(file_url(path), options=dict(SAFE_INPUT_OPTIONS), metadata_errors="ignore",
                     timeout=timeout) as container:
            name = container.format.name
            if any(family in FALLBACK_CONTAINERS for family in name.split(",")):
                return f"container {name!r}: timestamps derived differently from ffprobe"
            if any(family in RAW_STREAMS for family in name.split(",")):
                return f"raw {name!r} stream: no container timestamps, the declared rate is ffprobe's"
            streams = []
            for s in container.streams:
                entry = {"index": s.index, "codec_type": s.type, "time_base": str(s.time_base or "1/1"),
                         "tags": dict(s.metadata)}
                if s.type == "video":
                    entry.update(_video_stream(s, av))
                streams.append(entry)
            main = next((s for s in container.streams.video
                         if not s.disposition & av.stream.Disposition.attached_pic), None)
            packets = []
            if main is not None:
                streams[main.index]["side_data_list"] = _rotation_side_data(path, name, main)
                # ffprobe's flags: K a keyframe, D a packet the decoder drops (an edit list), C a corrupt one
                packets = [{"stream_index": main.index, "pts": p.pts, "dts": p.dts,
                            "flags": ("K" if p.is_keyframe else "_") + ("D" if p.is_discard else "_")
                            + ("C" if p.is_corrupt else "_"), "pos": p.pos, "size": p.size}
                           for p in container.demux(main) if p.size]
            fmt = {"format_name": name, "duration": container.duration / 1e6 if container.duration else None,
                   "bit_rate": container.bit_rate or None}
    except Fallback as exc:
        return str(exc)
    except (av.error.FFmpegError, OSError, ValueError) as exc:  # the path out: probe.jsonl stays relative
        return "pyav: " + str(exc).replace(file_url(path), "<file>").replace(path, "<file>")
    return {"format": fmt, "streams": streams, "packets": packets}


def count_frames(path: str) -> int | None:
    """The frames ``probe``'s record counts for ``path`` (its main video stream's packets the decoder keeps),
    counted without a record per packet (``repack verify``); None where the probe would not trust PyAV (the
    caller probes then) or PyAV cannot open the file."""
    import av

    try:
        with av.open(file_url(path), options=dict(SAFE_INPUT_OPTIONS), metadata_errors="ignore") as container:
            families = container.format.name.split(",")
            if any(family in FALLBACK_CONTAINERS or family in RAW_STREAMS for family in families):
                return None
            main = next((s for s in container.streams.video
                         if not s.disposition & av.stream.Disposition.attached_pic), None)
            return 0 if main is None else sum(1 for p in container.demux(main) if p.size and not p.is_discard)
    except (av.error.FFmpegError, OSError, ValueError):
        return None


IMAGE_CONTAINERS = ("image2", "gif", "apng")  # and every "*_pipe" demuxer: a picture (or a GIF), not a video


def is_image_container(name: str) -> bool:
    """Whether a libavformat demuxer name (``container.format.name``) is a picture's (a JPEG named .mp4)."""
    return any(family in IMAGE_CONTAINERS or family.endswith("_pipe") for family in name.split(","))


def header_codec(path: str) -> str | None:
    """The codec of the main video stream (the one the probe judges) from the container header
    only, no packets read; None when PyAV cannot open the file or it has no such stream; "" for a picture
    or a GIF (``is_image_container``): no video of the dataset, whose one codec it must not choose."""
    import av

    try:
        with av.open(file_url(path), options=dict(SAFE_INPUT_OPTIONS), metadata_errors="ignore") as container:
            if is_image_container(container.format.name):
                return ""
            main = next((s for s in container.streams.video
                         if not s.disposition & av.stream.Disposition.attached_pic), None)
            return getattr(main.codec_context.codec, "canonical_name", main.codec_context.name) if main else None
    except (av.error.FFmpegError, OSError, ValueError):
        return None

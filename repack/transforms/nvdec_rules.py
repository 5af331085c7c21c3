"""The decoder-support rule: can NVDEC, as driven by one of DALI's video readers, decode this
video correctly and fast on the chosen GPU?

``decide(info, target, max_gop_s, max_height, reader)`` takes a probe record
(repack.transforms.probe) and returns a ``Decision``: ``ok`` (use as is), ``transcode``
(re-encode with the DALI-friendly recipe) or ``reject`` (quarantine: not a usable video), with
every reason spelled out. Non-blocking observations (B-frames, ignored audio, moov at the end,
non-square pixels) are ``notes``. User limits: a keyframe gap above ``max_gop_s``
(``long_gop``) or a displayed height above ``max_height`` (``too_tall``) means transcode.
``reader`` is the DALI reader the videos are judged for (``DALI_READERS``): ``legacy``
(the default) = ``fn.readers.video``, which reads one codec per reader, so a dataset for it must
be one codec: the *dataset codec* (``legacy_codec``, chosen once per job by
``dataset_codec``). The one-codec rule: when every input's video stream has the same codec C,
the target's NVDEC decodes C and repack has a transcode recipe for C (``ENCODABLE``: H.264 and
HEVC), C is the dataset codec, so an all-HEVC folder keeps its HEVC files and transcodes only
those that fail another check, to HEVC; otherwise (mixed codecs, or one codec repack cannot
encode to) the dataset codec is H.264 and every other codec is transcoded to H.264
(``legacy_one_codec``). It is the default reader because it reads 4-12x faster than the other
(transcode once offline, read fast every epoch). ``experimental`` = ``fn.experimental.readers.video`` / ``fn.experimental.decoders.video``
reads a dataset of mixed codecs as is (no transcode), at that read cost.
pipelines.dali_video reads with the reader the manifest names. Reject: decoder errors
found by ``--verify decode`` (``decode_errors`` in the record); a refused container
(``format_refused``); truncated: packets past the end of the file, fewer packets than the
declared frame count, or (Matroska/WebM) a packet span short of the header's duration by more
than one frame and 5 %.

Facts (NVDEC as measured on an H200; A100/H100/H200 share the NVDEC column; L4/L40 are Ada):

- H.264: 8-bit 4:2:0 only (no High 10, 4:2:2, 4:4:4), 48x16 .. 4096x4096.
- HEVC: 4:2:0 at 8/10/12-bit, 144x144 .. 8192x8192; 4:4:4 decodes but DALI cannot output it.
- VP9: profiles 0 and 2 (8/10/12-bit 4:2:0), at least 128x128.
- VP8, MPEG-4 Part 2, MJPEG: supported (8-bit 4:2:0 taken as the safe set) by the legacy
  reader; DALI's newer GPU decoder (the experimental reader) fails to create an NVDEC decoder
  for MJPEG on the H200, so MJPEG is transcoded for it.
- The legacy reader creates one NVDEC decoder per reader for the codec of the first file it
  opens and fails on a file of another codec ("... is not the same codec as previous files",
  seen on the H200 with H.264 and HEVC outputs in one dataset); every file decodes alone. It
  has no AV1 path at all ("Unhandled codec"). The experimental reader read a mix of H.264,
  HEVC (8- and 10-bit), VP8, VP9 and MPEG-4 Part 2 in one pass, but slowly: random 16-frame
  H.264 clips (640x360, pipelines.dali_video) ran at 11.4 clips/s against the legacy reader's
  139.5 with a 1 s GOP, and 9.3 against 35.4 with a 250-frame GOP.
- AV1: not on A100/H100/H200 (no AV1 in their NVDEC); yes on Ada (L4, L40, L40S) and A10.
- DALI's reader ignores rotation metadata, decodes frames not fields (interlaced), needs even
  dimensions and constant frame rate, picks the largest video stream (not the first), and
  seeks to keyframes: a first packet that is not a keyframe breaks seeking, and seeking cost
  grows with the keyframe gap (16-frame random clips ran 4x faster with a 1 s GOP than with
  250 frames on the H200).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from repack.errors import UsageError


@dataclass(frozen=True)
class CodecLimits:
    """What one NVDEC + DALI combination decodes for one codec."""

    label: str
    bit_depths: frozenset
    chroma: frozenset
    min_size: tuple[int, int]
    max_size: tuple[int, int]
    bad_profiles: tuple[str, ...] = ()  # substrings of ffprobe profile names NVDEC refuses
    chroma_note: str = ""


H264 = CodecLimits("H.264", frozenset({8}), frozenset({"420"}), (48, 16), (4096, 4096),
                   ("High 10", "High 4:2:2", "High 4:4:4", "Extended"))
HEVC = CodecLimits("HEVC", frozenset({8, 10, 12}), frozenset({"420"}), (144, 144), (8192, 8192),
                   chroma_note="4:4:4 HEVC decodes on NVDEC but DALI cannot output it")
VP9 = CodecLimits("VP9", frozenset({8, 10, 12}), frozenset({"420"}), (128, 128), (8192, 8192))
VP8 = CodecLimits("VP8", frozenset({8}), frozenset({"420"}), (48, 16), (4096, 4096))
MPEG4 = CodecLimits("MPEG-4 Part 2", frozenset({8}), frozenset({"420"}), (48, 16), (2032, 2032),
                    ("Simple Studio",))
MJPEG = CodecLimits("MJPEG", frozenset({8}), frozenset({"420"}), (64, 64), (16384, 16384),
                    chroma_note="only 4:2:0 MJPEG is verified through DALI; other chroma is transcoded")
AV1 = CodecLimits("AV1", frozenset({8, 10}), frozenset({"420"}), (128, 128), (8192, 8192))

_BASE = {"h264": H264, "hevc": HEVC, "vp9": VP9, "vp8": VP8, "mpeg4": MPEG4, "mjpeg": MJPEG}


@dataclass(frozen=True)
class Target:
    """A GPU model: its architecture and the codecs its NVDEC + DALI decode."""

    name: str
    arch: str
    codecs: dict = field(default_factory=dict)


TARGETS: dict[str, Target] = {
    "h100": Target("h100", "Hopper", dict(_BASE)),
    "h200": Target("h200", "Hopper", dict(_BASE)),
    "a100": Target("a100", "Ampere GA100", dict(_BASE)),
    "a10": Target("a10", "Ampere GA102", {**_BASE, "av1": AV1}),
    "l4": Target("l4", "Ada", {**_BASE, "av1": AV1}),
    "l40": Target("l40", "Ada", {**_BASE, "av1": AV1}),
    "l40s": Target("l40s", "Ada", {**_BASE, "av1": AV1}),
}
DEFAULT_TARGET = "h100"
HEADER_DRIFT_FRAMES = 0.5  # a header rate whose frame times drift this far from the packets' by the end is wrong
VFR_DRIFT_FRAMES = 0.45  # frames this far off one constant rate: a reader placing frames by it takes another one


def is_vfr(info: dict) -> bool:
    """The stream has no one frame rate: some intervals differ from the usual one, or its frames stray from
    the constant rate of its span (a 25 fps stretch then a 30 fps one: each interval within 20 % of the median)."""
    return bool(info.get("irregular_intervals")) or (info.get("grid_drift_frames") or 0) >= VFR_DRIFT_FRAMES


def undecodable_leading(info: dict) -> int:
    """Packets of an H.264 stream's first GOP shown before its keyframe (an open GOP cut at its start): they
    reference pictures the file does not hold, so no decoder outputs them. Another codec's may decode (HEVC's
    RADL pictures do): not counted."""
    return int(info.get("leading_packets") or 0) if info.get("codec") == "h264" else 0
# The DALI video readers the rule knows; the manifest records which one the decisions were made
# for, and pipelines.dali_video reads with that one by default (legacy for manifests without it).
DALI_READERS = {"legacy": "fn.readers.video", "experimental": "fn.experimental.readers.video"}
DEFAULT_DALI_READER = "legacy"  # the fast reader: see the module docstring
LEGACY_CODEC = "h264"  # the legacy reader's dataset codec unless every input shares another one (dataset_codec)
# codecs repack's transcode recipe can write (repack.transforms.transcode): a dataset codec must be one of them,
# so that a video of that codec which fails another check can be transcoded without adding a second codec
ENCODABLE = ("h264", "hevc")
REJECT, TRANSCODE, OK = "reject", "transcode", "ok"
CODEC_NAMES = {"av1": "AV1", "mpeg2video": "MPEG-2", "mpeg1video": "MPEG-1", "vc1": "VC-1", "wmv3": "WMV9",
               "prores": "ProRes", "dnxhd": "DNxHD", "gif": "GIF", "rawvideo": "raw video", "theora": "Theora"}


def get_target(name: str) -> Target:
    """The target ``name`` (case-insensitive); UsageError for an unknown one."""
    key = name.lower()
    if key not in TARGETS:
        raise UsageError(f"unknown --target {name!r}; choose from {', '.join(sorted(TARGETS))}")
    return TARGETS[key]


@dataclass(frozen=True)
class Decision:
    """The verdict for one video on one target."""

    decision: str
    reasons: tuple = ()   # ({"code", "message"}, ...): why it cannot be used as is
    notes: tuple = ()     # ({"code", "message"}, ...): observations that do not block

    @property
    def codes(self) -> list[str]:
        return [r["code"] for r in self.reasons]

    def to_json(self) -> dict:
        return {"decision": self.decision, "reasons": list(self.reasons), "notes": list(self.notes)}


def _r(code: str, message: str) -> dict:
    return {"code": code, "message": message}


def get_reader(name: str) -> str:
    """The DALI reader ``name``; UsageError for an unknown one."""
    if name not in DALI_READERS:
        raise UsageError(f"unknown --dali-reader {name!r}; choose from {', '.join(DALI_READERS)}")
    return name


def dataset_codec(codecs, target: str | Target = DEFAULT_TARGET, reader: str = DEFAULT_DALI_READER,
                  encoders: tuple[str, ...] = ENCODABLE) -> str:
    """The one codec of a dataset read by ``reader`` (the one-codec rule, module docstring): the
    codec every input shares (``codecs``: the codec of each input's video stream, None for
    inputs without one, which are rejected anyway) when ``target`` decodes it and it is in
    ``encoders``; else H.264. Only the legacy reader needs one codec; for the others the answer
    is H.264, the codec of every transcode."""
    tgt = target if isinstance(target, Target) else get_target(target)
    found = {c for c in codecs if c}
    if reader == "legacy" and len(found) == 1:
        (codec,) = found
        if codec in tgt.codecs and codec in encoders:
            return codec
    return LEGACY_CODEC


def _reader_reason(reader: str, codec: str, label: str, legacy_codec: str = LEGACY_CODEC) -> dict | None:
    """Why ``reader`` cannot take a ``codec`` video that NVDEC decodes, or None."""
    if reader == "legacy" and codec != legacy_codec:
        name = _BASE[legacy_codec].label if legacy_codec in _BASE else legacy_codec
        return _r("legacy_one_codec", f"{label}: DALI's legacy fn.readers.video reads one codec per reader; "
                                      f"transcoded to {name}, the one codec of this dataset")
    if reader == "experimental" and codec == "mjpeg":
        return _r("codec", "DALI's experimental video reader (fn.experimental.readers.video, the new GPU decoder) "
                           "fails to create an NVDEC decoder for MJPEG")
    return None


def _reject(info: dict) -> list[dict]:
    if info.get("error"):
        return [_r(info.get("error_code") or "probe_failed", info["error"])]
    if info.get("decode_errors"):
        shown = "; ".join(info.get("decode_messages") or ())
        return [_r("decode_errors", f"{info['decode_errors']} decoder error(s) in a full decode "
                                    f"({info.get('decoded_frames')} of {info.get('packets')} packets decoded to "
                                    f"frames): {shown}")]
    container = info.get("container") or ""
    if container in ("image2", "gif") and (info.get("frames") or 0) <= 1 or container.endswith("_pipe"):
        return [_r("still_image", f"a still image ({container}), not a video")]
    if not info.get("video_streams"):
        kind = "audio only" if info.get("audio_streams") else "no streams"
        return [_r("no_video", f"no video stream ({kind})")]
    if info.get("codec") is None:
        return [_r("no_video", "only an attached picture (cover art), no video stream")]
    nb, packets = info.get("nb_frames"), info.get("packets") or 0
    if info.get("packets_past_eof"):
        return [_r("truncated", f"truncated: {info['packets_past_eof']} packet(s) point past the end of the file")]
    if nb and packets + (info.get("discarded_packets") or 0) < nb:
        return [_r("truncated", f"truncated: the container declares {nb} frames, only {packets} packets are readable")]
    declared, span = info.get("declared_duration_s"), info.get("span_s")
    if declared and span is not None:
        # the header's duration runs from time 0, the packets' span from the first one (a file starting at 1 s)
        end = span + max(info.get("first_pts_s") or 0.0, 0.0)
        tolerance = max(info.get("frame_interval_s") or 0.0, 0.05 * declared)
        if declared - end > tolerance + 1e-6:
            return [_r("truncated", f"truncated: the header declares {declared:.3f} s, the packets end at "
                                    f"{end:.3f} s")]
    if info.get("corrupt_packets"):  # (PyAV's scan flags it; ffprobe's packet list does not)
        return [_r("truncated", f"truncated or damaged: {info['corrupt_packets']} packet(s) flagged corrupt by the "
                                "demuxer (a cut fragment)")]
    if packets < 2:
        return [_r("too_few_frames", f"{packets} video packet(s): not a video")]
    return []


def sample_aspect(text: str | None) -> Fraction:
    """ffprobe's ``sample_aspect_ratio`` ('16:9') as a Fraction; 1 when absent, 0:1 or unreadable."""
    try:
        num, den = (int(x) for x in str(text).split(":"))
    except ValueError:
        return Fraction(1)
    return Fraction(num, den) if num > 0 and den > 0 else Fraction(1)


def decide(info: dict, target: str | Target = DEFAULT_TARGET, max_gop_s: float = 1.0,
           max_height: int | None = None, reader: str = DEFAULT_DALI_READER,
           legacy_codec: str = LEGACY_CODEC) -> Decision:
    """Apply the rule to one probe record; see the module docstring for the facts used.

    ``max_height`` (the user's ``--max-height``): a taller video (displayed height, rotation
    applied) needs transcoding (reason ``too_tall``) so the recipe scales it down. ``reader``:
    the DALI reader (a key of ``DALI_READERS``) the video must be read by; ``legacy_codec``: the
    dataset codec for the legacy reader (``dataset_codec``)."""
    tgt = target if isinstance(target, Target) else get_target(target)
    get_reader(reader)
    rejects = _reject(info)
    if rejects:
        return Decision(REJECT, tuple(rejects))
    reasons: list[dict] = []
    notes: list[dict] = []
    codec = info["codec"]
    limits = tgt.codecs.get(codec)
    w, h = info.get("width") or 0, info.get("height") or 0
    if limits is None:
        name = CODEC_NAMES.get(codec, codec)
        reasons.append(_r("codec", f"{name} is not decoded by NVDEC through DALI on {tgt.name} ({tgt.arch})"))
    else:
        unread = _reader_reason(reader, codec, limits.label, legacy_codec)
        if unread:
            reasons.append(unread)
        profile = info.get("profile") or ""
        bad = next((p for p in limits.bad_profiles if p.lower() in profile.lower()), None)
        if bad:
            reasons.append(_r("profile", f"{limits.label} profile {profile!r} is not supported by NVDEC"))
        depth = info.get("bit_depth")
        if depth not in limits.bit_depths:
            allowed = "/".join(str(d) for d in sorted(limits.bit_depths))
            reasons.append(_r("bit_depth", f"{limits.label} at {depth}-bit ({info.get('pix_fmt')}): NVDEC decodes "
                                           f"{limits.label} only at {allowed}-bit"))
        if info.get("chroma") not in limits.chroma:
            extra = f"; {limits.chroma_note}" if limits.chroma_note else ""
            reasons.append(_r("chroma", f"{limits.label} with {info.get('chroma')} chroma ({info.get('pix_fmt')}): "
                                        f"only 4:2:0 is decoded through DALI{extra}"))
        (min_w, min_h), (max_w, max_h) = limits.min_size, limits.max_size
        if w < min_w or h < min_h:
            reasons.append(_r("too_small", f"{w}x{h} is below NVDEC's {limits.label} minimum {min_w}x{min_h}"))
        if w > max_w or h > max_h:
            reasons.append(_r("too_large", f"{w}x{h} exceeds NVDEC's {limits.label} maximum {max_w}x{max_h}"))
    shown_h = w if info.get("rotation") in (90, 270) else h
    if max_height and shown_h > max_height:
        reasons.append(_r("too_tall", f"{shown_h} px tall (displayed) exceeds --max-height {max_height}"))
    if w % 2 or h % 2:
        reasons.append(_r("odd_size", f"odd dimensions {w}x{h}: NVDEC output surfaces need even width and height"))
    if info.get("field_order") not in ("progressive", "unknown", None):
        reasons.append(_r("interlaced", f"interlaced ({info['field_order']}): DALI returns frames, not "
                                        "deinterlaced fields"))
    if info.get("rotation"):
        reasons.append(_r("rotated", f"rotation {info['rotation']} degrees in the metadata: DALI ignores it "
                                     "and returns the frames unrotated"))
    if info.get("mirrored"):
        reasons.append(_r("mirrored", "the display matrix mirrors the picture: DALI ignores it and returns the "
                                      "frames unflipped"))
    playable = [s for s in info.get("video_streams") or () if not s.get("attached_pic")]
    if len(playable) > 1:
        largest = max(playable, key=lambda s: (s.get("width") or 0) * (s.get("height") or 0))
        reasons.append(_r("several_video_streams", f"{len(playable)} video streams: DALI picks the largest "
                                                   f"(#{largest['index']}, {largest.get('width')}x"
                                                   f"{largest.get('height')}), not the first"))
    if info.get("missing_pts"):
        reasons.append(_r("missing_timestamps", f"{info['missing_pts']} of {info['packets']} packets have no "
                                                "timestamp: frames cannot be located for seeking"))
    if info.get("irregular_intervals"):
        reasons.append(_r("vfr", f"variable frame rate: {info['irregular_intervals']} of {info['packets'] - 1} "
                                 f"frame intervals differ from the median {info.get('frame_interval_s')} s "
                                 "(DALI's reader supports constant frame rate only)"))
    elif is_vfr(info) and not info.get("missing_pts"):  # the spacing of some frames only: no rate to stray from
        reasons.append(_r("vfr", f"variable frame rate: the frames stray up to {info['grid_drift_frames']:g} frame(s) "
                                 "from one constant rate (the rate changes within the stream; DALI's reader supports "
                                 "constant frame rate only)"))
    if undecodable_leading(info):
        reasons.append(_r("open_gop_start", f"the first GOP is open: {undecodable_leading(info)} frame(s) shown before "
                                            "its keyframe reference pictures before the file's start; no decoder "
                                            "outputs them"))
    measured, header = info.get("fps_measured"), info.get("avg_frame_rate") or info.get("r_frame_rate")
    # wrong once frames placed by the header's rate drift half a frame by the file's end (a 25 fps MP4 whose last
    # sample lasts 5 frames says 24.8: 0.8 % off, and from frame ~60 on a reader took the frame 1-4 after);
    # compared in time, from the packets' span (fps_measured is rounded: an NTSC rate over hours would drift)
    frames, span = int(info.get("packets") or 0), info.get("span_s")
    drift = abs(frames / header - span) * header if header and span and frames else 0.0
    if measured and drift >= HEADER_DRIFT_FRAMES and not is_vfr(info) \
            and not info.get("missing_pts"):
        reasons.append(_r("rate_header_wrong", f"the header's frame rate {header:g} is not the packets' {measured:g} "
                                               "fps: a reader that places frames by the header's rate takes the "
                                               "wrong ones"))
    if not info.get("first_packet_key"):
        reasons.append(_r("first_not_keyframe", "the first video packet is not a keyframe: DALI cannot seek to "
                                                "the start"))
    gop = info.get("max_gop_s")  # a gap of one frame (every frame a keyframe, a clip slower than 1/--max-gop fps)
    if gop is not None and gop > max_gop_s + 1e-6 and (info.get("max_gop_frames") or 2) > 1:  # costs no seek
        reasons.append(_r("long_gop", f"keyframe gap up to {gop:.2f} s ({info.get('max_gop_frames')} frames) > "
                                      f"--max-gop {max_gop_s:g} s: every random clip decodes from the previous "
                                      "keyframe, so seeking cost grows with the gap"))
    if info.get("b_frames"):
        notes.append(_r("b_frames", "B-frames (reordered timestamps): fine for NVDEC, some extra decode latency"))
    if info.get("moov_after_mdat"):
        notes.append(_r("moov_at_end", "the MP4 index (moov) follows the media data: a copy is remuxed with "
                                       "+faststart (stream copy, no re-encode)"))
    if sample_aspect(info.get("sar")) != 1:  # as rotation: what DALI returns is not what a player shows
        reasons.append(_r("non_square_pixels", f"sample aspect ratio {info['sar']}: DALI returns the stored "
                                               "pixels, distorted; a transcode scales to square pixels (SAR 1:1)"))
    if info.get("audio_streams") or info.get("other_streams"):
        notes.append(_r("extra_streams", f"{info.get('audio_streams', 0)} audio and {info.get('other_streams', 0)} "
                                         "other stream(s), ignored by DALI"))
    r, avg = info.get("r_frame_rate"), info.get("avg_frame_rate")
    if r and avg and abs(r - avg) > 0.01 * r and not is_vfr(info) and not any(
            reason["code"] == "rate_header_wrong" for reason in reasons):
        notes.append(_r("rate_header_mismatch", f"r_frame_rate {r:g} != avg_frame_rate {avg:g}, but the packet "
                                                "timestamps are regular"))
    return Decision(TRANSCODE if reasons else OK, tuple(reasons), tuple(notes))

"""Tiny generated video clips (ffmpeg lavfi testsrc2) covering every branch of the NVDEC rule.

``CLIPS`` names each clip: its relative path (class folder/file), how to make it, and the
decision and reason codes the rule must give for target h100, per DALI reader
(``Clip.expected``). ``make_clips(root)`` writes them in parallel (ffmpeg does the work in
subprocesses; a thread pool is enough).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

SRC = "testsrc2=s={w}x{h}:r={r}:d={d}"


@dataclass(frozen=True)
class Clip:
    rel: str
    args: tuple[str, ...]            # ffmpeg args after the lavfi input ('' for special clips)
    decision: str                    # expected for target h100 and the experimental reader
    reasons: frozenset = field(default_factory=frozenset)
    size: tuple = (160, 120, 25, 1.0)  # w, h, fps (a number or 'num/den'), seconds
    special: str = ""                # empty | rotate | truncate | jpeg | audio | dual | hls | corrupt
    needs: str = ""                  # encoder that must exist, else the clip is skipped
    quarantined: str = ""            # the code when --transcode quarantines it after all (the frame check)
    legacy: tuple = ()               # (decision, reasons) for --dali-reader legacy (the default) where they differ

    def expected(self, reader: str = "legacy") -> tuple[str, frozenset]:
        """(decision, reason codes) the rule must give for target h100 and ``reader`` (default: the
        default --dali-reader)."""
        return self.legacy if reader == "legacy" and self.legacy else (self.decision, self.reasons)


def _r(*codes: str) -> frozenset:
    return frozenset(codes)


# the legacy reader (fn.readers.video) reads one codec per reader: every codec but H.264 is transcoded
ONE_CODEC = ("transcode", _r("legacy_one_codec"))


X264 = ("-c:v", "libx264", "-preset", "ultrafast", "-g", "25", "-bf", "0")
CLIPS: tuple[Clip, ...] = (
    Clip("good/h264.mp4", X264 + ("-pix_fmt", "yuv420p", "-movflags", "+faststart"), "ok"),
    # ffmpeg's default MP4 layout: moov after mdat; ok, and remuxed with +faststart when copied
    Clip("good/moov_at_end.mp4", X264 + ("-pix_fmt", "yuv420p"), "ok"),
    Clip("good/hevc.mp4", ("-c:v", "libx265", "-preset", "ultrafast", "-x265-params", "log-level=none:keyint=25",
                           "-pix_fmt", "yuv420p", "-tag:v", "hvc1"), "ok", size=(192, 144, 25, 1.0), needs="libx265",
         legacy=ONE_CODEC),
    Clip("good/hevc10.mkv", ("-c:v", "libx265", "-preset", "ultrafast", "-x265-params", "log-level=none:keyint=25",
                             "-pix_fmt", "yuv420p10le"), "ok", size=(192, 144, 25, 1.0), needs="libx265",
         legacy=ONE_CODEC),
    Clip("good/vp9.webm", ("-c:v", "libvpx-vp9", "-deadline", "realtime", "-cpu-used", "8", "-g", "25",
                           "-pix_fmt", "yuv420p"), "ok", size=(160, 128, 25, 1.0), needs="libvpx-vp9",
         legacy=ONE_CODEC),
    Clip("good/vp8.webm", ("-c:v", "libvpx", "-deadline", "realtime", "-cpu-used", "8", "-g", "25"), "ok",
         needs="libvpx", legacy=ONE_CODEC),
    # the experimental reader's GPU decoder cannot create an NVDEC decoder for MJPEG
    Clip("good/mjpeg.avi", ("-c:v", "mjpeg", "-pix_fmt", "yuvj420p", "-q:v", "5"), "transcode", _r("codec"),
         legacy=ONE_CODEC),
    Clip("good/mpeg4.avi", ("-c:v", "mpeg4", "-g", "25", "-q:v", "5"), "ok", legacy=ONE_CODEC),
    Clip("good/audio_b.mp4", X264 + ("-pix_fmt", "yuv420p", "-c:a", "aac", "-shortest"), "ok", special="audio_b"),
    # MPEG-4 Part 2 in AVI with packed B-frames: a third of the packets carry no timestamp
    Clip("bad/packed_bframes.avi", ("-frames:v", "120", "-c:v", "mpeg4", "-bf", "2", "-q:v", "5", "-f", "avi"),
         "transcode", _r("missing_timestamps"), size=(160, 120, "30000/1001", 4.004),
         legacy=("transcode", _r("missing_timestamps", "legacy_one_codec"))),
    # 24x32 with 4:3 pixels shows as 32x32: scaled to square pixels, padded to 48x32 (H.264's minimum width)
    Clip("bad/sar_pad.mp4", ("-vf", "setsar=4/3") + X264 + ("-pix_fmt", "yuv420p"), "transcode",
         _r("too_small", "non_square_pixels"),
         size=(24, 32, 25, 1.0)),
    # garbage inside valid packets: the packet scan sees only the long GOP; --verify decode rejects it
    Clip("bad/corrupt_middle.mp4", ("-c:v", "libx264", "-preset", "ultrafast", "-g", "100", "-bf", "0",
                                    "-pix_fmt", "yuv420p"), "transcode", _r("long_gop"), special="corrupt",
         size=(160, 120, 25, 4.0), quarantined="frames_changed"),
    Clip("bad/h264_10bit.mp4", X264 + ("-pix_fmt", "yuv420p10le"), "transcode", _r("bit_depth", "profile")),
    Clip("bad/h264_444.mp4", X264 + ("-pix_fmt", "yuv444p"), "transcode", _r("chroma", "profile")),
    Clip("bad/hevc444.mkv", ("-c:v", "libx265", "-preset", "ultrafast", "-x265-params", "log-level=none:keyint=25",
                             "-pix_fmt", "yuv444p"), "transcode", _r("chroma"), size=(192, 144, 25, 1.0),
         needs="libx265", legacy=("transcode", _r("chroma", "legacy_one_codec"))),
    Clip("bad/av1.mkv", ("-c:v", "libaom-av1", "-cpu-used", "8", "-g", "25", "-pix_fmt", "yuv420p"), "transcode",
         _r("codec"), size=(128, 128, 25, 1.0), needs="libaom-av1"),
    Clip("bad/rotated.mp4", X264 + ("-pix_fmt", "yuv420p"), "transcode", _r("rotated"), special="rotate"),
    Clip("bad/interlaced.mp4", ("-vf", "setfield=tff", "-flags", "+ildct+ilme", "-x264opts", "tff=1") + X264 +
         ("-pix_fmt", "yuv420p"), "transcode", _r("interlaced")),
    Clip("bad/odd.webm", ("-vf", "scale=161:131", "-c:v", "libvpx-vp9", "-deadline", "realtime", "-cpu-used", "8", "-g", "25"),
         "transcode", _r("odd_size"), size=(161, 131, 25, 1.0), needs="libvpx-vp9",
         legacy=("transcode", _r("odd_size", "legacy_one_codec"))),
    Clip("bad/tiny.mp4", X264 + ("-pix_fmt", "yuv420p"), "transcode", _r("too_small"), size=(32, 32, 25, 1.0)),
    Clip("bad/tiny_vp9.webm", ("-c:v", "libvpx-vp9", "-deadline", "realtime", "-cpu-used", "8", "-g", "25"),
         "transcode", _r("too_small"), size=(64, 64, 25, 1.0), needs="libvpx-vp9",
         legacy=("transcode", _r("too_small", "legacy_one_codec"))),
    Clip("bad/vfr.mkv", ("-vf", "settb=1/1000,setpts='(N*0.04+mod(N\\,2)*0.02)/TB'", "-fps_mode", "passthrough") + X264 +
         ("-pix_fmt", "yuv420p"), "transcode", _r("vfr")),
    Clip("bad/long_gop.mp4", ("-c:v", "libx264", "-preset", "ultrafast", "-g", "250", "-keyint_min", "250",
                              "-sc_threshold", "0", "-pix_fmt", "yuv420p"), "transcode", _r("long_gop"),
         size=(160, 120, 25, 2.0)),
    Clip("bad/two_streams.mkv", X264 + ("-pix_fmt", "yuv420p"), "transcode", _r("several_video_streams"),
         special="dual"),
    Clip("bad/no_keyframe_first.ts", ("-c:v", "libx264", "-preset", "ultrafast", "-g", "10", "-bf", "0",
                                      "-x264-params", "repeat-headers=1", "-pix_fmt", "yuv420p",
                                      "-bsf:v", "noise=drop=eq(n\\,0)"), "transcode", _r("first_not_keyframe")),
    Clip("junk/audio_only.m4a", (), "reject", _r("no_video"), special="audio"),
    Clip("junk/empty.mp4", (), "reject", _r("empty"), special="empty"),
    # an HLS playlist named .mp4 whose segment lies outside the source root: never opened
    Clip("junk/playlist.mp4", X264 + ("-pix_fmt", "yuv420p", "-f", "mpegts"), "reject", _r("format_refused"),
         special="hls"),
    Clip("junk/photo.mp4", (), "reject", _r("still_image"), special="jpeg"),
    Clip("junk/truncated.mp4", X264 + ("-pix_fmt", "yuv420p"), "reject", _r("probe_failed"), special="truncate"),
    Clip("junk/truncated_faststart.mp4", X264 + ("-pix_fmt", "yuv420p", "-movflags", "+faststart"), "reject",
         _r("truncated"), special="truncate"),
    Clip("junk/truncated.mkv", X264 + ("-pix_fmt", "yuv420p"), "reject", _r("truncated"), special="truncate",
         size=(160, 120, 25, 2.0)),
    Clip("junk/truncated.webm", ("-c:v", "libvpx", "-deadline", "realtime", "-cpu-used", "8", "-g", "25"), "reject",
         _r("truncated"), special="truncate", size=(160, 120, 25, 2.0), needs="libvpx"),
)


def encoders() -> set[str]:
    """Names of the video/audio encoders this ffmpeg has."""
    out = subprocess.run(["ffmpeg", "-hide_banner", "-encoders"], capture_output=True, text=True).stdout
    return {line.split()[1] for line in out.splitlines()[10:] if len(line.split()) > 1}


def ffprobe_json(path: str | os.PathLike, *args: str) -> dict:
    """An independent ffprobe run (not repack's code path): its JSON output for ``args``."""
    out = subprocess.run(["ffprobe", "-v", "error", "-of", "json", *args, str(path)], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out)


def video_codecs(path: str | os.PathLike) -> list[str]:
    """The codec of every video stream of ``path``, by an independent ffprobe run."""
    streams = ffprobe_json(path, "-select_streams", "v", "-show_entries", "stream=codec_name")["streams"]
    return [s["codec_name"] for s in streams]


def _ffmpeg(args: list[str]) -> None:
    """Run ffmpeg with ``args`` verbatim. The generators speak ffmpeg's own flags on purpose (odd
    inputs are what they make); repack's own ffmpeg/ffprobe commands are built with ffmpeg-python
    (repack.transforms.ffmpeg_cli)."""
    proc = subprocess.run(["ffmpeg", "-nostdin", "-hide_banner", "-loglevel", "error", "-y", *args],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ffmpeg {' '.join(args)} failed: {proc.stderr.strip()[-400:]}")


def rotate_mp4(path: Path, degrees: int | str = 90) -> None:
    """Patch the first track header's display matrix (ffmpeg 5 cannot write it) to rotate (90, 180) or mirror
    ("vflip", "hflip": ffprobe's rotation of a vertical flip is 0, of a horizontal one 180)."""
    data = bytearray(path.read_bytes())
    i = data.find(b"tkhd")
    version = data[i + 4]
    offset = i + 8 + (20 if version == 0 else 32) + 8 + 8
    matrix = {90: (0, 65536, 0, -65536, 0, 0, 0, 0, 1 << 30), 180: (-65536, 0, 0, 0, -65536, 0, 0, 0, 1 << 30),
              "vflip": (65536, 0, 0, 0, -65536, 0, 0, 0, 1 << 30), "hflip": (-65536, 0, 0, 0, 65536, 0, 0, 0, 1 << 30)}
    data[offset:offset + 36] = struct.pack(">9i", *matrix[degrees])
    path.write_bytes(bytes(data))


def make_clip(root: Path, clip: Clip) -> Path:
    """Write one clip under ``root``; returns its path."""
    path = root / clip.rel
    path.parent.mkdir(parents=True, exist_ok=True)
    w, h, r, d = clip.size
    lavfi = ["-f", "lavfi", "-i", SRC.format(w=w, h=h, r=r, d=d)]
    if clip.special == "empty":
        path.write_bytes(b"")
    elif clip.special == "hls":
        segment = root.parent / f"{root.name}-outside" / "secret.ts"
        segment.parent.mkdir(parents=True, exist_ok=True)
        _ffmpeg(lavfi + list(clip.args) + [str(segment)])
        target = os.path.relpath(segment, path.parent)
        path.write_text(f"#EXTM3U\n#EXT-X-VERSION:3\n#EXT-X-TARGETDURATION:1\n#EXTINF:1.0,\n{target}\n"
                        "#EXT-X-ENDLIST\n")
    elif clip.special == "audio":
        _ffmpeg(["-f", "lavfi", "-i", "sine=frequency=440:duration=1", "-c:a", "aac", str(path)])
    elif clip.special == "jpeg":
        _ffmpeg(lavfi + ["-frames:v", "1", "-f", "image2", "-c:v", "mjpeg", str(path)])
    elif clip.special == "audio_b":
        _ffmpeg(lavfi + ["-f", "lavfi", "-i", "sine=frequency=440:duration=1", *clip.args, str(path)])
    elif clip.special == "dual":
        _ffmpeg(lavfi + ["-f", "lavfi", "-i", SRC.format(w=2 * w, h=2 * h, r=r, d=d), "-map", "0:v", "-map", "1:v",
                         *clip.args, str(path)])
    else:
        _ffmpeg(lavfi + list(clip.args) + [str(path)])
    if clip.special == "rotate":
        rotate_mp4(path)
    elif clip.special == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) * 2 // 3])
    elif clip.special == "corrupt":
        corrupt_middle(path)
    return path


def corrupt_middle(path: Path, length: int = 3000, seed: int = 1) -> None:
    """Overwrite ``length`` bytes in the middle of ``path`` with seeded random bytes."""
    data = bytearray(path.read_bytes())
    start = len(data) // 2
    data[start:start + length] = random.Random(seed).randbytes(min(length, len(data) - start))
    path.write_bytes(bytes(data))


def make_clips(root: str | os.PathLike, clips=CLIPS, workers: int = 4) -> dict[str, Clip]:
    """Generate ``clips`` under ``root`` in parallel; returns {rel: clip} of those made
    (clips whose encoder is missing are skipped)."""
    if not shutil.which("ffmpeg"):
        raise RuntimeError("ffmpeg is not installed")
    root = Path(root)
    have = encoders()
    todo = [c for c in clips if not c.needs or c.needs in have]
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda c: make_clip(root, c), todo))
    return {c.rel: c for c in todo}


def make_index_clip(path: str | os.PathLike, frames: int, codec_args: tuple[str, ...], size=(64, 48), fps: int = 25) -> None:
    """A clip whose frame N has uniform luma 16 + 4*N (so a decoded frame tells its index)."""
    w, h = size
    src = f"color=c=black:s={w}x{h}:r={fps}:d={frames / fps},format=gray,geq=lum='16+4*N'"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    _ffmpeg(["-f", "lavfi", "-i", src, "-frames:v", str(frames), *codec_args, str(path)])

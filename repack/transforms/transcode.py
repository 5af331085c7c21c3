"""The DALI-friendly transcode recipe and the faststart remux, as ffmpeg-python graphs.

Output: first video stream only; no audio, subtitles, data, chapters or metadata; rotation
baked in (ffmpeg's autorotate, the display matrix is not copied); deinterlaced (yadif) when
interlaced; square pixels (scaled to the display aspect ratio, SAR 1:1); explicit even
dimensions (with an optional ``max_height`` and the target decoder's maximum), padded up to
the decoder's minimum; H.264 High (libx264), or HEVC Main (libx265, single-threaded for
reproducible bytes) when the dataset codec is HEVC (``Recipe.codec``, the one-codec rule of
repack.transforms.nvdec_rules), 8-bit 4:2:0; fixed GOP (no scene-cut keyframes, closed GOP,
``bframes`` B-frames, 0 by default); ``+faststart``. Bit-exact flags and fixed thread counts
make the output depend only on the input, the options and the ffmpeg/x264 build.

Frame timing (``plan_timing``), so that no frame is lost:

- constant frame rate, or timestamps missing (``missing_pts``: e.g. an AVI with packed
  B-frames): every decoded frame is kept, one output frame each, and the timestamps are
  regenerated (``setpts=N/rate/TB``) at ``rate`` = the measured rate snapped to a standard
  rate, or, when timestamps are missing, the stream's declared rate (``r_frame_rate``, else
  ``avg_frame_rate``) snapped the same way. Expected: frames out = frames in.
- variable frame rate (irregular intervals): resampled by time to the standard rate nearest
  the mean rate (``fps`` filter: a frame is repeated or dropped where the source's spacing
  differs from the constant grid), so clip times stay true. Expected: frames out = the
  source's span x rate.

``frames_problem`` compares the re-probed output with that expectation (more than one frame
off: the job quarantines the file with both numbers).
"""

from __future__ import annotations

import errno
import signal
from dataclasses import dataclass

from repack.transforms.ffmpeg_cli import compile_ffmpeg, run, safe_input
from repack.transforms.nvdec_rules import H264, get_target, is_vfr, sample_aspect, undecodable_leading

STANDARD_RATES = (8.0, 10.0, 12.0, 12.5, 15.0, 20.0, 24000 / 1001, 24.0, 25.0, 30000 / 1001, 30.0, 48.0, 50.0,
                  60000 / 1001, 60.0, 90.0, 100.0, 120000 / 1001, 120.0)
RATE_TEXT = {24000 / 1001: "24000/1001", 30000 / 1001: "30000/1001", 60000 / 1001: "60000/1001",
             120000 / 1001: "120000/1001"}
KEEP, RESAMPLE, COPY = "keep", "resample", "copy"


@dataclass(frozen=True)
class Recipe:
    """Encoder settings of the recipe (all of them change the output bytes)."""

    crf: int = 18
    preset: str = "fast"
    gop: int | None = None          # frames; None = one keyframe per second (capped by max_gop_s)
    max_gop_s: float = 1.0
    max_height: int | None = None
    bframes: int = 0
    threads: int = 1
    target: str = "h100"
    codec: str = "h264"             # h264 (libx264) or hevc (libx265): nvdec_rules.ENCODABLE


@dataclass(frozen=True)
class Timing:
    """How the output's frame times are made (see the module docstring) and what to expect."""

    rate: float
    rate_text: str
    mode: str                   # KEEP (setpts, every frame kept), RESAMPLE (fps filter, VFR) or COPY
    rate_from: str              # "measured", "declared" or "median interval" (resampled)
    frames_in: int
    expected_frames: int
    expected_duration_s: float


MAX_GRID_RATE = 240.0  # a resampled source's rate from its median frame interval, at most (else its mean rate)
MAX_GRID_FRAMES = 30_000  # and its frames at most this many, or 4x the source's (else its mean rate)


def snap_rate(fps: float | None) -> tuple[float, str]:
    """The standard frame rate nearest to ``fps`` (within 3 %), else ``fps`` rounded to 1/1000."""
    if not fps or fps <= 0:
        return 25.0, "25"
    best = min(STANDARD_RATES, key=lambda r: abs(r - fps))
    if abs(best - fps) <= 0.03 * best:
        return best, RATE_TEXT.get(best, f"{best:g}")
    value = round(fps, 3)
    return value, f"{value:g}"


def source_frames(info: dict) -> int:
    """Frames the source decodes to: the decoded frames when a full decode ran (``--verify
    decode``), else the video packets of the scan from the first keyframe on (packets before
    it reference a picture that is not in the file: no decoder can output them)."""
    decoded = info.get("decoded_frames")
    if decoded:
        return int(decoded)
    return int(info.get("frames") or 0) - int(info.get("packets_before_key") or 0) - undecodable_leading(info)


def plan_timing(info: dict) -> Timing:
    """The output rate, how timestamps are made, and the frames/duration the output must have."""
    frames = source_frames(info)
    if info.get("missing_pts"):
        declared = info.get("r_frame_rate") or info.get("avg_frame_rate")
        rate, text = snap_rate(declared or info.get("fps"))
        rate_from = "declared" if declared else "measured"
    else:
        rate, text = snap_rate(info.get("fps"))
        rate_from = "measured"
    if is_vfr(info) and not info.get("missing_pts"):
        # the grid of the stream's usual spacing (its median interval), not its mean rate: a 25 fps capture with
        # a stall has a mean rate of 17.5, whose grid drops real frames all along the regular stretches; on the
        # median's grid every regularly spaced frame keeps its place and only a gap is filled by repeats
        # frames that come in bursts (pairs 2 ms apart) have no such grid: their median's rate (500 fps) would
        # multiply the frames; above MAX_GRID_RATE, the mean rate. A long stall keeps the grid (its repeats keep
        # every frame at its time) unless its repeats would pass MAX_GRID_FRAMES beyond 4x the frames (an hour of
        # a motion-triggered camera's idle at 240 fps: 864,000 frames to encode)
        interval = float(info.get("frame_interval_s") or 0)
        span = float(info.get("span_s") or info.get("duration_s") or frames / rate)
        if interval > 0:
            grid, grid_text = snap_rate(1 / interval)
            if grid <= MAX_GRID_RATE and span * grid <= max(4 * frames, MAX_GRID_FRAMES):
                rate, text, rate_from = grid, grid_text, "median interval"
        return Timing(rate, text, RESAMPLE, rate_from, frames, max(1, round(span * rate)), round(span, 6))
    return Timing(rate, text, KEEP, rate_from, frames, frames, round(frames / rate, 6))


def output_geometry(info: dict, recipe: Recipe) -> tuple[int, int, int, int]:
    """(scaled width, height, padded width, height) of the output, all even, for square pixels:
    a non-1:1 sample aspect ratio is applied to the width first (the output's SAR is 1:1)."""
    w, h = int(info["width"]), int(info["height"])
    sar = sample_aspect(info.get("sar"))
    if sar != 1:
        w = max(2, int(round(w * sar)))
    if info.get("rotation") in (90, 270):
        w, h = h, w
    scale = 1.0
    if recipe.max_height and h > recipe.max_height:
        scale = recipe.max_height / h
    limits = get_target(recipe.target).codecs.get(recipe.codec, H264)
    (min_w, min_h), (max_w, max_h) = limits.min_size, limits.max_size
    scale = min(scale, max_w / w, max_h / h)
    sw = max(2, int(round(w * scale / 2)) * 2)
    sh = max(2, int(round(h * scale / 2)) * 2)
    sw, sh = min(sw, max_w - max_w % 2), min(sh, max_h - max_h % 2)
    pw, ph = max(sw, min_w + min_w % 2), max(sh, min_h + min_h % 2)
    return sw, sh, pw, ph


def gop_frames(rate: float, recipe: Recipe) -> int:
    """Keyframe interval in frames: ``recipe.gop``, else one second; never above ``max_gop_s``
    (so every output passes the re-probe's long-GOP check)."""
    limit = max(1, int(rate * recipe.max_gop_s + 1e-6))
    if recipe.gop:
        return min(recipe.gop, limit)
    return max(1, min(int(round(rate)), limit))


def transcode_stream(src: str, dst: str, info: dict, recipe: Recipe, timing: Timing):
    """The ffmpeg-python graph that transcodes ``src`` (probed as ``info``) into ``dst`` (MP4)."""
    gop = gop_frames(timing.rate, recipe)
    sw, sh, pw, ph = output_geometry(info, recipe)
    source = safe_input(src, threads=recipe.threads)
    stream = info.get("stream_index")
    video = source[str(stream)] if stream is not None else source["v:0"]
    if info.get("field_order") not in ("progressive", "unknown", None):
        video = video.filter("yadif", mode="send_frame", parity="auto", deint="all")
    if timing.mode == RESAMPLE:
        video = video.filter("fps", fps=timing.rate_text)
    else:
        video = video.filter("setpts", f"N/({timing.rate_text})/TB")
    video = video.filter("scale", sw, sh, flags="bicubic")
    if (pw, ph) != (sw, sh):
        video = video.filter("pad", pw, ph, (pw - sw) // 2, (ph - sh) // 2, color="black")
    video = video.filter("setsar", "1").filter("format", "yuv420p")
    gop_params = f"scenecut=0:open-gop=0:keyint={gop}:min-keyint={gop}:bframes={recipe.bframes}"
    if recipe.codec == "hevc":  # one thread pool, one frame thread, no WPP: the same bytes on every run
        encoder = {"c:v": "libx265", "profile:v": "main", "tag:v": "hvc1",
                   "x265-params": gop_params + ":pools=1:frame-threads=1:wpp=0:log-level=error"}
    else:
        encoder = {"c:v": "libx264", "profile:v": "high", "x264-params": gop_params}
    return video.output(dst, format="mp4", r=timing.rate_text, fps_mode="cfr", map_metadata=-1, map_chapters=-1,
                        preset=recipe.preset, crf=recipe.crf, g=gop, keyint_min=gop, sc_threshold=0,
                        bf=recipe.bframes, threads=recipe.threads, fflags="+bitexact", movflags="+faststart",
                        **{"pix_fmt": "yuv420p", "flags:v": "+cgop+bitexact", **encoder}
                        ).global_args("-filter_complex_threads", str(recipe.threads))


def build_command(src: str, dst: str, info: dict, recipe: Recipe, ffmpeg: str = "ffmpeg") -> list[str]:
    """The ffmpeg argument list (compiled by ffmpeg-python) that transcodes ``src`` into ``dst``."""
    return compile_ffmpeg(transcode_stream(src, dst, info, recipe, plan_timing(info)), ffmpeg)


def remux_command(src: str, dst: str, container: str = "mp4", ffmpeg: str = "ffmpeg") -> list[str]:
    """Stream copy of ``src``'s video and audio into ``dst`` with ``moov`` first (``+faststart``):
    no re-encode, bit-exact muxing, the source's metadata kept."""
    import ffmpeg as ffmpeg_python

    source = safe_input(src)
    out = ffmpeg_python.output(source["v"], source["a?"], dst, format=container, c="copy", map_metadata=0,
                               movflags="+faststart", fflags="+bitexact")
    return compile_ffmpeg(out, ffmpeg)


def copy_timing(info: dict) -> Timing:
    """The expectation for a copy or a stream-copy remux: the same packets, the same frames."""
    rate, text = snap_rate(info.get("fps"))
    frames = int(info.get("frames") or 0)
    return Timing(rate, text, COPY, "measured", frames, frames, float(info.get("duration_s") or 0.0))


def frames_problem(timing: Timing, output: dict) -> str | None:
    """None if the re-probed ``output`` has the expected frames (one frame of slack), else the
    quarantine reason with both numbers (frames and seconds)."""
    frames = int(output.get("frames") or 0)
    if abs(frames - timing.expected_frames) <= 1:
        return None
    seconds = output.get("span_s") or output.get("duration_s") or 0.0
    return (f"frame count changed: the source has {timing.frames_in} frames ({timing.expected_duration_s:.3f} s, "
            f"{timing.expected_frames} expected at {timing.rate_text} fps, {timing.mode}), the output has {frames} "
            f"frames ({seconds:.3f} s)")


# what ffmpeg prints (strerror) when its output cannot be written: the job's storage, not the input
JOB_WRITE_ERRORS = {"No space left on device": errno.ENOSPC, "File too large": errno.EFBIG,
                    "Disk quota exceeded": errno.EDQUOT}
# signals that end ffmpeg for the job's reasons: the file-size limit (SIGXFSZ), a stop of the job
JOB_SIGNALS = {signal.SIGXFSZ: errno.EFBIG, signal.SIGTERM: errno.EINTR, signal.SIGINT: errno.EINTR,
               signal.SIGHUP: errno.EINTR}


def run_ffmpeg(cmd: list[str], src: str, timeout: float | None = None, output: str | None = None) -> str | None:
    """Run an ffmpeg argument list reading ``src``; None on success, else its last error line (the input's
    quarantine reason). OSError where the output could not be written (disk full, a file-size limit or quota,
    also when ffmpeg exits 0 after saying so) or ffmpeg was stopped by such a signal: the task fails and a re-run
    does it again, where a quarantine would keep a good input out of the dataset for good."""
    result = run(cmd, timeout)
    where = f"{output or 'the output'} (from {src})"
    said = "\n".join(result.lines(src))  # the input's path left out: a name holding those words is no full disk
    for arg in cmd:  # nor is one the output's temp name carries
        said = said.replace(arg, "<arg>") if "/" in arg else said
    for text, code in JOB_WRITE_ERRORS.items():
        if text in said:
            raise OSError(code, f"ffmpeg could not write {where}: {text}")
    if result.returncode < 0 and -result.returncode in JOB_SIGNALS:
        stopped = signal.Signals(-result.returncode).name
        raise OSError(JOB_SIGNALS[-result.returncode], f"ffmpeg was stopped by {stopped} writing {where}: "
                                                       f"{'File too large' if stopped == 'SIGXFSZ' else 'stopped'}")
    return None if result.returncode == 0 else result.error_line(src)

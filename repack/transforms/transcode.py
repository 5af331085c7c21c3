"""The DALI-friendly transcode recipe: ffmpeg argument lists (never a shell string).

Output: first video stream only; no audio, subtitles, data, chapters or metadata; rotation
baked in (ffmpeg's autorotate, the display matrix is not copied); deinterlaced (yadif) when
interlaced; constant frame rate snapped to a standard rate; explicit even dimensions (with an
optional ``max_height`` and the target decoder's maximum), padded up to the decoder's minimum;
H.264 High, 8-bit 4:2:0; fixed GOP (no scene-cut keyframes, closed GOP, ``bframes`` B-frames,
0 by default); ``+faststart``. Bit-exact flags and a fixed thread count make the output
depend only on the input, the options and the ffmpeg/x264 build.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from dataclasses import dataclass

from repack.transforms.nvdec_rules import H264, get_target

STANDARD_RATES = (8.0, 10.0, 12.0, 12.5, 15.0, 20.0, 24000 / 1001, 24.0, 25.0, 30000 / 1001, 30.0, 48.0, 50.0,
                  60000 / 1001, 60.0, 90.0, 100.0, 120000 / 1001, 120.0)
RATE_TEXT = {24000 / 1001: "24000/1001", 30000 / 1001: "30000/1001", 60000 / 1001: "60000/1001",
             120000 / 1001: "120000/1001"}


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


def snap_rate(fps: float | None) -> tuple[float, str]:
    """The standard frame rate nearest to ``fps`` (within 3 %), else ``fps`` rounded to 1/1000."""
    if not fps or fps <= 0:
        return 25.0, "25"
    best = min(STANDARD_RATES, key=lambda r: abs(r - fps))
    if abs(best - fps) <= 0.03 * best:
        return best, RATE_TEXT.get(best, f"{best:g}")
    value = round(fps, 3)
    return value, f"{value:g}"


def output_geometry(info: dict, recipe: Recipe) -> tuple[int, int, int, int]:
    """(scaled width, height, padded width, height) of the output, all even."""
    w, h = int(info["width"]), int(info["height"])
    if info.get("rotation") in (90, 270):
        w, h = h, w
    scale = 1.0
    if recipe.max_height and h > recipe.max_height:
        scale = recipe.max_height / h
    limits = get_target(recipe.target).codecs.get("h264", H264)
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


def video_filters(info: dict, recipe: Recipe) -> str:
    """The -vf chain: deinterlace, constant rate, scale, pad, 8-bit 4:2:0."""
    rate, rate_text = snap_rate(info.get("fps"))
    sw, sh, pw, ph = output_geometry(info, recipe)
    chain = []
    if info.get("field_order") not in ("progressive", "unknown", None):
        chain.append("yadif=mode=send_frame:parity=auto:deint=all")
    chain.append(f"fps=fps={rate_text}")
    chain.append(f"scale={sw}:{sh}:flags=bicubic")
    if (pw, ph) != (sw, sh):
        chain.append(f"pad={pw}:{ph}:{(pw - sw) // 2}:{(ph - sh) // 2}:color=black")
    chain.append("format=yuv420p")
    return ",".join(chain)


def build_command(src: str, dst: str, info: dict, recipe: Recipe, ffmpeg: str = "ffmpeg") -> list[str]:
    """The full ffmpeg argument list that transcodes ``src`` (probed as ``info``) into ``dst`` (MP4)."""
    rate, rate_text = snap_rate(info.get("fps"))
    gop = gop_frames(rate, recipe)
    x264 = f"scenecut=0:open-gop=0:keyint={gop}:min-keyint={gop}:bframes={recipe.bframes}"
    stream = info.get("stream_index")
    return [
        ffmpeg, "-nostdin", "-hide_banner", "-loglevel", "error", "-y",
        "-threads", str(recipe.threads), "-i", src,
        "-map", f"0:{stream}" if stream is not None else "0:v:0",
        "-an", "-sn", "-dn", "-map_metadata", "-1", "-map_chapters", "-1",
        "-vf", video_filters(info, recipe), "-r", rate_text, "-fps_mode", "cfr",
        "-c:v", "libx264", "-profile:v", "high", "-pix_fmt", "yuv420p",
        "-preset", recipe.preset, "-crf", str(recipe.crf),
        "-g", str(gop), "-keyint_min", str(gop), "-sc_threshold", "0", "-bf", str(recipe.bframes),
        "-flags:v", "+cgop+bitexact", "-x264-params", x264, "-threads", str(recipe.threads),
        "-fflags", "+bitexact", "-movflags", "+faststart", "-f", "mp4", dst,
    ]


PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` for ffmpeg/ffprobe children: on Linux, ask the kernel to SIGKILL the child
    when the worker that started it dies (prctl(PR_SET_PDEATHSIG, SIGKILL)), so a killed repack
    leaves no ffmpeg running. A no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def run_transcode(cmd: list[str], timeout: float | None = None) -> str | None:
    """Run an ffmpeg command list; None on success, else the last line of ffmpeg's error output."""
    try:
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout,
                              preexec_fn=die_with_parent)
    except subprocess.TimeoutExpired:
        return f"ffmpeg timed out after {timeout:.0f} s"
    if proc.returncode == 0:
        return None
    lines = [line for line in proc.stderr.decode(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else f"ffmpeg exited with {proc.returncode}"

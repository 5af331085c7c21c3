"""``--verify decode``: decode every frame of a video's main stream and collect decoder errors.

The default packet scan (repack.transforms.probe) reads packet headers only: a corrupt middle
(garbage inside valid packets) passes it. This decodes the whole stream with ffmpeg into the
null muxer, one decoder thread (so the messages and their order do not depend on timing),
and reports the frames decoded and the decoder's error lines (pointers stripped, so a rerun
gives the same record). Its cost is measured in tests/benchmarks/bench_video.py.
"""

from __future__ import annotations

import re

from repack.transforms.ffmpeg_cli import compile_ffmpeg, run, safe_input

MAX_MESSAGES = 5
NULL_MUXER = re.compile(r"\[(?:out#\d+/)?null[\] ]")  # the null muxer's own lines (timestamps it was handed), no
# decoder's: a VFR file made by joining two rates had every frame decoded and 20 "errors" of non-monotonic dts


def decode_command(path: str, stream_index: int | None, ffmpeg_cmd: str = "ffmpeg") -> list[str]:
    """ffmpeg: decode stream ``stream_index`` (else the first video stream) of ``path`` into the null
    muxer, reporting the frame count on stdout (``-progress pipe:1``)."""
    source = safe_input(path, threads=1)
    stream = source[str(stream_index)] if stream_index is not None else source["v:0"]
    out = stream.output("-", format="null").global_args("-progress", "pipe:1", "-nostats")
    return compile_ffmpeg(out, ffmpeg_cmd)


def decode_check(path: str, stream_index: int | None = None, timeout: float | None = None) -> dict:
    """{"decoded_frames", "decode_errors", "decode_messages"} of one full decode of ``path``.

    ``decode_errors`` counts the decoder's error lines, not the null muxer's (a failed run counts at least one);
    ``decode_messages`` holds the first few, for probe.jsonl and the quarantine reason."""
    result = run(decode_command(path, stream_index), timeout)
    frames = 0
    for line in result.stdout.decode(errors="replace").splitlines():
        if line.startswith("frame="):
            frames = int(line.split("=", 1)[1] or 0)
    errors = _decoder_lines(result.lines(path))
    if result.returncode != 0 and not errors:
        errors = [result.error_line(path)]
    return {"decoded_frames": frames, "decode_errors": len(errors), "decode_messages": errors[:MAX_MESSAGES]}


def _decoder_lines(lines: list[str]) -> list[str]:
    """``lines`` less the null muxer's and the "Last message repeated" lines that repeat one of them."""
    kept: list[str] = []
    muxer = False
    for line in lines:
        if NULL_MUXER.match(line) or (muxer and line.startswith("Last message repeated")):
            muxer = True
            continue
        muxer = False
        kept.append(line)
    return kept

"""Build ffmpeg/ffprobe command lines with ffmpeg-python and run them under repack's rules.

Building: every ffmpeg command is an ffmpeg-python graph (``ffmpeg.input(...).filter(...)
.output(...)``) compiled to an argument list (never a shell string); ffprobe commands are
built like ``ffmpeg.probe`` builds them (its fixed arguments, then keyword options through
ffmpeg-python's own keyword converter). ``ffmpeg.probe`` and ``ffmpeg.run`` themselves are not
used: they start the child without ``die_with_parent`` and without a timeout.

Confinement: the tools read only the input file. The input is opened as ``file:<absolute
path>`` with ``-protocol_whitelist file`` (no network, no pipe, no nested protocol such as
``concat:`` or ``subfile,``) and ``-format_whitelist`` = ``ALLOWED_FORMATS``: single-file
containers only, so a playlist or reference demuxer (HLS, DASH, concat, image2 sequence
patterns, ...) is refused before it opens anything else, whatever the file's name.

Running: ``run`` starts the child with ``die_with_parent`` (PR_SET_PDEATHSIG: it dies with
the worker that started it), stdin closed, output captured, an optional timeout.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass

from repack.exec.parent_death import die_with_parent

# Demuxers that read exactly one file (no playlist, no references to other files). The image
# pipes are here so a still image is recognised (and rejected as one) instead of refused.
from repack.manifest.containers import ALLOWED_FORMATS, SAFE_INPUT_OPTIONS  # noqa: F401 - used here and re-exported
_REFUSED = re.compile(r"\[([\w,]+) @ [^\]]*\] Format not on whitelist")
_POINTER = re.compile(r" @ 0x[0-9a-f]+\]")


def file_url(path: str) -> str:
    """``file:`` + the absolute path: never read as another protocol or as an option."""
    return "file:" + os.path.abspath(path)


STAND_IN = "file:repack-path-"  # + the hex of a path's bytes: a non-UTF-8 path in an ffmpeg-python graph


def safe_input(path: str, **options):
    """``ffmpeg.input`` of ``path`` confined to that one file (see the module docstring). A path that is not
    UTF-8 goes into the graph as a stand-in (ffmpeg-python hashes its nodes as UTF-8 text, and raised on the
    name's escaped bytes), put back by ``compile_ffmpeg``: ffmpeg is given the file's own bytes."""
    import ffmpeg

    url = file_url(path)
    try:
        url.encode("utf-8")
    except UnicodeEncodeError:
        url = STAND_IN + os.fsencode(url).hex()
    return ffmpeg.input(url, **SAFE_INPUT_OPTIONS, **options)


def ffprobe_args(path: str, ffprobe: str = "ffprobe", **options) -> list[str]:
    """The ffprobe argument list ``ffmpeg.probe(path, **options)`` would run, confined to ``path``."""
    from ffmpeg._utils import convert_kwargs_to_cmd_line_args

    return [ffprobe, "-v", "error", "-show_format", "-show_streams", "-of", "json",
            *convert_kwargs_to_cmd_line_args({**SAFE_INPUT_OPTIONS, **options}), file_url(path)]


def compile_ffmpeg(stream, ffmpeg_cmd: str = "ffmpeg") -> list[str]:
    """An ffmpeg-python output graph as an argument list, quiet, overwriting, stdin unused."""
    args = stream.global_args("-nostdin", "-hide_banner", "-loglevel", "error").compile(
        cmd=ffmpeg_cmd, overwrite_output=True)
    return [os.fsdecode(bytes.fromhex(arg[len(STAND_IN):])) if arg.startswith(STAND_IN) else arg for arg in args]


@dataclass(frozen=True)
class Result:
    """What a finished ffmpeg/ffprobe run left: exit status, stdout bytes, stderr text."""

    returncode: int
    stdout: bytes
    stderr: str

    def lines(self, path: str) -> list[str]:
        """The non-empty stderr lines, the input's path replaced by ``<file>`` and log pointers
        stripped (``[h264 @ 0x55...]`` -> ``[h264]``), so a rerun gives the same text."""
        return [_POINTER.sub("]", line.strip().replace(file_url(path), "<file>").replace(path, "<file>"))
                for line in self.stderr.splitlines() if line.strip()]

    def error_line(self, path: str) -> str:
        """The last line of ``lines``, else the exit status."""
        lines = self.lines(path)
        return lines[-1] if lines else f"exited with {self.returncode}"

    def refused_format(self) -> str | None:
        """The demuxer name when the input was refused by ``-format_whitelist``, else None."""
        match = _REFUSED.search(self.stderr)
        return match.group(1) if match else None


def refusal_message(demuxer: str) -> str:
    """The quarantine reason for a refused container format."""
    return (f"container format {demuxer!r} is not on the allow-list of single-file video containers: "
            "playlist and reference formats (HLS, DASH, concat, image sequences) could make ffmpeg read "
            "other files, so it was not opened")


def run(cmd: list[str], timeout: float | None = None) -> Result:
    """Run ``cmd`` (an argument list) with ``die_with_parent``; a timeout is exit status 124."""
    try:
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout,
                              preexec_fn=die_with_parent)
    except subprocess.TimeoutExpired:
        return Result(124, b"", f"{os.path.basename(cmd[0])} timed out after {timeout:.0f} s")
    return Result(proc.returncode, proc.stdout, proc.stderr.decode(errors="replace"))


def encoder_names(ffmpeg: str = "ffmpeg") -> set[str]:
    """The encoders this ffmpeg build has (``ffmpeg -encoders``: libx264, libx265, ...); empty if it fails."""
    result = run([ffmpeg, "-hide_banner", "-encoders"], timeout=60)
    if result.returncode != 0:
        return set()
    listing = result.stdout.decode(errors="replace").partition(" ------\n")[2]  # the table after the legend
    return {fields[1] for fields in map(str.split, listing.splitlines()) if len(fields) > 1}

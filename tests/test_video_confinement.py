"""ffprobe and ffmpeg read only the input file: the file protocol alone, allow-listed single-file
containers, the input named as ``file:<absolute path>``. Playlists and reference files (HLS,
concat) are quarantined without opening what they point at; every command repack runs is built
by ffmpeg-python and carries the same confinement."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from repack.transforms.decode_check import decode_command
from repack.transforms.ffmpeg_cli import ALLOWED_FORMATS
from repack.transforms.probe import probe_file
from repack.transforms.transcode import Recipe, build_command, plan_timing, remux_command, transcode_stream
from tests.conftest import read_manifest_json, run_repack
from tests.tools.videos import CLIPS, make_clips

pytestmark = pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="ffmpeg is not installed")
ROOT = Path(__file__).resolve().parents[1]
BY_REL = {c.rel: c for c in CLIPS}


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("confine") / "src"
    make_clips(root, [BY_REL["junk/playlist.mp4"], BY_REL["good/h264.mp4"]])
    return root


def test_hls_playlist_pointing_outside_is_refused_unread(src, tmp_path):
    playlist = src / "junk/playlist.mp4"
    target = playlist.read_text().splitlines()[4]
    assert target.startswith("../../") and (playlist.parent / target).resolve().exists()
    # what a plain ffprobe does: it follows the playlist out of the source root and reports the segment
    plain = json.loads(subprocess.run(["ffprobe", "-v", "error", "-of", "json", "-show_format", "-show_streams",
                                       str(playlist)], capture_output=True, text=True, check=True).stdout)
    assert plain["format"]["format_name"] == "hls" and plain["streams"][0]["codec_name"] == "h264"
    # repack's probe refuses the demuxer. Proof that nothing outside is opened: the segment is now a
    # FIFO with no writer, which would block any reader until the timeout
    fifo = (playlist.parent / target).resolve()
    fifo.unlink()
    os.mkfifo(fifo)
    info = probe_file(str(playlist), timeout=20)
    assert info["error_code"] == "format_refused" and "'hls'" in info["error"] and "allow-list" in info["error"]


def test_reference_formats_and_odd_names(tmp_path, src):
    outside = tmp_path / "outside.mp4"
    shutil.copy(src / "good/h264.mp4", outside)
    (tmp_path / "src/c").mkdir(parents=True)
    (tmp_path / "src/c/list.mp4").write_text(f"ffconcat version 1.0\nfile '{outside}'\n")
    shutil.copy(src / "good/h264.mp4", tmp_path / "src/c/concat:x.mp4")  # a name that looks like a protocol
    shutil.copy(src / "good/h264.mp4", tmp_path / "src/c/-i.mp4")       # a name that looks like an option
    assert probe_file(str(tmp_path / "src/c/list.mp4"))["error_code"] == "format_refused"
    for name in ("concat:x.mp4", "-i.mp4"):
        assert probe_file(str(tmp_path / "src/c" / name))["codec"] == "h264"
    out = tmp_path / "out"
    run_repack("video", tmp_path / "src", out, "--transcode", "--quiet")
    manifest = read_manifest_json(out)
    assert {e["source"] for e in manifest["shards"]} == {"c/concat:x.mp4", "c/-i.mp4"}
    [refused] = manifest["quarantine"]
    assert refused["source"] == "c/list.mp4" and refused["codes"] == ["format_refused"]
    assert "'concat'" in refused["reason"] and "other files" in refused["reason"]


def test_a_listed_file_named_dot_mp4_is_quarantined_with_the_reason(tmp_path):
    hidden = tmp_path / "in" / ".mp4"
    hidden.parent.mkdir()
    hidden.write_text("#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1.0,\n../../outside/secret.ts\n#EXT-X-ENDLIST\n")
    (tmp_path / "list.csv").write_text("path,label\nin/.mp4,a\n")
    out = tmp_path / "out"
    proc = run_repack("video", tmp_path / "list.csv", out, "--list", "--transcode", "--quiet", check=False)
    assert proc.returncode == 7 and "nothing was packed" in proc.stderr  # its only input was refused
    [record] = read_manifest_json(out)["quarantine"]
    assert record["source"] == "in/.mp4" and record["codes"] == ["format_refused"] and "'hls'" in record["reason"]


def test_every_command_is_confined_to_the_input_file(src):
    path = str(src / "good/h264.mp4")
    info = probe_file(path)
    commands = [build_command(path, "/o.mp4", info, Recipe()), remux_command(path, "/o.mp4"),
                decode_command(path, info["stream_index"])]
    for cmd in commands:
        i = cmd.index("-i")
        assert cmd[i + 1] == "file:" + os.path.abspath(path)
        assert cmd[cmd.index("-protocol_whitelist") + 1] == "file" and cmd.index("-protocol_whitelist") < i
        assert cmd[cmd.index("-format_whitelist") + 1].split(",") == list(ALLOWED_FORMATS)
    assert not {"hls", "dash", "concat", "image2", "tee"} & set(ALLOWED_FORMATS)


def test_commands_are_built_with_ffmpeg_python(src):
    """The transcode is an ffmpeg-python graph; compiling it gives the command repack runs."""
    import ffmpeg

    path = str(src / "good/h264.mp4")
    info = probe_file(path)
    graph = transcode_stream(path, "/o.mp4", info, Recipe(), plan_timing(info))
    assert isinstance(graph, ffmpeg.nodes.OutputStream)
    assert ffmpeg.compile(graph)[1:] == [a for a in build_command(path, "/o.mp4", info, Recipe())[1:]
                                         if a not in ("-nostdin", "-hide_banner", "-loglevel", "error", "-y")]


def test_only_ffmpeg_cli_starts_ffmpeg_or_ffprobe():
    """No other repack module that mentions ffmpeg/ffprobe starts processes itself."""
    starters = []
    for path in sorted((ROOT / "repack").rglob("*.py")):
        text = path.read_text()
        imports = {alias.name for node in ast.walk(ast.parse(text)) if isinstance(node, (ast.Import, ast.ImportFrom))
                   for alias in node.names} | {node.module for node in ast.walk(ast.parse(text))
                                               if isinstance(node, ast.ImportFrom) and node.module}
        if ("ffmpeg" in text or "ffprobe" in text) and ("subprocess" in imports or "Popen" in imports):
            starters.append(path.relative_to(ROOT).as_posix())
    assert starters == ["repack/transforms/ffmpeg_cli.py"]


def test_every_input_has_output_names_no_other_input_can_take():
    """``output_names``: an input's copied and transcoded names are no other input's, whichever of the two
    each input ends up with (``a/clip``, with no extension and transcoded, was written over ``a/clip.mp4``,
    copied, and the job failed at its end naming the path twice)."""
    from repack.jobs.video import output_names

    rels = ["a/clip", "a/clip.mp4", "a/x.mkv", "a/x.mp4", "a/x.mkv.mp4", "b/y.mov", "b/y.MOV", "b/y"]
    names = output_names(rels)
    for i, (copied, transcoded) in enumerate(names):
        others = {name for j, pair in enumerate(names) if j != i for name in pair}
        assert copied not in others and transcoded not in others, (rels[i], copied, transcoded)
    assert names[1] == ("a/clip.mp4", "a/clip.mp4") and names[0][1].startswith("_renamed/00000000_clip")

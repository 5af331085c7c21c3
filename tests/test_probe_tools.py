"""The in-process probe (PyAV) against the ffprobe subprocess on every test clip: the same record
field by field and the same decision for every target and DALI reader; where PyAV cannot give
a field (AVI timestamps, libavformat errors, refused containers) the probe falls back to
ffprobe, and the container-header facts (MP4 rotation, Matroska projection) are checked on
real files. Real ffmpeg/ffprobe and PyAV throughout."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from repack.transforms.container_facts import matroska_has_projection, mp4_rotations
from repack.transforms.nvdec_rules import DALI_READERS, TARGETS, decide
from repack.transforms.probe import ffprobe_probe, probe_codec, probe_file
from tests.tools.videos import CLIPS, make_clips, make_index_clip, rotate_mp4

av = pytest.importorskip("av")
pytestmark = pytest.mark.skipif(shutil.which("ffprobe") is None, reason="ffprobe is not installed")

# containers (or outcomes) that go to ffprobe by design (repack/transforms/probe_pyav.py)
FFPROBE_BY_DESIGN = {"bad/packed_bframes.avi", "good/mjpeg.avi", "good/mpeg4.avi", "junk/empty.mp4",
                     "junk/playlist.mp4", "junk/truncated.mp4"}


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    root = tmp_path_factory.mktemp("probe-clips")
    made = make_clips(root)
    return {rel: (str(root / rel), ffprobe_probe(str(root / rel)), probe_file(str(root / rel))) for rel in made}


def _differences(by_ffprobe: dict, chosen: dict) -> dict:
    keys = (set(by_ffprobe) | set(chosen)) - {"probe_tool", "probe_fallback"}
    diffs = {k: (by_ffprobe.get(k), chosen.get(k)) for k in sorted(keys) if by_ffprobe.get(k) != chosen.get(k)}
    # libavcodec has no profile names for some codecs (VP8): ffprobe then prints the number, PyAV
    # None. The rule reads profiles of H.264/HEVC only, which have names.
    if "profile" in diffs and diffs["profile"][1] is None and str(diffs["profile"][0]).isdigit() \
            and chosen.get("codec") not in ("h264", "hevc"):
        del diffs["profile"]
    # a packet read short at a cut is flagged corrupt by PyAV's demuxer, never in ffprobe's packet list (the
    # decision is the same: the cut is seen first by the frames or the duration the container declares)
    if diffs.get("corrupt_packets", (None,))[0] == 0:
        del diffs["corrupt_packets"]
    return diffs


@pytest.mark.parametrize("rel", [c.rel for c in CLIPS])
def test_same_record_and_decisions_as_ffprobe(clips, rel):
    if rel not in clips:
        pytest.skip(f"{rel}: encoder not available")
    _, by_ffprobe, chosen = clips[rel]
    assert _differences(by_ffprobe, chosen) == {}
    for target in TARGETS:
        for reader in DALI_READERS:
            assert decide(chosen, target, reader=reader).to_json() == decide(by_ffprobe, target, reader=reader).to_json()
    assert chosen["probe_tool"] == ("ffprobe" if rel in FFPROBE_BY_DESIGN else "pyav")
    assert bool(chosen.get("probe_fallback")) == (rel in FFPROBE_BY_DESIGN)


def test_header_codec_matches_the_full_probe(clips):
    """probe_codec (the container header only, PyAV in-process) names the codec the ffprobe probe
    judges, on every clip (None where it has no main video stream or cannot be read, and for a picture: it
    is no video, and must not choose a dataset's one codec)."""
    from repack.transforms.probe_pyav import is_image_container

    for rel, (path, by_ffprobe, _) in clips.items():
        picture = is_image_container(by_ffprobe.get("container") or "")
        assert probe_codec(path) == (None if picture else by_ffprobe.get("codec")), rel


def test_refused_container_is_never_opened_in_process(clips):
    """The HLS playlist (its segment lies outside the source root) is refused by PyAV's open as
    by ffprobe's: the record names the demuxer, as ffprobe gives it."""
    _, _, chosen = clips["junk/playlist.mp4"]
    assert chosen["error_code"] == "format_refused" and chosen["container"] == "hls"


@pytest.mark.parametrize("degrees", [90, 180])
def test_mp4_rotation_from_track_header_matches_ffprobe(tmp_path, degrees):
    path = tmp_path / f"r{degrees}.mp4"
    make_index_clip(path, 10, ("-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p"))
    rotate_mp4(path, degrees)
    chosen, by_ffprobe = probe_file(str(path)), ffprobe_probe(str(path))
    assert chosen["probe_tool"] == "pyav"
    assert chosen["rotation"] == by_ffprobe["rotation"] == (360 - degrees) % 360
    assert mp4_rotations(str(path)) == {1: (360 - degrees) % 360}


@pytest.mark.parametrize("mirror", ["vflip", "hflip"])
def test_a_mirroring_display_matrix_is_transcoded_as_players_show_it(tmp_path, mirror):
    """A flip in the display matrix (a vertical one has rotation 0) is seen by both probes and transcoded with
    the flip baked in: copied, DALI (which ignores the matrix) would read the picture unflipped."""
    import subprocess

    import numpy as np

    from tests.conftest import read_manifest_json, run_repack

    src = tmp_path / "src"
    src.mkdir()
    path = src / "m.mp4"
    subprocess.run(["ffmpeg", "-hide_banner", "-loglevel", "error", "-f", "lavfi", "-i", "testsrc=size=64x48:rate=25",
                    "-t", "1", "-c:v", "libx264", "-preset", "ultrafast", "-qp", "0", "-g", "25", "-pix_fmt", "yuv420p",
                    str(path)], check=True)

    def first_frame(video: Path) -> np.ndarray:
        with av.open(str(video)) as container:
            return next(container.decode(video=0)).to_ndarray(format="gray").astype(np.int16)

    stored = first_frame(path)
    rotate_mp4(path, mirror)
    chosen, by_ffprobe = probe_file(str(path)), ffprobe_probe(str(path))
    assert chosen["probe_tool"] == "pyav" and chosen["mirrored"] is by_ffprobe["mirrored"] is True
    assert "mirrored" in decide(chosen, "h100").codes
    out = tmp_path / "out"
    run_repack("video", src, out, "--transcode", "--preset", "ultrafast", "--quiet")
    [entry] = read_manifest_json(out)["shards"]
    assert entry["transcoded"] is True
    shown = np.flipud(stored) if mirror == "vflip" else np.fliplr(stored)
    output = first_frame(out / "videos" / "m.mp4")
    assert np.abs(output - shown).mean() < 4 < np.abs(output - stored).mean()


def test_non_square_pixels_are_transcoded_to_square_ones(tmp_path):
    """An otherwise decodable clip stored 64x48 with 16:11 pixels displays 93x48: copied, DALI returned it 64 px
    wide; it is transcoded to square pixels now, as a rotated one is."""
    import subprocess

    from tests.conftest import read_manifest_json, run_repack

    src = tmp_path / "src"
    src.mkdir()
    subprocess.run(["ffmpeg", "-hide_banner", "-loglevel", "error", "-f", "lavfi", "-i", "testsrc=size=64x48:rate=25",
                    "-t", "1", "-vf", "setsar=16/11", "-c:v", "libx264", "-preset", "ultrafast", "-g", "25", "-bf", "0",
                    "-pix_fmt", "yuv420p", str(src / "a.mp4")], check=True)
    info = probe_file(str(src / "a.mp4"))
    assert info["sar"] == "16:11" and decide(info, "h100").codes == ["non_square_pixels"]
    out = tmp_path / "out"
    run_repack("video", src, out, "--transcode", "--preset", "ultrafast", "--quiet")
    [entry] = read_manifest_json(out)["shards"]
    output = probe_file(str(out / entry["path"]))
    assert entry["transcoded"] is True and output["sar"] in ("1:1", None)
    assert (output["width"], output["height"]) == (92, 48)  # 93 px wide, made even


def test_a_raw_h264_stream_keeps_its_declared_frame_rate(tmp_path):
    """A raw .h264 stream (no container timestamps) of 25 fps: PyAV's base rate is its field rate (50), so it was
    transcoded at 50 fps, half its duration. Its rate is ffprobe's now (the probe falls back, naming why)."""
    import subprocess

    from tests.conftest import read_manifest_json, run_repack

    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    subprocess.run(["ffmpeg", "-hide_banner", "-loglevel", "error", "-f", "lavfi", "-i", "testsrc2=s=160x120:r=25:d=2",
                    "-c:v", "libx264", "-preset", "ultrafast", "-g", "25", "-bf", "0", "-pix_fmt", "yuv420p", "-f",
                    "h264", str(src / "clip.h264")], check=True)
    info = probe_file(str(src / "clip.h264"))
    assert info["probe_tool"] == "ffprobe" and "raw 'h264' stream" in info["probe_fallback"]
    out = tmp_path / "out"
    run_repack("video", src.parent, out, "--probe", "--transcode", "--preset", "ultrafast", "--quiet")
    [entry] = read_manifest_json(out)["shards"]
    assert (entry["fps"], entry["frames_in"], entry["frames_out"], entry["duration_s"]) == (25.0, 50, 50, 2.0)


def test_a_clip_slower_than_one_frame_per_max_gop_with_every_frame_a_keyframe_is_no_long_gop(tmp_path):
    """0.5 fps, every frame a keyframe: the 2 s gap costs no seek (it was transcoded for nothing, then quarantined
    as "still not GPU-decodable"); the same rate with a frame between keyframes is a long GOP."""
    import subprocess

    for gop, long in ((1, False), (2, True)):
        path = tmp_path / f"slow{gop}.mp4"
        subprocess.run(["ffmpeg", "-hide_banner", "-loglevel", "error", "-f", "lavfi", "-i", "testsrc=s=64x48:r=0.5:d=8",
                        "-c:v", "libx264", "-preset", "ultrafast", "-g", str(gop), "-bf", "0", "-pix_fmt", "yuv420p",
                        str(path)], check=True)
        assert ("long_gop" in decide(probe_file(str(path)), "h100").codes) is long, gop


def _element(ident: bytes, payload: bytes) -> bytes:
    assert len(payload) < 127
    return ident + bytes([0x80 | len(payload)]) + payload


def _matroska_header(video_children: bytes) -> bytes:
    """EBML header + Segment { Info, Tracks { TrackEntry { Video { ... } } } }, real element IDs."""
    ebml = _element(b"\x1a\x45\xdf\xa3", _element(b"\x42\x82", b"matroska"))
    video = _element(b"\xe0", _element(b"\xb0", b"\x40") + _element(b"\xba", b"\x30") + video_children)
    tracks = _element(b"\x16\x54\xae\x6b", _element(b"\xae", _element(b"\xd7", b"\x01") + video))
    info = _element(b"\x15\x49\xa9\x66", _element(b"\x2a\xd7\xb1", b"\x0f\x42\x40"))
    return ebml + _element(b"\x18\x53\x80\x67", info + tracks)


def test_matroska_projection_walk(tmp_path, clips):
    assert matroska_has_projection(clips["bad/vfr.mkv"][0]) is False
    assert matroska_has_projection(clips["good/vp9.webm"][0]) is False
    cases = {"plain.mkv": (_matroska_header(b""), False),
             # Projection (0x7670) { ProjectionType (0x7671) = 0 }: PyAV cannot read its rotation
             "projection.mkv": (_matroska_header(_element(b"\x76\x70", _element(b"\x76\x71", b"\x00"))), True),
             "junk.mkv": (b"\x00" * 64, None)}
    for name, (data, expected) in cases.items():
        (tmp_path / name).write_bytes(data)
        assert matroska_has_projection(str(tmp_path / name)) is expected, name


def test_a_right_ntsc_header_over_hours_is_not_called_wrong_and_a_drifting_one_is():
    """The header rule compares times: a rounded measured rate called a right 29.97 header wrong after ~3 h."""
    from fractions import Fraction

    from repack.transforms.nvdec_rules import decide
    from repack.transforms.probe import packet_stats

    def reasons(header: float, frames: int, ticks: int, time_base: Fraction, last_ticks: int | None = None) -> list:
        packets = [{"pts": i * ticks, "flags": "K" if i % 30 == 0 else ""} for i in range(frames)]
        stats = packet_stats(packets, time_base, 10**12)
        if last_ticks is not None:  # a last sample that lasts longer: the header's average rate is lower
            header = frames / float((frames - 1) * ticks * time_base + last_ticks * time_base)
        info = {"codec": "h264", "profile": "High", "width": 1280, "height": 720, "pix_fmt": "yuv420p",
                "bit_depth": 8, "chroma": "420", "field_order": "progressive", "sar": "1:1", "avg_frame_rate": header,
                "r_frame_rate": header, "nb_frames": frames, "video_streams": [{}], "container": "mov,mp4", **stats}
        return [r["code"] for r in decide(info, max_gop_s=2.0).reasons]

    assert "rate_header_wrong" not in reasons(30000 / 1001, 5 * 3600 * 30, 1001, Fraction(1, 30000))
    assert "rate_header_wrong" not in reasons(24000 / 1001, 6 * 3600 * 24, 1001, Fraction(1, 24000))
    assert "rate_header_wrong" not in reasons(25.0, 100, 512, Fraction(1, 12800), last_ticks=512 * 13 // 10)
    assert "rate_header_wrong" in reasons(25.0, 100, 512, Fraction(1, 12800), last_ticks=512 * 19 // 10)

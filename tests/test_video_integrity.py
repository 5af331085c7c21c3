"""`repack video` keeps what the source has: every frame (packed B-frames without timestamps,
VFR resampled by time, a lost frame quarantined with both counts), square pixels after a scale or
pad, a moov-at-end MP4 remuxed with faststart without re-encoding, and `--verify decode` catching
a corrupt middle. Every count is checked against an independent ffprobe pass."""

from __future__ import annotations

import json
import shutil
from fractions import Fraction
from pathlib import Path

import pytest

from repack.transforms.probe import probe_file
from repack.transforms.transcode import Timing, frames_problem, plan_timing
from tests.conftest import read_manifest_json, run_repack
from tests.tools.videos import CLIPS, ffprobe_json, make_clips

pytestmark = pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="ffmpeg is not installed")
BY_REL = {c.rel: c for c in CLIPS}
USED = ("bad/packed_bframes.avi", "bad/vfr.mkv", "bad/sar_pad.mp4", "bad/corrupt_middle.mp4", "good/moov_at_end.mp4",
        "good/h264.mp4")


def decoded_frames(path: Path) -> int:
    """Frames the first video stream decodes to (ffprobe -count_frames)."""
    data = ffprobe_json(path, "-select_streams", "v:0", "-count_frames", "-show_entries", "stream=nb_read_frames")
    return int(data["streams"][0]["nb_read_frames"])


def video_packets(path: Path) -> list[tuple]:
    """(pts, dts, size, flags, MD5 of the data) of every packet of the first video stream."""
    data = ffprobe_json(path, "-select_streams", "v:0", "-show_entries", "packet=pts,dts,size,flags,data_hash",
                        "-show_data_hash", "MD5")
    return [(p.get("pts"), p.get("dts"), p["size"], p["flags"], p["data_hash"]) for p in data["packets"]]


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("integrity") / "src"
    make_clips(root, [BY_REL[rel] for rel in USED])
    return root


@pytest.fixture(scope="module")
def out(src, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("integrity-out") / "out"
    run_repack("video", src, out, "--transcode", "--preset", "ultrafast", "--quiet")
    return out


@pytest.fixture(scope="module")
def entries(out) -> dict:
    return {e["source"]: e for e in read_manifest_json(out)["shards"]}


def test_packed_bframes_avi_keeps_every_frame(src, out, entries):
    """41 of 120 packets without a timestamp: the rate comes from the stream's declared rate and
    every frame is kept (the measured 20 fps would have dropped a third of the clip)."""
    path = src / "bad/packed_bframes.avi"
    info = probe_file(str(path))
    declared = float(Fraction(ffprobe_json(path, "-show_streams")["streams"][0]["r_frame_rate"]))
    assert info["missing_pts"] > 0 and info["fps_measured"] < 0.8 * declared  # the trap
    timing = plan_timing(info)
    assert (timing.rate_from, timing.mode, timing.rate_text) == ("declared", "keep", "30000/1001")
    frames = decoded_frames(path)
    entry = entries["bad/packed_bframes.avi"]
    assert entry["frames_in"] == entry["frames_out"] == frames == info["packets"]
    assert decoded_frames(out / entry["path"]) == frames
    assert entry["fps"] == pytest.approx(declared, rel=1e-3)
    assert entry["duration_s"] == pytest.approx(frames / declared, abs=0.02)


def test_vfr_is_resampled_by_time(src, entries):
    info = probe_file(str(src / "bad/vfr.mkv"))
    entry = entries["bad/vfr.mkv"]
    assert info["irregular_intervals"] and entry["frame_timing"] == "resample"
    assert abs(entry["frames_out"] - round(info["span_s"] * entry["fps"])) <= 1
    assert entry["duration_s"] == pytest.approx(info["span_s"], abs=1 / entry["fps"] + 1e-3)


def test_lost_frames_are_quarantined_with_both_numbers(src, out):
    path = src / "bad/corrupt_middle.mp4"
    record = next(q for q in read_manifest_json(out)["quarantine"] if q["source"] == "bad/corrupt_middle.mp4")
    assert record["codes"] == ["frames_changed"]
    assert record["frames_in"] == probe_file(str(path))["packets"]
    assert record["frames_out"] == decoded_frames(path) < record["frames_in"] - 1
    assert f"{record['frames_in']} frames" in record["reason"] and f"{record['frames_out']} frames" in record["reason"]
    assert not list((out / "videos" / "bad").glob("corrupt_middle*"))


def test_frame_check_tolerates_one_frame():
    timing = Timing(25.0, "25", "keep", "measured", 100, 100, 4.0)
    assert frames_problem(timing, {"frames": 99}) is None and frames_problem(timing, {"frames": 101}) is None
    assert "the output has 98 frames" in frames_problem(timing, {"frames": 98, "span_s": 3.92})


def test_scaled_or_padded_output_has_square_pixels(src, out, entries):
    """24x32 stored with 4:3 pixels displays as 32x32: scaled to 32x32 square pixels and padded to
    H.264's 48-pixel minimum width, SAR 1:1 (not 4:3, which would display as 2:1)."""
    import av
    import numpy as np

    assert ffprobe_json(src / "bad/sar_pad.mp4", "-show_streams")["streams"][0]["sample_aspect_ratio"] == "4:3"
    entry = entries["bad/sar_pad.mp4"]
    stream = ffprobe_json(out / entry["path"], "-show_streams")["streams"][0]
    assert (stream["width"], stream["height"]) == (48, 32)
    assert (stream["sample_aspect_ratio"], stream["display_aspect_ratio"]) == ("1:1", "3:2")
    with av.open(str(out / entry["path"])) as container:
        luma = next(container.decode(video=0)).to_ndarray(format="gray").astype(int)
    assert luma[:, :8].max() <= 20 and luma[:, 40:].max() <= 20  # the pad bars: black
    assert luma[:, 8:40].mean() > 40  # the 32x32 picture between them
    for rel in ("bad/packed_bframes.avi", "bad/vfr.mkv"):
        stream = ffprobe_json(out / entries[rel]["path"], "-show_streams")["streams"][0]
        assert stream["sample_aspect_ratio"] == "1:1"


def test_moov_at_end_copy_is_remuxed_with_faststart(src, out, entries):
    source = src / "good/moov_at_end.mp4"
    entry = entries["good/moov_at_end.mp4"]
    assert probe_file(str(source))["moov_after_mdat"]
    assert entry["remuxed"] and not entry["transcoded"] and entry["path"] == "videos/good/moov_at_end.mp4"
    output = out / entry["path"]
    assert not probe_file(str(output))["moov_after_mdat"]
    data = output.read_bytes()
    assert data.index(b"moov") < data.index(b"mdat")
    assert video_packets(output) == video_packets(source)  # stream copy: the same packets, no re-encode
    faststart = entries["good/h264.mp4"]  # already faststart: copied byte for byte
    assert not faststart["remuxed"] and (out / faststart["path"]).read_bytes() == (src / "good/h264.mp4").read_bytes()


def test_verify_decode_rejects_a_corrupt_middle(src, tmp_path):
    """The packet scan sees only a long GOP; a full decode finds the decoder errors. The record is
    the same on every run (log pointers stripped)."""
    pick = tmp_path / "src"
    for rel in ("bad/corrupt_middle.mp4", "good/h264.mp4"):
        (pick / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / rel, pick / rel)
    run_repack("video", pick, tmp_path / "scan", "--quiet")
    scan = {r["source"]: r for r in map(json.loads, (tmp_path / "scan/probe.jsonl").read_text().splitlines())}
    assert scan["bad/corrupt_middle.mp4"]["decision"] == "transcode"
    assert [r["code"] for r in scan["bad/corrupt_middle.mp4"]["reasons"]] == ["long_gop"]
    assert "decode_errors" not in scan["bad/corrupt_middle.mp4"] and scan["good/h264.mp4"]["verify"] == "packets"
    runs = []
    for name in ("a", "b"):
        run_repack("video", pick, tmp_path / name, "--verify", "decode", "--quiet")
        runs.append((tmp_path / name / "probe.jsonl").read_bytes())
    assert runs[0] == runs[1]
    decoded = {r["source"]: r for r in map(json.loads, runs[0].decode().splitlines())}
    bad, good = decoded["bad/corrupt_middle.mp4"], decoded["good/h264.mp4"]
    assert bad["decision"] == "reject" and [r["code"] for r in bad["reasons"]] == ["decode_errors"]
    assert bad["decode_errors"] > 0 and bad["decode_messages"] and "0x" not in " ".join(bad["decode_messages"])
    assert bad["decoded_frames"] == decoded_frames(pick / "bad/corrupt_middle.mp4")
    assert good["decision"] == "ok" and good["decode_errors"] == 0 and good["decoded_frames"] == good["packets"]
    manifest = read_manifest_json(tmp_path / "a")
    assert manifest["verify"] == "decode"
    assert [q["codes"] for q in manifest["quarantine"]] == [["decode_errors"]]


def test_a_stall_in_a_regular_capture_drops_no_frame(tmp_path):
    """A 25 fps capture with 15 frames lost to a stall (mean rate 17.5): resampled on the grid of its median
    interval, every source frame is in the output in order and only the gap is filled by repeats."""
    import subprocess

    import av
    import numpy as np

    src = tmp_path / "src"
    src.mkdir()
    subprocess.run(["ffmpeg", "-hide_banner", "-loglevel", "error", "-f", "lavfi", "-i",
                    "color=c=black:s=64x48:r=25:d=2,format=gray,geq=lum='16+4*N'", "-frames:v", "50",
                    "-vf", r"select='not(between(n\,20\,34))',format=yuv420p", "-fps_mode", "vfr",
                    "-c:v", "libx264", "-qp", "0", "-g", "25", "-bf", "0", str(src / "stall.mp4")], check=True)
    out = tmp_path / "out"
    run_repack("video", src, out, "--transcode", "--preset", "ultrafast", "--quiet")
    [entry] = read_manifest_json(out)["shards"]
    assert entry["frame_timing"] == "resample" and entry["fps"] == 25

    def frame_numbers(path: Path) -> list[int]:  # frame N has luma 16 + 4N
        with av.open(str(path)) as container:
            return [int(round((float(np.median(f.to_ndarray(format="gray"))) - 16) / 4))
                    for f in container.decode(video=0)]

    source, output = frame_numbers(src / "stall.mp4"), frame_numbers(out / "videos" / "stall.mp4")
    assert len(source) == 35 and list(dict.fromkeys(output)) == source
    assert len(output) == entry["frames_out"] == 50


def test_frames_in_bursts_keep_the_mean_rate():
    """Pairs of frames 2 ms apart every 80 ms have no grid: their median interval's 1000 fps would make 2,002
    frames of 52 (and quarantine the output); past 240 fps the mean rate is kept. A long stall keeps its grid
    (its mean rate, 2.5 fps, dropped 17 of 20 frames)."""
    info = {"frames": 52, "fps": 25.974, "frame_interval_s": 0.001, "irregular_intervals": 25, "span_s": 2.002}
    timing = plan_timing(info)
    assert (timing.mode, timing.rate, timing.rate_from, timing.expected_frames) == ("resample", 25.974, "measured", 52)
    stall = {"frames": 35, "fps": 17.5, "frame_interval_s": 0.04, "irregular_intervals": 1, "span_s": 2.0}
    assert (plan_timing(stall).rate, plan_timing(stall).rate_from) == (25.0, "median interval")
    long_stall = {"frames": 20, "fps": 2.5, "frame_interval_s": 0.04, "irregular_intervals": 1, "span_s": 8.0}
    assert (plan_timing(long_stall).rate, plan_timing(long_stall).expected_frames) == (25.0, 200)
    idle = {"frames": 101, "fps": 0.028, "frame_interval_s": 1 / 240, "irregular_intervals": 1, "span_s": 3600.0}
    assert plan_timing(idle).rate_from == "measured"  # 864,000 repeats at 240 fps: the mean rate


def ffmpeg(*args) -> None:
    import subprocess

    subprocess.run(["ffmpeg", "-hide_banner", "-loglevel", "error", "-y", *map(str, args)], check=True)


def reason_codes(out: Path) -> set[str]:
    """The decision reasons of a one-video dataset's probe record."""
    record, = map(json.loads, (out / "probe.jsonl").read_text().splitlines())
    return {reason["code"] for reason in record["reasons"]}


def test_a_rate_change_within_a_fifth_is_variable_frame_rate(tmp_path):
    """1 s at 25 fps then 1 s at 30 fps: no interval differs from the median by 20 %, but the frames stray 2.5
    frames from the average rate, where a reader places them: resampled, never copied with the average rate."""
    parts = []
    for rate in (25, 30):
        parts.append(tmp_path / f"{rate}.mp4")
        ffmpeg("-f", "lavfi", "-i", f"testsrc=size=64x48:rate={rate}:duration=1", "-c:v", "libx264", "-preset",
               "ultrafast", "-bf", "0", "-pix_fmt", "yuv420p", "-video_track_timescale", "30000", parts[-1])
    (tmp_path / "list.txt").write_text("".join(f"file '{p}'\n" for p in parts))
    src = tmp_path / "src"
    src.mkdir()
    ffmpeg("-f", "concat", "-safe", "0", "-i", tmp_path / "list.txt", "-c", "copy", src / "v25_30.mp4")
    info = probe_file(str(src / "v25_30.mp4"))
    assert not info["irregular_intervals"] and info["grid_drift_frames"] > 2
    out = tmp_path / "out"
    run_repack("video", src, out, "--transcode", "--preset", "ultrafast", "--quiet")
    entry = read_manifest_json(out)["shards"][0]
    assert reason_codes(out) == {"vfr"} and entry["frame_timing"] == "resample" and entry["fps"] == 30
    assert decoded_frames(out / entry["path"]) == entry["frames"] == 60


def test_an_open_gop_cut_at_its_start_counts_the_frames_a_decoder_outputs(tmp_path):
    """An H.264 stream cut with -c copy at an open GOP's keyframe: its two leading B-frames reference the GOP
    before the cut, so no decoder outputs them. It was copied with 2 frames more than it decodes to (the
    readers failed on the last clips); now transcoded, and the entry counts what decodes."""
    ffmpeg("-f", "lavfi", "-i", "testsrc=size=64x48:rate=25:duration=3", "-c:v", "libx264", "-preset", "medium",
           "-g", "12", "-keyint_min", "12", "-sc_threshold", "0", "-bf", "2", "-pix_fmt", "yuv420p",
           "-x264-params", "open-gop=1:b-pyramid=0:b-adapt=0", tmp_path / "full.ts")
    src = tmp_path / "src"
    src.mkdir()
    ffmpeg("-ss", "1.0", "-i", tmp_path / "full.ts", "-c", "copy", src / "cut.ts")
    decodable = decoded_frames(src / "cut.ts")
    info = probe_file(str(src / "cut.ts"))
    assert info["first_packet_key"] and info["leading_packets"] == info["packets"] - decodable > 0
    out = tmp_path / "out"
    run_repack("video", src, out, "--transcode", "--preset", "ultrafast", "--quiet")
    entry = read_manifest_json(out)["shards"][0]
    assert reason_codes(out) == {"open_gop_start"}
    assert entry["frames_in"] == entry["frames"] == decodable == decoded_frames(out / entry["path"])


def test_the_entry_duration_is_the_videos_not_the_files(tmp_path):
    """2 s of video beside 5 s of audio: the entry says 2 s (it said the file's 5 s)."""
    src = tmp_path / "src"
    src.mkdir()
    ffmpeg("-f", "lavfi", "-i", "testsrc=size=64x48:rate=25:duration=2", "-f", "lavfi", "-i", "sine=duration=5",
           "-map", "0:v", "-map", "1:a", "-c:v", "libx264", "-preset", "ultrafast", "-bf", "0", "-g", "12",
           "-pix_fmt", "yuv420p", "-c:a", "aac", "-movflags", "+faststart", src / "long_audio.mp4")  # copied as is, its audio too
    out = tmp_path / "out"
    run_repack("video", src, out, "--transcode", "--quiet")
    entry = read_manifest_json(out)["shards"][0]
    assert entry["frames"] == 50 and entry["duration_s"] == pytest.approx(2.0, abs=0.01)

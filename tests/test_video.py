"""`repack video`: probe + NVDEC decision on generated clips of every branch, transcode, resume,
determinism, webdataset packing and failure modes. Real ffmpeg/ffprobe throughout."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

from repack.transforms.nvdec_rules import decide
from repack.transforms.probe import probe_file
from repack.transforms.transcode import Recipe, build_command, gop_frames, output_geometry, snap_rate
from tests.conftest import read_manifest_json, run_repack
from tests.tools.videos import CLIPS, encoders, make_clips, make_index_clip, video_codecs

pytestmark = pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="ffmpeg is not installed")


@pytest.fixture(scope="session")
def video_clips(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("clips")
    return root, make_clips(root)


@pytest.fixture(scope="session")
def transcoded(video_clips, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("video-out") / "out"
    run_repack("video", video_clips[0], out, "--transcode", "--shard-size", "4", "--quiet", "--preset", "ultrafast")
    return out


@pytest.mark.parametrize("reader", ["experimental", "legacy"])
@pytest.mark.parametrize("clip", CLIPS, ids=[c.rel for c in CLIPS])
def test_decision_and_reasons_per_branch(video_clips, clip, reader):
    root, made = video_clips
    if clip.rel not in made:
        pytest.skip(f"this ffmpeg has no {clip.needs} encoder")
    verdict = decide(probe_file(str(root / clip.rel)), "h100", 1.0, reader=reader)
    decision, reasons = clip.expected(reader)
    assert verdict.decision == decision, verdict.reasons
    assert set(verdict.codes) == set(reasons), verdict.reasons
    assert all(r["message"] for r in verdict.reasons)


def test_av1_depends_on_target(video_clips):
    root, made = video_clips
    if "bad/av1.mkv" not in made:
        pytest.skip("this ffmpeg has no AV1 encoder (libaom-av1)")
    info = probe_file(str(root / "bad/av1.mkv"))
    assert decide(info, "h100").codes == ["codec"]
    assert decide(info, "a100", reader="experimental").codes == ["codec"]
    assert decide(info, "l4", reader="experimental").decision == "ok"
    assert decide(info, "l40", reader="experimental").decision == "ok"
    assert decide(info, "l4").codes == ["legacy_one_codec"]  # the default legacy fn.readers.video has no AV1


def test_max_gop_threshold(video_clips):
    info = probe_file(str(video_clips[0] / "bad/long_gop.mp4"))
    assert info["max_gop_s"] == pytest.approx(2.0) and info["keyframes"] == 1
    assert decide(info, "h100", max_gop_s=1.0).codes == ["long_gop"]
    assert decide(info, "h100", max_gop_s=3.0).decision == "ok"


def test_probe_cli_report_and_strict(video_clips, tmp_path):
    root, made = video_clips
    proc = run_repack("video", root, tmp_path / "p", "--probe", "--json", "--quiet")
    summary = json.loads(proc.stdout)
    lines = [json.loads(x) for x in (tmp_path / "p" / "probe.jsonl").read_text().splitlines()]
    assert sorted(rec["source"] for rec in lines) == sorted(made)
    expected = {d: sum(1 for c in made.values() if c.expected()[0] == d) for d in ("ok", "transcode", "reject")}
    assert summary["decisions"] == expected
    by_source = {rec["source"]: rec for rec in lines}
    for rel, clip in made.items():
        assert by_source[rel]["dali_reader"] == "legacy"  # the default
        assert by_source[rel]["decision"] == clip.expected()[0]
        assert {r["code"] for r in by_source[rel]["reasons"]} == set(clip.expected()[1])
    assert not (tmp_path / "p" / "videos").exists()
    human = run_repack("video", root, tmp_path / "p2", "--probe")
    assert "need transcoding" in human.stdout and "several_video_streams" in human.stdout
    strict = run_repack("video", root, tmp_path / "p3", "--probe", "--strict", check=False)
    assert strict.returncode == 6


def test_transcode_outputs_pass_the_rule(video_clips, transcoded):
    root, made = video_clips
    manifest = read_manifest_json(transcoded)
    entries = {e["source"]: e for e in manifest["shards"]}
    usable = {rel for rel, c in made.items() if c.expected()[0] != "reject" and not c.quarantined}
    assert set(entries) == usable
    codes = {q["source"]: q["codes"] for q in manifest["quarantine"]}
    assert codes == {rel: [c.quarantined or next(iter(c.expected()[1]))] for rel, c in made.items()
                     if c.expected()[0] == "reject" or c.quarantined}
    for rel, entry in entries.items():
        source = probe_file(str(root / rel))
        assert entry["transcoded"] == (made[rel].expected()[0] == "transcode")
        assert entry["remuxed"] == (not entry["transcoded"] and source["moov_after_mdat"])
        if entry["transcoded"]:
            assert entry["path"].endswith(".mp4") and entry["codec"] == "h264"
        elif not entry["remuxed"]:
            assert (transcoded / entry["path"]).read_bytes() == (root / rel).read_bytes()
        output = probe_file(str(transcoded / entry["path"]))
        again = decide(output, "h100", 1.0)
        assert again.decision == "ok", (rel, again.reasons)
        assert entry["frames"] >= 2 and entry["fps"] > 0 and entry["width"] % 2 == 0
        assert entry["frames_out"] == entry["frames"] == output["frames"]
        assert abs(entry["frames_out"] - entry["frames_in"]) <= 1 or entry["frame_timing"] == "resample"
        assert not output["moov_after_mdat"]
    rot = entries["bad/rotated.mp4"]
    assert (rot["width"], rot["height"]) == (120, 160)  # rotation baked in
    assert (entries["bad/tiny.mp4"]["width"], entries["bad/tiny.mp4"]["height"]) == (48, 32)  # padded to 48x16 min
    listing = (transcoded / "file_list.txt").read_text().splitlines()
    assert listing == [f"{e['path']} {e['cls']}" for e in manifest["shards"]]
    assert manifest["classes"] == {"bad": 0, "good": 1, "junk": 2}
    assert run_repack("verify", transcoded).returncode == 0
    again = run_repack("video", root, transcoded, "--transcode", "--shard-size", "4", "--preset", "ultrafast")
    assert "nothing to do" in again.stdout


def test_reader_datasets_one_codec_or_mixed(video_clips, transcoded, tmp_path):
    """DALI's legacy fn.readers.video (the default) reads one codec per reader (on the H200 a
    dataset of H.264 and HEVC outputs failed: "... is not the same codec as previous files").
    Judged for it, only H.264 stays as is and every other codec is transcoded (legacy_one_codec),
    file by file; an independent ffprobe finds H.264 in every output. Judged for the experimental
    reader, the same inputs keep their mix of codecs. Codecs are checked, not decoding: DALI's CPU
    backend has no H.264 decoder (tests/gpu/gpu_video.py reads both datasets whole on the GPU)."""
    root, made = video_clips
    mixed = tmp_path / "mixed"
    run_repack("video", root, mixed, "--transcode", "--dali-reader", "experimental", "--shard-size", "4", "--quiet",
               "--preset", "ultrafast")
    for out, reader in ((transcoded, "legacy"), (mixed, "experimental")):
        manifest = read_manifest_json(out)
        assert manifest["dali_reader"] == reader
        probes = {p["source"]: p for p in map(json.loads, (out / "probe.jsonl").read_text().splitlines())}
        for rel, clip in made.items():
            decision, reasons = clip.expected(reader)
            assert (probes[rel]["decision"], {r["code"] for r in probes[rel]["reasons"]}) == (decision, set(reasons))
            assert probes[rel]["dali_reader"] == reader
        one_codec = sum(1 for c in made.values() if "legacy_one_codec" in c.expected(reader)[1])
        assert manifest["stats"]["reasons"].get("legacy_one_codec", 0) == one_codec
        assert one_codec > 0 if reader == "legacy" else one_codec == 0
        entries = {e["source"]: e for e in manifest["shards"]}
        assert set(entries) == {rel for rel, c in made.items() if c.expected(reader)[0] != "reject" and not c.quarantined}
        for rel, entry in entries.items():
            assert entry["transcoded"] == (made[rel].expected(reader)[0] == "transcode")
            assert decide(probe_file(str(out / entry["path"])), "h100", 1.0, reader=reader).decision == "ok"
    codecs = {out: {codec for e in read_manifest_json(out)["shards"] for codec in video_codecs(out / e["path"])}
              for out in (transcoded, mixed)}
    assert codecs[transcoded] == {"h264"}
    assert {"h264", "mpeg4"} <= codecs[mixed]  # the same inputs for the experimental reader: several codecs kept


def test_transcode_is_deterministic_and_resumes(video_clips, tmp_path):
    src = tmp_path / "src"
    for rel in ("bad/interlaced.mp4", "bad/vfr.mkv", "good/h264.mp4", "good/moov_at_end.mp4"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(video_clips[0] / rel, src / rel)
    args = ("--transcode", "--shard-size", "1", "--preset", "ultrafast", "--quiet")
    run_repack("video", src, tmp_path / "a", *args)
    run_repack("video", src, tmp_path / "b", *args, "--workers", "1", "--link")
    run_repack("video", src, tmp_path / "c", *args)
    a, b = read_manifest_json(tmp_path / "a"), read_manifest_json(tmp_path / "b")
    assert [(s["path"], s["sha256"]) for s in a["shards"]] == [(s["path"], s["sha256"]) for s in b["shards"]]
    # a lost output and task record: only that task is redone, with the same bytes
    victim = a["shards"][0]
    (tmp_path / "c" / victim["path"]).unlink()
    proc = run_repack("video", src, tmp_path / "c", *args[:-1])
    assert "1 task(s) run, 3 resumed" in proc.stdout
    assert read_manifest_json(tmp_path / "c")["shards"] == a["shards"]
    assert (tmp_path / "a" / "manifest.json").read_bytes() != b""
    linked = tmp_path / "b" / "videos/good/h264.mp4"
    assert linked.stat().st_ino == (src / "good/h264.mp4").stat().st_ino  # --link hard-links compatible inputs


def test_webdataset_packing(video_clips, tmp_path):
    src = tmp_path / "src"
    for rel in ("bad/tiny.mp4", "good/h264.mp4", "good/mpeg4.avi", "junk/empty.mp4"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(video_clips[0] / rel, src / rel)
    out = tmp_path / "wds"  # the experimental reader keeps the MPEG-4 AVI as is: a tar member of another type
    run_repack("video", src, out, "--transcode", "--to", "webdataset", "--shard-size", "2", "--dali-reader",
               "experimental", "--quiet")
    manifest = read_manifest_json(out)
    assert manifest["format"] == "webdataset" and manifest["totals"]["samples"] == 3
    assert [v["source"] for v in manifest["videos"]] == ["bad/tiny.mp4", "good/h264.mp4", "good/mpeg4.avi"]
    names = []
    for shard in manifest["shards"]:
        with tarfile.open(out / shard["path"]) as tar:
            names += tar.getnames()
            for member in tar.getmembers():
                if member.name.endswith(".json"):
                    meta = json.loads(tar.extractfile(member).read())
                    assert meta["sha256"] and meta["frames"] >= 2
    assert [n.split(".", 1)[1] for n in names] == ["mp4", "cls", "json", "mp4", "cls", "json", "avi", "cls", "json"]
    assert run_repack("verify", out).returncode == 0
    video = out / manifest["videos"][1]["path"]  # a prepared video beside the shards, as the reader takes it
    data = bytearray(video.read_bytes())
    data[len(data) // 2] ^= 0xFF
    video.write_bytes(bytes(data))
    damaged = run_repack("verify", out, check=False)
    assert damaged.returncode == 5 and f"{manifest['videos'][1]['path']}: sha256 differs" in damaged.stdout + damaged.stderr


def test_missing_ffmpeg_fails_fast(video_clips, tmp_path):
    proc = run_repack("video", video_clips[0], tmp_path / "x", "--transcode", check=False,
                      env={"PATH": str(tmp_path / "empty-bin")})
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "ffprobe and ffmpeg not found" in proc.stderr
    assert not (tmp_path / "x" / "manifest.json").exists()
    decode = run_repack("video", video_clips[0], tmp_path / "z", "--verify", "decode", check=False,
                        env={"PATH": str(tmp_path / "empty-bin")})  # a full decode needs ffmpeg too
    assert decode.returncode == 2 and "ffprobe and ffmpeg not found" in decode.stderr


def test_bad_options_fail_fast(video_clips, tmp_path):
    proc = run_repack("video", video_clips[0], tmp_path / "y", "--to", "webdataset", check=False)
    assert proc.returncode == 2 and "--transcode" in proc.stderr


def test_recipe_command_is_an_argument_list():
    info = {"width": 161, "height": 131, "fps": 29.969, "field_order": "tt", "rotation": 90, "stream_index": 1}
    cmd = build_command("/in put.mkv", "/out.mp4", info, Recipe(max_height=100, crf=20))
    assert cmd[0] == "ffmpeg" and "file:/in put.mkv" in cmd and "/out.mp4" in cmd
    assert cmd[cmd.index("-protocol_whitelist") + 1] == "file" and "hls" not in cmd[cmd.index("-format_whitelist") + 1]
    graph = cmd[cmd.index("-filter_complex") + 1]
    assert graph.startswith("[0:1]yadif=") and "setpts=N/(30000/1001)/TB" in graph and "scale=82:100" in graph
    assert "setsar=1" in graph
    for flag in ("-map_metadata", "+faststart", "+bitexact", "+cgop+bitexact"):
        assert flag in cmd
    assert cmd[cmd.index("-bf") + 1] == "0"
    assert snap_rate(23.98)[1] == "24000/1001" and snap_rate(7.0) == (7.0, "7")
    assert output_geometry({"width": 8000, "height": 4000}, Recipe()) == (4096, 2048, 4096, 2048)


def test_encoders_listed():
    assert "libx264" in encoders()


def _vp8(path: Path, frames: int = 6, size=(96, 64)) -> None:
    """A VP8 clip: kept as is for the experimental reader (``--dali-reader experimental``) and
    decoded by DALI's CPU backend."""
    make_index_clip(path, frames, ("-c:v", "libvpx", "-deadline", "realtime", "-g", "8", "-pix_fmt", "yuv420p"),
                    size=size)


def test_unsafe_names_get_safe_outputs_and_a_dali_file_list(tmp_path, monkeypatch):
    """Whitespace, newline and non-UTF-8 names: renamed outputs, original source kept, file_list
    readable by DALI (relative to OUT), and the run finishes."""
    src = tmp_path / "src"
    _vp8(src / "cls/plain.webm")
    for name in (b"a b.webm", b"new\nline.webm", b"caf\xe9.webm"):
        shutil.copy(src / "cls/plain.webm", os.fsdecode(bytes(src / "cls") + b"/" + name))
    out = tmp_path / "out"
    run_repack("video", src, out, "--transcode", "--dali-reader", "experimental", "--quiet")
    manifest = read_manifest_json(out)
    by_source = {e["source"]: e for e in manifest["shards"]}
    assert set(by_source) == {"cls/plain.webm", "cls/a b.webm", "cls/new\nline.webm",
                              os.fsdecode(b"cls/caf\xe9.webm")}
    assert by_source["cls/plain.webm"]["path"] == "videos/cls/plain.webm"
    renamed = sorted(e["path"] for s, e in by_source.items() if s != "cls/plain.webm")
    assert renamed == ["videos/_renamed/00000000_a_b.webm", "videos/_renamed/00000001_caf.webm",
                       "videos/_renamed/00000002_new_line.webm"]
    assert all((out / p).read_bytes() == (src / "cls/plain.webm").read_bytes() for p in renamed)
    listing = (out / "file_list.txt").read_bytes().decode("utf-8").splitlines()
    assert sorted(listing) == sorted(f"{e['path']} 0" for e in manifest["shards"])
    from nvidia.dali import fn, pipeline_def

    @pipeline_def(batch_size=4, num_threads=1, device_id=None)
    def from_list():
        frames, labels = fn.experimental.readers.video(device="cpu", file_list=str(out / "file_list.txt"),
                                                       sequence_length=2)
        return frames, labels

    monkeypatch.chdir(out)  # DALI resolves file_list paths against the working directory
    pipe = from_list()
    pipe.build()
    frames, labels = pipe.run()
    assert len(frames) == 4 and np.asarray(frames[0]).shape == (2, 64, 96, 3)


def test_gop_is_capped_and_max_height_applies_to_copies(tmp_path):
    src = tmp_path / "src"
    (src / "c").mkdir(parents=True)
    subprocess.run(["ffmpeg", "-loglevel", "error", "-f", "lavfi", "-i", "testsrc2=s=160x120:r=25:d=3", "-c:v",
                    "libx264", "-preset", "ultrafast", "-g", "25", "-bf", "0", "-pix_fmt", "yuv420p",
                    str(src / "c/tall.mp4")], check=True)
    _vp8(src / "c/small.webm")
    assert decide(probe_file(str(src / "c/tall.mp4")), "h100", 1.0, max_height=96).codes == ["too_tall"]
    out = tmp_path / "out"
    run_repack("video", src, out, "--transcode", "--gop", "50", "--max-height", "96", "--preset", "ultrafast",
               "--dali-reader", "experimental", "--quiet")  # the VP8 clip is copied for this reader
    manifest = read_manifest_json(out)
    assert manifest["quarantine"] == []
    entries = {e["source"]: e for e in manifest["shards"]}
    tall, small = entries["c/tall.mp4"], entries["c/small.webm"]
    assert tall["transcoded"] and tall["height"] == 96 and tall["max_gop_s"] <= 1.0 and tall["frames"] == 75
    assert not small["transcoded"] and small["height"] == 64
    assert gop_frames(25.0, Recipe(gop=50)) == 25 and gop_frames(25.0, Recipe(gop=10)) == 10


def test_truncated_matroska_keeps_declared_duration(video_clips):
    root, made = video_clips
    info = probe_file(str(root / "junk/truncated.mkv"))
    assert info["duration_s"] == pytest.approx(2.0, abs=0.01) and info["span_s"] < 1.8
    assert decide(info).codes == ["truncated"]
    whole = probe_file(str(root / "good/vp9.webm")) if "good/vp9.webm" in made else None
    assert whole is None or decide(whole, reader="experimental").decision == "ok"


def test_killed_worker_takes_ffmpeg_with_it(tmp_path):
    """ffmpeg started by ffmpeg_cli.run dies (PR_SET_PDEATHSIG) when its worker is SIGKILLed."""
    code = ("from repack.transforms.ffmpeg_cli import run; run(['ffmpeg', '-nostdin', '-re', "
            "'-f', 'lavfi', '-i', 'testsrc2=s=64x48:d=60', '-f', 'null', '-'])")
    worker = subprocess.Popen([sys.executable, "-c", code])
    children: list[int] = []
    deadline = time.monotonic() + 20
    while not children and time.monotonic() < deadline:
        for task in Path(f"/proc/{worker.pid}/task").iterdir():
            children += [int(x) for x in (task / "children").read_text().split()]
        time.sleep(0.05)
    assert children, "ffmpeg did not start"
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(children[0]):
        time.sleep(0.05)
    assert not _alive(children[0])


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_progress_bar_shows_frames_per_second(tmp_path, monkeypatch):
    """Issue 4: the progress bar reports frames/s (the engine's per-record counters)."""
    import io
    import sys

    from repack.config import EngineOptions
    from repack.jobs.engine import Engine
    from repack.jobs.video import VideoJob, VideoSpec
    from tests.tools.videos import make_index_clip

    for i in range(3):
        make_index_clip(tmp_path / "src" / "c" / f"v{i}.mp4", 20,
                        ("-c:v", "libx264", "-preset", "ultrafast", "-g", "10", "-bf", "0", "-pix_fmt", "yuv420p"))

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    spec = VideoSpec(source=str(tmp_path / "src"), out=str(tmp_path / "out"), transcode=True, shard_size=1)
    Engine(VideoJob(spec), EngineOptions(workers=1)).run()
    assert "frames/s=" in terminal.getvalue() and "video/s" in terminal.getvalue()

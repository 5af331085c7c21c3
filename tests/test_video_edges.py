"""`repack video` and `VideoClipDataset` at the edges of what a container says: an MP4 edit list (packets
the decoder drops), a fragmented MP4 cut short (a corrupt last packet), a Matroska header whose frame rate
is not its packets', and MPEG-TS, whose seek lands after the wanted frame. Real ffmpeg-made clips; every
clip the reader gives is compared with a full sequential decode of its file."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import read_manifest_json, run_repack

pytestmark = pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="needs ffmpeg")

SOURCE = ["-f", "lavfi", "-i", "testsrc=duration={seconds}:size=64x64:rate=25", "-c:v", "libx264", "-pix_fmt",
          "yuv420p", "-g", "25", "-bf", "0"]


def ffmpeg(*args) -> None:
    subprocess.run(["ffmpeg", "-loglevel", "error", "-y", *map(str, args)], check=True)


def encode(path: Path, seconds: int, *extra) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    ffmpeg(*[a.format(seconds=seconds) for a in SOURCE], *extra, path)
    return path


def clips_match_a_full_decode(out: Path, length: int) -> int:
    """Every clip of ``VideoClipDataset(out, length)`` equals the frames of a sequential decode; the clips."""
    import av

    from pipelines.torch_video import VideoClipDataset

    dataset = VideoClipDataset(out, length, stride=1, step=1)
    decoded: dict[str, list] = {}
    for i in range(len(dataset)):
        video, start = dataset.index[i]
        path = dataset.paths[video]
        if path not in decoded:
            with av.open(path) as container:
                decoded[path] = [f.to_ndarray(format="rgb24") for f in container.decode(container.streams.video[0])]
        clip, _ = dataset[i]
        assert np.array_equal(clip.numpy(), np.stack(decoded[path][start:start + length])), (path, start)
    return len(dataset)


def test_an_edit_list_is_counted_in_the_frames_the_decoder_gives(tmp_path):
    """`ffmpeg -ss 0.48 -c copy` keeps the GOP before the cut and hides its first 12 frames with an edit
    list: the manifest counted 75 frames of 63 (clips past the end raised), and a transcode of the same
    cut (4:4:4) was quarantined as frames_changed."""
    src = tmp_path / "src"
    for chroma in ("yuv420p", "yuv444p"):
        whole = encode(tmp_path / f"whole-{chroma}.mp4", 3, "-pix_fmt", chroma)
        (src / "e").mkdir(parents=True, exist_ok=True)
        ffmpeg("-ss", "0.48", "-i", whole, "-c", "copy", src / "e" / f"cut-{chroma}.mp4")
    out = tmp_path / "out"
    run_repack("video", src, out, "--probe", "--transcode", "--quiet")
    manifest = read_manifest_json(out)
    assert manifest["quarantine"] == [] and [v["frames"] for v in manifest["shards"]] == [63, 63]
    assert clips_match_a_full_decode(out, 16) == 2 * (63 - 16 + 1)


def test_a_fragmented_mp4_cut_short_is_quarantined_as_truncated(tmp_path):
    """Its last packet ends at the end of the file (no packet points past it) but is flagged corrupt: it
    was copied (or resampled as vfr) with most of its frames gone and no record."""
    full = encode(tmp_path / "full.mp4", 4, "-movflags", "frag_keyframe+empty_moov+default_base_moof")
    src = tmp_path / "src" / "f"
    src.mkdir(parents=True)
    (src / "cut.mp4").write_bytes(full.read_bytes()[:full.stat().st_size // 2])
    encode(src / "whole.mp4", 1)
    out = tmp_path / "out"
    run_repack("video", src.parent, out, "--probe", "--transcode", "--quiet")
    (record,) = read_manifest_json(out)["quarantine"]
    assert record["source"] == "f/cut.mp4" and record["codes"] == ["truncated"] and "corrupt" in record["reason"]


def test_a_header_rate_that_is_not_the_packets_is_transcoded_and_ts_clips_are_read(tmp_path):
    """A Matroska header saying 30 fps over 25 fps packets was copied: the reader placed frames by the
    header's rate (every clip wrong or failing); it is transcoded now. An MPEG-TS copy's seek lands after
    the wanted frame: its clips are decoded from the start instead of failing."""
    src = tmp_path / "src" / "c"
    mkv = encode(src / "rate.mkv", 2)
    data = bytearray(mkv.read_bytes())
    at = data.find(b"\x23\xe3\x83\x84")  # Matroska DefaultDuration, 4-byte value: 30 fps
    assert at > 0
    struct.pack_into(">I", data, at + 4, 33333333)
    mkv.write_bytes(bytes(data))
    encode(src / "v.ts", 2, "-f", "mpegts")
    encode(src / "b.ts", 2, "-f", "mpegts", "-bf", "2")  # B-frames: even a seek to its first timestamp lands late
    out = tmp_path / "out"
    run_repack("video", src.parent, out, "--probe", "--transcode", "--quiet")
    decisions = {json.loads(line)["source"]: json.loads(line) for line in (out / "probe.jsonl").read_text().splitlines()}
    assert [r["code"] for r in decisions["c/rate.mkv"]["reasons"]] == ["rate_header_wrong"]
    assert decisions["c/v.ts"]["decision"] == decisions["c/b.ts"]["decision"] == "ok"
    assert decisions["c/b.ts"]["b_frames"] is True
    assert clips_match_a_full_decode(out, 8) == 3 * (50 - 8 + 1)


def test_a_header_rate_under_one_percent_off_that_drifts_half_a_frame_is_transcoded(tmp_path):
    """A 25 fps MP4 whose last sample lasts longer (phones, screen recorders) says 24.78 fps: 0.9 % off, so it
    was copied, and the reader placed its frames by that rate: from frame ~56 on, the frame after."""
    whole = encode(tmp_path / "whole.mp4", 4)
    src = tmp_path / "src" / "c"
    src.mkdir(parents=True)
    ffmpeg("-i", whole, "-c", "copy", "-bsf:v", r"setts=duration=if(eq(N\,99)\,DURATION*19/10\,DURATION)",
           src / "last.mp4")
    out = tmp_path / "out"
    run_repack("video", src.parent, out, "--probe", "--transcode", "--quiet")
    (decision,) = [json.loads(line) for line in (out / "probe.jsonl").read_text().splitlines()]
    assert 0.99 * decision["fps_measured"] < decision["avg_frame_rate"] < decision["fps_measured"]
    assert [r["code"] for r in decision["reasons"]] == ["rate_header_wrong"]
    assert clips_match_a_full_decode(out, 8) == 100 - 8 + 1


def test_a_whole_matroska_file_starting_after_zero_is_kept_and_a_cut_one_is_not(tmp_path):
    """The header's duration runs from time 0 and the packets' span from the first packet: a complete MKV whose
    timestamps start at 1 s was quarantined as truncated ("declares 3.000 s, the packets cover only 2.000 s")."""
    src = tmp_path / "src" / "c"
    late = encode(src / "late.mkv", 2, "-output_ts_offset", "1.0")
    cut = encode(tmp_path / "whole.mkv", 4, "-output_ts_offset", "1.0", "-g", "5")
    (src / "cut.mkv").write_bytes(cut.read_bytes()[:cut.stat().st_size // 2])
    out = tmp_path / "out"
    run_repack("video", src.parent, out, "--probe", "--transcode", "--quiet")
    (record,) = read_manifest_json(out)["quarantine"]
    assert record["source"] == "c/cut.mkv" and record["codes"] == ["truncated"], record
    assert late.exists() and clips_match_a_full_decode(out, 8) == 50 - 8 + 1


def test_a_video_larger_than_a_tar_member_is_quarantined_for_webdataset(tmp_path, monkeypatch):
    """--to webdataset: a prepared video over the ustar member limit (8 GiB) failed its shard on every re-run
    ("exceeds the ustar limit"), the other videos of the shard with it; it is quarantined by name now (the limit
    lowered here: a real one would take 8 GiB)."""
    import repack.jobs.video as video
    from repack.jobs.video import VideoJob, VideoSpec
    from tests.tools.videos import make_index_clip

    make_index_clip(tmp_path / "src" / "a" / "v.mp4", 10, ("-c:v", "libx264", "-pix_fmt", "yuv444p"))
    (tmp_path / "out").mkdir()
    job = VideoJob(VideoSpec(source=str(tmp_path / "src"), out=str(tmp_path / "out"), to="webdataset",
                             transcode=True, preset="ultrafast"))
    plan = job.plan()
    monkeypatch.setattr(video, "MAX_MEMBER_SIZE", 1000)
    record = job.run_task(plan.tasks[0])
    assert record["videos"] == [] and record["quarantine"][0]["codes"] == ["too_big_for_tar"]
    assert "--to videos" in record["quarantine"][0]["reason"]


def test_a_long_or_non_utf8_name_that_needs_a_transcode_is_renamed_and_packed(tmp_path):
    """Both failed the whole job on every run (exit 4, no manifest): a name over ~230 bytes, whose temp file
    name (``.NAME.mp4.tmp-<task id>``) passed 255 bytes; a non-UTF-8 name, which ffmpeg-python could not hash
    when the file had to go through ffmpeg. Both are packed under ``_renamed/`` now, their sources kept."""
    import os

    src = tmp_path / "src" / "c"
    long_name = "a" * 240 + ".mp4"
    encode(src / long_name, 1, "-pix_fmt", "yuv444p")  # 4:4:4: NVDEC cannot, so it is transcoded
    made = encode(tmp_path / "bad.mp4", 1, "-pix_fmt", "yuv444p")
    os.rename(made, os.fsencode(src) + b"/bad\xff.mp4")
    encode(src / "plain.mp4", 1)
    out = tmp_path / "out"
    run_repack("video", src.parent, out, "--probe", "--transcode", "--quiet")
    records = [json.loads(line) for line in (out / "probe.jsonl").read_text().splitlines()]
    assert len(records) == 3 and not read_manifest_json(out)["quarantine"]
    by_source = {r["source"]: r for r in records}
    assert by_source[f"c/{long_name}"]["decision"] == "transcode"
    assert by_source["c/bad\udcff.mp4"]["decision"] == "transcode"
    renamed = sorted(p.name for p in (out / "videos" / "_renamed").iterdir())
    assert len(renamed) == 2 and all(name.endswith(".mp4") and len(name) < 64 for name in renamed)
    assert run_repack("verify", out, check=False).returncode == 0


def test_a_decode_check_counts_no_null_muxer_line_as_a_decoder_error(tmp_path):
    """Two rates joined as one file (10 then 30 fps) hand the null muxer non-monotonic timestamps; every frame
    decodes. Its 20 muxer lines were counted as decoder errors, and `--verify decode` quarantined a good file."""
    parts = []
    for rate in (10, 30):
        part = tmp_path / f"r{rate}.ts"
        ffmpeg("-f", "lavfi", "-i", f"testsrc=duration=1:size=64x64:rate={rate}", "-c:v", "libx264", "-pix_fmt",
               "yuv420p", "-f", "mpegts", part)
        parts.append(str(part))
    src = tmp_path / "src" / "c"
    src.mkdir(parents=True)
    ffmpeg("-i", "concat:" + "|".join(parts), "-c", "copy", src / "joined.mp4")
    from repack.transforms.decode_check import decode_check

    checked = decode_check(str(src / "joined.mp4"))
    assert checked["decoded_frames"] == 40 and checked["decode_errors"] == 0, checked
    out = tmp_path / "out"
    run_repack("video", src.parent, out, "--probe", "--transcode", "--verify", "decode", "--quiet")
    assert not read_manifest_json(out)["quarantine"]


def test_hidden_files_and_os_junk_are_counted_as_skipped(tmp_path):
    """The scan skips them by name, as for images; a video job said nowhere that it had (25 inputs of 27)."""
    src = tmp_path / "src" / "c"
    encode(src / "a.mp4", 1)
    shutil.copy(src / "a.mp4", src / ".hidden.mp4")
    (tmp_path / "src" / ".hid").mkdir()
    shutil.copy(src / "a.mp4", tmp_path / "src" / ".hid" / "b.mp4")
    (src / ".DS_Store").write_bytes(b"\0")
    out = tmp_path / "out"
    run_repack("video", src.parent, out, "--probe", "--quiet")
    totals = read_manifest_json(out)["totals"]
    assert totals["inputs"] == 1 and totals["skipped_junk"] == 3, totals  # .hidden.mp4, .DS_Store, the folder .hid

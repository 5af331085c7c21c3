"""An ffmpeg that cannot write its output (a full disk, a file-size limit or quota) fails the task: a re-run does it
again. It was the input's quarantine ("transcode failed: exited with -25", "output still not GPU-decodable"), a
finished task's record, so a re-run with room kept the good videos out of the dataset for good (exit 7 or 0)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT, read_manifest_json, run_repack


def _clips(root):
    for folder, name, codec in (("a", "h264_1.mp4", ["-c:v", "libx264", "-g", "250", "-pix_fmt", "yuv420p"]),
                                ("b", "mpeg4_1.avi", ["-c:v", "mpeg4"]), ("b", "mpeg4_2.avi", ["-c:v", "mpeg4"])):
        (root / folder).mkdir(parents=True, exist_ok=True)
        subprocess.run(["ffmpeg", "-loglevel", "error", "-y", "-f", "lavfi", "-i",
                        "testsrc=duration=2:size=160x120:rate=25", *codec, str(root / folder / name)], check=True)
    return root


def test_a_file_size_limit_fails_the_tasks_and_a_rerun_packs_every_video(tmp_path):
    src = _clips(tmp_path / "src")
    out, reference = tmp_path / "out", tmp_path / "reference"
    run_repack("video", src, reference, "--probe", "--transcode", "--quiet")
    limited = subprocess.run(["sh", "-c", 'ulimit -f 12 && exec "$0" -m repack video "$1" "$2" --probe --transcode',
                              sys.executable, src, out], cwd=ROOT, capture_output=True, text=True)
    assert limited.returncode == 4, limited.stdout + limited.stderr
    assert "ffmpeg" in limited.stderr and "File too large" in limited.stderr and "Traceback" not in limited.stderr
    run_repack("video", src, out, "--probe", "--transcode", "--quiet")
    done, wanted = read_manifest_json(out), read_manifest_json(reference)
    assert done["quarantine"] == wanted["quarantine"] == []
    assert [v["sha256"] for v in done["shards"]] == [v["sha256"] for v in wanted["shards"]]
    assert run_repack("verify", out).returncode == 0


def test_an_input_named_like_a_full_disk_is_still_the_inputs_fault(tmp_path):
    """ffmpeg quotes the input's path (and the output's temp name, made from it): a bad file named
    "Disk quota exceeded.mp4" failed its task on every run instead of being quarantined."""
    import random

    from repack.transforms.transcode import remux_command, run_ffmpeg

    for name in ("other.mp4", "Disk quota exceeded.mp4", "No space left on device.mp4"):
        src = tmp_path / name
        src.write_bytes(random.Random(0).randbytes(5000))  # not a video (fixed bytes: some random ones made ffmpeg
        # say "Invalid argument", and the full suite failed once in two runs)
        reason = run_ffmpeg(remux_command(str(src), str(tmp_path / f".{name}.tmp-1"), "mp4"), str(src),
                            output=f"videos/{name}")
        assert reason and "Invalid data" in reason, (name, reason)

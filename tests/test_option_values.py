"""Option values that were accepted and then ignored or misread, or that gave a traceback: each is read as
meant or refused in one line now (the real CLI, exit 2). A names file saved with a byte order mark removes its
first name too."""

from __future__ import annotations

from tests.conftest import read_manifest_json, run_repack, sample_paths
from tests.test_images_job import write_jpegs


def test_values_refused_in_one_line(tmp_path):
    src = write_jpegs(tmp_path / "src" / "c", 3).parent
    cases = [
        (("images", src, tmp_path / "o1", "--shuffle", "--seed", "-1"), "--seed"),  # -1 shuffled as seed 1
        (("images", src, tmp_path / "o2", "--ray-address", "auto"), "apply to --executor ray"),  # ignored
        (("images", src, tmp_path / "o3", "--ray-driver-cpus", "2"), "apply to --executor ray"),
        (("video", src, tmp_path / "o4", "--probe", "--max-gop", "nan"), "--max-gop must be a positive number"),
        (("video", src, tmp_path / "o5", "--transcode", "--threads", "0"), "--threads"),  # ZeroDivisionError
    ]
    for args, words in cases:
        done = run_repack(*args, check=False)
        assert done.returncode == 2 and words in done.stderr and "Traceback" not in done.stderr, (args, done.stderr)


def test_a_names_file_with_a_byte_order_mark_removes_its_first_name(tmp_path):
    src, out = write_jpegs(tmp_path / "src" / "c", 4).parent, tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    names = tmp_path / "names.txt"
    names.write_bytes(b"\xef\xbb\xbfc/0.jpg\r\nc/1.jpg\r\n")  # Notepad's "UTF-8"
    done = run_repack("remove", out, "--sources", names)
    assert "2 sample(s) removed, 0 name(s) not found" in done.stdout + done.stderr
    assert sorted(sample_paths(out)) == ["c/2.jpg", "c/3.jpg"] and read_manifest_json(out)["totals"]["samples"] == 2

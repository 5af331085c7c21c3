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
        (("images", src, tmp_path / "o6", "--shard-bytes", "9223372036854775807"), "at most 1 EiB"),  # OverflowError
        (("images", src, tmp_path / "o7", "--num-nodes", "0"), "--num-nodes must be at least 1"),  # named --node-rank
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


def test_an_empty_path_is_refused_not_taken_for_the_current_folder(tmp_path):
    """`repack images SRC "$OUT"` with OUT unset wrote the dataset into the current folder; gc and remove worked on
    it. Every path argument refuses an empty one now."""
    src = write_jpegs(tmp_path / "src" / "c", 2).parent
    (tmp_path / "names.txt").write_text("c/0.jpg\n")
    for args in (("images", src, ""), ("images", " ", tmp_path / "o"), ("gc", ""), ("verify", ""),
                 ("remove", "", "--sources", tmp_path / "names.txt"), ("pull", "", tmp_path / "d")):
        done = run_repack(*args, check=False)
        assert done.returncode == 2 and "is empty (an unset shell variable?)" in done.stderr, (args, done.stderr)


def test_numbers_in_environment_variables_are_named_when_bad(tmp_path, monkeypatch):
    """REPACK_S3_STALE_LOCK_S="abc" was the default and "nan" one second (below the heartbeat), in silence; an
    S3 limit of inf overflowed later with a traceback; `pull --versions ²` raised int()'s ValueError."""
    import pytest

    from repack.commands.pull import parse_versions
    from repack.errors import UsageError
    from repack.manifest.s3_waits import _number
    from repack.store.s3_lock import stale_after

    for raw in ("abc", "nan", "inf", "0"):
        monkeypatch.setenv("REPACK_S3_STALE_LOCK_S", raw)
        with pytest.raises(UsageError, match="REPACK_S3_STALE_LOCK_S"):
            stale_after()
    monkeypatch.setenv("REPACK_S3_STALE_LOCK_S", "2")
    assert stale_after() == 2.0
    for raw in ("inf", "nan"):
        monkeypatch.setenv("REPACK_S3_ATTEMPTS", raw)
        with pytest.raises(ValueError, match="REPACK_S3_ATTEMPTS"):
            _number("REPACK_S3_ATTEMPTS", 5, 1)
    with pytest.raises(UsageError, match="--versions '²'"):
        parse_versions("²")


def test_a_dataset_packed_with_a_negative_seed_appends_with_its_absolute_value(tmp_path):
    """--seed below 0 is refused now; a dataset an older repack packed with --seed -1 (shuffled as seed 1) takes
    --append --shuffle --seed 1, where the comparison asked for the -1 the CLI no longer accepts."""
    import json

    src, out = write_jpegs(tmp_path / "src" / "c", 4).parent, tmp_path / "out"
    run_repack("images", src, out, "--shuffle", "--seed", "1", "--quiet")
    manifest = read_manifest_json(out)
    manifest["created_by"]["options"]["seed"] = -1  # as the older repack recorded it
    (out / "manifest.json").write_text(json.dumps(manifest))
    write_jpegs(src / "d", 2, "n")
    done = run_repack("images", src, out, "--append", "--shuffle", "--seed", "1")
    assert "2 new sample(s)" in done.stdout, done.stdout + done.stderr


def test_decimal_sizes_are_exact():
    """'2.01MB' went through a float: 2,009,999 bytes."""
    from repack.sizes import parse_size

    assert parse_size("2.01MB") == 2_010_000 and parse_size("0.1GB") == 100_000_000 and parse_size(" 512 MB ") == 512 * 10**6

"""Quarantine records beyond the first few in a columnar side file (``repack.manifest.quarantine_records``): the
manifest lists ``REPACK_QUARANTINE_LISTED`` of them, ``quarantine.records`` holds every one; verify, inspect, an
--append, a remove and gc read and carry them, a damaged file is named, and a job with more bad inputs than a
manifest can list is published under the manifest cap that refused it before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from repack.manifest.quarantine_records import QuarantineFileError, decode, encode, reason_counts, record_count
from tests.conftest import read_manifest_json, run_repack
from tests.test_images_job import jpeg_bytes, write_jpegs

RECORDS = [
    {"source": "cat/a.jpg", "reason": "truncated JPEG"},
    {"source": "cat/b.jpg", "reason": "not a recognized image format"},
    {"source": "docs/x.txt", "line": None, "reason": "not UTF-8"},
    {"source": "docs/y.jsonl", "line": 7, "reason": "no text field", "no_documents": True},
    {"seg": 3, "line": 4, "reason": "empty"},  # a text task's record before its source is named
    {"source": "v/clip.mp4", "reason": "transcode failed: x", "codes": ["transcode_failed"], "frames_in": 12},
    {"source": "caf\u00e9/\udcff.jpg", "reason": "truncated JPEG"},  # a name that is not UTF-8 on disk
    {"source": "cat/c.jpg"},
]


def test_records_come_back_as_they_were_written():
    raw = encode(RECORDS)
    assert decode(raw, "f") == RECORDS and record_count(raw, "f") == len(RECORDS)
    assert decode(raw, "f", 2) == RECORDS[:2]
    assert reason_counts(raw, "f") == {"truncated JPEG": 2, "not a recognized image format": 1, "not UTF-8": 1,
                                       "no text field": 1, "empty": 1, "transcode failed: x": 1, "?": 1}
    assert decode(encode([]), "f") == []


@pytest.mark.parametrize("damage", [lambda raw: raw[:-1], lambda raw: b"x" + raw[1:],
                                    lambda raw: raw.replace(b'"records": 8', b'"records": 9'),
                                    lambda raw: raw.replace(b'{"codes"', b'x"codes"'),  # a record's other keys:
                                    lambda raw: raw.replace(b'{"no_documents":true}', b'[1,2,3,4,5,6,7,8,9,0]')])
def test_a_damaged_file_is_refused_by_name(damage):  # not JSON, not an object (same size: past the header check)
    with pytest.raises(QuarantineFileError, match="OUT/quarantine.records: not a quarantine file"):
        decode(damage(encode(RECORDS)), "OUT/quarantine.records")


def bad_inputs(folder: Path, count: int, stem: str = "bad") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (folder / f"{stem}{i}.jpg").write_bytes(b"not a jpeg %d" % i)


def every_record(out: Path) -> list[dict]:
    lines = run_repack("inspect", out, "--quarantine").stdout.splitlines()
    return [json.loads(line) for line in lines]


def test_a_dataset_keeps_every_record_through_its_versions(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    write_jpegs(src / "cat", 4, "c")
    bad_inputs(src / "cat", 6)
    bad_inputs(src / "dog", 4, "d")
    env = {"REPACK_QUARANTINE_LISTED": "3"}
    run_repack("images", src, out, "--quiet", env=env)
    manifest = read_manifest_json(out)
    assert manifest["files"] == {"quarantine": "quarantine.records"} and manifest["totals"]["quarantined"] == 10
    assert manifest["version"] == 2  # a partial list: a repack that knows only version 1 refuses it, never
    # carries the listed records into a next version and loses the rest
    records = every_record(out)
    assert len(records) == 10 and manifest["quarantine"] == records[:3]
    assert sorted(r["source"] for r in records) == sorted([f"cat/bad{i}.jpg" for i in range(6)] +
                                                          [f"dog/d{i}.jpg" for i in range(4)])
    summary = json.loads(run_repack("inspect", out, "--json").stdout)["quarantine"]
    assert summary["count"] == 10 and sum(summary["reasons"].values()) == 10 and len(summary["listed"]) == 10
    assert run_repack("verify", out).returncode == 0

    bad_inputs(src / "emu", 2, "e")  # appended: two more bad inputs and one sample
    (src / "emu" / "e.jpg").write_bytes(jpeg_bytes(seed=7))
    run_repack("images", src, out, "--append", "--quiet", env=env)
    manifest = read_manifest_json(out)
    assert manifest["files"] == {"quarantine": "quarantine-v2.records"} and manifest["totals"]["quarantined"] == 12
    assert every_record(out) == records + [{"reason": records[0]["reason"], "source": f"emu/e{i}.jpg"}
                                           for i in range(2)]
    again = run_repack("images", src, out, "--append", "--quiet", env=env)  # nothing new: every record known
    assert again.returncode == 0 and read_manifest_json(out)["dataset_version"]["number"] == 2

    (tmp_path / "gone.txt").write_text("cat/bad0.jpg\ncat/c0.jpg\n")  # a quarantined input taken down, a sample
    run_repack("remove", out, "--sources", tmp_path / "gone.txt", "--quiet", env={"REPACK_QUARANTINE_LISTED": "20"})
    manifest = read_manifest_json(out)
    assert "files" not in manifest and manifest["totals"]["quarantined"] == 11  # listed whole again: no side file
    assert manifest["version"] == 1
    assert [r["source"] for r in manifest["quarantine"]] == [r["source"] for r in every_record(out)] and \
        "cat/bad0.jpg" not in {r["source"] for r in manifest["quarantine"]}
    run_repack("gc", out, "--keep", "1")
    assert not list(out.glob("quarantine*.records")) and run_repack("verify", out).returncode == 0


def test_a_damaged_side_file_is_named_and_nothing_changes(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    write_jpegs(src / "cat", 3, "c")
    bad_inputs(src / "cat", 3)
    run_repack("images", src, out, "--quiet", env={"REPACK_QUARANTINE_LISTED": "1"})
    side = out / "quarantine.records"
    side.write_bytes(side.read_bytes().replace(b"bad2.jpg", b"bad9.jpg"))  # same size, other content
    verified = run_repack("verify", out, check=False)
    assert verified.returncode != 0 and "quarantine.records" in verified.stdout + verified.stderr
    (tmp_path / "gone.txt").write_text("cat/c0.jpg\n")
    removed = run_repack("remove", out, "--sources", tmp_path / "gone.txt", check=False)
    assert removed.returncode != 0 and "quarantine.records: not the quarantine records the manifest records" in \
        removed.stderr
    assert read_manifest_json(out).get("dataset_version") is None  # still version 1

    import hashlib  # a well-formed file whose digest the manifest was edited to: other records, another count
    forged = encode(RECORDS)
    side.write_bytes(forged)
    manifest = read_manifest_json(out)
    manifest["file_digests"]["quarantine"] = {"bytes": len(forged), "sha256": hashlib.sha256(forged).hexdigest()}
    (out / "manifest.json").write_text(json.dumps(manifest))
    problems = run_repack("verify", out, check=False).stderr
    assert "quarantine.records: 8 quarantine records, totals.quarantined says 3" in problems
    assert "quarantine.records: its first records are not the ones the manifest lists" in problems


def test_more_bad_inputs_than_a_manifest_holds_are_published(tmp_path):
    """3,000 bad inputs under a 200 KiB manifest cap: listed whole they are refused at publish (what a crawl with
    millions of broken files met at the default 256 MiB cap); in the side file the dataset is published and read."""
    src = tmp_path / "src"
    write_jpegs(src / "cat", 2, "c")
    bad_inputs(src / "cat", 3000)
    cap = {"REPACK_MAX_MANIFEST_BYTES": str(200 << 10)}
    listed = run_repack("images", src, tmp_path / "listed", "--quiet", check=False,
                        env={**cap, "REPACK_QUARANTINE_LISTED": "100000"})
    assert listed.returncode != 0 and "cap" in listed.stderr and not (tmp_path / "listed" / "manifest.json").exists()
    out = tmp_path / "out"
    run_repack("images", src, out, "--quiet", env=cap)
    manifest = read_manifest_json(out)
    assert manifest["totals"]["quarantined"] == 3000 and len(manifest["quarantine"]) == 1000
    assert (out / "manifest.json").stat().st_size < 200 << 10
    assert run_repack("verify", out, env=cap).returncode == 0
    from pipelines.torch_webdataset import ImageShardDataset

    assert len(list(ImageShardDataset(out, decode=False))) == 2


def test_a_refused_or_killed_version_leaves_nothing_verify_calls_a_stray(tmp_path):
    """A version refused at publish (over the manifest cap) writes no side file; one a kill left before its manifest
    is pending for verify, and --overwrite removes it; a finished job re-run without its side file says so."""
    src, out = tmp_path / "src", tmp_path / "out"
    write_jpegs(src / "cat", 3, "c")
    env = {"REPACK_QUARANTINE_LISTED": "1"}
    run_repack("images", src, out, "--shard-size", "1", "--quiet", env=env)
    write_jpegs(src / "dog", 6, "d")
    bad_inputs(src / "dog", 3)
    cap = {**env, "REPACK_MAX_MANIFEST_BYTES": "8000"}
    refused = run_repack("images", src, out, "--shard-size", "1", "--append", "--quiet", check=False, env=cap)
    assert refused.returncode != 0 and "nothing is published" in refused.stderr
    assert not list(out.glob("quarantine*")) and run_repack("verify", out, env=cap).returncode == 0
    (out / "quarantine-v2.records").write_bytes(encode(RECORDS))  # as a run killed before its manifest leaves it
    verified = run_repack("verify", out, env=cap)
    assert verified.returncode == 0 and "quarantine-v2.records" in verified.stdout + verified.stderr
    (out / "duplicates-v2.groups").write_bytes(b"x")  # a refused append's groups file, as it is moved in first
    run_repack("images", src, out, "--shard-size", "1", "--overwrite", "--quiet")
    assert not list(out.glob("quarantine*")) and not list(out.glob("duplicates*"))
    assert run_repack("verify", out).returncode == 0

    run_repack("images", src, tmp_path / "again", "--quiet", env=env)
    (tmp_path / "again" / "quarantine.records").unlink()
    rerun = run_repack("images", src, tmp_path / "again", "--quiet", env=env)
    assert "quarantine.records: missing" in rerun.stderr and "repack verify" in rerun.stderr


def test_records_are_read_in_batches_as_written():
    from repack.manifest.quarantine_records import iter_records

    many = [dict(r, n=i) if i % 3 else r for i in range(7) for r in RECORDS]  # 56 records, some with extra keys
    raw = encode(many)
    for batch in (1, 5, 56, 100):
        assert list(iter_records(raw, "f", batch)) == many == decode(raw, "f")
    assert decode(raw, "f", 9) == many[:9] and decode(raw, "f", 0) == [] and decode(raw, "f", 1000) == many

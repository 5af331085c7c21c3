"""Duplicate groups beyond what a manifest lists live in a columnar side file (``repack.manifest.duplicate_groups``):
the manifest stays small however many copies SOURCE holds, and everything that needs every group (an --append's
dropped copies, a remove's takedown of one, verify, gc, s3:// publish and pull) finds them there."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from repack.config import ImagesSpec
from repack.errors import UsageError
from repack.jobs.images import duplicate_report
from repack.manifest.duplicate_groups import GroupsFileError, decode, encode, report_dropped
from tests import test_append_rules
from tests.benchmarks.tiny_files import tiny_jpegs
from tests.conftest import duplicate_groups, read_manifest_json, run_repack, sample_paths
from tests.tools.s3server import MotoServer, client, objects, s3_env

GROUPS = [
    {"sha256": "ab" * 32, "paths": ["a/kept.jpg", "b/copy.jpg", "c/\udcff-not-utf8.jpg"], "prints": [[10, 99], [7]]},
    {"sha256": "cd" * 32, "paths": ["x.jpg", "y.jpg"]},  # a packed-duplicates report: no prints
    {"sha256": "ef" * 32, "paths": ["p.jpg", "q.jpg"], "prints": [[5, -1]]},
]


def test_groups_file_round_trip_and_damage_named():
    raw = encode(GROUPS)
    assert list(decode(raw, "OUT/duplicates.groups")) == GROUPS
    assert list(decode(encode([]), "empty")) == []
    dropped = report_dropped({"file": "duplicates.groups"}, lambda name: raw, "OUT")  # as columns, no dict per group
    assert dropped == report_dropped({"list": GROUPS}, None, "OUT") == (
        ["b/copy.jpg", "c/\udcff-not-utf8.jpg", "y.jpg", "q.jpg"], ["ab" * 32, "ab" * 32, "cd" * 32, "ef" * 32],
        [[10, 99], [7], [], [5, -1]])
    damaged = [raw[:-1], raw + b"\0", b"x" + raw[1:], raw.replace(b'"paths": 7', b'"paths": 8'),
               raw[:raw.index(b"\n") + 1] + b"{}\n" + raw[raw.index(b"}\n") + 2:],
               raw.replace(b'"groups": 3', b'"groups": 1e999'), raw.replace(b'"groups": 3', b'"groups": 3.0'),
               raw[:raw.index(b"\n") + 1] + b"[" * 100_000 + b"\n" + raw[raw.index(b"}\n") + 2:]]
    for bad in damaged:
        with pytest.raises(GroupsFileError, match="OUT/duplicates.groups: not a duplicate-groups file"):
            list(decode(bad, "OUT/duplicates.groups"))


def test_a_report_lists_what_the_manifest_holds_and_files_the_rest(tmp_path, monkeypatch):
    groups = [{"sha256": f"{n:064x}", "paths": [f"c{n % 1000:03d}/{n:08d}.jpg", f"copies/{n:08d}.jpg"],
               "prints": [[700 + n % 50, 1_700_000_000_000_000_000 + n]]} for n in range(20_000)]
    report, side = duplicate_report(groups, 20_000, tmp_path, "duplicates.groups")
    assert report["groups"] == report["extra_copies"] == 20_000 and len(report["list"]) == 1000
    assert report["file"] == "duplicates.groups" and side["files"] == {"duplicates": "duplicates.groups"}
    assert side["file_digests"]["duplicates"]["bytes"] == (tmp_path / "duplicates.groups").stat().st_size
    assert list(decode((tmp_path / "duplicates.groups").read_bytes(), "f")) == groups
    assert len(json.dumps(report)) < 200 * 1000  # JSON of every group: ~5 MB here, ~250 B a group
    monkeypatch.setenv("REPACK_DUPLICATES_LISTED", "30000")
    report, side = duplicate_report(groups, 20_000, tmp_path / "none", "duplicates.groups")
    assert report["list"] == groups and "file" not in report and side == {}
    monkeypatch.setenv("REPACK_DUPLICATES_LISTED", "-1")
    with pytest.raises(UsageError, match="REPACK_DUPLICATES_LISTED='-1'"):
        duplicate_report(groups, 20_000, tmp_path, "duplicates.groups")


def test_the_groups_file_name_is_no_option_of_the_job():
    """It names an output: a job.json written before it existed keeps its options fingerprint (a resume or re-run
    of such a job was refused as "run with other options (--duplicates-file ...)")."""
    spec = ImagesSpec(source="SRC", out="OUT")
    assert "duplicates_file" not in spec.options()
    assert dataclasses.replace(spec, duplicates_file="duplicates-v3.groups").options() == spec.options()


@pytest.mark.parametrize("case", [test_append_rules.test_dedup_holds_across_versions,
                                  test_append_rules.test_a_copy_dedup_dropped_stays_out_when_taken_down_or_its_kept_copy_is,
                                  test_append_rules.test_an_append_of_copies_alone_records_them,
                                  test_append_rules.test_an_append_compares_a_dropped_copy_by_its_fingerprint_before_reading_it],
                         ids=lambda case: case.__name__[len("test_"):])
def test_dedup_rules_hold_with_every_group_in_side_files(case, tmp_path, monkeypatch):
    """The --dedup rules across versions (test_append_rules), with no group listed in any manifest."""
    monkeypatch.setenv("REPACK_DUPLICATES_LISTED", "0")
    case(tmp_path)


def copies_tree(root, copies: int):
    """12 tiny JPEGs and ``copies`` copies of them in a folder of their own."""
    src = tiny_jpegs(root, 0, 12, workers=1)
    (src / "c999").mkdir()
    for n in range(copies):
        shutil.copy(src / f"c{n % 12:03d}" / f"{n % 12:08d}.jpg", src / "c999" / f"copy{n:03d}.jpg")
    return src


def test_verify_gc_and_readers_with_a_groups_file(tmp_path, monkeypatch):
    monkeypatch.setenv("REPACK_DUPLICATES_LISTED", "1")
    src, out = copies_tree(tmp_path / "src", 5), tmp_path / "out"
    run_repack("images", src, out, "--dedup", "--quiet")
    manifest = read_manifest_json(out)
    report = manifest["stats"]["duplicates"]
    assert (report["groups"], report["dropped"], len(report["list"])) == (5, 5, 1)
    assert manifest["files"] == {"duplicates": "duplicates.groups"}
    assert len(duplicate_groups(out, report)) == 5
    assert run_repack("verify", out).returncode == 0
    for n, rel in enumerate(("c001/zz_new.jpg", "c999/copy012.jpg")):  # an append: 2 new groups, a file of its own
        shutil.copy(src / f"c00{3 * n}" / f"0000000{3 * n}.jpg", src / rel)
    tiny_jpegs(src, 50, 1, workers=1)
    run_repack("images", src, out, "--dedup", "--append", "--quiet")
    manifest = read_manifest_json(out)
    assert manifest["files"] == {"duplicates": "duplicates.groups", "duplicates-v2": "duplicates-v2.groups"}
    assert len(sample_paths(out)) == 13 and manifest["totals"]["duplicates_dropped"] == 7
    run_repack("gc", out, "--keep", "1")
    assert run_repack("verify", out).returncode == 0  # version 1's groups file is version 2's too: kept
    from pipelines.torch_webdataset import ImageShardDataset

    assert sum(1 for _ in ImageShardDataset(out, decode=False)) == 13
    groups = out / "duplicates.groups"
    data = bytearray(groups.read_bytes())
    data[-1] ^= 1
    groups.write_bytes(bytes(data))
    bad = run_repack("verify", out, check=False)
    assert bad.returncode == 5 and "duplicates.groups: sha256 differs" in bad.stderr + bad.stdout
    refused = run_repack("images", src, out, "--dedup", "--append", check=False)  # never read as the groups
    assert refused.returncode == 5 and "duplicates.groups: not the duplicate groups the manifest records" in \
        refused.stderr, refused.stderr
    groups.unlink()
    bad = run_repack("verify", out, check=False)
    assert bad.returncode == 5 and "duplicates.groups: missing" in bad.stderr + bad.stdout
    refused = run_repack("images", src, out, "--dedup", "--append", check=False)
    assert refused.returncode != 0 and "duplicates.groups: missing" in refused.stderr


def test_a_groups_file_a_killed_run_left_goes_when_the_rerun_lists_every_group(tmp_path, monkeypatch):
    src, out = copies_tree(tmp_path / "src", 3), tmp_path / "out"
    monkeypatch.setenv("REPACK_DUPLICATES_LISTED", "1")
    run_repack("images", src, out, "--dedup", "--quiet")
    assert (out / "duplicates.groups").is_file()
    for manifest in out.glob("manifest*.json"):  # as a run killed between the side file and its manifest
        manifest.unlink()
    monkeypatch.setenv("REPACK_DUPLICATES_LISTED", "1000")
    run_repack("images", src, out, "--dedup", "--quiet")
    assert not (out / "duplicates.groups").exists() and "files" not in read_manifest_json(out)
    assert len(read_manifest_json(out)["stats"]["duplicates"]["list"]) == 3
    assert run_repack("verify", out).returncode == 0
    monkeypatch.setenv("REPACK_DUPLICATES_LISTED", "many")
    bad = run_repack("images", src, tmp_path / "other", "--dedup", check=False)
    assert bad.returncode == 2 and "REPACK_DUPLICATES_LISTED='many'" in bad.stderr and "Traceback" not in bad.stderr
    assert not list((tmp_path / "other").glob("*.tar"))  # refused before any task


def test_inspect_names_every_versions_groups_file(tmp_path, monkeypatch):
    monkeypatch.setenv("REPACK_DUPLICATES_LISTED", "0")
    src, out = copies_tree(tmp_path / "src", 2), tmp_path / "out"
    run_repack("images", src, out, "--dedup", "--quiet")
    shutil.copy(src / "c004" / "00000004.jpg", src / "c999" / "late.jpg")
    run_repack("images", src, out, "--dedup", "--append", "--quiet")
    shown = run_repack("inspect", out).stdout
    assert "3 group(s)" in shown and "every group: duplicates.groups, duplicates-v2.groups" in shown, shown


def test_groups_files_published_and_pulled_on_s3(tmp_path, monkeypatch):
    monkeypatch.setenv("REPACK_DUPLICATES_LISTED", "0")
    server = MotoServer()
    try:
        env = {**s3_env(server.endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch")}
        s3 = client(server.endpoint)
        s3.create_bucket(Bucket="dups")
        src = copies_tree(tmp_path / "src", 3)
        run_repack("images", src, "s3://dups/run", "--dedup", "--quiet", env=env)
        shutil.copy(src / "c002" / "00000002.jpg", src / "c999" / "late.jpg")
        run_repack("images", src, "s3://dups/run", "--dedup", "--append", "--quiet", env=env)
        names = set(objects(s3, "dups", "run"))
        assert {"duplicates.groups", "duplicates-v2.groups"} <= names
        assert run_repack("verify", "s3://dups/run", env=env).returncode == 0
        pulled = tmp_path / "pulled"
        run_repack("pull", "s3://dups/run", pulled, env=env)
        manifest = read_manifest_json(pulled)
        assert [len(duplicate_groups(pulled, r)) for r in (manifest["stats"]["duplicates"],
                                                           manifest["stats"]["appended"][-1]["duplicates"])] == [3, 1]
        assert run_repack("verify", pulled).returncode == 0
    finally:
        server.stop()

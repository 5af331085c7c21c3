"""`repack video SRC OUT --transcode --append`: only the new videos are prepared (into OUT/videos-vN, new
shards with --to webdataset), every existing file stays byte-identical, the dataset's recorded codec (the
legacy reader's one codec) is reused for the new videos instead of being decided again, nothing new
publishes nothing, and kill -9 + re-run equals an uninterrupted append. Real ffmpeg/ffprobe clips; an
independent ffprobe checks the codecs."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import kill_after_records, read_manifest_json, run_repack
from tests.tools.videos import SRC, _ffmpeg, encoders, video_codecs

pytestmark = pytest.mark.skipif(shutil.which("ffmpeg") is None or "libx265" not in encoders(),
                                reason="needs ffmpeg with libx265")

X265 = ("-c:v", "libx265", "-preset", "ultrafast", "-pix_fmt", "yuv420p", "-tag:v", "hvc1",
        "-x265-params", "log-level=none:keyint=25")
X264 = ("-c:v", "libx264", "-preset", "ultrafast", "-g", "25", "-bf", "0", "-pix_fmt", "yuv420p",
        "-movflags", "+faststart")
PREPARE = ("--probe", "--transcode", "--preset", "ultrafast")


def clip(path: Path, args: tuple[str, ...], seed: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    source = SRC.format(w=192 + 16 * seed, h=144, r=25, d=1)
    _ffmpeg(["-f", "lavfi", "-i", source, *args, str(path)])


def dataset_files(out: Path) -> dict[str, bytes]:
    """Every dataset file under OUT (job state aside) by relative path."""
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and ".repack" not in p.relative_to(out).parts}


def test_video_append_reuses_the_dataset_codec_and_keeps_every_file(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    clip(src / "a/one.mp4", X265)
    clip(src / "a/two.mp4", X265, seed=1)
    run_repack("video", src, out, *PREPARE, "--quiet")
    assert read_manifest_json(out)["codec"] == "hevc"  # every input HEVC: the legacy reader's one codec
    before = dataset_files(out)
    clip(src / "a/h264.mp4", X264, seed=2)  # alone, an H.264 clip would make an H.264 dataset
    clip(src / "c/three.mp4", X265, seed=3)  # a new class
    done = run_repack("video", src, out, *PREPARE, "--append")
    said = done.stdout + done.stderr
    assert "published version 2" in said and "codec hevc kept from the dataset's recorded decision" in said
    after = dataset_files(out)
    assert {name: after[name] for name in before if name != "manifest.json"} == \
        {name: data for name, data in before.items() if name != "manifest.json"}  # byte-identical
    assert after["manifest.v1.json"] == before["manifest.json"]
    manifest = read_manifest_json(out)
    change = manifest["dataset_version"]["change"]
    assert change["kind"] == "append" and change["added_samples"] == 2 and change["codec"] == "hevc"
    assert manifest["codec"] == "hevc" and manifest["classes"] == {"a": 0, "c": 1}
    new = {e["source"]: e for e in manifest["shards"][2:]}
    assert [e["source"] for e in manifest["shards"]] == ["a/one.mp4", "a/two.mp4", "a/h264.mp4", "c/three.mp4"]
    assert new["a/h264.mp4"]["path"] == "videos-v2/a/h264.mp4" and new["a/h264.mp4"]["transcoded"]
    assert new["c/three.mp4"]["cls"] == 1 and not new["c/three.mp4"]["transcoded"]
    assert video_codecs(out / "videos-v2/a/h264.mp4") == ["hevc"]  # transcoded to the dataset's codec
    probes = [json.loads(line) for line in (out / "probe-v2.jsonl").read_text().splitlines()]
    assert [p["source"] for p in probes] == ["a/one.mp4", "a/two.mp4", "a/h264.mp4", "c/three.mp4"]
    assert [r["code"] for r in probes[2]["reasons"]] == ["legacy_one_codec"]
    assert (out / "file_list-v2.txt").read_text().splitlines() == [
        "videos/a/one.mp4 0", "videos/a/two.mp4 0", "videos-v2/a/h264.mp4 0", "videos-v2/c/three.mp4 1"]
    assert manifest["totals"]["videos"] == 4 and manifest["totals"]["transcoded"] == 1  # only the H.264 one
    assert manifest["stats"]["reasons"] == {"legacy_one_codec": 1}
    assert run_repack("verify", out).returncode == 0 and run_repack("verify", out, "--version", "1").returncode == 0
    assert manifest["file_digests"]["file_list"]["bytes"] == (out / "file_list-v2.txt").stat().st_size
    listing = (out / "file_list-v2.txt").read_bytes()
    (out / "file_list-v2.txt").write_bytes(listing.replace(b"three.mp4 1", b"three.mp4 0"))  # a label changed
    damaged = run_repack("verify", out, check=False)
    assert damaged.returncode == 5 and "file_list-v2.txt: sha256 differs from the manifest's" in damaged.stderr
    (out / "file_list-v2.txt").write_bytes(listing)
    manifest_edited = dict(manifest, shards=[*manifest["shards"][:3], {**manifest["shards"][3], "cls": 0}])
    (out / "manifest.json").write_text(json.dumps(manifest_edited))  # the entry's label edited, not the list's
    damaged = run_repack("verify", out, check=False)
    assert damaged.returncode == 5 and "file_list-v2.txt: line 4 is 'videos-v2/c/three.mp4 1', the manifest's " \
        "entries give 'videos-v2/c/three.mp4 0'" in damaged.stderr
    (out / "manifest.json").write_bytes((out / "manifest.v2.json").read_bytes())
    (out / "probe.jsonl").write_bytes((out / "probe.jsonl").read_bytes() + b"{}\n")  # version 1's probe grew
    damaged = run_repack("verify", out, "--version", "1", check=False)
    assert damaged.returncode == 5 and "probe.jsonl: " in damaged.stderr and "the manifest says" in damaged.stderr
    (out / "probe.jsonl").write_bytes((out / "probe.jsonl").read_bytes()[:-3])
    from pipelines.torch_video import VideoClipDataset

    latest, pinned = VideoClipDataset(out, 4), VideoClipDataset(out, 4, version=1)  # the PyTorch reader pins too
    assert len(latest.paths) == 4 and [p.rsplit("/", 1)[-1] for p in pinned.paths] == ["one.mp4", "two.mp4"]
    again = run_repack("video", src, out, *PREPARE, "--append")
    assert "nothing new" in again.stdout + again.stderr and not (out / "manifest.v3.json").exists()
    refused = run_repack("video", src, out, *PREPARE, "--target", "l4", "--append", check=False)
    assert refused.returncode == 2 and "--target l4 (the dataset: h100)" in refused.stderr
    (tmp_path / "takedown.txt").write_text("a/one.mp4\n")
    no_remove = run_repack("remove", out, "--sources", tmp_path / "takedown.txt", check=False)
    assert no_remove.returncode == 2 and "holds video in videos" in no_remove.stderr  # not done for video yet


def test_video_append_killed_and_rerun_equals_an_uninterrupted_append(tmp_path):
    src, a, b = tmp_path / "src", tmp_path / "a", tmp_path / "b"
    clip(src / "x/first.mp4", X264)
    args = ["video", src, None, *PREPARE, "--to", "webdataset", "--shard-size", "2", "--workers", "1", "--quiet"]
    for out in (a, b):
        run_repack(*[out if x is None else x for x in args])
    for i in range(4):
        clip(src / "x" / f"new{i}.mp4", X264, seed=i + 1)
    run_repack(*[b if x is None else x for x in args], "--append")  # uninterrupted
    kill_after_records([a if x is None else x for x in args] + ["--append"], a / ".repack" / "append-v2" / "out", 1)
    assert json.loads((a / "manifest.json").read_bytes()).get("dataset_version") is None  # still version 1
    assert run_repack("verify", a).returncode == 0
    run_repack(*[a if x is None else x for x in args], "--append")
    assert dataset_files(a).keys() == dataset_files(b).keys()
    for name, data in dataset_files(b).items():
        if not name.startswith("manifest"):
            assert dataset_files(a)[name] == data, name
    manifest = read_manifest_json(a)
    assert [s["path"] for s in manifest["shards"]] == ["shard-000000.tar", "shard-v2-000000.tar",
                                                      "shard-v2-000001.tar"]
    assert [v["path"] for v in manifest["videos"]][1:] == [f"videos-v2/x/new{i}.mp4" for i in range(4)]
    keys = [v["key"] for v in manifest["videos"]]
    assert len(set(keys)) == 5
    assert run_repack("verify", a).returncode == 0


def test_video_append_refuses_another_layout_or_link_rule_that_would_pack_a_video_twice(tmp_path):
    """A flat (unlabeled) video dataset appended from SOURCE with a class folder recorded its packed videos as
    quarantined ("outside the class folders") beside their samples, and a later append packed them again (two
    samples of one file); so did an append without the dataset's --allow-outside-source for a linked video. Both
    are refused now, as for images; a packed input the staged plan would quarantine keeps its sample, unrecorded."""
    src, out = tmp_path / "src", tmp_path / "out"
    clip(src / "x.mp4", X264)
    outside = tmp_path / "elsewhere" / "cam.mp4"
    clip(outside, X264, seed=1)
    (src / "cam.mp4").symlink_to(outside)
    run_repack("video", src, out, *PREPARE, "--allow-outside-source", "--quiet")
    clip(src / "a/z.mp4", X264, seed=2)
    done = run_repack("video", src, out, *PREPARE, "--allow-outside-source", "--append", check=False)
    assert done.returncode == 2 and "SOURCE has class folders now" in done.stderr
    shutil.rmtree(src / "a")
    done = run_repack("video", src, out, *PREPARE, "--append", check=False)
    assert done.returncode == 2 and "no --allow-outside-source (the dataset: --allow-outside-source)" in done.stderr
    (src / "cam.mp4").unlink()
    os.mkfifo(src / "cam.mp4")  # the packed video replaced by a FIFO: quarantined by the plan, and it has a sample
    done = run_repack("video", src, out, *PREPARE, "--allow-outside-source", "--append")
    assert "nothing new" in done.stdout  # its sample stays, and no record of it would let a later append repack it
    assert not (out / "manifest.v2.json").exists() and read_manifest_json(out)["totals"]["samples"] == 2


def test_a_video_named_like_another_member_or_a_folder_gets_names_of_its_own(tmp_path):
    """--to webdataset: a video named ``x.cls`` (or ``y.json``) made a sample of two ``.cls`` members (verify said
    OK; plain webdataset refused the shard), one with a non-ASCII extension failed its whole shard; a transcoded
    ``a.avi`` -> ``a.mp4`` beside a folder ``a.mp4/`` failed the job for good. Each gets a name of its own now."""
    src, out = tmp_path / "src", tmp_path / "out"
    clip(src / "c/ok.mp4", X264)
    for name in ("x.cls", "y.json", "z.vidéo"):
        shutil.copy(src / "c/ok.mp4", src / "c" / name)
    clip(src / "c/a.avi", ("-c:v", "mpeg4", "-q:v", "5"), seed=1)  # transcoded to a .mp4
    clip(src / "c/a.mp4/inner.mp4", X264, seed=2)
    run_repack("video", src, out, *PREPARE, "--to", "webdataset", "--quiet")
    manifest = read_manifest_json(out)
    assert manifest["totals"]["samples"] == 6 and not manifest["quarantine"]
    paths = [e["path"] for e in manifest["videos"]]
    assert len(set(paths)) == 6 and "videos/c/a.mp4/inner.mp4" in paths
    import webdataset as wds

    samples = list(wds.WebDataset([str(out / s["path"]) for s in manifest["shards"]], shardshuffle=False))
    assert len(samples) == 6
    for sample in samples:
        assert sample["cls"] == b"0" and json.loads(sample["json"])["source"].startswith("c/")
        assert sum(key not in ("__key__", "__url__", "__local_path__", "cls", "json") for key in sample) == 1
    assert run_repack("verify", out).returncode == 0

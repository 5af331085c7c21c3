"""A dataset received from someone else, damaged or forged with its hashes recorded again: the readers refuse
what they would read wrong by name (an index line giving a sample two members of one extension, a member left
out of the index, a member before its tar's first header, a shard entry dropped, token pointers that are not
the documents back to back, a manifest linked to outside the root), verify answers with problems instead of a
traceback or unbounded memory, and no command writes outside OUT (lock files and job state linked elsewhere,
a job state naming another folder)."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import time
from pathlib import Path

import pytest

from pipelines.torch_text import DocumentDataset
from pipelines.torch_webdataset import ImageShardDataset
from repack.manifest import ManifestError
from tests.conftest import read_manifest_json, run_repack
from tests.test_images_job import write_jpegs


def two_classes(factory, name: str, per_class: int, *args: str) -> Path:
    """Two class folders of ``per_class`` JPEGs packed with ``args`` (read only)."""
    src = factory.mktemp(f"{name}-src")
    write_jpegs(src / "cat", per_class, "c")
    write_jpegs(src / "dog", per_class, "d")
    out = factory.mktemp(name) / "out"
    run_repack("images", src, out, *args, "--quiet")
    return out


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    return two_classes(tmp_path_factory, "received", 6, "--shard-size", "4")


def copy_of(packed: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(packed, out)
    return out


def forge(out: Path, change=None) -> None:
    """The manifest's sizes and sha256 made to agree with the (edited) files, after ``change(manifest)``."""
    manifest = read_manifest_json(out)
    if change:
        change(manifest)
    for shard in manifest["shards"]:
        for key, size, sha in (("path", "bytes", "sha256"), ("index", "index_bytes", "index_sha256"),
                               ("checksums", "checksums_bytes", "checksums_sha256")):
            if shard.get(key):
                data = (out / shard[key]).read_bytes()
                shard[size], shard[sha] = len(data), hashlib.sha256(data).hexdigest()
    (out / "manifest.json").write_text(json.dumps(manifest))


def index_lines(out: Path) -> list[str]:
    return (out / "shard-000000.idx").read_text().splitlines()


def read_all(out: Path) -> list[str]:
    return [sample["key"] for sample in ImageShardDataset(out, output="dict", decode=False)]


def test_an_index_line_with_two_members_of_one_extension_is_refused(packed, tmp_path):
    out = copy_of(packed, tmp_path)
    head, *lines = index_lines(out)
    (out / "shard-000000.idx").write_text("\n".join(["v1.2 3", lines[0] + " " + lines[1], *lines[2:]]) + "\n")

    def fewer(manifest):
        manifest["shards"][0]["samples"] = 3
        manifest["totals"]["samples"] -= 1
    forge(out, fewer)
    with pytest.raises(ManifestError, match=r"shard-000000\.idx: .*sample 0's line gives two members one extension"):
        read_all(out)


@pytest.mark.parametrize("damage", ["member left out", "offset before the first header"])
def test_an_index_that_does_not_lay_out_its_tar_is_refused(packed, tmp_path, damage):
    out = copy_of(packed, tmp_path)
    head, *lines = index_lines(out)
    if damage == "member left out":  # the second sample without its .json: read with meta None before
        tokens = lines[1].split(" ")
        lines[1] = " ".join(tokens[:8])
    else:
        tokens = lines[0].split(" ")
        lines[0] = " ".join([tokens[0], "0", *tokens[2:]])
    (out / "shard-000000.idx").write_text("\n".join([head, *lines]) + "\n")
    forge(out)
    with pytest.raises(ManifestError, match=r"shard-000000\.idx: not a v1\.2 index of its tar .*a member left out"):
        read_all(out)


def test_a_shard_entry_dropped_from_the_manifest_is_refused_by_the_readers(packed, tmp_path):
    out = copy_of(packed, tmp_path)
    forge(out, lambda manifest: manifest["shards"].pop(1))
    with pytest.raises(ManifestError, match=r"totals\.samples is 12, its shards hold 8"):
        read_all(out)


def test_verify_of_a_shard_declaring_absurd_samples_ends_with_problems(packed, tmp_path):
    out = copy_of(packed, tmp_path)
    forge(out, lambda manifest: manifest["shards"][0].update(samples=10 ** 30))
    started = time.monotonic()
    proc = run_repack("verify", out, check=False, timeout=120)
    assert proc.returncode == 5 and "manifest says 1000000000000000000000000000000" in proc.stderr
    assert time.monotonic() - started < 60


def test_a_manifest_linked_to_outside_the_root_is_refused(packed, tmp_path):
    out = copy_of(packed, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "manifest.json").write_bytes((out / "manifest.json").read_bytes())
    (out / "manifest.json").unlink()
    (out / "manifest.json").symlink_to(outside / "manifest.json")
    with pytest.raises(ManifestError, match="resolves outside the dataset root"):
        read_all(out)
    proc = run_repack("verify", out, check=False)
    assert proc.returncode == 5 and "resolves outside the dataset root" in proc.stderr and "Traceback" not in proc.stderr


def test_lock_files_and_job_state_linked_elsewhere_are_never_written_through(packed, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = copy_of(packed, tmp_path)
    (out / ".repack" / "lock").unlink(missing_ok=True)
    (out / ".repack" / "lock").symlink_to(victim)
    (tmp_path / "takedown.txt").write_text("cat/c0.jpg\n")
    for args in (("gc", out), ("remove", out, "--sources", tmp_path / "takedown.txt")):
        proc = run_repack(*args, check=False)
        assert proc.returncode == 2 and "is a symbolic link" in proc.stderr, args
    assert victim.read_text() == "keep me"
    elsewhere = tmp_path / "elsewhere"
    shutil.move(out / ".repack", elsewhere)
    (out / ".repack").symlink_to(elsewhere)
    before = sorted(p.name for p in elsewhere.iterdir())
    proc = run_repack("gc", out, check=False)
    assert proc.returncode == 2 and "is a symbolic link" in proc.stderr
    assert sorted(p.name for p in elsewhere.iterdir()) == before


def test_merge_writes_into_the_folder_it_is_given_not_the_one_its_job_state_names(tmp_path):
    src = write_jpegs(tmp_path / "src" / "c", 8, "a").parent
    original = tmp_path / "original"
    for rank in (0, 1):
        run_repack("images", src, original, "--shard-size", "4", "--num-nodes", "2", "--node-rank", str(rank),
                   "--quiet")
    moved = tmp_path / "moved"
    shutil.copytree(original, moved)
    run_repack("merge", moved)
    assert (moved / "manifest.json").exists() and not (original / "manifest.json").exists()
    assert run_repack("verify", moved).returncode == 0


def test_token_pointers_that_are_not_the_documents_back_to_back_are_refused(tmp_path):
    from tests.tools.text import documents, train_bpe, write_tokenizer

    tok = write_tokenizer(train_bpe(documents(30, seed=1)), tmp_path / "tok")
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(30, seed=2)))
    out = tmp_path / "out"
    run_repack("text", src, out, "--tokenizer", tok.parent, "--quiet")
    idx = bytearray((out / "text_document.idx").read_bytes())
    n = struct.unpack_from("<Q", idx, 18)[0]
    for where, value in ((1, 0), (2, 10 ** 9)):  # document 1 reads document 0's tokens; document 2 past the end
        struct.pack_into("<q", idx, 34 + 4 * n + 8 * where, value)
    (out / "text_document.idx").write_bytes(bytes(idx))
    manifest = read_manifest_json(out)
    manifest["shards"][0].update(index_sha256=hashlib.sha256(bytes(idx)).hexdigest())
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"sequence pointers are not its documents back to back"):
        DocumentDataset(out)
    proc = run_repack("verify", out, check=False)
    assert proc.returncode == 5 and "sequence_pointers are not the byte offsets" in proc.stderr
    assert "Traceback" not in proc.stderr


# -- video, LMDB and the report ---------------------------------------------------------------------------
def ffmpeg_clip(path: Path, seed: int) -> None:
    import subprocess

    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i", f"testsrc=duration=1:size=64x64:rate=10",
                    "-vf", f"hue=h={seed * 40}", "-c:v", "libx264", "-pix_fmt", "yuv420p", str(path)], check=True)


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> Path:
    if shutil.which("ffmpeg") is None:
        pytest.skip("ffmpeg is not installed")
    src = tmp_path_factory.mktemp("video-src")
    for n, rel in enumerate(("cat/v1.mp4", "cat/v2.mp4", "dog/v3.mp4")):
        ffmpeg_clip(src / rel, n)
    out = tmp_path_factory.mktemp("video") / "out"
    run_repack("video", src, out, "--transcode", "--quiet")
    return out


def video_entry(out: Path, change) -> None:
    manifest = read_manifest_json(out)
    change(manifest["shards"])
    manifest["totals"]["samples"] = sum(s["samples"] for s in manifest["shards"])  # the totals made to agree
    (out / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("damage,said", [
    ("a class the map lacks", "class 7 is not an index of the dataset's class map"),
    ("another label's class", "class 1 is not its label 'cat''s"),
    ("listed twice", "is listed twice"),
    ("frames no file holds", "is not a frame count its"),
])
def test_a_video_entry_read_wrong_is_refused(videos, tmp_path, damage, said):
    from pipelines.torch_video import VideoClipDataset

    out = tmp_path / "copy"
    shutil.copytree(videos, out)

    def edit(shards):
        if damage == "a class the map lacks":
            shards[0]["cls"] = 7
        elif damage == "another label's class":
            shards[0]["cls"] = 1
        elif damage == "listed twice":  # through a link beside it: another name, the same file
            (out / shards[0]["path"]).parent.joinpath("alias.mp4").symlink_to(Path(shards[0]["path"]).name)
            shards.append({**shards[0], "path": str(Path(shards[0]["path"]).parent / "alias.mp4")})
        else:
            shards[0]["frames"] = 10 ** 7
    video_entry(out, edit)
    with pytest.raises(ManifestError, match=said):
        VideoClipDataset(out, sequence_length=4)
    proc = run_repack("verify", out, check=False)  # verify names what the reader refuses
    assert proc.returncode == 5 and (damage == "listed twice" or said in proc.stderr), proc.stderr


def test_verify_names_a_frame_count_edited_within_the_files_size(videos, tmp_path):
    """Fewer frames than the file holds: the reader cuts fewer clips, silently; verify counts the packets."""
    from pipelines.torch_video import VideoClipDataset

    out = tmp_path / "copy"
    shutil.copytree(videos, out)
    frames = read_manifest_json(out)["shards"][0]["frames"]
    clips = len(VideoClipDataset(out, sequence_length=1))

    def edit(shards):
        shards[0]["frames"] = frames - 4
    video_entry(out, edit)
    assert len(VideoClipDataset(out, sequence_length=1)) == clips - 4
    proc = run_repack("verify", out, check=False)
    assert proc.returncode == 5 and f"{frames} frames, manifest says {frames - 4}" in proc.stderr


def test_verify_names_an_index_whose_size_or_sha256_the_manifest_records_otherwise(packed, tmp_path):
    """The DALI loader checks each .idx against the manifest's index_bytes and index_sha256: so does verify."""
    for field, edit in (("index_sha256", lambda v: ("1" if v[0] != "1" else "2") + v[1:]),
                        ("index_bytes", lambda v: v + 1)):
        out = copy_of(packed, tmp_path / field)
        manifest = read_manifest_json(out)
        manifest["shards"][1][field] = edit(manifest["shards"][1][field])
        (out / "manifest.json").write_text(json.dumps(manifest))
        proc = run_repack("verify", out, check=False)
        assert proc.returncode == 5 and "shard-000001.idx" in proc.stderr and "not the manifest's" in proc.stderr


def test_verify_names_an_image_type_that_no_field_names(tmp_path):
    from PIL import Image

    src = write_jpegs(tmp_path / "src" / "c", 3, "a").parent
    Image.new("RGB", (16, 16), (1, 2, 3)).save(src / "c" / "p.png")
    out = tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    manifest = read_manifest_json(out)
    assert manifest["fields"]["png"] == "image"
    del manifest["fields"]["png"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    proc = run_repack("verify", out, check=False)
    assert proc.returncode == 5 and "hold png images (stats.formats) that no 'image' field names" in proc.stderr


def test_verify_of_an_lmdb_with_damaged_pages_names_it_never_a_traceback(lmdb_out, tmp_path):
    """A flipped byte in a page LMDB's cursor walks: verify names data.lmdb (its sha256, its records), whatever
    the flip makes the cursor raise."""
    from repack.sinks.lmdb_sink import LmdbSink

    out = copy_of(lmdb_out, tmp_path)
    shard = read_manifest_json(out)["shards"][0]
    data = (out / "data.lmdb").read_bytes()
    unreadable = 0
    for offset in range(2 * 4096, len(data), 7):
        damaged = bytearray(data)
        damaged[offset] ^= 1
        (out / "data.lmdb").write_bytes(damaged)
        problems = []
        LmdbSink.verify_shard(out, shard, lambda ok, problem: ok or problems.append(problem))
        assert problems and all(p.startswith("data.lmdb: ") for p in problems), offset
        unreadable += any("its records cannot be read" in p for p in problems)
    assert unreadable  # some flips break the walk itself (before: a traceback, exit 1)


def test_a_prepared_video_replaced_by_a_concat_script_never_opens_another_file(videos, tmp_path):
    """An ffconcat script in place of a video, naming a symlink beside it to a video outside the root: the reader
    opens that one file as one of the single-file containers, and FFmpeg's concat demuxer is not one."""
    from pipelines.sample_errors import SampleDecodeError
    from pipelines.torch_video import VideoClipDataset

    out = tmp_path / "copy"
    shutil.copytree(videos, out)
    secret = tmp_path / "private" / "secret.mp4"
    ffmpeg_clip(secret, 5)
    first = read_manifest_json(out)["shards"][0]["path"]
    (out / first).parent.joinpath("part.mp4").symlink_to(secret)
    (out / first).write_text("ffconcat version 1.0\nfile part.mp4\n")
    with pytest.raises(SampleDecodeError, match=r"decode failed"):
        VideoClipDataset(out, sequence_length=4)[0]


@pytest.fixture(scope="module")
def lmdb_out(tmp_path_factory) -> Path:
    return two_classes(tmp_path_factory, "lmdb", 3, "--to", "lmdb")


def test_a_cut_lmdb_with_its_size_recorded_again_is_refused_not_mapped(lmdb_out, tmp_path):
    """Mapped reads past a file's end are SIGBUS: the readers and the report check LMDB's meta pages first (run in
    a child process, so a regression kills it, not the tests)."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = tmp_path / "copy"
    shutil.copytree(lmdb_out, out)
    data = (out / "data.lmdb").read_bytes()
    (out / "data.lmdb").write_bytes(data[:len(data) - 4096])
    forge(out)
    code = ("import sys\nfrom pipelines.torch_lmdb import LmdbImageDataset\nfrom repack.manifest import ManifestError\n"
            "try:\n    list(LmdbImageDataset(sys.argv[1], decode=False))\nexcept ManifestError as exc:\n"
            "    print('refused', exc)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "refused" in proc.stdout and "not safe to open as LMDB" in proc.stdout
    report = run_repack("inspect", out, "--html", tmp_path / "r.html", check=False)
    assert report.returncode == 0, report.stderr


def test_a_labeled_lmdb_sample_without_a_class_of_the_map_is_named(lmdb_out, tmp_path):
    import lmdb

    from pipelines.sample_errors import SampleDecodeError
    from pipelines.torch_lmdb import LmdbImageDataset

    for value in (None, b"7"):
        out = tmp_path / f"copy-{value}"
        shutil.copytree(lmdb_out, out)
        env = lmdb.open(str(out / "data.lmdb"), subdir=False, lock=False)
        with env.begin(write=True) as txn:
            if value is None:
                txn.delete(b"s/0000000001/cls")
            else:
                txn.put(b"s/0000000001/cls", value)
        env.close()
        forge(out)
        with pytest.raises(SampleDecodeError, match=r"s/0000000001.*(no class|class index 7 is not in)"):
            list(LmdbImageDataset(out, decode=False))


def test_the_report_escapes_a_received_class_map_and_refuses_sections_of_other_shapes(packed, tmp_path):
    out = copy_of(packed, tmp_path)
    manifest = read_manifest_json(out)
    (out / "manifest.json").write_text(json.dumps({**manifest, "classes": {"cat": "<script>x()</script>", "dog": 1}}))
    run_repack("inspect", out, "--html", tmp_path / "r.html")
    assert "<script>x()</script>" not in (tmp_path / "r.html").read_text()
    # sections of another JSON type: verify crashed (format a list, stats a string) or said OK (created_by a
    # string, dataset_version.number a string) while the other commands and the readers refused them
    for key, value, said in (("created_by", "a string", "created_by must be a dict"),
                             ("format", ["webdataset"], "format must be a str"),
                             ("stats", "x", "stats must be a dict"),
                             ("dataset_version", {"number": "1"}, "dataset_version.number must be a whole number")):
        (out / "manifest.json").write_text(json.dumps({**manifest, key: value}))
        for command in ("inspect", "verify"):
            proc = run_repack(command, out, check=False)
            assert proc.returncode == 5 and said in proc.stdout + proc.stderr, (command, key, proc.stderr)
            assert "Traceback" not in proc.stderr


def test_links_planted_in_the_job_state_are_refused_before_anything_is_written(packed, tmp_path):
    """A received dataset's ``.repack`` holding links (a write probe's name for every pid, a link deep in the
    task folder): every command that writes there refuses, naming the link; the files they point to stay."""
    victim = tmp_path / "important.conf"
    victim.write_text("keep me")
    out = copy_of(packed, tmp_path)
    for pid in range(1, 200):
        (out / ".repack" / f".write-probe-{pid}").symlink_to(victim)
    (tmp_path / "takedown.txt").write_text("cat/c0.jpg\n")
    for args in (("gc", out, "--keep", "1"), ("remove", out, "--sources", tmp_path / "takedown.txt")):
        proc = run_repack(*args, check=False)
        assert proc.returncode == 2 and "is a symbolic link" in proc.stderr and ".write-probe-" in proc.stderr, args
    for probe in (out / ".repack").glob(".write-probe-*"):
        probe.unlink()
    (out / ".repack" / "tasks" / "deep").mkdir()
    (out / ".repack" / "tasks" / "deep" / "shard-000000.lock").symlink_to(victim)
    proc = run_repack("gc", out, check=False)
    assert proc.returncode == 2 and "deep/shard-000000.lock" in proc.stderr
    assert victim.read_text() == "keep me"


@pytest.mark.parametrize("folder, args", [("segments", ("--chunk-size", "2")), ("parts", ("--to", "lmdb"))])
def test_a_job_state_folder_linked_elsewhere_is_never_written_through(tmp_path, folder, args):
    src = write_jpegs(tmp_path / "src" / "c", 6, "a").parent
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    kept = {name: f"precious {name}".encode() for name in (".shard-000000.tar.tmp-shared", "part-000000.bin")}
    for name, data in kept.items():
        (elsewhere / name).write_bytes(data)
    out = tmp_path / "out"
    (out / ".repack").mkdir(parents=True)
    (out / ".repack" / folder).symlink_to(elsewhere)
    proc = run_repack("images", src, out, "--shard-size", "4", *args, "--quiet", check=False)
    assert proc.returncode == 2 and f".repack/{folder}" in proc.stderr and "is a symbolic link" in proc.stderr
    assert {p.name: p.read_bytes() for p in elsewhere.iterdir()} == kept


def test_merge_refuses_a_plan_whose_task_names_a_path(tmp_path):
    """A forged plan (its digest written into job.json) naming a task ``../../victim/pwn``: merge refuses it
    before any file is written, never a shard outside OUT."""
    from repack.jobs.base import Plan, Task, read_plan, save_plan
    from repack.store import open_store

    src = write_jpegs(tmp_path / "src" / "c", 8, "a").parent
    out = tmp_path / "parts" / "out"
    for rank in (0, 1):
        run_repack("images", src, out, "--shard-size", "4", "--num-nodes", "2", "--node-rank", str(rank), "--quiet")
    store = open_store(str(out))
    plan = read_plan(store)
    forged = Plan(tuple(Task("../../victim/pwn" if n == 0 else t.task_id, t.payload, t.group)
                        for n, t in enumerate(plan.tasks)), plan.quarantine, plan.info)
    save_plan(store, forged)
    state = json.loads((out / ".repack" / "job.json").read_text())
    (out / ".repack" / "job.json").write_text(json.dumps({**state, "plan_digest": forged.digest}))
    proc = run_repack("merge", out, check=False)
    assert proc.returncode == 2 and "plan.json.gz is missing or damaged" in proc.stderr
    assert not (tmp_path / "victim").exists() and not (out / "manifest.json").exists()


def test_a_dangling_link_at_a_video_temp_name_is_removed_not_written_through(tmp_path):
    if shutil.which("ffmpeg") is None:
        pytest.skip("ffmpeg is not installed")
    src = tmp_path / "src"
    ffmpeg_clip(src / "a" / "v1.mp4", 0)
    target = tmp_path / "elsewhere" / "new.mp4"
    target.parent.mkdir()
    out = tmp_path / "out"
    (out / "videos" / "a").mkdir(parents=True)
    for task in ("shard-000000", "shard-000000-c0000"):
        (out / "videos" / "a" / f".v1.mp4.tmp-{task}").symlink_to(target)
    run_repack("video", src, out, "--transcode", "--overwrite", "--quiet")
    assert not target.exists()
    assert (out / "videos" / "a" / "v1.mp4").is_file() and not (out / "videos" / "a" / "v1.mp4").is_symlink()
    assert run_repack("verify", out).returncode == 0


def test_a_damaged_video_is_named_by_its_digest_alone_its_frames_not_counted(videos, tmp_path):
    """A video whose bytes changed is one problem (its sha256); its frames are counted only in a file that
    matches, where a count differing from the entry's is the manifest's edit."""
    from repack.sinks.videos import VideosSink

    out = tmp_path / "copy"
    shutil.copytree(videos, out)
    shard = read_manifest_json(out)["shards"][0]
    data = bytearray((out / shard["path"]).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (out / shard["path"]).write_bytes(bytes(data))
    problems = []
    VideosSink.verify_shard(out, {**shard, "frames": shard["frames"] + 3}, lambda ok, p: ok or problems.append(p))
    assert problems == [f"{shard['path']}: sha256 mismatch"]

"""`repack images` to WebDataset end to end through the real CLI: layout, quarantine, scan rules,
determinism, resume after kill -9, locking, option changes, fail-fast errors, verify."""

from __future__ import annotations

import fcntl
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from PIL import Image

from repack.sinks.tar_format import iter_members
from repack.transforms.image_check import BadImage, inspect_image
from tests.conftest import kill_after_records, read_manifest_json, run_repack
from tests.tools.photos import load_photos

WDS2IDX = Path(sys.executable).with_name("wds2idx")


def jpeg_bytes(size=(64, 48), quality=85, seed=0, mode="RGB") -> bytes:
    photo = load_photos()["coffee"].convert(mode)
    x = (seed * 37) % (photo.width - size[0])
    buf = io.BytesIO()
    photo.crop((x, 0, x + size[0], size[1])).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def write_jpegs(folder: Path, count: int, stem: str = "") -> Path:
    """``folder`` (created) holding ``count`` small distinct JPEGs named ``<stem><i>.jpg``."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (folder / f"{stem}{i}.jpg").write_bytes(jpeg_bytes(seed=i))
    return folder


def png_bytes(size=(40, 30)) -> bytes:
    buf = io.BytesIO()
    load_photos()["chelsea"].resize(size).save(buf, "PNG")
    return buf.getvalue()


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.suffix in (".tar", ".idx")}


def manifest_without_run(out: Path) -> dict:
    data = read_manifest_json(out)
    data.pop("run")
    return data


@pytest.fixture()
def messy_tree(tmp_path) -> Path:
    """A labeled tree with every kind of trouble the scan and the checks must handle."""
    root = tmp_path / "src"
    for cls in ("cat", "dog"):
        (root / cls).mkdir(parents=True)
    (root / "cat" / "a.v2.jpg").write_bytes(jpeg_bytes(seed=1))
    (root / "cat" / "same.jpg").write_bytes(jpeg_bytes(seed=2))
    (root / "dog" / "same.jpg").write_bytes(jpeg_bytes(seed=3))
    (root / "dog" / "photo.JPEG").write_bytes(jpeg_bytes(seed=4))
    (root / "dog" / "really_png.jpg").write_bytes(png_bytes())
    (root / "dog" / "it's $(rm -rf x); \"q\".jpg").write_bytes(jpeg_bytes(seed=5))
    (root / os.fsdecode(b"cat/caf\xe9-latin1.jpg")).write_bytes(jpeg_bytes(seed=6))
    full = jpeg_bytes(seed=7, size=(120, 90))
    (root / "cat" / "truncated.jpg").write_bytes(full[: len(full) // 2])
    (root / "cat" / "empty.jpg").write_bytes(b"")
    (root / "dog" / "notes.txt").write_bytes(b"not an image at all")
    (root / "dog" / "broken_link.jpg").symlink_to(root / "does-not-exist.jpg")
    (root / "dog" / "link_to_cat.jpg").symlink_to(root / "cat" / "a.v2.jpg")
    (root / "cat" / "loop").symlink_to(root / "cat")
    (root / "cat" / ".DS_Store").write_bytes(b"junk")
    (root / "dog" / "Thumbs.db").write_bytes(b"junk")
    (root / "dog" / "@eaDir").mkdir()
    (root / "dog" / "@eaDir" / "x.jpg").write_bytes(jpeg_bytes(seed=8))
    (root / ".hidden").mkdir()
    (root / ".hidden" / "y.jpg").write_bytes(jpeg_bytes(seed=9))
    return root


def test_pack_layout_and_quarantine(messy_tree, tmp_path):
    out = tmp_path / "out"
    proc = run_repack("images", messy_tree, out, "--shard-size", "3", "--quiet", "--json")
    summary = json.loads(proc.stdout)
    m = read_manifest_json(out)
    assert m["schema"] == "repack.manifest" and m["version"] == 1 and m["format"] == "webdataset"
    assert m["classes"] == {"cat": 0, "dog": 1}
    reasons = {q["source"]: q["reason"] for q in m["quarantine"]}
    assert "truncated" in reasons["cat/truncated.jpg"]
    assert "empty" in reasons["cat/empty.jpg"]
    assert "not a recognized image" in reasons["dog/notes.txt"]
    assert reasons["dog/broken_link.jpg"] == "broken symlink"
    assert "symlink loop" in reasons["cat/loop"]
    assert "same file as cat/a.v2.jpg" in reasons["dog/link_to_cat.jpg"]
    assert len(reasons) == 6 and m["totals"]["quarantined"] == 6 == summary["totals"]["quarantined"]
    assert m["totals"]["samples"] == 7 and m["totals"]["inputs"] == 13
    assert m["totals"]["skipped_junk"] >= 4
    # every sample: image under its real type, cls, json; keys unique, short, ASCII, dot-free
    metas, keys = {}, set()
    for shard in m["shards"]:
        assert shard["samples"] > 0
        with tarfile.open(out / shard["path"]) as tf:
            members = tf.getmembers()
        assert all(not mem.pax_headers and mem.mtime == 0 and mem.uid == 0 and mem.isreg() for mem in members)
        assert all(len(mem.name) < 100 and mem.name.isascii() for mem in members)
        with tarfile.open(out / shard["path"]) as tf:
            for i in range(0, len(members), 3):
                group = members[i:i + 3]
                key = group[0].name.split(".")[0]
                assert [mem.name.split(".", 1)[0] for mem in group] == [key] * 3 and "." not in key
                exts = [mem.name.split(".", 1)[1] for mem in group]
                assert exts[1:] == ["cls", "json"]
                meta = json.loads(tf.extractfile(group[2]).read())
                assert exts[0] == meta["format"]
                assert int(tf.extractfile(group[1]).read()) == m["classes"][meta["class"]]
                assert tf.extractfile(group[0]).read() == (messy_tree / meta["path"]).read_bytes()
                keys.add(key)
                metas[meta["path"]] = (exts[0], meta)
    assert len(keys) == 7
    assert metas["dog/really_png.jpg"][0] == "png"
    assert metas["dog/photo.JPEG"][0] == "jpg"
    assert {"cat/same.jpg", "dog/same.jpg", "cat/a.v2.jpg"} <= set(metas)
    assert metas["cat/a.v2.jpg"][1]["width"] == 64 and metas["cat/a.v2.jpg"][1]["height"] == 48
    assert run_repack("verify", out).returncode == 0


def test_index_files_match_dalis_wds2idx(packed_photos, tmp_path):
    m = read_manifest_json(packed_photos)
    assert len(m["shards"]) == 5
    for shard in m["shards"]:
        theirs = tmp_path / (shard["path"] + ".idx")
        subprocess.run([str(WDS2IDX), str(packed_photos / shard["path"]), str(theirs)], check=True,
                       capture_output=True)
        assert (packed_photos / shard["index"]).read_bytes() == theirs.read_bytes()


def test_no_follow_symlinks_and_strict(messy_tree, tmp_path):
    out = tmp_path / "out"
    proc = run_repack("images", messy_tree, out, "--no-follow-symlinks", "--strict", "--quiet", check=False)
    assert proc.returncode == 6 and "--strict" in proc.stderr
    again = run_repack("images", messy_tree, out, "--no-follow-symlinks", "--strict", "--quiet", check=False)
    assert again.returncode == 6  # a finished job re-run under --strict still reports the quarantine
    # what --strict leaves: no manifest.json (not a dataset), the shards, and the would-be manifest
    assert not (out / "manifest.json").exists() and list(out.glob("shard-*.tar"))
    assert "no manifest.json was published" in again.stderr
    withheld = json.loads((out / ".repack" / "strict-manifest.json").read_text())
    reasons = {q["source"]: q["reason"] for q in withheld["quarantine"]}
    assert all("symlink (not followed" in reasons[p] for p in ("dog/link_to_cat.jpg", "cat/loop", "dog/broken_link.jpg"))
    verify = run_repack("verify", out, check=False)
    assert verify.returncode != 0
    published = run_repack("images", messy_tree, out, "--no-follow-symlinks", "--quiet")  # without --strict
    assert "(0 task(s) run," in published.stdout and read_manifest_json(out)["quarantine"] == withheld["quarantine"]
    # a published dataset re-checked under --strict is withdrawn: exit 6 leaves no manifest.json, always
    assert run_repack("images", messy_tree, out, "--no-follow-symlinks", "--strict", check=False).returncode == 6
    assert not (out / "manifest.json").exists()


def test_flat_folder_is_unlabeled(tmp_path):
    src = write_jpegs(tmp_path / "flat", 3, stem="img")
    out = tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    m = read_manifest_json(out)
    assert m["classes"] == {} and "cls" not in m["fields"] and m["totals"]["samples"] == 3
    with tarfile.open(out / m["shards"][0]["path"]) as tf:
        assert [n.rsplit(".", 1)[1] for n in tf.getnames()] == ["jpg", "json"] * 3


@pytest.mark.parametrize("kind", ["csv", "tsv", "jsonl"])
def test_list_files(tmp_path, kind):
    images = tmp_path / "imgs"
    images.mkdir()
    rows = []
    for i, label in enumerate(["b", "a", "b"]):
        (images / f"{i}.jpg").write_bytes(jpeg_bytes(seed=i))
        path = f"imgs/{i}.jpg" if i != 2 else str(images / f"{i}.jpg")  # relative and absolute
        rows.append((path, label))
    rows.append(("imgs/missing.jpg", "a"))
    listing = tmp_path / f"files.{kind}"
    if kind == "jsonl":
        listing.write_text("".join(json.dumps({"path": p, "label": l}) + "\n" for p, l in rows) + "{broken\n")
    else:
        sep = "," if kind == "csv" else "\t"
        listing.write_text(f"path{sep}label\n" + "".join(f"{p}{sep}{l}\n" for p, l in rows))
    out = tmp_path / "out"
    run_repack("images", listing, out, "--list", "--quiet")
    m = read_manifest_json(out)
    assert m["classes"] == {"a": 0, "b": 1} and m["totals"]["samples"] == 3
    reasons = [q["reason"] for q in m["quarantine"]]
    assert any("unreadable" in r for r in reasons)
    assert len(reasons) == (2 if kind == "jsonl" else 1)


def test_shuffle_mixes_classes_deterministically(photo_tree, tmp_path):
    def cls_sequence(out):
        seq = []
        for shard in read_manifest_json(out)["shards"]:
            with tarfile.open(out / shard["path"]) as tf:
                seq.append([int(tf.extractfile(n).read()) for n in tf.getmembers() if n.name.endswith(".cls")])
        return seq

    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for out, seed in ((a, 5), (b, 5), (c, 6)):
        run_repack("images", photo_tree, out, "--shuffle", "--seed", seed, "--shard-size", "40", "--quiet")
    assert shard_bytes(a) == shard_bytes(b) and shard_bytes(a) != shard_bytes(c)
    assert all(len(set(s)) >= 6 for s in cls_sequence(a))
    unshuffled = tmp_path / "d"
    run_repack("images", photo_tree, unshuffled, "--shard-size", "40", "--quiet")
    seq = [x for s in cls_sequence(unshuffled) for x in s]
    assert seq == sorted(seq)


def test_shard_bytes_cut(photo_tree, tmp_path):
    out = tmp_path / "out"
    run_repack("images", photo_tree, out, "--shard-bytes", "300KB", "--quiet")
    m = read_manifest_json(out)
    assert len(m["shards"]) > 3
    assert all(s["bytes"] <= 300_000 or s["samples"] == 1 for s in m["shards"])


def test_byte_identical_reruns_and_worker_counts(photo_tree, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    run_repack("images", photo_tree, a, "--shard-size", "30", "--workers", "1", "--quiet")
    run_repack("images", photo_tree, b, "--shard-size", "30", "--workers", "2", "--quiet")
    assert shard_bytes(a) == shard_bytes(b)
    assert manifest_without_run(a) == manifest_without_run(b)
    again = run_repack("images", photo_tree, a, "--shard-size", "30")
    assert "nothing to do" in again.stdout


def test_resume_after_kill_is_byte_identical(photo_tree, tmp_path):
    reference = tmp_path / "ref"
    run_repack("images", photo_tree, reference, "--shard-size", "4", "--workers", "1", "--quiet")
    for kill_after in (1, 7, 19):
        out = tmp_path / f"killed{kill_after}"
        kill_after_records(["images", photo_tree, out, "--shard-size", "4", "--workers", "1", "--quiet"], out,
                           kill_after)
        assert not (out / "manifest.json").exists() or kill_after >= 30
        resumed = run_repack("images", photo_tree, out, "--shard-size", "4", "--workers", "1")
        assert "resumed" in resumed.stdout
        assert shard_bytes(out) == shard_bytes(reference)
        assert manifest_without_run(out) == manifest_without_run(reference)
        assert not [p for p in out.iterdir() if p.name.startswith(".") and p.name != ".repack"]


def test_second_live_run_is_refused(photo_tree, tmp_path):
    out = tmp_path / "out"
    (out / ".repack" / "tasks").mkdir(parents=True)
    with open(out / ".repack" / "lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("12345")
        held.flush()
        proc = run_repack("images", photo_tree, out, "--quiet", check=False)
    assert proc.returncode == 3 and "already running" in proc.stderr
    assert not (out / "manifest.json").exists()


def test_changed_options_refused_unless_overwrite(photo_tree, tmp_path):
    out = tmp_path / "out"
    run_repack("images", photo_tree, out, "--shard-size", "50", "--quiet")
    proc = run_repack("images", photo_tree, out, "--shard-size", "60", "--quiet", check=False)
    assert proc.returncode == 2 and "--overwrite" in proc.stderr
    assert "(--shard-size: 50 -> 60)" in proc.stderr and "values it was started with" in proc.stderr
    proc = run_repack("images", photo_tree, out, "--shard-size", "50", "--chunk-size", "16", "--quiet", check=False)
    assert proc.returncode == 2 and "(--chunk-size: 1024 -> 16)" in proc.stderr, proc.stderr  # the default named
    run_repack("images", photo_tree, out, "--shard-size", "60", "--overwrite", "--quiet")
    m = read_manifest_json(out)
    assert [s["samples"] for s in m["shards"]] == [60, 60]
    assert sorted(p.name for p in out.glob("shard-*")) == [f"shard-00000{i}.{e}" for i in (0, 1) for e in ("crc", "idx", "tar")]


def test_a_job_planned_otherwise_from_the_same_inputs_is_not_called_a_changed_source(photo_tree, tmp_path):
    """A job whose recorded plan differs while no input does (left by a repack that laid its tasks out
    otherwise, as the s3:// listing into columns did) is refused as such, not as "source changed"."""
    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(photo_tree, src)
    run_repack("images", src, out, "--shard-size", "50", "--quiet")
    state = out / ".repack" / "job.json"
    recorded = json.loads(state.read_text())
    state.write_text(json.dumps({**recorded, "plan_digest": "0" * 64}))  # what another planner's layout leaves
    proc = run_repack("images", src, out, "--shard-size", "50", "--quiet", check=False)
    assert proc.returncode == 2 and "planned differently from the same inputs" in proc.stderr, proc.stderr
    assert "source changed" not in proc.stderr and "--overwrite" in proc.stderr
    first = sorted(src.rglob("*.jpg"))[0]
    first.write_bytes(first.read_bytes() + b"\0")  # an input that did change is still named as such
    proc = run_repack("images", src, out, "--shard-size", "50", "--quiet", check=False)
    assert proc.returncode == 2 and "source changed" in proc.stderr and first.name in proc.stderr, proc.stderr


def test_bad_jobs_fail_fast(tmp_path, photo_tree):
    (tmp_path / "emptysrc").mkdir()
    (tmp_path / "afile").write_text("x")
    cases = [
        (["images", tmp_path / "missing", tmp_path / "o1"], "does not exist"),
        (["images", tmp_path / "emptysrc", tmp_path / "o2"], "holds no inputs"),
        (["images", photo_tree, tmp_path / "afile" / "out"], "not writable"),
        (["images", photo_tree, tmp_path / "o4", "--shard-bytes", "lots"], "bad size"),
        (["images", photo_tree, tmp_path / "o5", "--shard-size", "0"], "--shard-size"),
    ]
    for args, message in cases:
        proc = run_repack(*args, check=False)
        assert proc.returncode == 2, (args, proc.stderr)
        assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_verify_finds_damage(packed_photos, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(packed_photos, out)
    assert run_repack("verify", out).returncode == 0
    tar = out / "shard-000001.tar"
    data = bytearray(tar.read_bytes())
    data[2000] ^= 0xFF
    tar.write_bytes(bytes(data))
    (out / "shard-000002.idx").write_text("v1.2 0\n")
    proc = run_repack("verify", out, check=False)
    assert proc.returncode == 5
    assert "shard-000001.tar: sha256 mismatch" in proc.stderr
    assert "shard-000002.idx: does not match" in proc.stderr


def test_readers_refuse_escaping_paths_and_unknown_versions(packed_photos, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(packed_photos, out)
    manifest = read_manifest_json(out)
    manifest["shards"][0]["path"] = "../outside.tar"
    (out / "manifest.json").write_text(json.dumps(manifest))
    proc = run_repack("verify", out, check=False)
    assert proc.returncode == 5 and "escapes" in proc.stderr
    manifest["shards"][0]["path"] = "shard-000000.tar"
    manifest["version"] = 3
    (out / "manifest.json").write_text(json.dumps(manifest))
    proc = run_repack("inspect", out, check=False)
    assert proc.returncode == 5 and "version 3 is not supported" in proc.stderr


def test_inspect_summary(packed_photos):
    text = run_repack("inspect", packed_photos).stdout
    assert "samples 120 in 5 shard(s)" in text and "classes (10)" in text and "quarantined: 0" in text


def corruptions(data: bytes) -> dict[str, bytes]:
    return {"half": data[: len(data) // 2], "header_only": data[:600], "stream_ff": data[:3000] + b"\xff" * 200 + data[3200:],
            "bad_sof": data[:150] + b"\x00" * 20 + data[170:], "zeros_mid": data[:3000] + b"\x00" * 2000 + data[5000:],
            "last_byte": data[:-1], "intact": data}


def test_decode_check_rejects_every_corruption_and_fake_end_markers():
    """`--verify decode` rejects whatever a full PIL decode rejects, and also the corruptions PIL decodes
    silently (libjpeg warnings: garbage in a scan, truncation hidden behind a fake end marker)."""
    photo = load_photos()["astronaut"].resize((256, 256))
    for progressive in (False, True):
        buf = io.BytesIO()
        photo.save(buf, "JPEG", quality=90, progressive=progressive)
        cases = corruptions(buf.getvalue())
        cases["fake_eoi"] = cases["half"] + b"\xff\xd9"
        for name, data in cases.items():
            try:
                full = Image.open(io.BytesIO(data))
                full.load()
                pil_ok = True
            except Exception:  # noqa: BLE001
                pil_ok = False
            try:
                inspect_image(data, "decode")
                ours_ok = True
            except BadImage:
                ours_ok = False
            assert ours_ok == (name == "intact"), (name, progressive)
            assert pil_ok or not ours_ok
        assert inspect_image(cases["fake_eoi"], "header").ext == "jpg"  # the end marker alone is fooled


def test_own_tar_reader_matches_tarfile(packed_photos):
    shard = packed_photos / "shard-000000.tar"
    with open(shard, "rb") as fh:
        ours = [(m.name, m.offset, m.size) for m in iter_members(fh)]
    with tarfile.open(shard) as tf:
        theirs = [(m.name, m.offset_data, m.size) for m in tf.getmembers()]
    assert ours == theirs


def test_fast_header_parse_agrees_with_pil():
    """--verify none reads JPEG/PNG dimensions without PIL; they must equal PIL's."""
    photo = load_photos()["astronaut"].resize((123, 77))
    variants = []
    for mode in ("RGB", "L", "CMYK"):
        for progressive in (False, True):
            buf = io.BytesIO()
            photo.convert(mode).save(buf, "JPEG", quality=80, progressive=progressive)
            variants.append(buf.getvalue())
    for mode in ("RGB", "L", "P", "RGBA", "I;16"):
        buf = io.BytesIO()
        photo.convert(mode if mode != "I;16" else "L").convert(mode).save(buf, "PNG")
        variants.append(buf.getvalue())
    buf = io.BytesIO()
    photo.save(buf, "JPEG", exif=Image.Exif().tobytes())  # APP1 segment before SOF
    variants.append(buf.getvalue())
    for data in variants:
        fast = inspect_image(data, "none")
        pil = Image.open(io.BytesIO(data))
        assert (fast.width, fast.height) == pil.size == (123, 77)
        assert fast.ext == {"JPEG": "jpg", "PNG": "png"}[pil.format]


def test_partitions_and_full_runs_exclude_each_other(photo_tree, tmp_path):
    """A live partition blocks a full run (and vice versa), but not another partition."""
    out = tmp_path / "out"
    (out / ".repack" / "tasks").mkdir(parents=True)
    with open(out / ".repack" / "lock", "w") as main, open(out / ".repack" / "lock-0-of-2", "w") as part:
        fcntl.flock(main, fcntl.LOCK_SH)
        fcntl.flock(part, fcntl.LOCK_EX)  # as a live `--num-nodes 2 --node-rank 0` holds them
        full = run_repack("images", photo_tree, out, "--quiet", check=False)
        assert full.returncode == 3 and "already running a job" in full.stderr
        same = run_repack("images", photo_tree, out, "--quiet", "--num-nodes", "2", "--node-rank", "0", check=False)
        assert same.returncode == 3 and "partition 0-of-2" in same.stderr
        run_repack("images", photo_tree, out, "--quiet", "--num-nodes", "2", "--node-rank", "1")
    with open(out / ".repack" / "tasks" / "shard-000000.lock", "w") as task:
        fcntl.flock(task, fcntl.LOCK_EX)  # another process is writing this very task
        proc = run_repack("images", photo_tree, out, "--quiet", "--retries", "0", check=False)
        assert proc.returncode == 4 and "shard-000000" in proc.stderr
    run_repack("merge", out, "--quiet", check=False)
    run_repack("images", photo_tree, out, "--quiet")
    assert run_repack("verify", out).returncode == 0


def test_out_inside_source_is_refused(tmp_path):
    src = tmp_path / "flat"
    src.mkdir()
    (src / "a.jpg").write_bytes(jpeg_bytes())
    proc = run_repack("images", src, src / "out", "--quiet", check=False)
    assert proc.returncode == 2 and "inside the source folder" in proc.stderr
    assert not (src / "out").exists()


def test_list_file_edge_rows(tmp_path):
    """Unlabeled rows of a labeled list, NUL bytes and duplicates: quarantined, order-independent."""
    (tmp_path / "sub").mkdir()
    for name in ("a", "b", "c"):
        (tmp_path / "sub" / f"{name}.jpg").write_bytes(jpeg_bytes(seed=ord(name)))
    rows = [{"path": "sub/a.jpg", "label": "x"}, {"path": "sub/b.jpg"}, {"path": "sub/c\u0000.jpg", "label": "x"},
            {"path": "./sub/a.jpg", "label": "y"}, {"path": "sub/c.jpg", "label": "y"}]
    outs = []
    for order in (rows, rows[::-1]):
        listing = tmp_path / f"list{len(outs)}.jsonl"
        listing.write_text("".join(json.dumps(r) + "\n" for r in order))
        out = tmp_path / f"out{len(outs)}"
        run_repack("images", listing, out, "--list", "--quiet")
        outs.append(out)
    m = read_manifest_json(outs[0])
    reasons = sorted(q["reason"].split(" (")[0] for q in m["quarantine"])
    assert reasons == ["listed twice", "no label", "row has no usable path"]
    assert m["totals"]["samples"] == 2
    assert shard_bytes(outs[0]) == shard_bytes(outs[1])


def test_non_utf8_names_print_on_a_strict_utf8_console(messy_tree, tmp_path):
    out = tmp_path / "out"
    env = {"PYTHONIOENCODING": "utf-8"}  # strict UTF-8 console: surrogate escapes cannot be encoded
    (messy_tree / os.fsdecode(b"\xe9t\xe9")).mkdir()
    (messy_tree / os.fsdecode(b"\xe9t\xe9") / "x.jpg").write_bytes(jpeg_bytes(seed=11))
    assert "packed" in run_repack("images", messy_tree, out, env=env).stdout
    text = run_repack("inspect", out, env=env).stdout
    assert "\\udce9t\\udce9=" in text  # the class name, escaped rather than a crash
    assert "nothing to do" in run_repack("images", messy_tree, out, env=env).stdout


def test_verify_flags_foreign_members_and_missing_fields(tmp_path):
    write_jpegs(tmp_path / "src" / "cls", 2)
    out = tmp_path / "out"
    run_repack("images", tmp_path / "src", out, "--quiet")
    manifest = read_manifest_json(out)
    shard = out / manifest["shards"][0]["path"]
    with tarfile.open(shard) as tf:
        members = [(m, tf.extractfile(m).read()) for m in tf.getmembers()]
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tf:
        for member, data in members:
            if member.name.endswith("00000001_1.cls"):
                continue  # a sample without its label
            tf.addfile(member, io.BytesIO(data))
        link = tarfile.TarInfo("00000002_x.cls")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/shadow"
        tf.addfile(link)
    from repack.sinks.checks import sha256_file
    from repack.sinks.tar_format import index_from_tar

    with open(shard, "rb") as fh:
        (out / manifest["shards"][0]["index"]).write_text(index_from_tar(fh))
    manifest["shards"][0].update(bytes=shard.stat().st_size, sha256=sha256_file(shard))
    (out / "manifest.json").write_text(json.dumps(manifest))
    proc = run_repack("verify", out, check=False)
    assert proc.returncode == 5
    assert "is not a regular file" in proc.stderr and "some sample lacks a field" in proc.stderr


@pytest.mark.parametrize("body", ["[]", '{"schema": "repack.manifest", "version": 1, "modality": "images", '
                                        '"format": "webdataset", "shards": [{"samples": 1}], "totals": {}, '
                                        '"quarantine": []}'])
def test_malformed_manifest_is_a_clear_error(tmp_path, body):
    (tmp_path / "manifest.json").write_text(body)
    for command in ("verify", "inspect"):
        proc = run_repack(command, tmp_path, check=False)
        assert proc.returncode == 5 and "Traceback" not in proc.stderr, proc.stderr


def test_more_bad_jobs_fail_fast(photo_tree, tmp_path):
    for args, message in ((["--to", "videos"], "'videos' is not one of 'webdataset', 'lmdb'"), (["--shard-bytes", "100B"], "--shard-bytes")):
        proc = run_repack("images", photo_tree, tmp_path / "o", *args, check=False)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert not (tmp_path / "o").exists()


def test_a_ring_of_symlinks_is_named_for_what_it_is(tmp_path):
    """Two links naming each other are no "broken symlink": the reason keeps the system's words."""
    src = tmp_path / "src" / "dog"
    src.mkdir(parents=True)
    (src / "ok.jpg").write_bytes(jpeg_bytes(seed=1))
    (src / "ring_a.jpg").symlink_to(src / "ring_b.jpg")
    (src / "ring_b.jpg").symlink_to(src / "ring_a.jpg")
    run_repack("images", src.parent, tmp_path / "out", "--quiet")
    reasons = {q["source"]: q["reason"] for q in read_manifest_json(tmp_path / "out")["quarantine"]}
    assert reasons == {f"dog/ring_{x}.jpg": "symlink: Too many levels of symbolic links" for x in "ab"}


def test_names_that_merely_start_with_an_at_sign_are_packed_and_nas_droppings_skipped(tmp_path):
    """Every name starting with "@" was skipped as junk, unnamed ("0 quarantined"): an "@2x" icon, and a whole
    "@home" class folder. Only the NAS droppings by name are skipped now (Synology's @eaDir and #recycle, QNAP's
    @Recycle), counted in skipped_junk."""
    src, out = tmp_path / "src", tmp_path / "out"
    (src / "cat" / "@2x.jpg").parent.mkdir(parents=True)
    (src / "cat" / "@2x.jpg").write_bytes(jpeg_bytes(seed=1))
    (src / "@home").mkdir()
    (src / "@home" / "a.jpg").write_bytes(jpeg_bytes(seed=2))
    for junk in ("@eaDir", "#recycle", "@Recycle"):
        (src / "cat" / junk).mkdir()
        (src / "cat" / junk / "t.jpg").write_bytes(jpeg_bytes(seed=3))
    run_repack("images", src, out, "--quiet")
    manifest = read_manifest_json(out)
    assert manifest["classes"] == {"@home": 0, "cat": 1} and manifest["totals"]["samples"] == 2
    assert manifest["totals"]["skipped_junk"] == 3 and manifest["quarantine"] == []

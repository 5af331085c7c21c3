"""`repack images --to lmdb` end to end: layout, quarantine, verify, determinism, kill -9 resume,
map growth, partitions + merge, and the PyTorch and DALI (CPU) readers."""

from __future__ import annotations

import json
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch

from repack.sinks.lmdb_sink import LmdbCollector, PartWriter
from tests.conftest import kill_after_records, read_manifest_json, run_repack
from tests.tools.photos import make_photo_tree

ARGS = ("--to", "lmdb", "--shard-size", "3")


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """36 small real photos in 6 classes, plus two inputs that must be quarantined."""
    root = tmp_path_factory.mktemp("lmdbsrc")
    make_photo_tree(root, per_class=6, classes=6, seed=3, max_side=96, min_side=40)
    (root / "coffee" / "coffee_9998.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    (root / "chelsea" / "chelsea_0002_empty.png").write_bytes(b"")
    return root


@pytest.fixture(scope="module")
def packed(tree, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lmdbout") / "out"
    run_repack("images", tree, out, *ARGS, "--workers", "2", "--quiet")
    return out


def without_run(out: Path) -> dict:
    data = read_manifest_json(out)
    data.pop("run")
    return data


def db_items(path: Path) -> list[tuple[bytes, bytes]]:
    env = lmdb.open(str(path), subdir=False, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return [(bytes(k), bytes(v)) for k, v in txn.cursor()]
    finally:
        env.close()


def test_layout_quarantine_and_verify(tree, packed):
    m = read_manifest_json(packed)
    assert m["format"] == "lmdb" and m["totals"]["samples"] == 36 and m["totals"]["quarantined"] == 2
    assert {q["source"] for q in m["quarantine"]} == {"coffee/coffee_9998.jpg", "chelsea/chelsea_0002_empty.png"}
    assert m["shards"][0]["path"] == "data.lmdb" and m["shards"][0]["samples"] == 36
    names = sorted(p.name for p in packed.iterdir())
    assert names == [".repack", "data.lmdb", "manifest.json"]  # no lock file, no parts, no temps
    assert not (packed / ".repack" / "parts").exists()
    items = dict(db_items(packed / "data.lmdb"))
    meta = json.loads(items[b"__meta__"])
    assert meta["count"] == 36 and meta["classes"] == m["classes"] and meta["layout"] == "repack-lmdb/1"
    sample_keys = sorted(k for k in items if k.startswith(b"s/"))
    assert sample_keys == sorted(b"s/%010d/%s" % (i, f) for i in range(36) for f in (b"img", b"cls", b"json"))
    # indices follow plan order (sorted paths) with the quarantined inputs skipped, labels agree
    rels = [json.loads(items[b"s/%010d/json" % i])["path"] for i in range(36)]
    expected = sorted(str(p.relative_to(tree)) for p in tree.rglob("*.*")
                      if p.name not in ("coffee_9998.jpg", "chelsea_0002_empty.png"))
    assert rels == sorted(rels, key=lambda r: r.encode()) == expected
    for i in range(36):
        meta_i = json.loads(items[b"s/%010d/json" % i])
        assert int(items[b"s/%010d/cls" % i]) == m["classes"][meta_i["class"]]
        assert items[b"s/%010d/img" % i] == (tree / meta_i["path"]).read_bytes()
    ok = run_repack("verify", packed)
    assert "OK" in ok.stdout
    again = run_repack("images", tree, packed, *ARGS)
    assert "nothing to do" in again.stdout


def test_verify_finds_damage(packed, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(packed, copy)
    data = bytearray((copy / "data.lmdb").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (copy / "data.lmdb").write_bytes(bytes(data))
    proc = run_repack("verify", copy, check=False)
    assert proc.returncode == 5 and "sha256 mismatch" in proc.stderr


def test_verify_finds_a_labeled_sample_without_its_class_with_the_hash_recorded_again(packed, tmp_path):
    """A class deleted from one sample and the database's new sha256 written into the manifest: every sample
    of a labeled dataset holds a class, so verify names the database."""
    import hashlib
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(packed, copy)
    env = lmdb.open(str(copy / "data.lmdb"), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        assert txn.delete(b"s/0000000003/cls")
    env.close()
    manifest = read_manifest_json(copy)
    raw = (copy / "data.lmdb").read_bytes()
    manifest["shards"][0].update(bytes=len(raw), sha256=hashlib.sha256(raw).hexdigest())
    manifest["totals"]["bytes"] = len(raw)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    proc = run_repack("verify", copy, check=False)
    assert proc.returncode == 5 and "each with an image and a class (36 found in order, 1 out of place or " \
        "without an image and a class)" in proc.stderr, proc.stderr


def test_deterministic_across_workers_and_resume_after_kill(tree, packed, tmp_path):
    single = tmp_path / "single"
    run_repack("images", tree, single, *ARGS, "--workers", "1", "--quiet")
    assert (single / "data.lmdb").read_bytes() == (packed / "data.lmdb").read_bytes()
    assert without_run(single) == without_run(packed)
    for kill_after in (1, 6):
        out = tmp_path / f"killed{kill_after}"
        kill_after_records(["images", tree, out, *ARGS, "--workers", "2", "--quiet"], out, kill_after)
        resumed = run_repack("images", tree, out, *ARGS, "--workers", "2")
        assert "done" in resumed.stdout
        assert (out / "data.lmdb").read_bytes() == (packed / "data.lmdb").read_bytes()
        assert without_run(out) == without_run(packed)
        assert "OK" in run_repack("verify", out).stdout


def test_partitions_and_merge_match_single_run(tree, packed, tmp_path):
    out = tmp_path / "parts"
    for rank in ("0", "1"):
        run_repack("images", tree, out, *ARGS, "--num-nodes", "2", "--node-rank", rank, "--quiet")
    assert not (out / "data.lmdb").exists()  # partitions only write parts; merge is the single writer
    run_repack("merge", out, "--quiet")
    assert (out / "data.lmdb").read_bytes() == (packed / "data.lmdb").read_bytes()


def test_map_grows_and_build_is_deterministic(tmp_path):
    """A 1 MiB map must grow (MapFullError caught, the build restarts); equal parts give equal files."""
    rng = np.random.default_rng(0)
    payloads = [[rng.bytes(int(n)) for n in rng.integers(20_000, 90_000, 12)] for _ in range(5)]
    files = {}
    for name, initial in (("small", 1 << 20), ("again", 1 << 20), ("auto", None)):
        out = tmp_path / name
        out.mkdir()
        records = []
        for t, chunk in enumerate(payloads):
            writer = PartWriter(out, f"shard-{t:06d}")
            for i, blob in enumerate(chunk):
                writer.add_sample(f"{t:04d}{i:04d}", [("img", blob), ("cls", b"%02d" % t), ("json", b"{}")])
            records.append({"task_id": f"shard-{t:06d}", "part": writer.commit()})
        shard = LmdbCollector(out, initial_map=initial).finish(records, {"classes": {}, "fields": {}, "labeled": True})
        assert shard["samples"] == 60 and not (out / ".repack" / "parts").exists()
        files[name] = (out / "data.lmdb").read_bytes()
        items = dict(db_items(out / "data.lmdb"))
        assert items[b"s/%010d/img" % 13] == payloads[1][1] and items[b"s/%010d/cls" % 13] == b"1"
        assert json.loads(items[b"t/shard-000001"])["start"] == 12
        env = lmdb.open(str(out / "data.lmdb"), subdir=False, readonly=True, lock=False)
        if initial:
            assert env.info()["map_size"] > initial  # it grew
        env.close()
    assert files["small"] == files["again"]


def test_torch_reader_with_workers(packed):
    from pipelines.torch_lmdb import LmdbImageDataset, resize_to_tensor

    ds = LmdbImageDataset(packed, transform=resize_to_tensor(32))
    assert len(ds) == 36
    m = read_manifest_json(packed)
    loader = torch.utils.data.DataLoader(ds, batch_size=5, num_workers=2, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    labels = []
    for images, y in loader:
        assert images.shape[1:] == (3, 32, 32) and images.dtype == torch.uint8
        labels += y.tolist()
    plain = [ds[i][1] for i in range(len(ds))]
    assert sorted(labels) == sorted(plain) and len(labels) == 36
    rec = LmdbImageDataset(packed, output="dict", decode=False)[7]
    assert rec["label"] == m["classes"][rec["meta"]["class"]]
    assert rec["image"][:2] == b"\xff\xd8" or rec["image"][:4] == b"\x89PNG"


def test_dali_reader_cpu(packed):
    from pipelines.dali_lmdb import build_lmdb_pipeline, read_epoch
    from pipelines.torch_lmdb import LmdbImageDataset

    ds = LmdbImageDataset(packed)
    expected = [ds[i][1] for i in range(len(ds))]
    for shard_id in range(2):
        pipe = build_lmdb_pipeline(packed, batch_size=8, num_threads=1, size=32, shard_id=shard_id, num_shards=2)
        for _epoch in range(2):
            batches = read_epoch(pipe)
            labels = np.concatenate([np.asarray(b[1].as_array()) for b in batches]).tolist()
            assert labels == expected[18 * shard_id:18 * (shard_id + 1)]
            assert all(b[0].as_array().shape[1:] == (3, 32, 32) for b in batches)


def test_dali_source_drop_last_ends_the_epoch_before_a_short_batch(packed):
    from pipelines.dali_lmdb import LmdbBatchSource
    from pipelines.torch_lmdb import open_lmdb_dataset

    _, path, count = open_lmdb_dataset(packed)
    assert count % 8 == 4  # 36 samples: 4 full batches of 8, then 4 left
    for drop_last, sizes in ((True, [8, 8, 8, 8]), (False, [8, 8, 8, 8, 4])):
        source = LmdbBatchSource(path, count, 8, random_shuffle=True, seed=1, drop_last=drop_last)
        for _epoch in range(2):
            got = []
            while True:
                try:
                    got.append(source()[1])
                except StopIteration:
                    break
            assert [len(labels) for labels in got] == sizes
    small = LmdbBatchSource(path, count, 64, drop_last=True)  # less than one batch: no batch at all
    with pytest.raises(StopIteration):
        small()
    with pytest.raises(ValueError, match="exclude"):
        LmdbBatchSource(path, count, 8, pad_last_batch=True, drop_last=True)


def test_torch_reader_transform_pickles_for_spawned_workers(packed):
    from pipelines.torch_lmdb import LmdbImageDataset, ResizeToTensor, resize_to_tensor

    ds = torch.utils.data.Subset(LmdbImageDataset(packed, transform=resize_to_tensor(16)), range(4))
    assert isinstance(ds.dataset.transform, ResizeToTensor)
    loader = torch.utils.data.DataLoader(ds, batch_size=2, num_workers=1, multiprocessing_context="spawn")
    batches = list(loader)
    assert [tuple(images.shape) for images, _ in batches] == [(2, 3, 16, 16)] * 2
    expected = torch.stack([ds[i][0] for i in range(4)])
    assert torch.equal(torch.cat([images for images, _ in batches]), expected)


def test_a_database_packed_again_at_the_same_path_is_read_as_itself_in_one_process(tmp_path):
    """The readers' LMDB environments are kept per file, not per path: a dataset packed again into the
    same OUT (--overwrite) and opened again in the same process reads its own samples (it read the old
    file's under the new manifest); a reader of the old dataset whose file is not open says the file was
    replaced instead of reading the new one."""
    import hashlib

    from pipelines import torch_lmdb
    from pipelines.torch_lmdb import LmdbImageDataset
    from tests.benchmarks.tiny_files import tiny_jpegs

    first, second, out = tiny_jpegs(tmp_path / "a", 0, 6, workers=1), tiny_jpegs(tmp_path / "b", 100, 6, workers=1), \
        tmp_path / "out"
    run_repack("images", first, out, "--to", "lmdb", "--quiet")
    old = LmdbImageDataset(out, decode=False, output="dict")
    untouched = LmdbImageDataset(out, decode=False, output="dict")
    before = old[0]["image"]
    run_repack("images", second, out, "--to", "lmdb", "--overwrite", "--quiet")
    again = LmdbImageDataset(out, decode=False, output="dict")
    sample = again[0]
    assert hashlib.sha256(sample["image"]).digest() == hashlib.sha256(
        (second / sample["meta"]["path"]).read_bytes()).digest() != hashlib.sha256(before).digest()
    assert old[0]["image"] == untouched[0]["image"] == before  # the old file, still open: the old dataset's
    torch_lmdb._ENVS.clear()  # a reader of the old dataset whose file is not open in this process any more
    with pytest.raises(RuntimeError, match="replaced since this reader opened"):
        LmdbImageDataset.__getitem__(untouched, 1)


def test_overwrite_replaces_a_data_lmdb_no_job_state_names(tmp_path):
    """OUT holding an earlier database but no job state or manifest (deleted by hand): --overwrite promises to
    replace files of the same names, yet the job took the old data.lmdb's task records for its own and published
    the old samples (10 of 18 inputs "packed", none quarantined; verify OK). --overwrite deletes it now, and a
    database is trusted only where its task records match this job's (ids, sample ranges, part sizes)."""
    from PIL import Image

    from pipelines.torch_lmdb import LmdbImageDataset

    for name, count, colour in (("a", 5, (255, 0, 0)), ("b", 9, (0, 0, 255))):
        for cls in ("cat", "dog"):
            (tmp_path / name / cls).mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", (32, 32), colour).save(tmp_path / name / cls / f"{name}{i}.png")
    out = tmp_path / "out"
    run_repack("images", tmp_path / "a", out, "--to", "lmdb", "--quiet")
    (out / "manifest.json").unlink()
    for path in sorted((out / ".repack").rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    (out / ".repack").rmdir()
    run_repack("images", tmp_path / "b", out, "--to", "lmdb", "--overwrite", "--quiet")
    dataset = LmdbImageDataset(out)
    assert len(dataset) == 18 and read_manifest_json(out)["totals"]["samples"] == 18
    assert all(dataset[i][0].getpixel((0, 0)) == (0, 0, 255) for i in range(18))


def test_a_page_damaged_in_place_is_named_by_the_readers_and_the_report(packed, tmp_path):
    """A page of data.lmdb overwritten in place (same size: the open checks pass) surfaced as LMDB's bare
    CorruptedError from the readers, naming neither the database nor the sample, and `repack inspect --html`
    crashed with a traceback. The readers raise a ShardIntegrityError naming both now; the report leaves the
    probes out (verify names the damage)."""
    import shutil

    from pipelines.sample_errors import ShardIntegrityError
    from pipelines.torch_lmdb import LmdbImageDataset

    out = tmp_path / "damaged"
    shutil.copytree(packed, out)
    with open(out / "data.lmdb", "r+b") as fh:  # page 2: the tree's first page (__meta__, the first samples)
        fh.seek(2 * 4096)
        fh.write(bytes(4096))
    with pytest.raises(ShardIntegrityError, match=r"data\.lmdb: sample '__meta__': the database cannot be read"):
        LmdbImageDataset(out)
    report = run_repack("inspect", out, "--html", tmp_path / "r.html", check=False)
    assert report.returncode == 0 and "Traceback" not in report.stderr and (tmp_path / "r.html").exists()
    assert run_repack("verify", out, check=False).returncode == 5

"""The DALI loaders resume exactly (issue 18 item 3), on DALI's CPU backend.

Each loader runs k batches with shuffling on, saves ``state_dict()`` (JSON), and a new process
builds a new loader from it: the batches that follow equal the uninterrupted run's (labels, keys,
the output tensors' bytes), the interrupted epoch then holds every sample exactly once, and the
next epoch follows. Images restore through DALI's own checkpoint (reader, shuffle buffer and the
random crop/mirror generators: ``train=True``), video through the experimental reader's, LMDB
through the external source's (epoch, batch) position. A state names its dataset version (issue 27
item 1): loaded into a loader of a later version it continues on its own while kept, else it is
refused naming both.
"""

from __future__ import annotations

import json
import random
import shutil
from collections import Counter

import pytest

from tests.conftest import run_repack
from tests.test_images_job import write_jpegs
from tests.tools.dali_resume_run import check_resumes, make_loader, run_in_new_process, take
from tests.tools.s3server import MotoServer, client, s3_env
from tests.tools.versioned import versioned_images
from tests.tools.videos import encoders, make_index_clip

VP8 = ("-c:v", "libvpx", "-deadline", "realtime", "-g", "8", "-pix_fmt", "yuv420p")
OPTIONS = {
    "images": {"batch_size": 16, "num_threads": 2, "size": 16, "train": True, "random_shuffle": True, "seed": 5,
               "initial_fill": 64},
    "lmdb": {"batch_size": 16, "num_threads": 2, "size": 16, "random_shuffle": True, "seed": 5},
    "video": {"sequence_length": 4, "stride": 2, "step": 3, "batch_size": 3, "device": "cpu", "device_id": None,
              "reader": "experimental", "num_threads": 1, "random_shuffle": True, "seed": 3, "initial_fill": 8},
}


@pytest.fixture(scope="module")
def datasets(photo_tree, packed_photos, tmp_path_factory) -> dict:
    """kind -> dataset root: the 120 photos as WebDataset and LMDB, four VP8 videos in 4 classes."""
    out = tmp_path_factory.mktemp("resume")
    run_repack("images", photo_tree, out / "lmdb", "--to", "lmdb", "--quiet")
    roots = {"images": str(packed_photos), "lmdb": str(out / "lmdb")}
    if shutil.which("ffmpeg") and "libvpx" in encoders():
        for name, frames in (("a", 30), ("b", 23), ("c", 17), ("d", 26)):  # one video per class: label = video
            make_index_clip(out / f"vsrc/{name}/{name}.webm", frames, VP8, size=(96, 64))
        run_repack("video", out / "vsrc", out / "video", "--transcode", "--dali-reader", "experimental", "--quiet")
        roots["video"] = str(out / "video")
    return roots


@pytest.fixture(scope="module")
def resumed(datasets) -> dict:
    """kind -> check_resume's rows, the restores of every kind in one new process."""
    kinds = [kind for kind in OPTIONS if kind in datasets]
    return dict(zip(kinds, check_resumes([(kind, datasets[kind], OPTIONS[kind]) for kind in kinds])))


@pytest.mark.parametrize("kind", ["images", "lmdb", "video"])
def test_resume_in_a_new_process_continues_the_uninterrupted_run(kind, datasets, resumed):
    if kind not in datasets:
        pytest.skip("ffmpeg with the libvpx (VP8) encoder is not installed")
    rows = resumed[kind]
    per_epoch = len(make_loader(kind, datasets[kind], OPTIONS[kind]))
    state_kind = {"images": "dali_webdataset", "lmdb": "dali_lmdb", "video": "dali_video"}[kind]
    assert [row["position"] for row in rows] == [(state_kind, 1, 0, 3), (state_kind, 1, 0, per_epoch),
                                                 (state_kind, 1, 1, 2)]
    for row in rows:
        assert row["equal"], f"{kind}: the batches after a restore at batch {row['before']} differ"
        assert row["epoch_once"], f"{kind}: the epoch interrupted at batch {row['before']} is not every sample once"


def test_images_resume_on_s3(photo_tree, tmp_path, monkeypatch):
    """DALI reads s3:// itself (moto's server on loopback); its checkpoint resumes there too. DALI
    (and pipelines.object_store) keep one S3 client per process, made for the first endpoint they
    see, so the loaders run in child processes: the uninterrupted run and a loader stopped after 5
    batches in one, the restore from its state in another."""
    server = MotoServer()
    try:
        client(server.endpoint).create_bucket(Bucket="resume")
        env = s3_env(server.endpoint)
        run_repack("images", photo_tree, "s3://resume/photos", "--shard-size", "25", "--quiet",
                   env={**env, "REPACK_SCRATCH": str(tmp_path)})
        for name, value in {**env, "AWS_ENDPOINT_URL": server.endpoint}.items():
            monkeypatch.setenv(name, value)
        job = {"kind": "images", "root": "s3://resume/photos", "options": OPTIONS["images"], "state": None}
        reference, stopped = run_in_new_process([{**job, "batches": 10}, {**job, "batches": 5, "save_state": True}])
        resumed, = run_in_new_process([{**job, "state": stopped["state"], "batches": 5}])
    finally:
        server.stop()
    assert stopped["records"] == reference["records"][:5]
    assert resumed["records"] == reference["records"][5:]  # the epoch's end included


def test_load_state_dict_rebuilds_in_place(datasets):
    loader = make_loader("lmdb", datasets["lmdb"], OPTIONS["lmdb"])
    reference = take("lmdb", make_loader("lmdb", datasets["lmdb"], OPTIONS["lmdb"]), 6)
    take("lmdb", loader, 4)
    state = loader.state_dict()
    take("lmdb", loader, 2)
    loader.load_state_dict(state)
    assert take("lmdb", loader, 2) == reference[4:]


def test_image_pipeline_restores_from_raw_dali_checkpoint(datasets):
    from pipelines.dali_webdataset import build_image_pipeline

    args = dict(batch_size=8, num_threads=1, size=16, random_shuffle=True, seed=2, initial_fill=32)
    pipe = build_image_pipeline(datasets["images"], **args)
    reference = [pipe.run()[1].as_array().tolist() for _ in range(5)]
    pipe = build_image_pipeline(datasets["images"], **args)
    for _ in range(2):
        pipe.run()
    restored = build_image_pipeline(datasets["images"], checkpoint=pipe.checkpoint(), **args)
    assert [restored.run()[1].as_array().tolist() for _ in range(3)] == reference[2:]


@pytest.mark.parametrize("kind", ["images", "lmdb"])
def test_bad_states_are_refused_with_the_reason(kind, datasets):
    root, options = datasets[kind], OPTIONS[kind]
    loader = make_loader(kind, root, options)
    take(kind, loader, 1)
    good = loader.state_dict()
    bad = [({**good, "kind": "torch_webdataset"}, "'torch_webdataset' loader"),
           ({**good, "version": 2}, "version 2 is not supported"),
           ({**good, "batch": -1}, "'batch' -1 is not a count"),
           ({**good, "batch": 999}, "batch 999 is past the epoch's"),
           ({**good, "options": {**good["options"], "seed": 6}}, r"seed: saved 6, now 5"),
           ("not a dict", "must be a dict")]
    if kind == "images":
        bad.append(({**good, "dali": "%%%"}, "not a base64 DALI checkpoint"))
        bad.append(({k: v for k, v in good.items() if k != "dali"}, "holds no DALI checkpoint"))
    for state, message in bad:
        with pytest.raises(ValueError, match=message):
            make_loader(kind, root, options, state)
    with pytest.raises(ValueError, match="batch_size: saved 16, now 8"):
        make_loader(kind, root, {**options, "batch_size": 8}, good)


def test_a_loader_without_checkpointing_has_no_state(datasets):
    loader = make_loader("images", datasets["images"], {**OPTIONS["images"], "enable_checkpointing": False})
    take("images", loader, 1)
    with pytest.raises(ValueError, match="enable_checkpointing=False"):
        loader.state_dict()
    state = make_loader("images", datasets["images"], OPTIONS["images"]).state_dict()
    with pytest.raises(ValueError, match="enable_checkpointing=False"):
        make_loader("images", datasets["images"], {**OPTIONS["images"], "enable_checkpointing": False}, state)


@pytest.mark.parametrize("last_batch", ["drop", "fill"])
def test_image_loader_resumes_with_the_other_last_batch_policies(last_batch, datasets):
    """DROP ends the epoch before the short batch, FILL pads it: a state taken at any batch of the
    first epoch and after its end resumes to the uninterrupted run (in this process)."""
    options = {**OPTIONS["images"], "last_batch": last_batch}
    whole = make_loader("images", datasets["images"], options)
    per_epoch = len(whole)
    assert per_epoch == (7 if last_batch == "drop" else 8)  # 120 samples, batches of 16
    reference = take("images", whole, per_epoch + 3)
    for k in (2, per_epoch, per_epoch + 2):
        loader = make_loader("images", datasets["images"], options)
        take("images", loader, k)
        resumed = make_loader("images", datasets["images"], options, loader.state_dict())
        assert take("images", resumed, per_epoch + 3 - k) == reference[k:], (last_batch, k)
    state = make_loader("images", datasets["images"], {**OPTIONS["images"], "last_batch": "drop"}).state_dict()
    with pytest.raises(ValueError, match="last_batch: saved 'drop', now 'partial'"):
        make_loader("images", datasets["images"], OPTIONS["images"], state)


@pytest.mark.parametrize("kind", ["images", "lmdb"])
def test_each_rank_resumes_its_own_shard(kind, datasets):
    """Two DDP ranks (shard_id of num_shards=2): each resumes its own part; a state of one rank is
    refused by the other."""
    keys, states = [], []
    for rank in range(2):
        options = {**OPTIONS[kind], "shard_id": rank, "num_shards": 2}
        reference = take(kind, make_loader(kind, datasets[kind], options), 5)
        loader = make_loader(kind, datasets[kind], options)
        take(kind, loader, 2)
        states.append(loader.state_dict())
        assert take(kind, make_loader(kind, datasets[kind], options, states[-1]), 3) == reference[2:]
        keys += [key for record in reference[:reference.index("END")] for key in record["keys"]]
    assert len(keys) == len(set(keys)) == 120  # the ranks' epochs: every sample once
    with pytest.raises(ValueError, match="shard_id: saved 0, now 1"):
        make_loader(kind, datasets[kind], {**OPTIONS[kind], "shard_id": 1, "num_shards": 2}, states[0])


def keys_of(records: list) -> list[str]:
    return [key for record in records if record != "END" for key in record["keys"]]


def test_a_state_continues_on_its_version_or_is_refused_naming_both(tmp_path_factory):
    """v1 (300 images), append (v2), remove (v3: 300 other images): a v1 state loaded into a loader
    of the latest version continues exactly on v1 (the uninterrupted v1 run's batches, every v1
    sample once), and is refused naming both versions once v1 is gc'ed."""
    root = versioned_images(tmp_path_factory.mktemp("versions"))
    options = {**OPTIONS["images"], "initial_fill": 32}
    whole = make_loader("images", str(root), {**options, "version": 1})
    per_epoch = len(whole)
    reference = take("images", whole, per_epoch + 1)
    assert reference[-1] == "END" and len(keys_of(reference)) == len(set(keys_of(reference))) == 300
    latest = make_loader("images", str(root), options)
    assert set(keys_of(take("images", latest, per_epoch))) != set(keys_of(reference))  # v3: other samples
    for stop in (1, random.Random(27).randrange(2, per_epoch - 1)):
        loader = make_loader("images", str(root), {**options, "version": 1})
        before = take("images", loader, stop)
        state = json.loads(json.dumps(loader.state_dict()))
        resumed = make_loader("images", str(root), options, state)  # no version=: the latest (3)
        after = take("images", resumed, per_epoch + 1 - stop)
        assert before + after == reference, f"stop {stop}: not the uninterrupted v1 run"
        assert Counter(keys_of(before + after)) == Counter(keys_of(reference))
        assert resumed.state_dict()["dataset"] == state["dataset"]
        latest.load_state_dict(state)  # in place, into a loader of v3
        assert take("images", latest, per_epoch + 1 - stop) == after
    from pipelines.dali_webdataset import build_image_pipeline

    raw = {k: v for k, v in options.items() if k not in ("batch_size", "num_threads")}
    with pytest.raises(ValueError, match=r"taken on version 1 .*reads version 3.*version="):
        build_image_pipeline(str(root), 16, 2, checkpoint=state, **raw)  # a raw pipeline does not re-open
    gone = tmp_path_factory.mktemp("gc") / "images"
    shutil.copytree(root, gone)
    run_repack("gc", gone, "--keep", "1")
    with pytest.raises(ValueError, match=r"taken on version 1 .*reads version 3.*no longer kept"):
        make_loader("images", str(gone), options, state)


def test_an_lmdb_state_continues_on_its_version_after_a_remove(tmp_path):
    """LMDB v1 (60 images), a remove (v2: 40): a v1 state continues exactly on v1's database
    (its sample count differs from v2's, so the options are v1's too); refused once v1 is gc'ed."""
    src, root = tmp_path / "src", tmp_path / "lmdb"
    for c in range(2):
        write_jpegs(src / f"c{c}", 30, f"c{c}_")
    run_repack("images", src, root, "--to", "lmdb", "--quiet")
    (tmp_path / "gone.txt").write_text("".join(f"c1/c1_{i}.jpg\n" for i in range(20)))
    run_repack("remove", root, "--sources", tmp_path / "gone.txt", "--quiet")
    options = OPTIONS["lmdb"]
    assert len(make_loader("lmdb", str(root), options)) == 3  # v2: 40 samples
    reference = take("lmdb", make_loader("lmdb", str(root), {**options, "version": 1}), 5)
    assert reference[4] == "END" and sorted(map(int, keys_of(reference))) == list(range(60))
    loader = make_loader("lmdb", str(root), {**options, "version": 1})
    before = take("lmdb", loader, 2)
    state = json.loads(json.dumps(loader.state_dict()))
    assert before + take("lmdb", make_loader("lmdb", str(root), options, state), 3) == reference
    run_repack("gc", root, "--keep", "1")
    with pytest.raises(ValueError, match=r"taken on version 1 .*reads version 2.*no longer kept"):
        make_loader("lmdb", str(root), options, state)


@pytest.mark.parametrize("kind", ["images", "lmdb"])
def test_a_loader_opened_on_the_latest_keeps_its_version_when_a_remove_publishes(kind, tmp_path):
    """A loader built without version= read the latest manifest at each build: a `repack remove` between its
    state and load_state_dict (or between its open and its pipeline's build) made it refuse its own state
    ("other options") or rebuild on the new version under the old one's identity (a sample twice, one never).
    It reads the version it opened, at every build, while that version is kept."""
    src, root = tmp_path / "src", tmp_path / kind
    for c in range(2):
        write_jpegs(src / f"c{c}", 30, f"c{c}_")
    run_repack("images", src, root, "--to", "lmdb" if kind == "lmdb" else "webdataset", "--quiet")
    options = OPTIONS[kind]
    reference = take(kind, make_loader(kind, str(root), options), 5)
    assert reference[4] == "END" and len(keys_of(reference)) == 60
    loader = make_loader(kind, str(root), options)
    before = take(kind, loader, 2)
    state = json.loads(json.dumps(loader.state_dict()))
    (tmp_path / "gone.txt").write_text("".join(f"c1/c1_{i}.jpg\n" for i in range(20)))
    run_repack("remove", root, "--sources", tmp_path / "gone.txt", "--quiet")
    loader.load_state_dict(state)  # in place: the loader's own version (1), still kept
    assert before + take(kind, loader, 3) == reference


def test_image_pipeline_refuses_an_index_changed_since_packing(packed_photos, tmp_path):
    """DALI takes an index's offsets as they are: a line moved would give one sample another's image; the index
    is checked against the manifest first, and the error names it."""
    import shutil

    from pipelines.dali_webdataset import build_image_pipeline
    from repack.manifest import ManifestError

    root = tmp_path / "copy"
    shutil.copytree(packed_photos, root)
    index = sorted(root.glob("shard-*.idx"))[0]
    head, first, second, *rest = index.read_bytes().split(b"\n")
    index.write_bytes(b"\n".join([head, second, first, *rest]))  # same bytes, two lines swapped
    with pytest.raises(ManifestError, match=f"{index.name}: its sha256 is not the manifest's"):
        build_image_pipeline(root, batch_size=8, num_threads=1, size=16)


def test_more_ranks_than_samples_pad_lmdb_and_are_refused_by_name_for_shards(tmp_path):
    """A rank of an LMDB with no sample of its own failed at build ("no data in the pipeline") while len() said 1;
    DALI's webdataset reader asserted `num_shards_ <= Size()` without a word on the dataset."""
    pytest.importorskip("nvidia.dali")
    from pipelines.dali_lmdb import dali_lmdb_loader
    from pipelines.dali_webdataset import dali_image_loader

    src = write_jpegs(tmp_path / "src" / "c", 3, "a").parent
    run_repack("images", src, tmp_path / "lmdb", "--to", "lmdb", "--quiet")
    run_repack("images", src, tmp_path / "shards", "--quiet")
    seen = []
    for rank in range(5):
        loader = dali_lmdb_loader(tmp_path / "lmdb", batch_size=1, num_threads=1, device_id=None, shard_id=rank,
                                  num_shards=5, size=None, with_index=True)
        batches = list(loader)
        assert len(batches) == len(loader) == 1, rank
        seen += [int(i) for batch in batches for i in batch[0]["index"].flatten()]
    assert set(seen) == {0, 1, 2} and len(seen) == 5
    with pytest.raises(ValueError, match=r"part 0 of 5 of 3 sample\(s\): DALI's reader needs"):
        dali_image_loader(tmp_path / "shards", batch_size=1, num_threads=1, device_id=None, num_shards=5, size=None)

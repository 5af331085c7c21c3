"""The readers on s3:// datasets (moto's S3 server on loopback, boto3, DALI's own S3 client):
ImageShardDataset streams ranged GETs and splits across ranks and workers exactly as on local
disk; the wds pipeline takes user stages; DALI reads the same shards straight from s3://."""

from __future__ import annotations

import numpy as np
import pytest
import webdataset as wds
from torch.utils.data import DataLoader

from pipelines.dali_webdataset import build_image_pipeline
from pipelines.manifest_access import sample_at
from pipelines.tar_blocks import sample_span
from pipelines.torch_webdataset import ImageShardDataset, image_pipeline
from repack.manifest import ManifestError
from tests.conftest import run_repack
from tests.tools.s3server import FaultProxy, MotoServer, client, s3_env

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


@pytest.fixture(scope="module")
def remote(packed_photos, photo_tree, tmp_path_factory):
    """packed_photos' source packed to s3://readers/photos (the same shards), behind a recording proxy."""
    server = MotoServer()
    client(server.endpoint).create_bucket(Bucket="readers")
    scratch = tmp_path_factory.mktemp("scratch")
    run_repack("images", photo_tree, "s3://readers/photos", "--shard-size", "25", "--quiet",
               env={**s3_env(server.endpoint), "REPACK_SCRATCH": str(scratch)})
    proxy = FaultProxy(server.port)
    proxy.server_endpoint = server.endpoint
    yield proxy
    proxy.stop()
    server.stop()


@pytest.fixture
def s3_environment(remote, monkeypatch):
    for name, value in s3_env(remote.endpoint).items():
        monkeypatch.setenv(name, value)
    return remote


def by_key(samples) -> dict:
    return {s["key"]: (s["label"], np.asarray(s["image"]), s["meta"]) for s in samples}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_torch_reader_streams_s3_like_local(s3_environment, packed_photos, num_workers):
    local = by_key(ImageShardDataset(packed_photos, output="dict"))
    s3_environment.requests.clear()
    seen: list[str] = []
    for rank in range(2):
        dataset = ImageShardDataset("s3://readers/photos", output="dict", rank=rank, world_size=2)
        got = by_key(DataLoader(dataset, batch_size=None, num_workers=num_workers))
        assert len(got) == len(dataset)
        for key, (label, image, meta) in got.items():
            assert label == local[key][0] and meta == local[key][2]
            np.testing.assert_array_equal(image, local[key][1])
        seen += got
    assert sorted(seen) == sorted(local) and len(seen) == 120
    shard_gets = [r for r in s3_environment.requests if r[0] == "GET" and r[1].split("?")[0].endswith(".tar")]
    assert shard_gets and all(r[2] and r[2].startswith("bytes=") for r in shard_gets)  # ranged, streamed


def test_shuffled_epochs_replay_and_user_stages(s3_environment):
    dataset = ImageShardDataset("s3://readers/photos", decode=False, shuffle=True, seed=5)
    loader = DataLoader(dataset, batch_size=None, num_workers=2, persistent_workers=True)
    epochs = []
    for epoch in range(2):
        dataset.set_epoch(epoch)
        epochs.append([label for _, label in loader])
    assert sorted(epochs[0]) == sorted(epochs[1]) and epochs[0] != epochs[1]
    keys = [s.key for w in range(2) for s in dataset.worker_samples(w, 2, epoch=1)]
    assert len(set(keys)) == 120

    pipe = image_pipeline("s3://readers/photos", decode=False, output="dict")
    pipe.append(wds.map(lambda s: (s["key"], s["label"])))
    pipe.append(wds.batched(16, partial=True))
    batches = list(pipe)
    assert sum(len(b[0]) for b in batches) == 120 and len(batches) == 8


def test_dali_reads_s3_directly(s3_environment, packed_photos, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_environment.server_endpoint)  # DALI's AWS SDK: no proxy

    def labels(root) -> list[int]:
        pipe = build_image_pipeline(root, batch_size=40, num_threads=1, size=32)
        out = []
        for _ in range(3):
            images, cls = pipe.run()[:2]
            out += [int(np.asarray(cls.at(i)).reshape(-1)[0]) for i in range(len(cls))]
        return out

    assert labels("s3://readers/photos") == labels(packed_photos)


def test_stream_cut_mid_shard_is_resumed(s3_environment, packed_photos, monkeypatch):
    cutting = FaultProxy(int(s3_environment.server_endpoint.rsplit(":", 1)[1]), cut_every=2)
    monkeypatch.setenv("AWS_ENDPOINT_URL", cutting.endpoint)
    try:
        dataset = ImageShardDataset("s3://readers/photos", output="dict", decode=False)
        # a loader worker: a new process, so a new S3 client on the cutting proxy
        got = {s["key"]: s["image"] for s in DataLoader(dataset, batch_size=None, num_workers=1)}
    finally:
        cutting.stop()
    assert cutting.cut >= 2
    assert got == {s["key"]: s["image"] for s in ImageShardDataset(packed_photos, output="dict", decode=False)}


def test_dali_names_an_s3_shard_cut_short_before_reading_it(s3_environment, photo_tree, tmp_path):
    """An object replaced by a shorter one (its manifest entry says more bytes): named before DALI reads it, as on
    local files (DALI's reader crashed on a short tar)."""
    s3 = client(s3_environment.server_endpoint)
    run_repack("images", photo_tree, "s3://readers/cut", "--shard-size", "25", "--quiet",
               env={**s3_env(s3_environment.server_endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch")})
    body = s3.get_object(Bucket="readers", Key="cut/shard-000001.tar")["Body"].read()
    s3.put_object(Bucket="readers", Key="cut/shard-000001.tar", Body=body[:-1024])
    with pytest.raises(ManifestError, match=r"s3://readers/cut/shard-000001\.tar: \d+ bytes, the manifest says"):
        build_image_pipeline("s3://readers/cut", batch_size=8, num_threads=1, size=16)


def test_missing_remote_dataset_is_a_manifest_error(s3_environment):
    with pytest.raises(ManifestError, match="no manifest"):
        ImageShardDataset("s3://readers/nothing-here")


def test_s3_batches_are_the_local_batches_one_get_per_run(s3_environment, packed_photos):
    """Raw batches from s3:// are the local batches, byte for byte, and each batch's run of adjacent samples
    in a shard is exactly one ranged GET of that run (received into the batch's buffer): no per-sample or
    per-block requests, whatever ``read_bytes`` says."""
    local = ImageShardDataset(packed_photos, decode=False, batch_size=8)
    want = list(local)
    s3_environment.requests.clear()
    remote = ImageShardDataset("s3://readers/photos", decode=False, batch_size=8, read_bytes=4096, prefetch=2)
    got = list(remote)
    assert [labels.tolist() for _, labels in got] == [labels.tolist() for _, labels in want]
    assert [[b.tobytes(i) for i in range(len(b))] for b, _ in got] == [[b.tobytes(i) for i in range(len(b))]
                                                                       for b, _ in want]
    runs = []
    for first in range(0, local.total_samples, 8):
        by_shard: dict[int, list] = {}
        for number in range(first, min(first + 8, local.total_samples)):
            sample = sample_at(local.index, number)
            by_shard.setdefault(sample.shard, []).append(sample_span(sample))
        runs += [(f"shard-{shard:06d}.tar", spans[0][0], spans[-1][1]) for shard, spans in by_shard.items()]
    gets = [(path.split("?")[0].rsplit("/", 1)[1], *map(int, rng.removeprefix("bytes=").split("-")))
            for method, path, rng in s3_environment.requests if method == "GET" and ".tar" in path]
    assert sorted((name, lo, hi + 1) for name, lo, hi in gets) == sorted(runs)
    assert len(runs) == 15 + 4  # 15 batches of 8, four of them across a shard boundary (shards of 25)

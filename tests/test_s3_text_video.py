"""The text and video readers on s3:// roots (moto's S3 server on loopback, through the recording
proxy): the same items as the local dataset, under DataLoader workers; token windows and
documents are ranged GETs of exactly their bytes (the .bin is never fetched whole); a clip reads
1 MiB blocks of its video. Resume works there as locally (the state holds no paths)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from pipelines.sampler_resume import ResumableSampler
from pipelines.torch_text import DocumentDataset, PackedTokenDataset, collate_pad
from pipelines.torch_video import VideoClipDataset
from tests.tools.reader_data import reader_datasets
from tests.tools.s3server import FaultProxy, MotoServer, client, s3_env

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create"),
              pytest.mark.filterwarnings("ignore:.set_vital. is deprecated")]


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    """The local datasets, and the same files uploaded to s3://readers/<name>, behind a recording proxy."""
    local = reader_datasets(tmp_path_factory.mktemp("s3tv"), names=("text_a", "video"))
    server = MotoServer()
    s3 = client(server.endpoint)
    s3.create_bucket(Bucket="readers")
    for name in ("text_a", "video"):
        if name not in local:
            continue
        root = Path(local[name])
        for path in sorted(root.rglob("*")):
            if path.is_file() and ".repack" not in path.parts:
                s3.put_object(Bucket="readers", Key=f"{name}/{path.relative_to(root)}", Body=path.read_bytes())
    proxy = FaultProxy(server.port)
    yield local, proxy
    proxy.stop()
    server.stop()


@pytest.fixture
def s3(remote, monkeypatch):
    local, proxy = remote
    for key, value in s3_env(proxy.endpoint).items():
        monkeypatch.setenv(key, value)
    proxy.requests.clear()
    return local, proxy


def bin_gets(proxy) -> list[tuple[str, str, str | None]]:
    return [r for r in proxy.requests if r[0] == "GET" and r[1].split("?")[0].endswith(".bin")]


def test_packed_windows_over_s3_equal_local_with_workers(s3):
    local, proxy = s3
    # windows of 128 tokens: 164 ranged GETs through the proxy to moto (of 32 tokens: 659, most of the test)
    here = PackedTokenDataset(local["text_a"], 128, seed=3)
    there = PackedTokenDataset("s3://readers/text_a", 128, seed=3)
    assert len(here) == len(there) and there.data.remote
    rows = torch.cat(list(DataLoader(there, batch_size=16, num_workers=2)))
    assert torch.equal(rows, torch.stack([here[i] for i in range(len(here))]))
    gets = bin_gets(proxy)
    assert len(gets) == len(there) and all(r[2] for r in gets)  # one ranged GET per window, never a whole .bin
    assert {r[2] for r in gets} >= {f"bytes={w * 256}-{w * 256 + 257}" for w in there.window_ids()[:5].tolist()}


def test_documents_over_s3_resume_exactly(s3):
    local, _ = s3
    here, there = DocumentDataset(local["text_a"]), DocumentDataset("s3://readers/text_a")
    assert [there[i].tolist() for i in range(0, len(there), 7)] == [here[i].tolist() for i in range(0, len(here), 7)]

    def loader(state=None):
        sampler = ResumableSampler(len(there), seed=1)
        dl = StatefulDataLoader(DocumentDataset("s3://readers/text_a"), batch_size=8, sampler=sampler,
                                collate_fn=collate_pad, num_workers=2)
        if state:
            dl.load_state_dict(state)
        return dl

    full = [b["input_ids"] for b in loader()]
    first = loader()
    head = []
    for batch in first:
        head.append(batch["input_ids"])
        if len(head) == 3:
            break
    rest = [b["input_ids"] for b in loader(json.loads(json.dumps(first.state_dict())))]
    assert len(head + rest) == len(full) and all(torch.equal(a, b) for a, b in zip(head + rest, full))


def test_missing_remote_text_dataset_names_the_url(s3):
    from repack.manifest import ManifestError

    with pytest.raises(ManifestError, match="s3://readers/nothing/manifest.json"):
        DocumentDataset("s3://readers/nothing")


def test_video_clips_over_s3_equal_local(s3):
    local, proxy = s3
    if "video" not in local:
        pytest.skip("ffmpeg with libvpx is not installed")
    here = VideoClipDataset(local["video"], sequence_length=3, stride=2, step=4)
    there = VideoClipDataset("s3://readers/video", sequence_length=3, stride=2, step=4)
    got = list(DataLoader(there, batch_size=2, num_workers=2))
    want = list(DataLoader(here, batch_size=2))
    assert len(got) == len(want)
    for (clips, labels), (clips_l, labels_l) in zip(got, want):
        assert torch.equal(clips, clips_l) and torch.equal(labels, labels_l)
    video_gets = [r for r in proxy.requests if r[0] == "GET" and "/videos/" in r[1]]
    assert video_gets and all(r[2] and r[2].startswith("bytes=") for r in video_gets)


def test_missing_remote_video_names_the_dataset_and_the_clip(s3):
    local, proxy = s3
    if "video" not in local:
        pytest.skip("ffmpeg with libvpx is not installed")
    s3c = client(proxy.endpoint)
    for obj in s3c.list_objects_v2(Bucket="readers", Prefix="video/")["Contents"]:
        s3c.copy_object(Bucket="readers", Key="gone/" + obj["Key"][6:], CopySource={"Bucket": "readers", "Key": obj["Key"]})
    ds = VideoClipDataset("s3://readers/gone", sequence_length=3, stride=2, step=4)
    s3c.delete_object(Bucket="readers", Key=ds.paths[-1].split("s3://readers/", 1)[1])
    assert ds[0][0].shape[0] == 3
    with pytest.raises(RuntimeError, match=rf"s3://readers/gone: clip {len(ds) - 1} needs s3://readers/gone/videos/"):
        ds[len(ds) - 1]

"""Never a silent drop (ImageShardDataset): one flipped byte in a tar header, a truncated shard, a
member removed from a tar each raise an error naming the shard and the sample key, on a local
folder and on s3:// (moto on loopback); with on_error="skip" the bad samples are skipped and
counted where the user reads them (``dataset.skipped``, across DataLoader workers)."""

from __future__ import annotations

import io
import shutil
import tarfile
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from pipelines.manifest_access import read_index
from pipelines.tar_blocks import ShardIntegrityError
from pipelines.torch_webdataset import ImageShardDataset
from tests.tools.loaders import failing_loader
from tests.tools.s3server import MotoServer, client, s3_env

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create", "ignore:skipped:UserWarning")
SHARD = "shard-000001.tar"


def index_of(root: Path) -> list:
    return read_index(ImageShardDataset(root).manifest, 1)


def flip_header_byte(root: Path) -> tuple[str, int]:
    """One byte of the 4th sample's image header (in its mode field) flipped: (key, samples lost)."""
    sample = index_of(root)[3]
    at = sample.members[0][1] - 512 + 101
    with open(root / SHARD, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0x01]))
    return sample.key, 1


def truncate(root: Path) -> tuple[str, int]:
    """The shard cut in the middle of its 11th sample: (first lost key, samples lost)."""
    samples = index_of(root)
    cut = samples[10].members[0][1] + 10
    with open(root / SHARD, "r+b") as fh:
        fh.truncate(cut)
    return samples[10].key, len(samples) - 10


def remove_member(root: Path) -> tuple[str, int]:
    """The .cls member of the 6th sample removed from the tar (the index unchanged): every later
    member moves, so from that sample on nothing is where the index says: (key, samples lost)."""
    samples = index_of(root)
    victim = samples[5]
    path = root / SHARD
    with tarfile.open(path) as src:
        members = [(m, src.extractfile(m).read()) for m in src.getmembers()]
    rewritten = path.with_suffix(".new")
    with tarfile.open(rewritten, "w", format=tarfile.USTAR_FORMAT) as dst:
        for member, data in members:
            if member.name != f"{victim.key}.cls":
                dst.addfile(member, io.BytesIO(data))
    rewritten.replace(path)
    return victim.key, len(samples) - 5


DAMAGE = {"flipped header byte": flip_header_byte, "truncated shard": truncate, "removed member": remove_member}


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = MotoServer()
    client(server.endpoint).create_bucket(Bucket="damage")
    yield server
    server.stop()


def upload(server: MotoServer, folder: Path, prefix: str) -> str:
    s3 = client(server.endpoint)
    for path in (p for p in folder.iterdir() if p.is_file()):
        s3.put_object(Bucket="damage", Key=f"{prefix}/{path.name}", Body=path.read_bytes())
    return f"s3://damage/{prefix}"


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damage_raises_naming_shard_and_key_or_is_skipped_and_counted(packed_photos, tmp_path, s3, monkeypatch,
                                                                      damage, where):
    folder = tmp_path / "ds"
    shutil.copytree(packed_photos, folder)
    key, lost = DAMAGE[damage](folder)
    root = str(folder)
    if where == "s3":
        for name, value in s3_env(s3.endpoint).items():
            monkeypatch.setenv(name, value)
        root = upload(s3, folder, f"{damage.replace(' ', '-')}")
    shard = f"{root}/{SHARD}"
    with pytest.raises(ShardIntegrityError) as caught:
        list(ImageShardDataset(root, decode=False))
    assert caught.value.url == shard and caught.value.key == key
    assert shard in str(caught.value) and repr(key) in str(caught.value)
    with pytest.raises(ShardIntegrityError, match=key), \
            failing_loader(DataLoader(ImageShardDataset(root, decode=False), batch_size=None, num_workers=2)) as failing:
        list(failing)  # through DataLoader workers alike

    skipping = ImageShardDataset(root, decode=False, on_error="skip", output="dict")
    got = list(DataLoader(skipping, batch_size=None, num_workers=2))
    assert len(got) == 120 - lost and skipping.skipped == lost
    assert key not in {s["key"] for s in got}
    intact = {s["key"]: s["image"] for s in ImageShardDataset(packed_photos, decode=False, output="dict")}
    assert all(intact[s["key"]] == s["image"] for s in got)  # what is delivered is the stored bytes


def test_intact_dataset_delivers_every_indexed_sample_in_order(packed_photos):
    dataset = ImageShardDataset(packed_photos, decode=False, output="dict", read_bytes=3000, prefetch=3)
    keys = [s["key"] for s in dataset]
    assert keys == [s.key for shard in range(len(dataset.counts)) for s in read_index(dataset.manifest, shard)]
    assert dataset.skipped == 0

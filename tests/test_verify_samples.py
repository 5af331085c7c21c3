"""The opt-in content check (issue 27, item 5): repack records a crc32 per sample beside each index
(``<shard>.crc``, layout in repack/sinks/sample_checksums.py), and ImageShardDataset(verify_samples=True)
checks every sample's payload as it reads it, so a flipped payload byte, which the tar headers and the
index cannot notice, is an error naming shard and key (raw mode, batches, DataLoader workers, s3://)
instead of wrong bytes delivered silently."""

from __future__ import annotations

import json
import shutil
import struct
import tarfile
import zlib
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from pipelines.manifest_access import read_index
from pipelines.tar_blocks import ShardIntegrityError
from pipelines.torch_webdataset import ImageShardDataset
from repack.manifest import ManifestError
from tests.tools.loaders import failing_loader
from tests.conftest import run_repack
from tests.tools.s3server import MotoServer, client, s3_env

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create", "ignore:skipped:UserWarning")
SHARD = "shard-000002.tar"


def test_the_producer_records_a_crc32_per_sample_beside_each_index(packed_photos):
    manifest = json.loads((packed_photos / "manifest.json").read_text())
    for entry in manifest["shards"]:
        raw = (packed_photos / entry["checksums"]).read_bytes()
        assert entry["checksums"] == entry["path"].replace(".tar", ".crc") and len(raw) == entry["checksums_bytes"]
        magic, count = struct.unpack_from("<8sQ", raw)
        assert magic == b"RPKCRC1\n" and count == entry["samples"] and len(raw) == 16 + 4 * count
        with tarfile.open(packed_photos / entry["path"]) as tar:  # computed independently, with tarfile
            members = [m for m in tar.getmembers()]
            expected, crc, key = [], 0, None
            for member in members:
                if key is not None and member.name.split(".")[0] != key:
                    expected.append(crc)
                    crc = 0
                key = member.name.split(".")[0]
                crc = zlib.crc32(tar.extractfile(member).read(), crc)
            expected.append(crc)
        assert list(struct.unpack_from(f"<{count}I", raw, 16)) == expected


def flip_payload_byte(root: Path) -> str:
    """One bit flipped in the middle of the image data of the 8th sample of SHARD: its key."""
    sample = read_index(ImageShardDataset(root).manifest, 2)[7]
    _, offset, size = next(m for m in sample.members if m[0] != "cls")
    with open(root / SHARD, "r+b") as fh:
        fh.seek(offset + size // 2)
        byte = fh.read(1)
        fh.seek(offset + size // 2)
        fh.write(bytes([byte[0] ^ 0x10]))
    return sample.key


@pytest.fixture
def flipped(packed_photos, tmp_path) -> tuple[Path, str]:
    root = tmp_path / "ds"
    shutil.copytree(packed_photos, root)
    return root, flip_payload_byte(root)


def test_a_flipped_payload_byte_is_caught_naming_shard_and_key(flipped, packed_photos):
    root, key = flipped
    intact = {s["key"]: s["image"] for s in ImageShardDataset(packed_photos, decode=False, output="dict")}
    unchecked = {s["key"]: s["image"] for s in ImageShardDataset(root, decode=False, output="dict")}
    assert unchecked[key] != intact[key]  # without the check: wrong bytes, delivered silently
    with pytest.raises(ShardIntegrityError) as caught:
        list(ImageShardDataset(root, decode=False, verify_samples=True))
    assert caught.value.url == str(root / SHARD) and caught.value.key == key
    assert "payload checksum mismatch" in str(caught.value)
    for batch_size in (None, 8):  # one at a time and in batches, through DataLoader workers
        with pytest.raises(ShardIntegrityError, match=f"{SHARD}: sample '{key}': payload checksum mismatch"), \
                failing_loader(DataLoader(ImageShardDataset(root, decode=False, verify_samples=True,
                                                            batch_size=batch_size), batch_size=None,
                                          num_workers=2)) as failing:
            list(failing)
        skipping = ImageShardDataset(root, decode=False, verify_samples=True, on_error="skip", output="dict",
                                     batch_size=batch_size)
        got = list(DataLoader(skipping, batch_size=None, num_workers=2))
        keys = [k for b in got for k in b["key"]] if batch_size else [s["key"] for s in got]
        assert len(keys) == 119 and key not in keys and skipping.skipped == 1
    checked = {s["key"]: s["image"] for s in ImageShardDataset(packed_photos, decode=False, output="dict",
                                                                  verify_samples=True)}
    assert checked == intact  # an intact dataset passes the check unchanged


def test_a_flipped_payload_byte_is_caught_on_s3(flipped, monkeypatch):
    root, key = flipped
    server = MotoServer()
    try:
        for name, value in s3_env(server.endpoint).items():
            monkeypatch.setenv(name, value)
        s3 = client(server.endpoint)
        s3.create_bucket(Bucket="check")
        for path in (p for p in root.iterdir() if p.is_file()):
            s3.put_object(Bucket="check", Key=f"ds/{path.name}", Body=path.read_bytes())
        with pytest.raises(ShardIntegrityError, match=f"s3://check/ds/{SHARD}: sample '{key}': payload checksum"):
            list(ImageShardDataset("s3://check/ds", decode=False, verify_samples=True))
    finally:
        server.stop()


def test_repack_verify_checks_the_checksum_file(packed_photos, tmp_path):
    root = tmp_path / "ds"
    shutil.copytree(packed_photos, root)
    crc = root / "shard-000001.crc"
    raw = bytearray(crc.read_bytes())
    raw[20] ^= 0x01
    crc.write_bytes(bytes(raw))
    proc = run_repack("verify", root, check=False)
    assert proc.returncode != 0 and "shard-000001.crc" in proc.stdout + proc.stderr


def test_a_dataset_without_checksums_is_refused_with_the_way_to_add_them(packed_photos, tmp_path):
    root = tmp_path / "old"
    shutil.copytree(packed_photos, root)
    manifest = json.loads((root / "manifest.json").read_text())
    for entry in manifest["shards"]:  # as repack wrote shard entries before it recorded checksums
        for field in ("checksums", "checksums_bytes", "checksums_sha256"):
            entry.pop(field)
        (root / entry["path"].replace(".tar", ".crc")).unlink()
    (root / "manifest.json").write_text(json.dumps(manifest))
    for name in root.glob("manifest.v*.json"):
        name.write_text(json.dumps(manifest))
    assert len(list(ImageShardDataset(root, decode=False))) == 120
    with pytest.raises(ManifestError, match=r"verify_samples=True needs the per-sample checksums .* Pack it again "
                                            r"to add them \(`repack images SRC OUT --overwrite`"):
        ImageShardDataset(root, verify_samples=True)

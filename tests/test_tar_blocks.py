"""The local read path of pipelines.tar_blocks: members read into their own bytes (DIRECT_BYTES) or cut
from the runs between them deliver the same samples and catch the same damage."""

import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from pipelines import tar_blocks
from pipelines.tar_blocks import ShardFiles, ShardIntegrityError
from pipelines.torch_webdataset import ImageShardDataset
from tests.test_reader_integrity import SHARD, flip_header_byte, truncate

pytestmark = pytest.mark.filterwarnings("ignore:skipped:UserWarning")
EVERY_MEMBER_DIRECT, NONE_DIRECT = 1, 1 << 40


@pytest.mark.parametrize("direct", [EVERY_MEMBER_DIRECT, NONE_DIRECT])
def test_direct_and_cut_members_are_the_stored_bytes(packed_photos, monkeypatch, direct):
    want = {s["key"]: (s["image"], s["label"]) for s in ImageShardDataset(packed_photos, decode=False, output="dict",
                                                                         read_bytes=1 << 40)}
    monkeypatch.setattr(tar_blocks, "DIRECT_BYTES", direct)
    got = {s["key"]: (s["image"], s["label"]) for s in ImageShardDataset(packed_photos, decode=False, output="dict")}
    assert got == want and len(got) == 120
    assert all(type(image) is bytes for image, _ in got.values())


@pytest.mark.parametrize("direct", [EVERY_MEMBER_DIRECT, NONE_DIRECT])
@pytest.mark.parametrize("damage", [flip_header_byte, truncate])
def test_damage_is_caught_whichever_way_members_are_read(packed_photos, tmp_path, monkeypatch, direct, damage):
    folder = tmp_path / "ds"
    shutil.copytree(packed_photos, folder)
    key, lost = damage(folder)
    monkeypatch.setattr(tar_blocks, "DIRECT_BYTES", direct)
    with pytest.raises(ShardIntegrityError) as caught:
        list(ImageShardDataset(folder, decode=False))
    assert caught.value.url == f"{folder}/{SHARD}" and caught.value.key == key
    skipping = ImageShardDataset(folder, decode=False, on_error="skip")
    assert len(list(skipping)) == 120 - lost and skipping.skipped == lost


def test_shard_files_close_at_interpreter_exit(tmp_path, monkeypatch):
    """``ShardFiles.close`` run by a batch iterator's ``finally`` while the interpreter tears down (the module's
    ``os`` already None) still closes its files, without 'Exception ignored ... NoneType' on stderr."""
    path = tmp_path / "a.bin"
    path.write_bytes(b"x" * 64)
    files = tar_blocks.ShardFiles()
    buffer = memoryview(bytearray(8))
    assert files.read_into(str(path), 0, buffer) == 8
    fd = next(iter(files._open.values()))[0]
    monkeypatch.setattr(tar_blocks, "os", None)
    files.close()
    monkeypatch.undo()
    assert not files.open_files
    with pytest.raises(OSError):
        os.fstat(fd)


def test_shard_files_keep_at_most_their_limit_open_and_never_close_one_being_read(tmp_path):
    paths = []
    for n in range(6):
        path = tmp_path / f"f{n}"
        path.write_bytes(bytes([n]) * 4096 + bytes(range(256)) * 16)
        paths.append(str(path))
    files = ShardFiles(limit=2)

    def read(step: int) -> bool:
        path = paths[(step * 7) % 6]
        start = (step * 131) % 8000
        buffer = bytearray(64)
        got = files.read_into(path, start, memoryview(buffer))
        with open(path, "rb") as fh:
            fh.seek(start)
            return bytes(buffer[:got]) == fh.read(64)

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(read, range(2_000)))
    assert files.open_files <= 2
    files.close()
    assert files.open_files == 0

"""The execution side of an image pack at many tiny samples: what a worker hands the driver is the
shard's bytes plus columns (DALI index lines, a crc32 per sample), so the driver assembles a shard
without reading it back per sample; a JPEG/PNG decode check needs no Pillow unless the input is bad;
a chunk record no resumed run could trust never reaches the job state."""

from __future__ import annotations

import base64
import io
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from repack.config import ImagesSpec
from repack.jobs.base import build_plan
from repack.jobs.engine import execute_task, record_name
from repack.jobs.images import ImagesJob
from repack.sinks.sample_checksums import checksums_header, sample_checksums
from repack.sinks.webdataset import ShardAssembler, TarSegmentWriter
from repack.transforms.image_check import BadImage, inspect_image

ROOT = Path(__file__).resolve().parents[1]


def _jpeg(shade: int, size=(16, 12)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, (shade, 255 - shade, shade // 2)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _png(shade: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGBA", (9, 7), (shade, 3, 200, 255)).save(buf, "PNG")
    return buf.getvalue()


def _samples(count: int, first: int = 0) -> list[tuple[str, list[tuple[str, bytes]]]]:
    return [(f"{n:08d}_x{n}", [("jpg", _jpeg(n * 7 % 256)), ("cls", b"%03d" % (n % 5)),
                               ("json", json.dumps({"n": n}).encode())]) for n in range(first, first + count)]


def test_segment_carries_its_index_lines_and_checksums(tmp_path):
    writer = TarSegmentWriter(tmp_path, "c0")
    for key, members in _samples(5):
        writer.add_sample(key, members)
    piece = writer.commit()
    index = f"v1.2 {piece['count']}\n{piece['index']}\n"
    crcs = base64.b64decode(piece["crc"])
    assert piece["count"] == 5 and len(crcs) == 4 * 5
    assert checksums_header(5) + crcs == sample_checksums(tmp_path / "c0.seg", index)  # the bytes on disk


def test_assembled_shard_equals_tarfile_view_and_read_back_checksums(tmp_path):
    """Segments (one spilled past its slot: rebased index lines) give a shard whose .idx and .crc equal
    what the tar's own headers and bytes say."""
    shared = tmp_path / ".shared"
    pieces, at = [], 0
    for number, (first, count, slot) in enumerate([(0, 3, None), (3, 4, 10), (7, 2, None)]):
        place = (shared, at, slot) if slot is not None else None
        writer = TarSegmentWriter(tmp_path / "segments", f"c{number}", place)
        for key, members in _samples(count, first):
            writer.add_sample(key, members)
        pieces.append(writer.commit())
        at += pieces[-1]["bytes"]
    assert "at" not in pieces[1]  # a slot of 10 bytes: spilled into a file of its own
    assembler = ShardAssembler(tmp_path, "shard", shared)
    for piece in pieces:
        assembler.add_segment(tmp_path / "segments" / piece["name"], piece)
    entry = assembler.commit()
    index = (tmp_path / entry["index"]).read_text()
    assert entry["samples"] == 9 and index.startswith("v1.2 9\n")
    with tarfile.open(tmp_path / entry["path"]) as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == [f"{key}.{ext}" for key, ms in _samples(9) for ext, _ in ms]
        offsets = [f"{m.name.split('.', 1)[1]} {m.offset_data} {m.size} {m.name}" for m in members]
    assert index.splitlines()[1:] == [" ".join(offsets[i:i + 3]) for i in range(0, len(offsets), 3)]
    assert (tmp_path / entry["checksums"]).read_bytes() == sample_checksums(tmp_path / entry["path"], index)


def test_decode_check_of_good_jpeg_and_png_needs_no_pillow():
    """The per-sample check of a valid JPEG/PNG is libjpeg-turbo (strict) / the PNG stream walk alone:
    Pillow's open, ~10x a tiny JPEG's whole decode, is not even imported."""
    code = ("import sys; from repack.transforms.image_check import inspect_image\n"
            "for data in (sys.stdin.buffer.read().split(b'--cut--')):\n"
            "    info = inspect_image(data, 'decode'); print(info.ext, info.width, info.height)\n"
            "print('PIL' in sys.modules)")
    blob = _jpeg(40) + b"--cut--" + _png(9)
    done = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, cwd=ROOT, check=True)
    assert done.stdout.decode().split("\n")[:3] == ["jpg 16 12", "png 9 7", "False"]


@pytest.mark.parametrize("damage,reason", [
    ("truncated", "cannot decode JPG: Truncated File Read"),
    ("corrupt scan", "cannot decode JPG: Corrupt JPEG data: premature end of data segment"),
    ("png crc", "cannot decode PNG: not identified by Pillow (corrupt header or chunk)"),
    ("png idat short", "truncated PNG (chunk 'IDAT' runs past the end of the file)")])
def test_bad_inputs_keep_their_reasons(damage, reason):
    """A bad input falls through to the Pillow path: its quarantine reason is the one Pillow's open, the
    trailer check and the decode gave before the check skipped Pillow for good inputs."""
    jpeg, png = _jpeg(90, (64, 64)), _png(5)
    data = {"truncated": jpeg[:len(jpeg) // 2], "corrupt scan": jpeg[:-40] + bytes(38) + jpeg[-2:],
            "png crc": png[:30] + bytes([png[30] ^ 1]) + png[31:], "png idat short": png[:-30] + png[-12:]}[damage]
    with pytest.raises(BadImage, match=f"^{re.escape(reason)}$"):
        inspect_image(data, "decode")


def test_placed_chunk_record_is_not_saved(tmp_path):
    """A chunk whose segment lies in its group's shared file is redone unless its group finishes, so its
    record only travels to the driver; an unplaced chunk's record is saved (a resume trusts it)."""
    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    for i in range(6):
        (src / f"{i}.jpg").write_bytes(_jpeg(i * 30))
    spec = ImagesSpec(source=str(tmp_path / "src"), out=str(tmp_path / "out"), chunk_size=3)
    job = ImagesJob(spec)
    (job.out / ".repack" / "tasks").mkdir(parents=True)
    first, second = build_plan(job).tasks
    assert first.group == second.group == "shard-000000" and first.payload["slot"]
    placed = json.loads(execute_task("images", spec.to_json(), json.dumps(first.to_json()), "d", False, True))
    unplaced = json.loads(execute_task("images", spec.to_json(), json.dumps(second.to_json()), "d", False, False))
    assert "at" in placed["segment"] and "at" not in unplaced["segment"]
    assert not (job.out / record_name(first.task_id)).exists()
    assert json.loads((job.out / record_name(second.task_id)).read_bytes()) == unplaced

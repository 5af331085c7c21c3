"""Caps that hold when raised (issue 21): with --max-pixels raised, --normalize never decodes more
than its stated budget (NORMALIZE_MEMORY_CAP); --max-doc-bytes refuses values whose whole-document
tokenization would break the worker budget, and memory follows the stated per-byte rule."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest

from repack.sources.text_docs import MAX_DOC_BYTES_LIMIT, TOKENIZE_BYTES_PER_BYTE
from repack.transforms.normalize import NORMALIZE_MEMORY_CAP
from tests.conftest import read_manifest_json, run_repack
from tests.test_hostile import peak_rss_mb
from tests.test_images_job import jpeg_bytes
from tests.tools.text import gpt2_tokenizer, write_tokenizer

BASE_MB = 200  # an interpreter with Pillow/numpy or tokenizers loaded, and the job's own state


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_bomb(width: int, height: int) -> bytes:
    """A valid, fully decodable all-black RGB PNG, a few hundred KB, declaring width x height."""
    packer = zlib.compressobj(9)
    row = b"\0" * (1 + 3 * width)
    body = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + _chunk(b"IDAT", body) + _chunk(b"IEND", b""))


def test_normalize_of_a_bomb_stays_in_budget_with_max_pixels_raised(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok.jpg").write_bytes(jpeg_bytes())
    (src / "bomb.png").write_bytes(png_bomb(9500, 9500))  # 90 Mpx: 271 MB of RGB decoded, just over the budget
    rc, peak = peak_rss_mb(["images", src, tmp_path / "out", "--normalize", "--max-pixels", str(10**9),
                            "--workers", "1", "--quiet"])
    assert rc == 0
    [entry] = read_manifest_json(tmp_path / "out")["quarantine"]
    assert entry["source"] == "bomb.png" and "decode budget" in entry["reason"]
    assert str(9500 * 9500 * 3) in entry["reason"] and str(NORMALIZE_MEMORY_CAP) in entry["reason"]
    assert peak < BASE_MB + NORMALIZE_MEMORY_CAP / 2**20, f"peak RSS {peak:.0f} MB"


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    return write_tokenizer(gpt2_tokenizer(), tmp_path_factory.mktemp("gpt2")).parent


def test_max_doc_bytes_refuses_what_it_cannot_honour(tmp_path, gpt2):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("one document\n")
    proc = run_repack("text", src, tmp_path / "out", "--tokenizer", gpt2, "--max-doc-bytes", "50MiB", check=False)
    assert proc.returncode == 2 and f"over the limit of {MAX_DOC_BYTES_LIMIT} bytes" in proc.stderr
    assert not (tmp_path / "out").exists()  # refused before any work


def test_long_document_memory_follows_the_stated_rule(tmp_path, gpt2):
    src = tmp_path / "src"
    src.mkdir()
    doc = 3 * 2**20
    (src / "a.txt").write_bytes(b"short\n" + b"word " * (doc // 5) + b"\nshort\n")
    rc, peak = peak_rss_mb(["text", src, tmp_path / "out", "--tokenizer", gpt2, "--max-doc-bytes", "4MiB",
                            "--workers", "1", "--quiet"])
    assert rc == 0 and read_manifest_json(tmp_path / "out")["totals"]["documents"] == 3
    assert peak < BASE_MB + TOKENIZE_BYTES_PER_BYTE * doc / 2**20, f"peak RSS {peak:.0f} MB"

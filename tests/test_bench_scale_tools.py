"""The scale benchmark's yardsticks (issue 26): its generated inputs are what it says (tiny, distinct,
decodable, 1,000 class folders, the same bytes however the work is split over processes), and its
job-state figure counts exactly what a real `repack images` output holds besides the manifest and
the files the manifest names."""

from __future__ import annotations

import hashlib
import io
import os

from PIL import Image

from tests.benchmarks.bench_scale import manifest_files, state_bytes
from tests.benchmarks.tiny_files import file_path, tiny_jpegs, tiny_texts
from tests.conftest import run_repack


def tree_digests(root) -> dict[str, str]:
    return {os.path.relpath(os.path.join(d, f), root): hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
            for d, _, names in os.walk(root) for f in names}


def test_tiny_jpegs_are_tiny_distinct_and_the_same_for_any_split(tmp_path):
    one = tiny_jpegs(tmp_path / "one", 0, 60, workers=1)
    two = tiny_jpegs(tmp_path / "two", 0, 40, workers=2)
    tiny_jpegs(two, 40, 20, workers=2)  # an --append's new files continue the numbering

    digests = tree_digests(one)
    assert digests == tree_digests(two)
    assert len(digests) == len(set(digests.values())) == 60
    assert sorted(p.name for p in one.iterdir())[:2] == ["c000", "c001"]
    assert file_path(one, 1001, ".jpg") == one / "c001" / "00001001.jpg"
    sizes = [p.stat().st_size for p in one.rglob("*.jpg")]
    assert 550 <= sum(sizes) / len(sizes) <= 850
    with Image.open(io.BytesIO((one / "c007" / "00000007.jpg").read_bytes())) as image:
        image.load()
        assert (image.format, image.size, image.mode) == ("JPEG", (32, 32), "RGB")


def test_tiny_texts_are_about_700_bytes_of_utf8(tmp_path):
    root = tiny_texts(tmp_path / "t", 0, 30, workers=2)
    texts = [p.read_bytes() for p in sorted(root.rglob("*.txt"))]
    assert len(texts) == len(set(texts)) == 30
    assert all(700 <= len(t) <= 1200 and t.decode("utf-8").endswith("\n") for t in texts)
    assert tree_digests(root) == tree_digests(tiny_texts(tmp_path / "u", 0, 30, workers=1))


def test_state_bytes_is_what_the_manifest_does_not_name(tmp_path):
    src = tiny_jpegs(tmp_path / "src", 0, 40, workers=1)
    out = tmp_path / "out"
    run_repack("images", str(src), str(out), "--verify", "none", "--quiet")

    manifests, named = manifest_files(out)
    assert manifests == {out / "manifest.json"}
    assert {p.suffix for p in named} >= {".tar", ".idx"}  # the shards and their side files
    assert all(p.parent == out for p in named)
    state = [p for p in out.rglob("*") if p.is_file() and p not in manifests | named]
    assert state and all(".repack" in p.relative_to(out).parts for p in state)
    assert state_bytes(out) == sum(p.stat().st_size for p in state) > 0


def test_the_text_part_is_sized_apart_and_shapes_may_run_without_a_rust_pool(monkeypatch):
    """REPACK_BENCH_SCALE_TEXT_FILES sizes the text part (issue 26 item 7 names 1M files), else N/2; a
    text_shapes shape of 0 threads is a worker without tokenizers' Rust pool, and a pool of 0 processes is refused."""
    import pytest

    from tests.benchmarks.bench_scale import text_files
    from tests.tools.text_shapes import parse_shape

    monkeypatch.delenv("REPACK_BENCH_SCALE_TEXT_FILES", raising=False)
    assert text_files(1_000_000) == 500_000 and text_files(1) == 1
    monkeypatch.setenv("REPACK_BENCH_SCALE_TEXT_FILES", "1000000")
    assert text_files(200_000) == 1_000_000
    monkeypatch.setenv("REPACK_BENCH_SCALE_TEXT_FILES", "0")
    with pytest.raises(ValueError, match="at least 1"):
        text_files(200_000)
    assert parse_shape("16x0") == (16, 0) and parse_shape("8x2") == (8, 2) and parse_shape("auto") is None
    with pytest.raises(ValueError, match="processes must be >= 1"):
        parse_shape("0x1")

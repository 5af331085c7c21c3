"""merge_parts: the merged prefix of parts (index, kernel copies and sha256 in three streams at once) equals
one writer given every document, and a part whose .bin disagrees with its .idx fails with nothing left."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from repack.sinks.megatron import CODE_OF, MegatronFormatError, PartWriter, merge_parts
from repack.sinks.megatron import BinAppender


def _documents(seed: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 400, count)
    return rng.integers(0, 50_000, int(lengths.sum())), lengths


def _write(folder, stem, batches) -> tuple:
    writer = PartWriter(folder, stem, "uint16")
    for tokens, lengths in batches:
        writer.add_documents(tokens, lengths)
    part = writer.commit()
    return folder / part["bin"], folder / part["idx"]


def test_merge_equals_one_writer_of_all_documents(tmp_path):
    (tmp_path / "parts").mkdir()
    batches = [_documents(seed, count) for seed, count in ((1, 300), (2, 0), (3, 1), (4, 2_000))]
    parts = [_write(tmp_path / "parts", f"part-{i}", [b]) for i, b in enumerate(batches)]  # part-1 is empty
    whole = _write(tmp_path, "whole", batches)
    merged = merge_parts(parts, CODE_OF["uint16"], tmp_path / "m.bin", tmp_path / "m.idx")
    data = (tmp_path / "m.bin").read_bytes()
    assert data == whole[0].read_bytes() == b"".join(p[0].read_bytes() for p in parts)
    assert (tmp_path / "m.idx").read_bytes() == whole[1].read_bytes()
    assert merged["sha256"] == hashlib.sha256(data).hexdigest()
    assert merged["index_sha256"] == hashlib.sha256(whole[1].read_bytes()).hexdigest()
    assert merged["documents"] == 2_301 and merged["bytes"] == len(data) == 2 * merged["tokens"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.bin", "m.idx", "parts", "whole.bin", "whole.idx"]


def test_part_shorter_than_its_index_fails_and_leaves_nothing(tmp_path):
    parts = [_write(tmp_path, f"part-{i}", [_documents(i, 50)]) for i in range(3)]
    data = parts[1][0].read_bytes()
    parts[1][0].write_bytes(data[:-2])  # one token lost
    with pytest.raises(MegatronFormatError, match="bytes of tokens"):
        merge_parts(parts, CODE_OF["uint16"], tmp_path / "m.bin", tmp_path / "m.idx")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"part-{i}.{e}" for i in range(3) for e in ("bin", "idx"))


def test_a_merge_that_takes_over_an_appender_equals_the_merge_from_the_first_part(tmp_path):
    (tmp_path / "parts").mkdir()
    batches = [_documents(seed, count) for seed, count in ((5, 200), (6, 0), (7, 900), (8, 40))]
    parts = [_write(tmp_path / "parts", f"part-{i}", [b]) for i, b in enumerate(batches)]
    plain = merge_parts(parts, CODE_OF["uint16"], tmp_path / "p.bin", tmp_path / "p.idx")
    ahead = BinAppender(tmp_path / "a.bin", write_back=True)
    ahead.extend([parts[0][0]])
    ahead.extend([parts[1][0], parts[2][0]])
    assert ahead.parts == 3 and ahead.tmp.exists() and not (tmp_path / "a.bin").exists()  # nothing visible as done
    taken = merge_parts(parts, CODE_OF["uint16"], tmp_path / "a.bin", tmp_path / "a.idx", ahead)
    assert taken == plain
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "p.bin").read_bytes()
    assert not ahead.tmp.exists()


def test_an_appender_given_up_leaves_no_file(tmp_path):
    part = _write(tmp_path, "part-0", [_documents(1, 30)])
    ahead = BinAppender(tmp_path / "m.bin")
    ahead.extend([part[0]])
    ahead.abort()
    ahead.abort()  # twice: nothing left to do
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part-0.bin", "part-0.idx"]

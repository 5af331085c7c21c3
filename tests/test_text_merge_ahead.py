"""The text job's merge ahead: parts appended in plan order whatever order their records land in, taken over by
the merge only when they are the records' parts, and no thread before the first record (the local pool forks
its workers from a driver without threads); a run's CLI output says how many parts were merged ahead."""

from __future__ import annotations

import threading

from repack.jobs.text_merge_ahead import MergeAhead
from repack.sinks.megatron import CODE_OF, merge_parts
from tests.test_text_merge import _documents, _write


def _parts(out, count: int) -> list[dict]:
    (out / "parts").mkdir()
    records = []
    for i in range(count):
        bin_path, idx_path = _write(out / "parts", f"part-{i}", [_documents(20 + i, 50 + 10 * i)])
        records.append({"task_id": f"part-{i:06d}", "part": {"bin": f"parts/{bin_path.name}",
                                                              "idx": f"parts/{idx_path.name}",
                                                              "bytes": bin_path.stat().st_size}})
    return records


def _merged(out, records, appended=None) -> dict:
    pairs = [(out / r["part"]["bin"], out / r["part"]["idx"]) for r in records]
    return merge_parts(pairs, CODE_OF["uint16"], out / "m.bin", out / "m.idx", appended)


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


def test_records_landing_out_of_order_are_appended_in_plan_order(tmp_path):
    records = _parts(tmp_path, 5)
    order = [r["task_id"] for r in records]
    ahead = MergeAhead(tmp_path, tmp_path / "m.bin", order, {order[1]: records[1]})  # one resumed
    assert "repack-merge-ahead" not in _threads()  # no record yet: no thread
    for n in (3, 0, 4, 2):
        ahead.finished(order[n], records[n])
    assert "repack-merge-ahead" in _threads()
    appended = ahead.take(records)
    assert appended is not None and appended.parts == 5
    merged = _merged(tmp_path, records, appended)
    reference = tmp_path / "ref"
    reference.mkdir()
    plain = merge_parts([(tmp_path / r["part"]["bin"], tmp_path / r["part"]["idx"]) for r in records],
                        CODE_OF["uint16"], reference / "m.bin", reference / "m.idx")
    assert merged == plain and (tmp_path / "m.bin").read_bytes() == (reference / "m.bin").read_bytes()
    ahead.abort()  # after a take: nothing of the merged prefix is touched
    assert (tmp_path / "m.bin").read_bytes() == (reference / "m.bin").read_bytes()
    assert not list(tmp_path.glob(".m.bin.tmp-*"))


def test_a_prefix_missing_its_first_part_waits_and_the_merge_appends_the_rest(tmp_path):
    records = _parts(tmp_path, 3)
    order = [r["task_id"] for r in records]
    ahead = MergeAhead(tmp_path, tmp_path / "m.bin", order, {})
    ahead.finished(order[1], records[1])
    ahead.finished(order[2], records[2])
    appended = ahead.take(records[:1] + records[1:])  # part 0 never reported: nothing could be appended
    assert appended is not None and appended.parts == 0
    assert _merged(tmp_path, records, appended)["bytes"] == sum(r["part"]["bytes"] for r in records)


def test_parts_that_are_not_the_records_parts_are_given_up(tmp_path):
    records = _parts(tmp_path, 3)
    order = [r["task_id"] for r in records]
    ahead = MergeAhead(tmp_path, tmp_path / "m.bin", order, {})
    for n in range(3):
        ahead.finished(order[n], records[n])
    redone = [dict(r) for r in records]
    redone[1] = {**records[1], "part": {**records[1]["part"], "bytes": records[1]["part"]["bytes"] + 2}}
    assert ahead.take(redone) is None
    assert not list(tmp_path.glob(".m.bin.tmp-*"))


def test_a_part_that_cannot_be_read_gives_up_the_merge_ahead(tmp_path):
    records = _parts(tmp_path, 2)
    order = [r["task_id"] for r in records]
    (tmp_path / records[0]["part"]["bin"]).unlink()
    ahead = MergeAhead(tmp_path, tmp_path / "m.bin", order, {})
    ahead.finished(order[0], records[0])
    assert ahead.take(records) is None and isinstance(ahead.error, FileNotFoundError)
    assert not list(tmp_path.glob(".m.bin.tmp-*"))

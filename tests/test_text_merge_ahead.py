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


def test_a_run_whose_task_fails_leaves_no_merge_ahead_file_and_the_re_run_resumes(tmp_path, monkeypatch):
    from repack.config import EngineOptions
    from repack.errors import IncompleteJobError
    from repack.jobs.engine import Engine
    from repack.jobs.text import TextJob, TextSpec
    from tests.test_text_many_files import small_files
    from tests.tools.text import gpt2_tokenizer, write_tokenizer

    tokenizer = write_tokenizer(gpt2_tokenizer(), tmp_path / "gpt2")
    src, out, ref = tmp_path / "src", tmp_path / "out", tmp_path / "ref"
    small_files(src, 120)
    spec = dict(tokenizer=str(tokenizer), doc_per="file", chunk_bytes=4000)
    seen_ahead: list[list[str]] = []
    real = TextJob._tokenize_task

    def fails_on_the_third(self, task, threads):
        if task.payload["index"] == 2:
            seen_ahead.append([p.name for p in out.glob(".text_document.bin.tmp-*")])
            raise OSError("the disk went away")
        return real(self, task, threads)

    monkeypatch.setattr(TextJob, "_tokenize_task", fails_on_the_third)
    options = EngineOptions(workers=1, quiet=True, retries=0)  # inline: the tasks run in this process, in order
    try:
        Engine(TextJob(TextSpec(source=str(src), out=str(out), **spec)), options).run()
        raise AssertionError("the failed task did not fail the job")
    except IncompleteJobError:
        pass
    assert seen_ahead and len(seen_ahead[0]) == 1  # the merge ahead was under way when the task failed
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name]  # ... and left nothing
    monkeypatch.setattr(TextJob, "_tokenize_task", real)
    resumed = Engine(TextJob(TextSpec(source=str(src), out=str(out), **spec)), options).run()
    assert resumed.skipped >= 2 and resumed.manifest["run"]["parts_merged_ahead"] == resumed.manifest["totals"]["parts"]
    Engine(TextJob(TextSpec(source=str(src), out=str(ref), **spec)), EngineOptions(workers=2, quiet=True)).run()
    for name in ("text_document.bin", "text_document.idx"):
        assert (out / name).read_bytes() == (ref / name).read_bytes()


def _text_run(tmp_path, out, name: str, **options):
    from repack.config import EngineOptions
    from repack.jobs.engine import Engine
    from repack.jobs.text import TextJob, TextSpec
    from tests.test_text_many_files import small_files
    from tests.tools.text import gpt2_tokenizer, write_tokenizer

    tokenizer = tmp_path / "gpt2" / "tokenizer.json"
    if not tokenizer.exists():
        write_tokenizer(gpt2_tokenizer(), tmp_path / "gpt2")
    src = tmp_path / "src"
    if not src.exists():
        small_files(src, 60)
    spec = TextSpec(source=str(src), out=str(out), tokenizer=str(tokenizer), doc_per="file", chunk_bytes=4000,
                    name=name)
    return Engine(TextJob(spec), EngineOptions(quiet=True, **options)).run()


def test_a_name_holding_a_task_id_keeps_its_merge_ahead_until_the_merge(tmp_path):
    """The engine's sweep of killed tasks' temps (any temp whose name holds a task id) ran before finalize and
    removed the live merge-ahead file of `--name books_part-000001`: the merge failed and left a lone .idx."""
    reference = _text_run(tmp_path, tmp_path / "ref", "text_document", workers=1)
    run = _text_run(tmp_path, tmp_path / "out", "books_part-000001", workers=1)
    assert reference.manifest["totals"]["parts"] > 2
    assert run.manifest["run"]["parts_merged_ahead"] == run.manifest["totals"]["parts"]
    for ext in ("bin", "idx"):
        assert (tmp_path / "out" / f"books_part-000001.{ext}").read_bytes() == \
            (tmp_path / "ref" / f"text_document.{ext}").read_bytes()
    assert not [p.name for p in (tmp_path / "out").iterdir() if ".tmp" in p.name]


def test_a_name_with_glob_characters_has_its_killed_runs_temps_swept(tmp_path, monkeypatch):
    from repack.errors import IncompleteJobError
    from repack.jobs.text import TextJob
    from repack.lifecycle.verify import verify_dataset

    out = tmp_path / "out"
    real = TextJob._tokenize_task

    def fails_on_the_second(self, task, threads):
        if task.payload["index"] == 1:
            raise OSError("the disk went away")
        return real(self, task, threads)

    monkeypatch.setattr(TextJob, "_tokenize_task", fails_on_the_second)
    try:
        _text_run(tmp_path, out, "d[1]", workers=1, retries=0)
        raise AssertionError("the failed task did not fail the job")
    except IncompleteJobError:
        pass
    monkeypatch.setattr(TextJob, "_tokenize_task", real)
    stale = out / ".d[1].bin.tmp-99999"  # what a run killed during its merge ahead leaves
    stale.write_bytes(b"\0" * 100)
    run = _text_run(tmp_path, out, "d[1]", workers=1)
    assert run.manifest["run"]["parts_merged_ahead"] == run.manifest["totals"]["parts"]
    assert not stale.exists()
    assert verify_dataset(str(out)) == []  # no file the manifest does not name


def test_a_merge_whose_appender_lost_its_file_lands_nothing(tmp_path):
    records = _parts(tmp_path, 2)
    order = [r["task_id"] for r in records]
    ahead = MergeAhead(tmp_path, tmp_path / "m.bin", order, {})
    ahead.finished(order[0], records[0])
    appended = ahead.take(records)
    appended.tmp.unlink()  # a sweep that took it for a dead run's temp
    try:
        _merged(tmp_path, records, appended)
        raise AssertionError("a merge into a removed file succeeded")
    except FileNotFoundError:
        pass
    assert not (tmp_path / "m.bin").exists() and not (tmp_path / "m.idx").exists()  # no lone index either
    assert not list(tmp_path.glob(".m.*.tmp-*"))

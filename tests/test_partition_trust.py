"""Static partitions and `repack merge` never publish a dataset that a one-machine run of the same command
would refuse: --strict given to the partitions holds at merge, partitions started together with other options
never mix into one dataset, and a text merge keeps the tokenizer the tokens were made with."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

from tests.conftest import ROOT, run_repack
from tests.benchmarks.tiny_files import jpeg_bytes


def tree(root: Path, count: int) -> Path:
    for i in range(count):
        folder = root / f"c{i % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:05d}.jpg").write_bytes(jpeg_bytes(i))
    return root


def test_strict_partitions_are_strict_at_merge_and_no_strict_publishes(tmp_path):
    src, out = tree(tmp_path / "src", 60), tmp_path / "out"
    (src / "c0" / "broken.jpg").write_bytes((src / "c0" / "00000.jpg").read_bytes()[:300])
    for rank in (0, 1):
        run_repack("images", src, out, "--shard-size", "10", "--strict", "--num-nodes", "2", "--node-rank", str(rank),
                   "--quiet")
    merged = run_repack("merge", out, check=False)
    assert merged.returncode == 6, merged.stderr
    assert "1 input(s) were quarantined" in merged.stderr and "repack merge --no-strict" in merged.stderr
    assert not (out / "manifest.json").exists()
    published = run_repack("merge", out, "--no-strict", "--quiet")
    assert published.returncode == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert [q["source"] for q in manifest["quarantine"]] == ["c0/broken.jpg"]
    assert manifest["totals"]["samples"] == 60
    assert manifest["run"]["executor"] == "partitions"  # not "local": the merge ran no task


def test_merge_strict_applies_to_partitions_run_without_it(tmp_path):
    src, out = tree(tmp_path / "src", 30), tmp_path / "out"
    (src / "c1" / "empty.jpg").write_bytes(b"")
    for rank in (0, 1):
        run_repack("images", src, out, "--shard-size", "10", "--num-nodes", "2", "--node-rank", str(rank), "--quiet")
    assert run_repack("merge", out, "--strict", check=False).returncode == 6
    assert not (out / "manifest.json").exists()


def test_partitions_started_together_with_other_options_never_mix(tmp_path):
    """Three pods start at once, one with --no-sample-json: whichever writes the job state first sets the
    options, every partition with others is refused by name, and what merges holds one layout."""
    src = tree(tmp_path / "src", 300)
    for attempt in range(3):
        out = tmp_path / f"out{attempt}"
        pods = [subprocess.Popen([sys.executable, "-m", "repack", "images", str(src), str(out), "--shard-size", "25",
                                  "--num-nodes", "3", "--node-rank", str(rank), "--quiet",
                                  *(["--no-sample-json"] if rank == 1 else [])],
                                 cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                for rank in range(3)]
        errors = [pod.communicate(timeout=120)[1] for pod in pods]
        refused = {rank for rank, err in enumerate(errors) if pods[rank].returncode != 0}
        assert refused in ({1}, {0, 2}), errors
        assert all("holds a job run with other options" in errors[rank] for rank in refused), errors
        accepted_json = 1 in refused  # ranks 0 and 2 (with the json member) wrote the state, or rank 1 did
        members = {name.rsplit(".", 1)[1] for shard in out.glob("shard-*.tar") for name in tarfile.open(shard).getnames()}
        assert ("json" in members) == accepted_json, (refused, members)
        if accepted_json:  # rank 1 runs again with the options the job was started with: merge publishes it whole
            run_repack("images", src, out, "--shard-size", "25", "--num-nodes", "3", "--node-rank", "1", "--quiet")
            run_repack("merge", out, "--quiet")
            assert json.loads((out / "manifest.json").read_text())["totals"]["samples"] == 300
            assert run_repack("verify", out, check=False).returncode == 0


def _text_partitions(tmp_path: Path, count: int, files: int, *extra: str) -> tuple[Path, Path]:
    """Both partitions of a text job over ``count`` documents in ``files`` files, not merged: (OUT, tokenizer)."""
    from tests.tools.text import documents, train_bpe, write_tokenizer

    docs = documents(count, seed=3)
    tokenizer = write_tokenizer(train_bpe(docs[:count // 2]), tmp_path / "tok")
    src, out = tmp_path / "corpus", tmp_path / "out"
    src.mkdir()
    for part in range(files):
        (src / f"part{part}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[part::files]))
    for rank in (0, 1):
        run_repack("text", src, out, "--tokenizer", tokenizer, *extra, "--num-nodes", "2", "--node-rank", str(rank),
                   "--quiet")
    return out, tokenizer


def test_a_text_merge_refuses_a_tokenizer_that_changed_since_the_plan(tmp_path):
    out, tokenizer = _text_partitions(tmp_path, 120, 2)
    planned = Path(tokenizer, "tokenizer.json") if Path(tokenizer).is_dir() else Path(tokenizer)
    original = planned.read_bytes()
    changed = json.loads(original)
    changed["added_tokens"].append({"id": len(changed["model"]["vocab"]) + 10, "content": "<|x|>", "single_word": False,
                                    "lstrip": False, "rstrip": False, "normalized": False, "special": True})
    planned.write_text(json.dumps(changed))
    merged = run_repack("merge", out, check=False)
    assert merged.returncode == 2 and "the tokenizer changed since the job was planned" in merged.stderr, merged.stderr
    assert not (out / "manifest.json").exists()
    planned.write_bytes(original)
    run_repack("merge", out, "--quiet")
    import hashlib

    manifest = json.loads((out / "manifest.json").read_text())
    assert hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest() == manifest["tokenizer"]["sha256"]
    assert run_repack("verify", out, check=False).returncode == 0


def test_a_merge_reads_and_removes_nothing_a_task_record_names_outside_out(tmp_path):
    """A task record naming its part by a path outside OUT (a forged or damaged record on the shared volume) is a
    damaged task (exit 4): the merge read that file into the dataset and then deleted it. An lmdb part alike."""
    out = _text_partitions(tmp_path, 80, 4, "--chunk-bytes", "2KiB")[0]
    records = sorted((out / ".repack" / "tasks").glob("part-*.json"))
    victim = tmp_path / "victim.bin"
    record = json.loads(records[0].read_text())
    victim.write_bytes((out / record["part"]["bin"]).read_bytes())
    record["part"]["bin"] = str(victim)
    records[0].write_text(json.dumps(record))
    merged = run_repack("merge", out, check=False)
    assert merged.returncode == 4 and f"missing or damaged: {records[0].stem}" in merged.stderr, merged.stderr
    assert victim.exists() and not (out / "manifest.json").exists()

    src, lmdb_out = tree(tmp_path / "src", 24), tmp_path / "lmdb"
    for rank in (0, 1):
        run_repack("images", src, lmdb_out, "--to", "lmdb", "--shard-size", "6", "--num-nodes", "2", "--node-rank",
                   str(rank), "--quiet")
    first = sorted((lmdb_out / ".repack" / "tasks").glob("shard-*.json"))[0]
    record = json.loads(first.read_text())
    outside = tmp_path / "outside.seg"
    outside.write_bytes((lmdb_out / record["part"]["path"]).read_bytes())
    record["part"]["path"] = str(outside)
    first.write_text(json.dumps(record))
    merged = run_repack("merge", lmdb_out, check=False)
    assert merged.returncode == 4 and first.stem in merged.stderr, merged.stderr


def test_a_merge_removes_what_a_killed_merge_left_and_checks_the_job_state(tmp_path):
    """A merge killed while it wrote the manifest, the tokenizer copy or the source runs left their temps, which
    the next merge kept (verify then failed for good); partitions of another repack version, or a job.json
    that is not a job state, are refused in one line (a traceback, or a merge stamped with this version)."""
    out = _text_partitions(tmp_path, 80, 4, "--chunk-bytes", "2KiB")[0]
    left = [".manifest.json.k1l2m3n4.tmp", ".tokenizer.json.a1b2c3d4.tmp", ".text_document.sources.q9w8e7r6.tmp"]
    for name in left:
        (out / name).write_bytes(b"half written")
    state_file = out / ".repack" / "job.json"
    state = json.loads(state_file.read_text())
    for forged, said in (({**state, "tool_version": "0.0.1"}, "partitions run by repack 0.0.1"),
                         ({**state, "job": "nope"}, "is not a repack job state"),
                         ({**state, "job": ["images"]}, "is not a repack job state"),
                         ({k: v for k, v in state.items() if k != "plan_digest"}, "is not a repack job state")):
        state_file.write_text(json.dumps(forged))
        refused = run_repack("merge", out, check=False)
        assert refused.returncode == 2 and said in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    state_file.write_text(json.dumps(state))
    run_repack("merge", out, "--quiet")
    assert not [name for name in left if (out / name).exists()]
    assert run_repack("verify", out, check=False).returncode == 0


def test_a_tokenizer_is_copied_only_against_its_planned_digest(tmp_path):
    import pytest

    from repack.errors import UsageError
    from repack.transforms.tokenize import planned_tokenizer_bytes

    secret = tmp_path / "credentials"
    secret.write_text("key=1")
    for digest in (None, ""):  # a plan that names none (damaged or forged) copies nothing
        with pytest.raises(UsageError, match="names no tokenizer sha256"):
            planned_tokenizer_bytes(secret, digest)


def test_a_merge_beside_a_running_partition_names_it(tmp_path):
    """A partition still running holds OUT's main lock shared (no pid there) and its own exclusively: a merge
    meanwhile exits 3 naming that partition and its pid, not "pid ?"."""
    import fcntl
    import os

    src, out = tree(tmp_path / "src", 30), tmp_path / "out"
    for rank in (0, 1):
        run_repack("images", src, out, "--shard-size", "10", "--num-nodes", "2", "--node-rank", str(rank), "--quiet")
    main = os.open(out / ".repack" / "lock", os.O_RDWR)
    mine = os.open(out / ".repack" / "lock-1-of-2", os.O_RDWR)
    try:  # as partition 1 running holds them
        fcntl.flock(main, fcntl.LOCK_SH)
        fcntl.flock(mine, fcntl.LOCK_EX)
        os.ftruncate(mine, 0)
        os.pwrite(mine, str(os.getpid()).encode(), 0)
        merged = run_repack("merge", out, check=False)
    finally:
        os.close(mine)
        os.close(main)
    assert merged.returncode == 3, merged.stderr
    assert f"partition 1-of-2 (pid {os.getpid()}) of a job run as static partitions" in merged.stderr
    assert "pid ?" not in merged.stderr
    assert run_repack("merge", out, "--quiet").returncode == 0


def test_a_partition_started_with_another_num_nodes_is_refused_by_name(tmp_path):
    """Partition 2 of 3 among partitions of 4 would leave tasks of the others unrun (the merge then only said a
    shard was missing): refused by name before any work; the same count resumes as before."""
    src, out = tree(tmp_path / "src", 80), tmp_path / "out"
    for rank in (0, 1, 3):
        run_repack("images", src, out, "--shard-size", "10", "--num-nodes", "4", "--node-rank", str(rank), "--quiet")
    odd = run_repack("images", src, out, "--shard-size", "10", "--num-nodes", "3", "--node-rank", "2", "--quiet",
                     check=False)
    assert odd.returncode == 2, odd.stderr
    assert "run as 4 static partitions (--num-nodes 4)" in odd.stderr and "--num-nodes 3" in odd.stderr
    run_repack("images", src, out, "--shard-size", "10", "--num-nodes", "4", "--node-rank", "2", "--quiet")
    run_repack("merge", out, "--quiet")
    assert json.loads((out / "manifest.json").read_text())["totals"]["samples"] == 80

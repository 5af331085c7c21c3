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


def test_a_text_merge_refuses_a_tokenizer_that_changed_since_the_plan(tmp_path):
    from tests.tools.text import documents, train_bpe, write_tokenizer

    docs = documents(120, seed=3)
    tokenizer = write_tokenizer(train_bpe(docs[:60]), tmp_path / "tok")
    src, out = tmp_path / "corpus", tmp_path / "out"
    src.mkdir()
    for part in range(2):
        (src / f"part{part}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[part::2]))
    for rank in (0, 1):
        run_repack("text", src, out, "--tokenizer", tokenizer, "--num-nodes", "2", "--node-rank", str(rank), "--quiet")
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

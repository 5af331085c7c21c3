"""`repack remove` on an LMDB image dataset (the database rewritten as data-vN.lmdb without the samples)
and on a token memmap dataset (the prefixes holding the documents rewritten without them), then
`repack gc --keep 1`: no file under OUT holds a removed image's bytes or a removed document's token ids,
and the readers (LmdbImageDataset, DocumentDataset) read the new version with the remaining samples in
order, and an older version by ``version=N`` until gc."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.conftest import read_manifest_json, run_repack
from tests.test_dataset_versions import make_source
from tests.test_remove_gc import every_file_bytes, text_in_two_versions


def lmdb_samples(out: Path, version: int | None = None) -> list[tuple[str, bytes, int]]:
    """(source path, image bytes, label) of every sample, in index order, as the PyTorch reader gives them."""
    from pipelines.torch_lmdb import LmdbImageDataset

    dataset = LmdbImageDataset(out, decode=False, output="dict", version=version)
    return [(item["meta"]["path"], item["image"], item["label"]) for item in (dataset[i] for i in range(len(dataset)))]


def test_lmdb_remove_rewrites_the_database_and_gc_deletes_the_removed_bytes(tmp_path):
    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--to", "lmdb", "--quiet")
    before = lmdb_samples(out)
    gone = {rel: (src / rel).read_bytes() for rel in ("cat/c1.jpg", "dog/d3.jpg")}
    assert all(any(data == image for _, image, _ in before) for data in gone.values())  # stored as is
    (tmp_path / "takedown.txt").write_text("cat/c1.jpg\ndog/d3.jpg\nnot/there.jpg\n")
    done = run_repack("remove", out, "--sources", tmp_path / "takedown.txt")
    assert "not found in the dataset: not/there.jpg" in done.stderr and "published version 2" in done.stdout
    v2 = read_manifest_json(out)
    assert v2["dataset_version"]["change"]["rewritten"] == {"data.lmdb": "data-v2.lmdb"}
    assert [s["path"] for s in v2["shards"]] == ["data-v2.lmdb"] and v2["totals"]["samples"] == 7
    assert v2["stats"]["class_counts"] == {"cat": 4, "dog": 3} and sum(v2["stats"]["formats"].values()) == 7
    assert lmdb_samples(out) == [s for s in before if s[0] not in gone]  # the others, in order
    assert lmdb_samples(out, version=1) == before  # a reader pinned to version 1 still reads it
    from pipelines.dali_lmdb import dali_lmdb_loader

    def dali_labels(version):  # DALI's LMDB pipeline pins a version the same way (CPU backend)
        loader = dali_lmdb_loader(out, batch_size=4, num_threads=1, device_id=None, size=None, version=version)
        return [int(x) for batch in loader for x in batch[0]["labels"].view(-1)]

    assert dali_labels(1) == [s[2] for s in before] and dali_labels(None) == [s[2] for s in lmdb_samples(out)]
    assert run_repack("verify", out).returncode == 0 and run_repack("verify", out, "--version", "1").returncode == 0
    keys = tmp_path / "keys.txt"
    keys.write_text("00000001_c1\n")
    refused = run_repack("remove", out, "--keys", keys, check=False)
    assert refused.returncode == 2 and "no keys" in refused.stderr and "--sources" in refused.stderr
    again = run_repack("remove", out, "--sources", tmp_path / "takedown.txt")
    assert "nothing published" in again.stdout and not (out / "manifest.v3.json").exists()

    run_repack("gc", out, "--keep", "1")
    assert not (out / "data.lmdb").exists()
    for name, blob in every_file_bytes(out):
        for rel, data in gone.items():
            assert data not in blob, f"{rel}'s bytes are still in {name}"
    assert lmdb_samples(out) == [s for s in before if s[0] not in gone]
    assert run_repack("verify", out).returncode == 0


def shard_runs(out: Path, shard: dict) -> list[list]:
    """A prefix's source runs as the manifest names them (its side file ``<prefix>.sources``)."""
    from repack.manifest.source_runs import runs_of

    return [list(run) for run in runs_of(shard, lambda rel: (out / rel).read_bytes())]


def token_documents(out: Path, version: int | None = None) -> list[list[int]]:
    from pipelines.torch_text import DocumentDataset

    dataset = DocumentDataset(out, version=version)
    return [dataset[i].tolist() for i in range(len(dataset))]


def test_token_remove_by_key_and_source_then_gc_deletes_the_removed_token_ids(tmp_path):
    from tests.tools.text import documents

    docs = documents(24, seed=7)
    corpus, tok, out = text_in_two_versions(tmp_path, docs, 14, 24)  # prefix text_document-v2: b.jsonl
    v2 = read_manifest_json(out)
    assert [shard_runs(out, s) for s in v2["shards"]] == [[["a.jsonl", 0, 14]], [["b.jsonl", 0, 10]]]
    before = token_documents(out)
    assert len(before) == 24
    keys = tmp_path / "keys.txt"
    keys.write_text("a.jsonl#3\na.jsonl#9\nb.jsonl#99\n")
    done = run_repack("remove", out, "--keys", keys)
    assert "not found in the dataset: b.jsonl#99" in done.stderr
    v3 = read_manifest_json(out)
    assert v3["dataset_version"]["change"]["rewritten"] == {"text_document.bin": "text_document-v3.bin"}
    assert v3["prefixes"] == ["text_document-v3", "text_document-v2"] and v3["shards"][1] == v2["shards"][1]
    assert shard_runs(out, v3["shards"][0]) == [["a.jsonl", 0, 3], ["a.jsonl", 4, 5], ["a.jsonl", 10, 4]]
    kept = [d for i, d in enumerate(before) if i not in (3, 9)]
    assert token_documents(out) == kept and token_documents(out, version=2) == before
    assert v3["totals"]["documents"] == 22 and v3["totals"]["tokens"] == sum(map(len, kept))
    assert v3["data_path"] == " ".join(f"{s['tokens']} {s['prefix']}" for s in v3["shards"])
    sources = tmp_path / "sources.txt"
    sources.write_text("b.jsonl\n")
    run_repack("remove", out, "--sources", sources, "--quiet")
    v4 = read_manifest_json(out)
    assert v4["dataset_version"]["change"]["rewritten"] == {"text_document-v2.bin": None}  # left empty: dropped
    assert v4["prefixes"] == ["text_document-v3"] and token_documents(out) == kept[:12]
    assert run_repack("verify", out).returncode == 0 and run_repack("verify", out, "--version", "2").returncode == 0

    run_repack("gc", out, "--keep", "1")
    removed = [before[3], before[9]] + before[14:]
    for name, blob in every_file_bytes(out):
        for number, ids in enumerate(removed):
            assert np.asarray(ids, dtype="<u2").tobytes() not in blob, f"removed document {number} is in {name}"
    assert sorted(p.name for p in out.glob("*.bin")) == ["text_document-v3.bin"]
    assert token_documents(out) == kept[:12] and run_repack("verify", out).returncode == 0


def test_remove_killed_before_publishing_reruns_to_the_same_bytes(tmp_path):
    """A remove killed after writing its new file (and with a half-written temp beside it) but before
    publishing: the re-run writes the same bytes as an uninterrupted remove, LMDB and tokens alike."""
    import shutil

    from tests.tools.text import documents, gpt2_tokenizer, write_tokenizer

    src, corpus, tok = make_source(tmp_path / "src"), tmp_path / "corpus", tmp_path / "tok"
    corpus.mkdir()
    write_tokenizer(gpt2_tokenizer(), tok)
    (corpus / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(12, seed=2)))
    (tmp_path / "sources.txt").write_text("cat/c2.jpg\n")
    (tmp_path / "keys.txt").write_text("a.jsonl#4\n")
    cases = [(("images", src, None, "--to", "lmdb", "--quiet"), "--sources", "data-v2.lmdb", ".data-v2.lmdb.tmp-remove"),
             (("text", corpus, None, "--tokenizer", tok, "--quiet"), "--keys", "text_document-v2.bin",
              ".text_document-v2.bin.tmp-999")]
    for job, by, written, temp in cases:
        a, b = tmp_path / f"a-{written}", tmp_path / f"b-{written}"
        names = tmp_path / ("sources.txt" if by == "--sources" else "keys.txt")
        for out in (a, b):
            run_repack(*[out if x is None else x for x in job])
        run_repack("remove", a, by, names, "--quiet")  # uninterrupted
        run_repack("remove", b, by, names, "--quiet")
        shutil.copy(b / "manifest.v1.json", b / "manifest.json")  # as if killed before anything was published
        (b / "manifest.v1.json").unlink()
        (b / "manifest.v2.json").unlink()
        (b / written).write_bytes(b"half a file")
        (b / temp).write_bytes(b"a temp left by the kill")
        read = lmdb_samples if by == "--sources" else token_documents
        assert read(b) == read(a, version=1)  # version 1 intact and readable (verify reports the stray files)
        run_repack("remove", b, by, names, "--quiet")
        assert (a / written).read_bytes() == (b / written).read_bytes()
        assert not (b / temp).exists()
        assert read_manifest_json(a)["shards"] == read_manifest_json(b)["shards"]
        assert run_repack("verify", b).returncode == 0


def test_token_keys_count_across_the_parts_of_one_file(tmp_path):
    """--no-merge: one file cut into several prefixes numbers its documents across them; removing a key
    rewrites only the prefix that holds it."""
    from tests.tools.text import documents, gpt2_tokenizer, write_tokenizer

    corpus, tok, out = tmp_path / "corpus", tmp_path / "tok", tmp_path / "out"
    corpus.mkdir()
    write_tokenizer(gpt2_tokenizer(), tok)
    (corpus / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(40, seed=1)))
    run_repack("text", corpus, out, "--tokenizer", tok, "--no-merge", "--chunk-bytes", "4KB", "--quiet")
    v1 = read_manifest_json(out)
    assert len(v1["shards"]) > 2
    runs = [shard_runs(out, s) for s in v1["shards"]]
    assert [r[0][1] for r in runs] == [sum(r[0][2] for r in runs[:i]) for i in range(len(runs))]  # 0, n0, n0+n1...
    target = runs[1][0][1]  # the first document of the second prefix
    (tmp_path / "keys.txt").write_text(f"a.jsonl#{target}\n")
    before = token_documents(out)
    run_repack("remove", out, "--keys", tmp_path / "keys.txt", "--quiet")
    v2 = read_manifest_json(out)
    second = v1["shards"][1]["path"]
    assert v2["dataset_version"]["change"]["rewritten"] == {second: second.replace(".bin", "-v2.bin")}
    assert v2["shards"][0] == v1["shards"][0] and v2["shards"][2:] == v1["shards"][2:]
    assert token_documents(out) == before[:target] + before[target + 1:]


def test_a_prefix_named_like_a_later_versions_file_stays_with_its_version(tmp_path):
    """`--name notes-v2`: version 2's publish took version 1's own prefix for a leftover of a killed writer
    and moved it aside (version 1 listed, unreadable, `verify --version 1` exit 5)."""
    from tests.tools.text import documents, gpt2_tokenizer, write_tokenizer

    docs = documents(6, seed=3)
    corpus, tok, out = tmp_path / "corpus", tmp_path / "tok", tmp_path / "out"
    corpus.mkdir()
    write_tokenizer(gpt2_tokenizer(), tok)
    (corpus / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:4]))
    (corpus / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[4:]))
    run_repack("text", corpus, out, "--tokenizer", tok, "--name", "notes-v2", "--quiet")
    first = token_documents(out)
    names = tmp_path / "names.txt"
    names.write_text("b.jsonl\n")
    run_repack("remove", out, "--sources", names)
    assert token_documents(out, version=1) == first and len(token_documents(out)) == 4
    assert run_repack("verify", out, "--version", "1").returncode == 0
    assert not (out / ".repack" / "rejected").exists()

"""Datasets over time: versioned manifests, `repack images --append` (new inputs only, existing shards
byte-identical, kill -9 and re-run = an uninterrupted append), readers pinned to a version."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.conftest import kill_after_records, read_manifest_json, run_repack
from tests.test_images_job import jpeg_bytes, write_jpegs


def dataset_files(out: Path) -> dict[str, bytes]:
    """Every dataset file (job state aside) by name."""
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


def make_source(root: Path) -> Path:
    write_jpegs(root / "cat", 5, "c")
    (root / "dog").mkdir()
    for i in range(4):  # content distinct from every cat's
        (root / "dog" / f"d{i}.jpg").write_bytes(jpeg_bytes(seed=20 + i))
    return root


def add_inputs(root: Path, count: int = 3) -> None:
    """New files only (the old ones untouched): ``count`` cats and one sample of a new class."""
    for i in range(count):
        (root / "cat" / f"new{i}.jpg").write_bytes(jpeg_bytes(seed=50 + i))
    (root / "emu").mkdir()
    (root / "emu" / "e0.jpg").write_bytes(jpeg_bytes(seed=90))


def three_versions(tmp_path: Path) -> tuple[Path, Path]:
    """(SOURCE, OUT) of a dataset in three versions: packed in shards of 4, ``add_inputs`` appended, then
    ``cat/c1.jpg`` removed (named in ``tmp_path/gone.txt``)."""
    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    add_inputs(src)
    run_repack("images", src, out, "--shard-size", "4", "--append", "--quiet")
    (tmp_path / "gone.txt").write_text("cat/c1.jpg\n")
    run_repack("remove", out, "--sources", tmp_path / "gone.txt", "--quiet")
    return src, out


def labels_read(out: Path, version: int | None = None) -> list[int]:
    """Every sample's label as the readers find it: the version's manifest, its shards' DALI index, the
    cls member's bytes."""
    from pipelines.manifest_access import open_manifest, parse_label, read_index

    manifest = open_manifest(out, version)
    labels = []
    for number, shard in enumerate(manifest.shards):
        with open(manifest.path(shard.path), "rb") as fh:
            for sample in read_index(manifest, number):
                _, offset, size = next(m for m in sample.members if m[0] == "cls")
                fh.seek(offset)
                labels.append(parse_label(fh.read(size)))
    return labels


def test_append_publishes_the_next_version_and_keeps_every_shard(tmp_path):
    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    before = dataset_files(out)
    add_inputs(src)
    done = run_repack("images", src, out, "--shard-size", "4", "--append")
    assert "published version 2" in done.stderr + done.stdout
    after = dataset_files(out)
    assert {name: after[name] for name in before if name != "manifest.json"} == \
        {name: data for name, data in before.items() if name != "manifest.json"}  # byte-identical
    assert after["manifest.v1.json"] == before["manifest.json"]  # version 1 kept as it was
    assert after["manifest.json"] == after["manifest.v2.json"]
    manifest = read_manifest_json(out)
    assert manifest["dataset_version"]["number"] == 2 and manifest["dataset_version"]["parent"] == 1
    assert manifest["dataset_version"]["change"]["kind"] == "append"
    assert manifest["dataset_version"]["change"]["added_samples"] == 4
    assert manifest["classes"] == {"cat": 0, "dog": 1, "emu": 2}  # a new class: the next index
    assert manifest["totals"]["samples"] == 13 and manifest["totals"]["inputs"] == 13
    assert [s["path"] for s in manifest["shards"]][-2:] == ["shard-000002.tar", "shard-v2-000000.tar"]
    assert sorted(labels_read(out)) == [0] * 8 + [1] * 4 + [2]
    assert sorted(labels_read(out, version=1)) == [0] * 5 + [1] * 4
    from pipelines.torch_webdataset import ImageShardDataset  # the PyTorch reader takes version=N too

    assert sorted(label for _, label in ImageShardDataset(out, decode=False, version=1)) == [0] * 5 + [1] * 4
    from pipelines.dali_webdataset import build_image_pipeline  # and the DALI pipeline (CPU backend here)

    images, labels = build_image_pipeline(out, batch_size=9, num_threads=1, size=32, version=1).run()
    assert sorted(int(labels.at(i)) for i in range(len(labels))) == [0] * 5 + [1] * 4
    again = run_repack("images", src, out, "--shard-size", "4", "--append")
    assert "nothing new" in again.stdout and not (out / "manifest.v3.json").exists()
    assert run_repack("verify", out).returncode == 0
    assert run_repack("verify", out, "--version", "1").returncode == 0
    shown = run_repack("inspect", out).stdout
    assert "version 2 (parent 1): append, added_samples 4" in shown and "kept versions: 1, 2" in shown
    missing = run_repack("verify", out, "--version", "7", check=False)
    assert missing.returncode != 0 and "no version 7" in missing.stderr + missing.stdout


def test_sample_keys_stay_unique_across_versions(tmp_path):
    from pipelines.manifest_access import open_manifest, read_index

    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    add_inputs(src)
    run_repack("images", src, out, "--shard-size", "4", "--append", "--quiet")
    manifest = open_manifest(out)
    keys = [s.key for i in range(len(manifest.shards)) for s in read_index(manifest, i)]
    assert len(keys) == 13 == len(set(keys))


def test_reader_of_version_n_reads_exactly_n_while_n_plus_1_is_published(tmp_path):
    from pipelines.torch_webdataset import ImageShardDataset

    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    reader = iter(ImageShardDataset(out, decode=False))  # opened while version 1 is the latest
    first = [next(reader) for _ in range(3)]
    add_inputs(src)
    run_repack("images", src, out, "--shard-size", "4", "--append", "--quiet")
    rest = list(reader)
    assert sorted(label for _, label in first + rest) == [0] * 5 + [1] * 4  # version 1, whole and only it


def test_an_append_whose_new_inputs_are_all_quarantined_records_them_in_a_version(tmp_path):
    """Not exit 7 (that is for a dataset with nothing in it): version 2 holds version 1's shards and the
    new input's quarantine record, the summary says nothing new was packed and why; the next append
    finds nothing new until the file changes."""
    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    before = read_manifest_json(out)
    (src / "cat" / "broken.jpg").write_bytes(b"not an image")
    done = run_repack("images", src, out, "--shard-size", "4", "--append", check=False)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    assert "published version 2" in said and "0 new samples (nothing new was packed: every new input was " \
        "quarantined), 9 in all; 1 quarantined" in said and "cat/broken.jpg: not a recognized image" in said
    manifest = read_manifest_json(out)
    assert manifest["shards"] == before["shards"] and manifest["totals"]["samples"] == 9
    assert [q["source"] for q in manifest["quarantine"]] == ["cat/broken.jpg"]
    assert manifest["dataset_version"]["change"]["added_samples"] == 0
    assert not (out / ".repack" / "append-v2").exists()  # no staging folder left behind
    assert run_repack("verify", out).returncode == 0
    again = run_repack("images", src, out, "--shard-size", "4", "--append")
    assert "nothing new: version 2" in again.stdout + again.stderr
    (src / "cat" / "broken.jpg").write_bytes(jpeg_bytes(seed=77))  # fixed: planned again, packed
    fixed = run_repack("images", src, out, "--shard-size", "4", "--append")
    assert "published version 3" in fixed.stdout + fixed.stderr
    manifest = read_manifest_json(out)  # it has a sample now: no quarantine record left, counted once
    assert manifest["totals"]["samples"] == 10 and manifest["totals"]["inputs"] == 10 and manifest["quarantine"] == []


def test_append_killed_and_rerun_equals_an_uninterrupted_append(tmp_path):
    src = make_source(tmp_path / "src")
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        run_repack("images", src, out, "--shard-size", "4", "--quiet")
    for i in range(24):
        (src / "dog" / f"more{i:02d}.jpg").write_bytes(jpeg_bytes(seed=100 + i))
    args = ["images", src, None, "--shard-size", "4", "--chunk-size", "2", "--workers", "1", "--append", "--quiet"]
    run_repack(*[str(b) if x is None else x for x in args])  # uninterrupted
    stage = a / ".repack" / "append-v2" / "out"
    kill_after_records([str(a) if x is None else x for x in args], stage, 3)
    assert json.loads((a / "manifest.json").read_bytes()).get("dataset_version") is None  # still version 1
    assert run_repack("verify", a).returncode == 0  # version 1 intact and readable
    assert sorted(labels_read(a)) == [0] * 5 + [1] * 4
    run_repack(*[str(a) if x is None else x for x in args])
    assert dataset_files(a).keys() == dataset_files(b).keys()
    for name, data in dataset_files(b).items():
        if not name.startswith("manifest"):
            assert dataset_files(a)[name] == data, name

    def without_run(out: Path, name: str) -> dict:
        data = json.loads((out / name).read_bytes())
        data.pop("run")
        return data

    assert without_run(a, "manifest.json") == without_run(b, "manifest.json")
    # killed between writing manifest.v2.json and manifest.json: a re-run only promotes version 2
    shutil.copy(b / "manifest.v1.json", b / "manifest.json")
    run_repack(*[str(b) if x is None else x for x in args])
    assert (b / "manifest.json").read_bytes() == (b / "manifest.v2.json").read_bytes()
    assert run_repack("verify", b).returncode == 0


def test_text_append_adds_a_prefix_of_the_new_files_only(tmp_path):
    from pipelines.torch_text import TokenMemmap
    from tests.tools.text import documents, gpt2_tokenizer, write_tokenizer

    docs = documents(40, seed=4)
    corpus, only_new, tok, out, fresh = (tmp_path / n for n in ("corpus", "only_new", "tok", "out", "fresh"))
    corpus.mkdir()
    only_new.mkdir()
    write_tokenizer(gpt2_tokenizer(), tok)
    (corpus / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:25]))
    run_repack("text", corpus, out, "--tokenizer", tok, "--quiet")
    before = dataset_files(out)
    for folder in (corpus, only_new):
        (folder / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[25:]))
    appended = run_repack("text", corpus, out, "--tokenizer", tok, "--append")
    run_repack("text", only_new, fresh, "--tokenizer", tok, "--quiet")
    after = dataset_files(out)
    tokens = [s["tokens"] for s in read_manifest_json(out)["shards"]]  # the version's --data-path is said
    assert f"Megatron --data-path {tokens[0]} {out}/text_document {tokens[1]} {out}/text_document-v2" in appended.stdout
    assert all(after[name] == data for name, data in before.items() if name != "manifest.json")
    assert after["text_document-v2.bin"] == (fresh / "text_document.bin").read_bytes()  # the new file only
    assert after["text_document-v2.idx"] == (fresh / "text_document.idx").read_bytes()
    manifest = read_manifest_json(out)
    assert manifest["prefixes"] == ["text_document", "text_document-v2"] and manifest["totals"]["documents"] == 40
    assert manifest["data_path"] == " ".join(f"{s['tokens']} {s['prefix']}" for s in manifest["shards"])
    assert len(TokenMemmap(out).prefixes) == 2 and run_repack("verify", out).returncode == 0
    again = run_repack("text", corpus, out, "--tokenizer", tok, "--append")
    assert "nothing new" in again.stdout
    (corpus / "c.jsonl").write_text(json.dumps({"text": docs[0]}) + "\n")  # every document ends alike in a dataset:
    for flags, said in ((("--no-append-eos",), "--no-append-eos (the dataset: --append-eos)"),  # verify relies on it
                        (("--add-bos",), "--add-bos (the dataset: no --add-bos)"),
                        (("--doc-per", "file"), "--doc-per file (the dataset: --doc-per line)"),  # what a document is
                        (("--field", "body"), "--field body (the dataset: --field text)"),
                        (("--max-doc-bytes", "1KiB"), "--max-doc-bytes 1024B (the dataset: --max-doc-bytes 8388608B)"),
                        (("--no-follow-symlinks",), "--no-follow-symlinks (the dataset: without --no-follow-symlinks)")):
        refused = run_repack("text", corpus, out, "--tokenizer", tok, "--append", *flags, check=False)
        assert refused.returncode == 2 and f"was tokenized with other options: {said}" in refused.stderr
    assert read_manifest_json(out)["dataset_version"]["number"] == 2 and run_repack("verify", out).returncode == 0
    from tests.tools.text import train_bpe

    other = tmp_path / "other-tok"
    write_tokenizer(train_bpe(docs), other)
    refused = run_repack("text", corpus, out, "--tokenizer", other, "--append", check=False)  # found after tokenizing:
    assert refused.returncode == 2 and "another tokenizer" in refused.stderr  # the staged job is discarded, so
    done = run_repack("text", corpus, out, "--tokenizer", tok, "--append")  # the right one appends at once
    assert "published version 3" in done.stdout and run_repack("verify", out).returncode == 0


def test_a_change_beside_a_first_pack_still_running_names_that_pack(tmp_path):
    """An --append, remove or gc started while the first pack of OUT runs (no manifest yet) said "holds no
    published dataset: pack one there first" of a folder being packed; it names the running process now (exit 3)."""
    import fcntl

    out = tmp_path / "out"
    (out / ".repack").mkdir(parents=True)
    with open(out / ".repack" / "lock", "w") as lock:  # what a running pack holds
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.write("4242")
        lock.flush()
        (tmp_path / "names.txt").write_text("a.jpg\n")
        for args in (("remove", out, "--sources", tmp_path / "names.txt"), ("gc", out)):
            done = run_repack(*args, check=False)
            assert done.returncode == 3 and "pid 4242" in done.stderr and "already running" in done.stderr, done.stderr
    done = run_repack("gc", out, check=False)  # a killed pack's lock: nothing to name
    assert done.returncode == 2 and "pack one there first" in done.stderr

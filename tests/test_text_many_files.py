"""`repack text` over many small files: the manifest does not grow with the input files (the source
runs live in a columnar side file that remove and verify read), documents of many files share
tokenizer calls, and the job state stays small per input file. Real GPT-2, the real CLI."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import read_manifest_json, run_repack
from tests.test_remove_lmdb_tokens import shard_runs, token_documents
from tests.tools.text import documents, gpt2_tokenizer, write_tokenizer


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    return write_tokenizer(gpt2_tokenizer(), tmp_path_factory.mktemp("gpt2"))


def small_files(root: Path, count: int, seed: int = 0) -> list[str]:
    """``count`` one-document .txt files in 10 folders; their rels in sorted order."""
    rels = []
    for i, text in enumerate(documents(count, seed=seed, mean_sentences=2.0)):
        rel = f"d{i % 10}/f{i:05d}.txt"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text or "x", encoding="utf-8")
        rels.append(rel)
    return sorted(rels)


def pack(tmp_path: Path, name: str, count: int, tokenizer: Path, *extra: str) -> tuple[Path, list[str]]:
    src, out = tmp_path / f"{name}-src", tmp_path / f"{name}-out"
    rels = small_files(src, count)
    run_repack("text", src, out, "--tokenizer", tokenizer, "--doc-per", "file", "--quiet", *extra)
    return out, rels


def test_manifest_size_does_not_grow_with_the_input_files(tmp_path, gpt2):
    small, _ = pack(tmp_path, "small", 40, gpt2)
    large, rels = pack(tmp_path, "large", 1200, gpt2)
    grown = (large / "manifest.json").stat().st_size - (small / "manifest.json").stat().st_size
    assert grown < 1500, f"the manifest grew {grown} bytes for 1160 more input files"
    manifest = read_manifest_json(large)
    (shard,) = manifest["shards"]
    assert "sources" not in shard and shard["source_runs"] == "text_document.sources"
    assert shard_runs(large, shard) == [[rel, 0, 1] for rel in rels]  # one document per file, in input order
    assert run_repack("verify", large).returncode == 0


def test_verify_names_a_damaged_source_runs_file(tmp_path, gpt2):
    out, _ = pack(tmp_path, "c", 30, gpt2)
    side = out / "text_document.sources"
    data = bytearray(side.read_bytes())
    data[-3] ^= 0xFF
    side.write_bytes(bytes(data))
    done = run_repack("verify", out, check=False)
    assert done.returncode != 0 and "text_document.sources: sha256 mismatch" in done.stdout + done.stderr


def test_remove_reads_the_inline_sources_of_an_older_manifest(tmp_path, gpt2):
    """A manifest written before the side file (runs inline under ``sources``) still takes removals; the
    rewritten prefix gets a side file."""
    out, rels = pack(tmp_path, "old", 30, gpt2)
    manifest = read_manifest_json(out)
    (shard,) = manifest["shards"]
    runs = shard_runs(out, shard)
    for key in ("source_runs", "source_runs_bytes", "source_runs_sha256"):
        del shard[key]
    shard["sources"] = runs
    (out / "text_document.sources").unlink()
    (out / "manifest.json").write_text(json.dumps(manifest))
    before = token_documents(out)
    (tmp_path / "gone.txt").write_text(f"{rels[3]}\n{rels[7]}\n")
    run_repack("remove", out, "--sources", tmp_path / "gone.txt", "--quiet")
    (new,) = read_manifest_json(out)["shards"]
    assert "sources" not in new and shard_runs(out, new) == [[rel, 0, 1] for rel in rels if rel not in
                                                             (rels[3], rels[7])]
    assert token_documents(out) == before[:3] + before[4:7] + before[8:]
    assert run_repack("verify", out).returncode == 0


def test_documents_of_many_files_share_tokenizer_calls(tmp_path, gpt2):
    """One encode_batch call per batch of documents (BATCH_DOCS, bounding a worker's memory), not one per
    input file."""
    from repack.jobs.text import BATCH_DOCS

    out, rels = pack(tmp_path, "calls", 300, gpt2)
    manifest = read_manifest_json(out)
    assert manifest["totals"]["documents"] == len(rels)
    assert manifest["totals"]["parts"] == 1
    assert manifest["run"]["tokenize_batches"] == -(-len(rels) // BATCH_DOCS) < len(rels)


def test_job_state_stays_under_64_bytes_per_input_file_and_append_still_compares_content(tmp_path, gpt2):
    """The per-file digests live in a binary file per task (32 B a file), not in the JSON records; a copy of
    SOURCE with new mtimes is still recognized by content (nothing new), and a new file is appended."""
    from tests.benchmarks.bench_scale import state_bytes

    out, rels = pack(tmp_path, "state", 1000, gpt2)
    per_input = state_bytes(out) / len(rels)
    assert per_input <= 64, f"{per_input:.1f} B of job state per input file"
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "state-src", copy, copy_function=shutil.copyfile)  # `cp -r`: new mtimes
    for path in copy.rglob("*.txt"):
        os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    again = run_repack("text", copy, out, "--tokenizer", gpt2, "--doc-per", "file", "--append")
    assert "nothing new" in again.stdout
    (copy / "d3" / "late.txt").write_text("A late document.\n")
    run_repack("text", copy, out, "--tokenizer", gpt2, "--doc-per", "file", "--append", "--quiet")
    manifest = read_manifest_json(out)
    assert manifest["totals"]["documents"] == len(rels) + 1
    assert [run[0] for run in shard_runs(out, manifest["shards"][-1])] == ["d3/late.txt"]


def test_planning_opens_only_the_files_a_cut_falls_in(tmp_path, monkeypatch):
    """Cutting many small JSON-lines files into chunks opens a file only to snap a cut inside it to a line
    start (one per chunk), not every file of the corpus."""
    import repack.sources.text_docs as text_docs
    from repack.jobs.text_plan import plan_chunk_columns
    from repack.sources.confine import Confinement

    for i in range(300):
        (tmp_path / f"f{i:03d}.jsonl").write_text("".join(json.dumps({"text": f"doc {i} {j} " * 40}) + "\n"
                                                          for j in range(5)))
    inputs, quarantine, _ = text_docs.list_text_files(str(tmp_path), False, Confinement())
    opened = []
    real_open = text_docs.open_input
    monkeypatch.setattr(text_docs, "open_input", lambda path, *args, **kw: opened.append(path) or
                        real_open(path, *args, **kw))
    chunks, _, _ = plan_chunk_columns(inputs, 20_000, "line", "text")
    assert len(inputs) == 300 and not quarantine and len(chunks) > 10
    assert len(opened) < len(chunks), f"{len(opened)} files opened to cut {len(inputs)} files into {len(chunks)} chunks"
    firsts = chunks.rows[chunks.starts == 0]
    assert [inputs.table.rel(row) for row in firsts.tolist()] == inputs.table.rels  # every file, in order


def test_ids_as_arrays_follow_the_per_document_bos_eos_rule(gpt2):
    """``encode_arrays`` (ids, BOS and EOS placed with numpy) gives exactly what ``encode`` gives per document,
    with GPT-2's <|endoftext|> as EOS and as BOS (documents that are empty, or start or end with it)."""
    from repack.transforms.tokenize import BatchEncoder, load_tokenizer

    tokenizer, _ = load_tokenizer(gpt2)
    eot = tokenizer.token_to_id("<|endoftext|>")
    texts = ["", "Hello world.", "<|endoftext|>", "ends here<|endoftext|>", "<|endoftext|>starts", " ",
             *documents(20, seed=3)]
    for bos, eos in ((None, eot), (eot, eot), (eot, None), (None, None), (tokenizer.token_to_id("Hello"), eot)):
        encoder = BatchEncoder(tokenizer, special_tokens=True, bos_id=bos, eos_id=eos)
        flat, lengths, errors = encoder.encode_arrays(texts)
        expected = encoder.encode(texts)
        assert not errors and lengths.tolist() == [len(ids) for ids in expected]
        assert flat.tolist() == [i for ids in expected for i in ids]


def test_every_document_gets_one_eos_whatever_its_text_ends_with(gpt2):
    """A document whose own text ends with the EOS token (or starts with BOS) still gets repack's EOS (BOS), as
    Megatron's --append-eod gives it; only a template that adds them is not doubled."""
    from tokenizers import processors

    from repack.transforms.tokenize import BatchEncoder, load_tokenizer

    tokenizer, _ = load_tokenizer(gpt2)
    eot = tokenizer.token_to_id("<|endoftext|>")
    texts = ["ends here<|endoftext|>", "<|endoftext|>starts", "plain"]
    bare = [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
    encoder = BatchEncoder(tokenizer, special_tokens=True, bos_id=eot, eos_id=eot)
    assert encoder.encode(texts) == [[eot, *ids, eot] for ids in bare]
    from tokenizers import Tokenizer

    framed = Tokenizer.from_file(str(gpt2))  # load_tokenizer's is shared (cached): never changed here
    framed.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>",
                                                          special_tokens=[("<|endoftext|>", eot)])
    templated = BatchEncoder(framed, special_tokens=True, bos_id=None, eos_id=eot)
    assert templated.encode(texts) == [[*ids, eot] for ids in bare]
    flat, lengths, _ = templated.encode_arrays(texts)
    assert flat.tolist() == [i for ids in bare for i in [*ids, eot]] and lengths.tolist() == [len(b) + 1 for b in bare]


def test_a_text_the_tokenizer_makes_nothing_of_is_an_empty_document(tmp_path):
    """A normalizer that strips accents leaves no ids of a text of combining marks: no document of a lone EOS
    (Megatron's preprocess appends its EOD only to a document with ids), counted as an empty document."""
    from tokenizers import normalizers

    from tests.tools.text import train_bpe

    tokenizer = train_bpe(documents(40, seed=2), vocab_size=400)
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents()])
    write_tokenizer(tokenizer, tmp_path / "tok")
    texts = ["hello", "\u0301\u0301", "world"]
    assert tokenizer.encode(texts[1]).ids == []
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    run_repack("text", tmp_path / "src", tmp_path / "out", "--tokenizer", tmp_path / "tok", "--quiet")
    totals = read_manifest_json(tmp_path / "out")["totals"]
    assert (totals["documents"], totals["empty_documents"]) == (2, 1)
    eos = tokenizer.token_to_id("</s>")
    assert token_documents(tmp_path / "out") == [[*tokenizer.encode(t).ids, eos] for t in (texts[0], texts[2])]


def test_the_bpe_cache_repack_sets_gives_the_ids_of_a_plain_load(gpt2):
    """load_tokenizer sets a BPE model's word cache (``BPE_CACHE_WORDS``, memory per forked worker) and more
    distinct words than it holds, encoded twice, give the ids of a tokenizer as tokenizers loads it."""
    from tokenizers import Tokenizer

    from repack.transforms import tokenize

    capped, _ = tokenize.load_tokenizer(gpt2)
    plain = Tokenizer.from_file(str(gpt2))  # tokenizers' default cache
    texts = [" ".join(f"w{i}x{j}" for j in range(40)) for i in range(2 * tokenize.BPE_CACHE_WORDS // 40)]
    texts += documents(50, seed=5)
    for _ in range(2):  # the second pass reads what the first left in the caches
        assert [e.ids for e in capped.encode_batch(texts)] == [e.ids for e in plain.encode_batch(texts)]


def _planning_peak(src: Path, out: Path, tokenizer: Path) -> int:
    """tracemalloc's peak in this process while `repack text SRC --doc-per file` is planned, hashed and saved
    as the engine does (the tokenizer loaded before)."""
    import concurrent.futures.process  # noqa: F401 - the scan pool's modules: imported before the trace
    import gc
    import tracemalloc

    from repack.jobs.base import save_plan
    from repack.jobs.text import TextJob, TextSpec
    from repack.store import open_store

    job = TextJob(TextSpec(source=str(src), out=str(out), tokenizer=str(tokenizer), doc_per="file"))
    job.tokenizer_info()
    (out / ".repack").mkdir(parents=True)
    gc.collect()
    tracemalloc.start()
    try:
        plan = job.plan()
        assert plan.info["files"] > 0 and plan.digest
        save_plan(open_store(str(out)), plan)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_planning_memory_per_input_file_is_bounded(tmp_path, gpt2):
    """The text driver plans on columns, not an object per file: between 20,000 and 40,000 input files the
    traced peak of planning grows by under 300 bytes per file (the lists of TextFile, Segment, rel strs
    and fingerprint lists of the payload tables made it ~1,020 B before; ~180 now)."""
    src = tmp_path / "src"
    for k in range(20):
        (src / f"d{k:02d}").mkdir(parents=True)

    def add(start: int, count: int) -> None:
        for i in range(start, start + count):
            (src / f"d{i % 20:02d}" / f"f{i:06d}.txt").write_bytes(b"x %d\n" % i)

    add(0, 20_000)
    small = _planning_peak(src, tmp_path / "small", gpt2)
    add(20_000, 20_000)
    large = _planning_peak(src, tmp_path / "large", gpt2)
    assert (large - small) / 20_000 < 300, (small, large)


def test_the_folder_scan_on_a_pool_lists_in_byte_order_and_reads_each_file_once(tmp_path):
    """The scan walks each top-level folder on its own process: the listing is still in byte order of the full
    paths ("a-b/" before "a.txt" before "a/"), root files sit between the folders, hidden and non-text files
    are skipped, a folder symlink is walked after the real tree (a link to a folder scanned already is
    quarantined; a link to a hidden folder is read through its real path), a file symlink and a hard link are
    aliases read once, and one process lists exactly the same."""
    from repack.sources.confine import Confinement
    from repack.sources.text_docs import list_text_files
    from repack.sources.scan_pool import start_method
    from repack.sources.text_scan import PARALLEL_MIN_FOLDERS
    from tests.conftest import thread_alive

    src = tmp_path / "src"
    rels = ["a/x.txt", "a-b/y.txt", "a.txt", "b/c/d.jsonl", "b/c.d/e.txt", "caf\u00e9/f.txt", "z.txt",
            "e/f/g/h.txt", "d/k.txt"] + [f"m{k}/n.txt" for k in range(PARALLEL_MIN_FOLDERS)]
    for rel in rels + ["d/.hidden.txt", "d/skip.bin", ".hid/w.txt"]:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(f"text of {rel}\n", encoding="utf-8")
    (src / "link").symlink_to("a")
    (src / "vis").symlink_to(".hid")
    (src / "b" / "c" / "loop").symlink_to("..")
    (src / "y-link.txt").symlink_to("a-b/y.txt")
    os.link(src / "a.txt", src / "e" / "hard.txt")
    listings = [list_text_files(str(src), False, Confinement(), workers) for workers in (1, 4)]
    with thread_alive():  # as under --executor ray: the pool's workers come from a forkserver
        assert start_method(4, PARALLEL_MIN_FOLDERS, PARALLEL_MIN_FOLDERS) == "forkserver"
        listings.append(list_text_files(str(src), False, Confinement(), 4))
    (inputs, quarantine, skipped), (inputs4, quarantine4, skipped4), threaded = listings
    assert inputs.table.rels == inputs4.table.rels and quarantine == quarantine4 and skipped == skipped4 == 3
    assert threaded[0].table.rels == inputs.table.rels and threaded[1:] == (quarantine, skipped)
    assert inputs.table.rels == sorted(rels + ["vis/w.txt"], key=lambda rel: rel.encode())
    paths = {rel: inputs.table.path(row) for row, rel in enumerate(inputs.table.rels)}
    assert paths == {**{rel: str(src / rel) for rel in rels}, "vis/w.txt": str(src / ".hid" / "w.txt")}
    assert [inputs.kind(row) for row in range(len(inputs))] == [("jsonl", "") if rel.endswith(".jsonl") else
                                                                ("txt", "") for rel in inputs.table.rels]
    assert [(q["source"], q["reason"]) for q in quarantine] == [
        ("b/c/loop", "folder already scanned as b (symlink loop or second link): skipped"),
        ("link", "folder already scanned as a (symlink loop or second link): skipped"),
        ("e/hard.txt", "same file as a.txt (hard link or second path): read once, under a.txt"),
        ("y-link.txt", "same file as a-b/y.txt (symlink inside the source root): read once, under a-b/y.txt")]


@pytest.mark.parametrize("workers", [1, 4])
def test_the_folder_scan_without_links_lists_in_byte_order_and_skips_what_an_s3_listing_skips(tmp_path, workers):
    """Top-level folders "a", "a-b", "a.b" beside root files "a.txt", "a-c.txt": the same byte order of full
    paths as an s3:// listing of the same keys (a folder's name taken with its "/"), and the same names skipped
    (OS and NAS droppings by name as well as hidden ones, a skipped folder counted once; a name merely starting with
    "@" is a file), so the same files give the same tokens wherever they are read from."""
    from repack.sources.confine import Confinement
    from repack.sources.text_docs import list_text_files
    from repack.sources.text_scan import PARALLEL_MIN_FOLDERS

    src = tmp_path / "src"
    rels = ["a/x.txt", "a-b/x.txt", "a.b/x.txt", "b/x.txt", "a.txt", "a-c.txt"] + \
        [f"m{k}/n.txt" for k in range(PARALLEL_MIN_FOLDERS)] + ["x/@s.txt"]
    junk = ["#recycle/r.txt", "@eaDir/q.txt", "__MACOSX/y.txt", "lost+found/z.txt", ".git/c.txt", "b/Thumbs.db"]
    for rel in rels + junk:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(f"text of {rel}\n", encoding="utf-8")
    inputs, quarantine, skipped = list_text_files(str(src), False, Confinement(), workers)
    assert inputs.table.rels == sorted(rels, key=lambda rel: rel.encode()) and quarantine == [] and skipped == 6


def test_side_file_names_cut_with_a_byte_mask_match_the_names_of_the_chosen_segments():
    """``SegmentColumns._runs_bytes`` takes the names of any ascending set of segments (the first, the last,
    repeated file names of a file cut over parts, none) exactly as joining them one by one would."""
    import numpy as np

    from repack.jobs.text import SegmentColumns
    from repack.manifest.source_runs import decode_runs
    from repack.sources.columns import name_ends

    rels = ["a.txt", "b/\u00e9t\u00e9.txt", "b/\u00e9t\u00e9.txt", "c/d/e.txt", "f.txt", "g.txt", "g.txt"]
    names = b"".join(r.encode() + b"\0" for r in rels)
    zeros = np.zeros(len(rels), np.int64)
    columns = SegmentColumns(names, name_ends(names), zeros, zeros, zeros, np.array([0, 3, len(rels)]))
    rng = np.random.default_rng(7)
    choices = [[], [0], [len(rels) - 1], [0, 2, 3, 6], list(range(len(rels)))]
    choices += [sorted(rng.choice(len(rels), size=k, replace=False).tolist()) for k in (2, 3, 5) for _ in range(5)]
    for chosen in choices:
        segs = np.asarray(chosen, np.int64)
        data = columns._runs_bytes(segs, np.zeros(len(segs), np.int64), np.ones(len(segs), np.int64))
        assert [run[0] for run in decode_runs(data)] == [rels[s] for s in chosen]

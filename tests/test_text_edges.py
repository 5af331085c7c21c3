"""`repack text` at the edges of a document: a cut .zst, a BOM before a long first line, a document of
exactly --max-doc-bytes in each mode and line ending, and a file that gave no document planned again by
--append once fixed. Real GPT-2, the real CLI, the tokens read back with the spec reader."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import ROOT, read_manifest_json, run_repack
from tests.test_text import spec_read
from tests.tools.text import gpt2_tokenizer, write_tokenizer

EOS = 50256


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2")
    write_tokenizer(gpt2_tokenizer(), folder)
    from tokenizers import Tokenizer

    return folder, Tokenizer.from_file(str(folder / "tokenizer.json"))


def pack(gpt2, src: Path, out: Path, *extra: str) -> dict:
    """Tokenize ``src`` into ``out`` (exit 0 or 7); the manifest with its documents' ids (every prefix's)
    under "ids"."""
    done = run_repack("text", src, out, "--tokenizer", gpt2[0], "--quiet", *extra, check=False)
    assert done.returncode in (0, 7), done.stderr
    manifest = read_manifest_json(out)
    manifest["ids"] = [ids for prefix in manifest["prefixes"] for ids in spec_read(out / prefix)["docs"]]
    return manifest


def expected(gpt2, *texts: str) -> list[list[int]]:
    return [gpt2[1].encode(text).ids + [EOS] for text in texts]


def test_a_cut_zst_keeps_the_lines_before_the_cut_and_quarantines_the_rest_by_name(gpt2, tmp_path):
    """zstandard's stream reader ends a cut frame as if the file were whole: the lines read so far were
    all of it, the last one cut mid-line, and nothing was quarantined. It reads as a cut .gz does now."""
    zstandard = pytest.importorskip("zstandard")
    lines = [f"line {i} of a file cut in two, {i * 7919 % 10007} padding" for i in range(20000)]  # blocks of 128 KB
    whole = zstandard.ZstdCompressor().compress("".join(line + "\n" for line in lines).encode())
    src = tmp_path / "src"
    src.mkdir()
    (src / "cut.txt.zst").write_bytes(whole[:len(whole) // 2])
    (src / "whole.txt.zst").write_bytes(whole + zstandard.ZstdCompressor().compress(b"a second frame\n"))
    manifest = pack(gpt2, src, tmp_path / "out", "--workers", "1")
    (record,) = manifest["quarantine"]
    kept = record["line"] - 1
    assert record["source"] == "cut.txt.zst" and "cut short" in record["reason"] and 0 < kept < len(lines)
    assert manifest["ids"] == expected(gpt2, *lines[:kept], *lines, "a second frame")


def test_a_bom_before_a_first_line_near_the_cap_leaves_the_line_whole(gpt2, tmp_path):
    """The BOM was stripped after the line was read to the cap, so a line cut by the cap no longer looked
    too long: it became several documents. A first line over the cap is one quarantined document."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"\xef\xbb\xbf" + b"a" * 99 + b"\nsecond line\n")
    (src / "b.txt").write_bytes(b"\xef\xbb\xbf" + b"b" * 101 + b"\nthird line\n")
    manifest = pack(gpt2, src, tmp_path / "out", "--max-doc-bytes", "100", "--doc-per", "line")
    assert manifest["ids"] == expected(gpt2, "a" * 99, "second line", "third line")
    assert [(q["source"], q["line"]) for q in manifest["quarantine"]] == [("b.txt", 1)]
    assert "longer than the 100-byte cap" in manifest["quarantine"][0]["reason"]


@pytest.mark.parametrize("doc_per,body", [
    ("line", b"%s\n"), ("line", b"%s\r\n"), ("line", b"%s"), ("blank-line", b"%s\n\nnext\n"),
    ("blank-line", b"%s"), ("file", b"\xef\xbb\xbf%s"), ("file", b"%s")])
def test_a_document_of_exactly_the_cap_is_kept_in_every_mode_and_one_byte_more_is_not(gpt2, tmp_path, doc_per, body):
    """--max-doc-bytes counts a document's text: not its LF or CRLF, not the newline after a paragraph,
    not a file's BOM (each was counted in one mode or another: the same document kept or quarantined)."""
    for size, kept in ((100, True), (101, False)):
        text = ("x" * (size - 5)) + " tail"
        src = tmp_path / f"src{size}"
        src.mkdir()
        (src / "d.txt").write_bytes(body % text.encode())
        manifest = pack(gpt2, src, tmp_path / f"out{size}", "--max-doc-bytes", "100", "--doc-per", doc_per)
        assert (expected(gpt2, text)[0] in manifest["ids"]) == kept, (size, manifest["quarantine"])
        assert bool(manifest["quarantine"]) != kept


def test_a_file_that_gave_no_document_is_planned_again_by_append_once_fixed(gpt2, tmp_path):
    """A UTF-16 file (quarantined whole with its line 1) and a file whose every line was quarantined have
    no document in the dataset: their records say so (no_documents), and --append packs them once they
    are fixed, dropping their old records. A file with a document and a bad line stays a packed file."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    (src / "good.txt").write_text("good one\ngood two\n")
    (src / "utf16.txt").write_bytes("first\nsecond\n".encode("utf-16"))
    (src / "bad.txt").write_bytes(b"\xff\xfe broken\n\xc3\x28 also broken\n")
    (src / "mixed.txt").write_bytes(b"fine\n\xc3\x28 broken\n")
    manifest = pack(gpt2, src, out, "--doc-per", "line")
    marked = {q["source"]: q.get("no_documents", False) for q in manifest["quarantine"]}
    assert marked == {"utf16.txt": True, "bad.txt": True, "mixed.txt": False}
    (src / "utf16.txt").write_text("first\nsecond\n")
    (src / "bad.txt").write_text("mended\n")
    appended = run_repack("text", src, out, "--tokenizer", gpt2[0], "--doc-per", "line", "--append", "--quiet")
    assert "3 new sample(s)" in appended.stdout
    manifest = pack(gpt2, src, out, "--doc-per", "line", "--append")  # nothing new now: the same version
    assert [q["source"] for q in manifest["quarantine"]] == ["mixed.txt"]
    assert sorted(map(tuple, manifest["ids"])) == sorted(map(tuple, expected(
        gpt2, "good one", "good two", "fine", "first", "second", "mended")))


COUNTED = ("inputs", "files", "input_bytes", "documents", "quarantined")


def test_a_file_of_blank_lines_is_packed_by_append_once_it_has_text_and_counted_once(gpt2, tmp_path):
    """A file of blank lines gives no document and no quarantine record: once it holds text, --append packs it
    (it was refused as a changed file with a sample). That version, and one where a quarantined file was fixed,
    count each file once, as a fresh pack of the same files does; a later change to the packed file is refused."""
    import os

    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    (src / "a.txt").write_text("alpha one\nalpha two\n")
    (src / "blank.txt").write_text("\n\n\n")
    (src / "utf16.txt").write_bytes("first\nsecond\n".encode("utf-16"))
    pack(gpt2, src, out, "--doc-per", "line")
    (src / "blank.txt").write_text("now some text\n")
    (src / "utf16.txt").write_text("first\n")
    appended = run_repack("text", src, out, "--tokenizer", gpt2[0], "--doc-per", "line", "--append", "--quiet")
    assert "2 new sample(s)" in appended.stdout, appended.stdout
    manifest = pack(gpt2, src, out, "--doc-per", "line", "--append")  # nothing new now: the same version
    assert manifest["dataset_version"]["number"] == 2
    assert sorted(map(tuple, manifest["ids"])) == sorted(map(tuple, expected(
        gpt2, "alpha one", "alpha two", "now some text", "first")))
    fresh = pack(gpt2, src, tmp_path / "fresh", "--doc-per", "line")
    assert {k: manifest["totals"][k] for k in COUNTED} == {k: fresh["totals"][k] for k in COUNTED}
    (src / "blank.txt").write_text("other text\n")
    os.utime(src / "blank.txt", ns=(1, 1))
    refused = run_repack("text", src, out, "--tokenizer", gpt2[0], "--doc-per", "line", "--append", check=False)
    assert refused.returncode == 2 and "changed since the dataset packed them" in refused.stderr
    assert "blank.txt" in refused.stderr
    # a file whose every document `remove --keys` took out is named by no source run either: never packed again
    (src / "blank.txt").write_text("now some text\n")
    os.utime(src / "blank.txt", ns=(1, 1))
    (tmp_path / "keys.txt").write_text("a.txt#0\na.txt#1\n")
    run_repack("remove", out, "--keys", tmp_path / "keys.txt", "--quiet")
    with open(src / "a.txt", "a") as grown:
        grown.write("alpha three\n")
    refused = run_repack("text", src, out, "--tokenizer", gpt2[0], "--doc-per", "line", "--append", check=False)
    assert refused.returncode == 2 and "a.txt" in refused.stderr


def test_a_zst_cut_anywhere_raises_and_a_whole_one_reads_back():
    """ZstdFrames follows the frame layout (skippable frames, checksums, RLE and raw blocks, frames without a
    content size): every cut inside a frame is an EOFError, a cut between frames is a whole shorter file."""
    import io
    import os

    import zstandard

    from repack.sources.text_docs import ZstdFrames

    compress = zstandard.ZstdCompressor
    streamed = compress().compressobj()
    noise = os.urandom(200_000)
    contents = [b"a" * 300_000, b"", noise, b"line\n" * 50_000]
    frames = [compress(write_checksum=True).compress(contents[0]),  # RLE blocks
              b"\x50\x2a\x4d\x18" + (5).to_bytes(4, "little") + b"skip!",
              compress().compress(noise),  # raw blocks
              streamed.compress(contents[3]) + streamed.flush()]  # no content size
    data = b"".join(frames)
    ends = {sum(map(len, frames[:k])): b"".join(contents[:k]) for k in range(len(frames) + 1)}
    for at in sorted(set(range(0, len(data), 997)) | set(ends) | {len(data) - 1, len(data) - 4}):
        reader = io.BufferedReader(ZstdFrames(io.BytesIO(data[:at]), zstandard), 1 << 16)
        if at in ends:
            assert reader.read() == ends[at]
        else:
            with pytest.raises(EOFError):
                reader.read()


def test_a_zst_of_very_repetitive_text_is_read_in_bounded_memory(tmp_path):
    """400 MB of text in a 0.2 MB .zst: read line by line, the process grows by a few MB (zstandard's stream
    reader), not by what a compressed slice expands to (hundreds of MB at once before)."""
    import subprocess
    import sys

    import zstandard

    path = tmp_path / "same.zst"
    path.write_bytes(zstandard.ZstdCompressor(level=3).compress(b"the same line again\n" * 20_000_000))
    code = ("import io, re, zstandard\nfrom repack.sources.text_docs import ZstdFrames\n"
            "peak = lambda: int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
            "open('/proc/self/clear_refs', 'w').write('5')\n"  # the peak so far (a forked parent's) reset
            "before = peak()\n"
            f"lines = sum(1 for _ in io.BufferedReader(ZstdFrames(open({str(path)!r}, 'rb'), zstandard), 1 << 20))\n"
            "print(lines, peak() - before)")
    lines, grown_kb = map(int, subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                              check=True).stdout.split())
    assert lines == 20_000_000
    assert grown_kb < 64 * 1024, f"grew by {grown_kb} KB"


def test_a_text_input_under_a_compression_repack_does_not_read_is_quarantined_by_name(gpt2, tmp_path):
    """A .jsonl.xz or .txt.bz2 was skipped like a README (3 files, 0 quarantined); it is named now, and the
    files skipped are counted in the summary."""
    import bz2
    import lzma

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text('{"text": "kept"}\n')
    (src / "b.jsonl.xz").write_bytes(lzma.compress(b'{"text": "in xz"}\n'))
    (src / "c.txt.bz2").write_bytes(bz2.compress(b"in bz2\n"))
    (src / "d.parquet.gz").write_bytes(b"not read")
    (src / "README.md").write_text("a corpus")
    (src / "a.jsonl.sha256").write_text("0" * 64)  # a side file, no input: skipped as the README is
    manifest = pack(gpt2, src, tmp_path / "out")
    assert manifest["ids"] == expected(gpt2, "kept")
    reasons = {q["source"]: q["reason"] for q in manifest["quarantine"]}
    assert reasons["b.jsonl.xz"].startswith("a .jsonl file under .xz: repack reads .jsonl as it is or compressed")
    assert reasons["c.txt.bz2"].startswith("a .txt file under .bz2") and set(reasons) == {"b.jsonl.xz", "c.txt.bz2",
                                                                                        "d.parquet.gz"}
    assert manifest["totals"]["skipped_files"] == 2  # README.md, a.jsonl.sha256
    said = run_repack("text", src, tmp_path / "again", "--tokenizer", gpt2[0])
    assert "2 other file(s) of SOURCE not read" in said.stdout and "3 quarantined" in said.stdout


def test_one_verdict_per_file_whatever_the_chunking(gpt2, tmp_path):
    """A piece of a file was judged binary by its own first 64 KiB: one NUL there lost the whole piece, so the
    same file gave other datasets under other --chunk-bytes. A file's first bytes judge every piece of it, and
    a stray NUL, wherever it is, costs its line."""
    lines = [f"line {i} of a long text file" for i in range(12_000)]
    late = list(lines)
    late[9_000] = "a NUL \0 far into the file"
    (tmp_path / "late").mkdir()
    (tmp_path / "late" / "a.txt").write_text("\n".join(late) + "\n")
    early = list(lines)
    early[10] = "a NUL \0 near the start"
    (tmp_path / "early").mkdir()
    (tmp_path / "early" / "a.txt").write_text("\n".join(early) + "\n")
    for chunk in ("100000", "150000", "1000000"):
        kept = pack(gpt2, tmp_path / "late", tmp_path / f"late-{chunk}", "--chunk-bytes", chunk)
        assert kept["totals"]["documents"] == 11_999 and [q["line"] for q in kept["quarantine"]] == [9_001], chunk
        kept = pack(gpt2, tmp_path / "early", tmp_path / f"early-{chunk}", "--chunk-bytes", chunk)
        assert kept["totals"]["documents"] == 11_999 and [q["line"] for q in kept["quarantine"]] == [11], chunk
    (tmp_path / "utf16").mkdir()
    (tmp_path / "utf16" / "a.txt").write_bytes("\n".join(lines).encode("utf-16-le"))  # a whole-file verdict
    for chunk in ("100000", "1000000"):
        lost = pack(gpt2, tmp_path / "utf16", tmp_path / f"utf16-{chunk}", "--chunk-bytes", chunk)
        assert lost["totals"]["documents"] == 0 and all("UTF-16" in q["reason"] for q in lost["quarantine"]), chunk


def test_a_damaged_stretch_inside_a_file_keeps_every_text_line_the_same_way_under_any_chunking(gpt2, tmp_path):
    """Random bytes between two runs of text: consecutive damaged lines are one record (they were a record apiece:
    30,000 for 8 MB), short fragments holding control characters are not packed, and what is packed is the same
    whatever --chunk-bytes."""
    import random

    text = "".join(f"line {i} of some ordinary text\n" for i in range(6_000)).encode()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_bytes(text + random.Random(0).randbytes(300_000) + text)
    packed = []
    for chunk in ("100000", "1000000"):
        manifest = pack(gpt2, tmp_path / "src", tmp_path / f"out-{chunk}", "--chunk-bytes", chunk)
        assert len(manifest["quarantine"]) < 100 and any("(a damaged stretch)" in q["reason"]
                                                          for q in manifest["quarantine"])
        kept = [gpt2[1].decode(ids[:-1]) for ids in manifest["ids"]]
        lines = {f"line {i} of some ordinary text" for i in range(6_000)}
        assert lines <= set(kept) and not any(c < " " and c not in "\t\f\v\x1b" for doc in kept for c in doc)
        packed.append(kept)
    assert packed[0] == packed[1]


def test_a_parquet_quarantined_while_planning_is_one_input_and_no_file_read_until_fixed(gpt2, tmp_path):
    """A parquet file repack cannot open is quarantined while planning: one input, not a file read (it counted
    twice in ``inputs`` and once in ``files``); fixed, --append packs it and each file counts once, as in a
    fresh pack."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    (src / "a.txt").write_text("alpha one\nalpha two\n")
    (src / "b.parquet").write_bytes(b"not a parquet file")
    manifest = pack(gpt2, src, out, "--doc-per", "line")
    assert [q["source"] for q in manifest["quarantine"]] == ["b.parquet"]
    assert {k: manifest["totals"][k] for k in ("inputs", "files", "input_bytes")} == \
        {"inputs": 2, "files": 1, "input_bytes": (src / "a.txt").stat().st_size}
    pq.write_table(pa.table({"text": ["beta one", "beta two"]}), src / "b.parquet")
    run_repack("text", src, out, "--tokenizer", gpt2[0], "--doc-per", "line", "--append", "--quiet")
    manifest = read_manifest_json(out)
    fresh = pack(gpt2, src, tmp_path / "fresh", "--doc-per", "line")
    assert manifest["quarantine"] == [] and manifest["totals"]["documents"] == 4
    assert {k: manifest["totals"][k] for k in COUNTED} == {k: fresh["totals"][k] for k in COUNTED}


def test_a_short_whole_file_fragment_is_quarantined_on_every_path(gpt2, tmp_path):
    """--doc-per file: a small plain .txt took a fast path that checked only for NUL, so a 13-character document
    holding a control character was packed from a.txt and quarantined from the same bytes gzipped."""
    import gzip

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"short text\x01ok")
    (src / "b.txt.gz").write_bytes(gzip.compress(b"short text\x01ok"))
    (src / "c.txt").write_bytes(b"a fine document\n")
    manifest = pack(gpt2, src, tmp_path / "out", "--doc-per", "file")
    reasons = {q["source"]: q["reason"] for q in manifest["quarantine"]}
    assert set(reasons) == {"a.txt", "b.txt.gz"} and reasons["a.txt"] == reasons["b.txt.gz"]
    assert manifest["ids"] == expected(gpt2, "a fine document\n")


def test_a_line_of_unicode_whitespace_separates_paragraphs_under_any_chunking(gpt2, tmp_path):
    """--doc-per blank-line: a line of only a no-break or an ideographic space is blank, as a document of only
    those is empty (it joined the paragraphs around it); the same documents however the file is cut."""
    src = tmp_path / "src"
    src.mkdir()
    body = "first para\n\u00a0\nsecond para\n\n\u3000\n\nthird para\n\n"
    (src / "p.txt").write_text(body * 40)
    want = expected(gpt2, *["first para", "second para", "third para"] * 40)
    for chunk in ("auto", "64B"):
        extra = () if chunk == "auto" else ("--chunk-bytes", chunk)
        manifest = pack(gpt2, src, tmp_path / f"out-{chunk}", "--doc-per", "blank-line", *extra)
        assert manifest["ids"] == want, chunk


def test_a_blank_line_longer_than_the_document_cap_still_separates_paragraphs(gpt2, tmp_path):
    """--doc-per blank-line, a whitespace-only line over --max-doc-bytes: the reader took it for an over-long text
    line (the paragraphs around it joined, a short one lost in a "longer than the cap" record) while the planner cut
    chunks after it as a blank line, so the documents depended on --chunk-bytes. It separates them under any
    chunking now, ASCII or Unicode spaces, across the reader's 64 KiB reads too."""
    from repack.sources.text_docs import SNAP_READ

    src = tmp_path / "src"
    src.mkdir()
    long_blank = " " * 150 + "\n"
    wide_blank = " " + "\u3000" * (SNAP_READ // 3 + 7) + "\n"  # 3-byte spaces over several reads, cut mid-character
    (src / "p.txt").write_text("first paragraph here\n" + long_blank + "second paragraph here\n" + wide_blank +
                               "third paragraph here\n\nfourth\n")
    want = expected(gpt2, "first paragraph here", "second paragraph here", "third paragraph here", "fourth")
    for chunk in ("auto", "10B"):
        extra = () if chunk == "auto" else ("--chunk-bytes", chunk)
        manifest = pack(gpt2, src, tmp_path / f"out-{chunk}", "--doc-per", "blank-line", "--max-doc-bytes", "100",
                        *extra)
        assert manifest["ids"] == want and manifest["quarantine"] == [], chunk


def test_a_damaged_stretch_names_every_kind_of_damage_it_holds():
    """Bad UTF-8 then a line holding a NUL: one record, which no longer says the second is bad UTF-8 too."""
    from repack.sources.text_docs import Doc, _one_record

    run = [Doc(9, reason="undecodable UTF-8 at byte 14 of the line"), Doc(10, reason="binary data, not text (NUL)")]
    record, = _one_record(run)
    assert record.line == 9 and record.reason.startswith("undecodable UTF-8 at byte 14")
    assert "the 1 document(s) after it are damaged too (binary data, not text)" in record.reason


def test_no_document_gives_no_prefix_in_a_pack_or_an_append(gpt2, tmp_path):
    """A merged job that gave no document (every input quarantined; an --append whose new file holds only a bad
    and an empty line) wrote a 0-document prefix and published it in prefixes/data_path: Megatron maps every
    prefix's .bin, and an empty file cannot be mapped. Such a job names no prefix now (as with --no-merge)."""
    import numpy as np

    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    (src / "a.jsonl").write_text('{"text": "hello world one"}\n{"text": "hello world two"}\n')
    pack(gpt2, src, out)
    (src / "b.jsonl").write_text('{"text": ""}\nnot json\n')
    appended = run_repack("text", src, out, "--tokenizer", gpt2[0], "--append", "--quiet")
    assert "0 new samples" in appended.stdout
    manifest = read_manifest_json(out)
    assert manifest["dataset_version"]["number"] == 2 and len(manifest["prefixes"]) == 1
    for prefix in manifest["prefixes"]:
        assert len(np.memmap(out / f"{prefix}.bin", dtype=np.uint16, mode="r"))  # as Megatron maps it
    assert len(manifest["data_path"].split()) == 2
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.txt").write_bytes("first\n".encode("utf-16"))
    empty = pack(gpt2, bad, tmp_path / "empty")  # exit 7: nothing packed
    assert empty["prefixes"] == [] and not list((tmp_path / "empty").glob("*.bin"))
    assert run_repack("verify", out).returncode == 0


def test_a_list_row_ends_at_a_newline_only(gpt2, tmp_path):
    """`repack text --list` split its rows with str.splitlines(): a file name holding U+2028, U+0085 or a form feed
    became two names (both quarantined as missing, or another file packed in its place), and the real file was never
    named. Rows end at "\\n" now (a "\\r" before it dropped)."""
    src = tmp_path / "src"
    src.mkdir()
    names = ["Chapter 1\u2028Intro.txt", "page\u0085break.txt", "a\x0cb.txt", "plain.txt"]
    for n, name in enumerate(names):
        (src / name).write_text(f"document number {n}\n")
    (src / "Intro.txt").write_text("not listed\n")
    listing = src / "list.txt"
    listing.write_bytes("\r\n".join(names).encode() + b"\r\n")
    manifest = pack(gpt2, listing, tmp_path / "out", "--list")
    assert manifest["quarantine"] == []
    assert sorted(map(tuple, manifest["ids"])) == sorted(map(tuple, expected(
        gpt2, *(f"document number {n}" for n in range(4)))))


def test_overwrite_after_a_kill_in_the_finish_step_leaves_none_of_its_files(gpt2, tmp_path):
    """A text job killed after its merged prefix and tokenizer copy were written, before its manifest: --overwrite
    with other options (or another command) left them in OUT, a dataset `repack verify` then refused (files the
    manifest does not name). --overwrite deletes what the replaced job writes under fixed names."""
    from tests.test_images_job import write_jpegs

    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    (src / "a.txt").write_text("one line\nanother line\n")
    run_repack("text", src, out, "--tokenizer", gpt2[0], "--quiet")
    (out / "manifest.json").unlink()  # as a kill -9 between the finish step's files and the manifest leaves it
    run_repack("text", src, out, "--tokenizer", gpt2[0], "--no-merge", "--overwrite", "--quiet")
    assert run_repack("verify", out).returncode == 0 and not (out / "text_document.bin").exists()
    (out / "manifest.json").unlink()
    images = write_jpegs(tmp_path / "imgs" / "c", 2).parent
    run_repack("images", images, out, "--overwrite", "--quiet")
    assert run_repack("verify", out).returncode == 0 and not (out / "tokenizer.json").exists()


def test_overwrite_keeps_the_files_it_reads_and_a_folder_repack_never_wrote(gpt2, tmp_path):
    """--overwrite deletes the fixed names a job writes only where OUT holds repack's work, and never a file the job
    reads: a user's OUT holding the tokenizer passed as --tokenizer OUT/tokenizer.json (and a probe.jsonl of theirs)
    lost both, and the job then failed on the missing tokenizer."""
    import shutil

    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    (src / "a.txt").write_text("hello world\n")
    shutil.copy(gpt2[0] / "tokenizer.json", out / "tokenizer.json")
    (out / "probe.jsonl").write_text("my notes\n")
    run_repack("text", src, out, "--tokenizer", out / "tokenizer.json", "--overwrite", "--quiet")
    assert (out / "probe.jsonl").read_text() == "my notes\n"
    run_repack("text", src, out, "--tokenizer", out / "tokenizer.json", "--no-merge", "--overwrite", "--quiet")
    assert (out / "tokenizer.json").exists() and read_manifest_json(out)["totals"]["documents"] == 1

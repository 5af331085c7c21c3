"""Binary and UTF-16 input to `repack text` is quarantined with a reason, never packed as documents
of unknown tokens: random bytes, UTF-16 with and without a byte-order mark (plain and gzipped),
a JSON document holding U+0000; a UTF-8 file with one bad line keeps its other lines."""

from __future__ import annotations

import gzip
import json
import random

from repack.sources.text_sniff import binary_reason
from tests.conftest import read_manifest_json, run_repack
from tests.tools.text import gpt2_tokenizer, write_tokenizer

TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(200))


def test_binary_and_utf16_files_are_quarantined(tmp_path):
    tok = write_tokenizer(gpt2_tokenizer(), tmp_path / "tok").parent
    src = tmp_path / "src"
    src.mkdir()
    (src / "good.txt").write_text(TEXT)
    (src / "random.txt").write_bytes(random.Random(8).randbytes(200_000))
    (src / "utf16_bom.txt").write_bytes(TEXT.encode("utf-16"))
    (src / "utf16_nobom.txt").write_bytes(TEXT.encode("utf-16-le"))
    (src / "utf16.jsonl.gz").write_bytes(gzip.compress(json.dumps({"text": "hello"}).encode("utf-16"), mtime=0))
    (src / "nul.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": "a\u0000b"}) + "\n")
    (src / "latin1.txt").write_bytes("caf\u00e9 ok\n".encode() + "caf\u00e9 bad\n".encode("latin-1") + b"last\n")
    out = tmp_path / "out"
    run_repack("text", src, out, "--tokenizer", tok, "--quiet", "--chunk-bytes", "1MB")
    m = read_manifest_json(out)
    reasons = {}
    for q in m["quarantine"]:
        reasons.setdefault(q["source"], []).append((q.get("line"), q["reason"]))
    assert set(reasons) == {"random.txt", "utf16_bom.txt", "utf16_nobom.txt", "utf16.jsonl.gz", "nul.jsonl",
                            "latin1.txt"}
    [(line, why)] = reasons["random.txt"]
    assert line == 1 and why.startswith("binary data") and "whole segment" in why
    assert "UTF-16 text (byte-order mark FF FE)" in reasons["utf16_bom.txt"][0][1]
    assert "UTF-16 text (no byte-order mark" in reasons["utf16_nobom.txt"][0][1] and "iconv" in reasons["utf16_nobom.txt"][0][1]
    assert "UTF-16" in reasons["utf16.jsonl.gz"][0][1]
    assert reasons["nul.jsonl"] == [(2, "binary data, not text: the document holds NUL (U+0000) characters")]
    assert [line for line, _ in reasons["latin1.txt"]] == [2]  # per line, as before: under the 10 % rule
    assert m["totals"]["documents"] == 200 + 1 + 2  # good.txt, nul.jsonl's first, latin1's two good lines


def test_sniff_rule():
    assert binary_reason(TEXT.encode()) is None
    assert binary_reason("d\u00e9j\u00e0 vu \u4e2d\u6587\n".encode() * 100) is None
    assert binary_reason(b"") is None
    assert binary_reason(random.Random(1).randbytes(4000)).startswith("binary data")
    assert binary_reason(bytes(range(128, 256)) * 4).startswith("binary data, not UTF-8")


def test_plain_text_agrees_with_binary_reason():
    """``plain_text`` (the whole-small-file fast path) accepts exactly what ``binary_reason`` accepts among
    NUL- and ESC-free UTF-8, decodes it, and defers (None) on everything else: control-heavy text around the
    10 % line (ASCII and not), U+FFFD, a UTF-8 BOM, invalid UTF-8, UTF-16, NUL, ANSI escapes, empty."""
    from repack.sources.text_sniff import SNIFF_BYTES, plain_text

    rng = random.Random(26)
    alphabet = ["a", "b", " ", "\n", "\t", "\x01", "\x07", "\x1f", "\u00e9", "\u2014", "\ufffd", "\U0001f600"]
    cases = [b"", b"\xef\xbb\xbf", "\ufeffhello\n".encode(), b"caf\xe9\n", TEXT.encode("utf-16"), b"a\x00b",
             b"\x1b[31mred\x1b[0m\n", b"x" * SNIFF_BYTES + b"\n", ("\x01" + "a" * 9).encode(),
             ("\x01" + "a" * 8).encode(), ("\ufffd" + "a" * 9).encode(), ("\ufffd" + "a" * 8).encode()]
    for _ in range(3000):
        size = rng.randint(1, 60)
        weights = [rng.random() ** 3 for _ in alphabet]
        cases.append("".join(rng.choices(alphabet, weights, k=size)).encode())
    accepted = 0
    for data in cases:
        text = plain_text(data)
        try:
            valid = data.decode("utf-8")
        except UnicodeDecodeError:
            valid = None
        if valid is None or "\x00" in valid or "\x1b" in valid or len(data) > SNIFF_BYTES:
            assert text is None, data
            continue
        assert (text is not None) == (binary_reason(data) is None), data
        if text is not None:
            assert text == valid
            accepted += 1
    assert 100 < accepted < len(cases) - 100  # both sides of the rule were exercised

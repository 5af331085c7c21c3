"""Datasets with three versions, written by the real `repack` CLI: v1, an append (v2), a remove (v3)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_repack
from tests.test_images_job import write_jpegs


def versioned_images(base: Path) -> Path:
    """v1: 300 images (3 classes, shards of 40); v2: 40 appended (340); v3: 40 of v1 removed (300)."""
    src, out = base / "img-src", base / "images"
    for c in range(3):
        write_jpegs(src / f"c{c}", 100, f"c{c}_")
    run_repack("images", src, out, "--shard-size", "40", "--quiet")
    write_jpegs(src / "c3", 40, "new")
    run_repack("images", src, out, "--shard-size", "40", "--append", "--quiet")
    gone = base / "img-gone.txt"
    gone.write_text("".join(f"c1/c1_{i}.jpg\n" for i in range(40)))
    run_repack("remove", out, "--sources", gone, "--quiet")
    return out


def versioned_tokens(base: Path) -> Path:
    """v1: 120 documents (a.jsonl); v2: 20 appended (b.jsonl); v3: 20 of a.jsonl removed (120)."""
    from tests.tools.text import documents, gpt2_tokenizer, write_tokenizer

    corpus, tok, out = base / "corpus", base / "tok", base / "tokens"
    corpus.mkdir()
    write_tokenizer(gpt2_tokenizer(), tok)
    docs = documents(140, seed=5)
    (corpus / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:120]))
    run_repack("text", corpus, out, "--tokenizer", tok, "--quiet")
    (corpus / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[120:]))
    run_repack("text", corpus, out, "--tokenizer", tok, "--append", "--quiet")
    keys = base / "tok-gone.txt"
    keys.write_text("".join(f"a.jsonl#{i}\n" for i in range(0, 40, 2)))
    run_repack("remove", out, "--keys", keys, "--quiet")
    return out

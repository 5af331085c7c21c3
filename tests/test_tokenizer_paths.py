"""--tokenizer takes a tokenizer.json, a model folder, or a local HuggingFace cache folder
(models--org--name with refs/main and snapshots/<rev>/tokenizer.json as blob symlinks); never
downloads."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from tests.conftest import read_manifest_json, run_repack
from tests.tools.text import documents, train_bpe


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe(documents(80, seed=4)).save(str(path))
    return path.read_bytes()


def hf_cache(root: Path, data: bytes, revisions: list[str], main: str | None) -> Path:
    """The layout huggingface_hub writes: blobs/<sha256>, snapshots/<rev>/tokenizer.json -> blob, refs/main."""
    model = root / "hub" / "models--acme--tiny"
    blob = model / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True)
    blob.write_bytes(data)
    for rev in revisions:
        snap = model / "snapshots" / rev
        snap.mkdir(parents=True)
        os.symlink(os.path.relpath(blob, snap), snap / "tokenizer.json")
        (snap / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    if main:
        (model / "refs").mkdir()
        (model / "refs" / "main").write_text(main)
    return model


def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(30, seed=5)))
    return path


def test_hf_cache_folder_uses_refs_main(tokenizer_json, tmp_path):
    model = hf_cache(tmp_path, tokenizer_json, ["a" * 40, "b" * 40], main="b" * 40)
    run_repack("text", corpus(tmp_path), tmp_path / "out", "--tokenizer", model, "--quiet")
    manifest = read_manifest_json(tmp_path / "out")
    assert manifest["tokenizer"]["sha256"] == hashlib.sha256(tokenizer_json).hexdigest()
    assert manifest["tokenizer"]["eos_token"] == "</s>"
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == tokenizer_json


def test_hf_cache_folder_with_one_snapshot_and_model_folder(tokenizer_json, tmp_path):
    model = hf_cache(tmp_path, tokenizer_json, ["c" * 40], main=None)
    run_repack("text", corpus(tmp_path), tmp_path / "out", "--tokenizer", model, "--quiet")
    run_repack("text", corpus(tmp_path), tmp_path / "out2", "--tokenizer", model / "snapshots" / ("c" * 40), "--quiet")
    assert (tmp_path / "out" / "text_document.bin").read_bytes() == (tmp_path / "out2" / "text_document.bin").read_bytes()


def test_ambiguous_or_empty_cache_folder_is_a_clear_error(tokenizer_json, tmp_path):
    model = hf_cache(tmp_path, tokenizer_json, ["d" * 40, "e" * 40], main=None)
    proc = run_repack("text", corpus(tmp_path), tmp_path / "out", "--tokenizer", model, check=False)
    assert proc.returncode == 2 and "2 snapshots and no refs/main" in proc.stderr and "d" * 40 in proc.stderr
    empty = tmp_path / "models--x--y"
    (empty / "snapshots" / "f").mkdir(parents=True)
    proc = run_repack("text", corpus(tmp_path), tmp_path / "out", "--tokenizer", empty, check=False)
    assert proc.returncode == 2 and "no snapshot" in proc.stderr and "nothing is downloaded" in proc.stderr

"""`repack verify` holds what the manifest declares beside its files against the shards (review, stop 51): each
edit below changed what a reader or Megatron trains on while every file still matched its sha256, and verify
said OK."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.conftest import run_repack
from tests.test_images_job import write_jpegs
from tests.tools.text import gpt2_tokenizer, write_tokenizer


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("declared")
    for name in ("cat", "dog", "fox"):
        write_jpegs(base / f"src/{name}", 3, stem=name)
    run_repack("images", base / "src", base / "wds", "--quiet")
    run_repack("images", base / "src", base / "lmdb", "--to", "lmdb", "--quiet")
    rng = random.Random(0)
    (base / "corpus").mkdir()
    for i in range(3):
        (base / f"corpus/f{i}.txt").write_text("".join(" ".join(rng.choice("ab cd ef gh".split()) for _ in range(20))
                                                       + f" {i}-{j}\n" for j in range(6000)))
    write_tokenizer(gpt2_tokenizer(), base / "tok")
    run_repack("text", base / "corpus", base / "text", "--tokenizer", base / "tok", "--no-merge", "--chunk-bytes",
               "0.5MB", "--quiet")
    return {"wds": base / "wds", "lmdb": base / "lmdb", "text": base / "text"}


def verify_after(root, tmp_path, edit) -> str:
    """`repack verify` of a copy of ``root`` whose manifest ``edit`` changed: its exit and output."""
    import shutil
    import tempfile

    copy = Path(tempfile.mkdtemp(dir=tmp_path)) / root.name
    shutil.copytree(root, copy)
    assert run_repack("verify", copy, check=False).returncode == 0
    data = json.loads((copy / "manifest.json").read_text())
    edit(data)
    (copy / "manifest.json").write_text(json.dumps(data))
    proc = run_repack("verify", copy, check=False)
    assert proc.returncode == 5, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def swap_cat_dog(data: dict) -> None:
    data["classes"]["cat"], data["classes"]["dog"] = data["classes"]["dog"], data["classes"]["cat"]
    data["classes"] = dict(sorted(data["classes"].items(), key=lambda kv: kv[1]))


def test_a_swapped_class_map_is_found(datasets, tmp_path):
    said = verify_after(datasets["wds"], tmp_path, swap_cat_dog)
    assert "its samples' .json names class 'cat', the class map 'dog'" in said
    said = verify_after(datasets["lmdb"], tmp_path, swap_cat_dog)
    assert "data.lmdb: its metadata's class map differs from the manifest's classes" in said


def test_token_prefixes_and_data_path_are_the_shards(datasets, tmp_path):
    def keep_first(data):
        assert len(data["shards"]) > 1
        data["prefixes"] = data["prefixes"][:1]
        data["data_path"] = f"{data['shards'][0]['tokens']} {data['shards'][0]['prefix']}"

    said = verify_after(datasets["text"], tmp_path, keep_first)
    assert "prefixes ['text_document_part-000000']: the shards' are" in said and "data_path" in said
    said = verify_after(datasets["text"], tmp_path, lambda data: data.update(dtype="int32"))
    assert "dtype 'int32':" in said


@pytest.mark.parametrize("edit,named", [
    (lambda data: data["fields"].update(cls="image"), "fields: 'cls' is 'image'"),
    (lambda data: data["fields"].update(jpg="metadata"), "no image member"),
    (lambda data: data["fields"].pop("cls"), "fields name no 'cls' member"),
    (lambda data: data.update(modality="video"), "a video dataset's name a 'video' member"),
])
def test_image_fields_and_modality_are_what_repack_writes(datasets, tmp_path, edit, named):
    assert named in verify_after(datasets["wds"], tmp_path, edit)

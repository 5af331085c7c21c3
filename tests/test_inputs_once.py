"""Every input packed once or quarantined with a reason naming it, whatever the way in: two hard links named by a
list file, a foreign shard reached through a symlink, a folder loop under a foreign source, a tar member whose
name holds a NUL, a corrupt image under `--normalize --verify none`, a text file with one bad line that an
--append sees again, a text file whose name is not UTF-8."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

from tests.conftest import read_manifest_json, run_repack
from tests.test_images_job import jpeg_bytes


def reasons(out: Path) -> dict[str, str]:
    return {q["source"]: q["reason"] for q in read_manifest_json(out)["quarantine"]}


def test_a_list_naming_two_hard_links_packs_the_file_once(tmp_path):
    (tmp_path / "a.jpg").write_bytes(jpeg_bytes(seed=1))
    os.link(tmp_path / "a.jpg", tmp_path / "b.jpg")
    (tmp_path / "list.csv").write_text("path\na.jpg\nb.jpg\n")
    run_repack("images", tmp_path / "list.csv", tmp_path / "out", "--list", "--quiet")
    assert read_manifest_json(tmp_path / "out")["totals"]["samples"] == 1
    assert reasons(tmp_path / "out")["b.jpg"].startswith("same file as a.jpg (hard link or second path)")


def foreign_shard(path: Path, names: list[str]) -> None:
    data = jpeg_bytes(seed=3)
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_a_foreign_shard_is_read_once_and_a_folder_loop_entered_once(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    foreign_shard(src / "s.tar", ["k1.jpg", "k2.jpg"])
    (src / "alias.tar").symlink_to("s.tar")
    (src / "sub" / "up").symlink_to("..")
    run_repack("images", src, tmp_path / "out", "--from", "webdataset", "--quiet")
    assert read_manifest_json(tmp_path / "out")["totals"]["samples"] == 2
    found = reasons(tmp_path / "out")
    assert found["alias.tar"].startswith("same file as s.tar (symlink inside the source root)")
    assert found["sub/up"] == "symlink loop (folder already being scanned)"


def test_a_member_name_holding_a_nul_is_quarantined_and_the_rest_packed(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    foreign_shard(src / "s.tar", ["good.jpg", "b\u00e4d\0name.jpg"])  # not ASCII: a pax path record keeps the NUL
    run_repack("images", src, tmp_path / "out", "--from", "webdataset", "--quiet")
    assert read_manifest_json(tmp_path / "out")["totals"]["samples"] == 1
    assert reasons(tmp_path / "out") == {"s.tar/b\u00e4d\\x00name.jpg": "tar member name holds a NUL byte (no input "
                                                                        "path can): not read"}


def test_normalize_never_passes_a_corrupt_input_whatever_verify_says(tmp_path):
    src = tmp_path / "src" / "c"
    src.mkdir(parents=True)
    good = jpeg_bytes(seed=4)
    (src / "good.jpg").write_bytes(good)
    (src / "cut.jpg").write_bytes(good[:len(good) // 2] + b"\xff\xd9")  # the scan cut, the end marker kept
    for verify in ("none", "header"):
        out = tmp_path / f"out-{verify}"
        run_repack("images", src.parent, out, "--normalize", "--verify", verify, "--quiet")
        assert read_manifest_json(out)["totals"]["samples"] == 1 and "c/cut.jpg" in reasons(out), verify


def tokenizer(tmp_path: Path) -> Path:
    from tests.tools.text import gpt2_tokenizer, write_tokenizer

    return write_tokenizer(gpt2_tokenizer(), tmp_path / "tok")


def test_a_text_file_with_one_bad_line_keeps_its_documents_once(tmp_path):
    tok, src, out = tokenizer(tmp_path), tmp_path / "src", tmp_path / "out"
    src.mkdir()
    (src / "a.jsonl").write_text('{"text": "one"}\n{"nottext": 1}\n{"text": "two"}\n')
    run_repack("text", src, out, "--tokenizer", tok, "--quiet")
    os.utime(src / "a.jsonl", ns=(0, 10**18))  # touched: same content
    again = run_repack("text", src, out, "--tokenizer", tok, "--append")
    assert "nothing new" in again.stdout + again.stderr
    (src / "a.jsonl").write_text('{"text": "one"}\n{"text": "fixed"}\n{"text": "two"}\n')
    changed = run_repack("text", src, out, "--tokenizer", tok, "--append", check=False)
    assert changed.returncode == 2 and "a.jsonl" in changed.stderr and "changed since" in changed.stderr
    assert read_manifest_json(out)["totals"]["documents"] == 2


def test_a_text_file_whose_name_is_not_utf8_is_quarantined(tmp_path):
    tok, src, out = tokenizer(tmp_path), tmp_path / "src", tmp_path / "out"
    src.mkdir()
    (src / "ok.txt").write_text("a document\n")
    with open(os.path.join(os.fsencode(src), b"caf\xe9.txt"), "wb") as fh:
        fh.write(b"another document\n")
    run_repack("text", src, out, "--tokenizer", tok, "--quiet")
    manifest = read_manifest_json(out)
    assert manifest["totals"]["documents"] == 1
    assert [q["reason"] for q in manifest["quarantine"]] == ["file name is not valid UTF-8 (a token dataset names its "
                                                              "source files in UTF-8): rename it"]
    assert run_repack("verify", out).returncode == 0

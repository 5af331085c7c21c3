"""Bounded everywhere: names files read with a cap and never waited on, verify names duplicate keys
(not only adjacent ones) and a class map that is not one-to-one, ANSI colour escapes are text."""

from __future__ import annotations

import json
import os

from repack.sinks.webdataset import TarShardWriter
from repack.sources.text_sniff import binary_reason
from tests.conftest import read_manifest_json, run_repack
from tests.test_dataset_versions import make_source
from tests.tools.text import gpt2_tokenizer, write_tokenizer


def test_names_files_fifo_device_and_oversized_are_refused_by_name(tmp_path):
    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    fifo = tmp_path / "names.fifo"
    os.mkfifo(fifo)
    for names in (fifo, "/dev/zero", tmp_path):  # no writer on the FIFO: a blocking open would hang
        refused = run_repack("remove", out, "--sources", names, check=False, timeout=30)
        assert refused.returncode == 2 and "is not a regular file" in refused.stderr and str(names) in refused.stderr
    big = tmp_path / "big.txt"
    with open(big, "wb") as fh:
        fh.truncate(256 * 2**20 + 1)  # sparse: over the cap without writing it
    refused = run_repack("remove", out, "--keys", big, check=False)
    assert refused.returncode == 2 and "over the 268435456-byte cap" in refused.stderr
    (tmp_path / "crlf.txt").write_bytes(b"cat/c0.jpg\r\ncat/c1.jpg\r\n")
    done = run_repack("remove", out, "--sources", tmp_path / "crlf.txt")
    assert "2 sample(s) removed, 0 name(s) not found" in done.stdout


def _samples(path):
    """(key, [(ext, bytes)], source) of every sample of a repack tar shard, in order."""
    from repack.sinks.tar_format import iter_members

    samples: list = []
    with open(path, "rb") as fh:
        for member in list(iter_members(fh)):
            fh.seek(member.offset)
            data = fh.read(member.size)
            key, _, ext = member.name.partition(".")
            if not samples or samples[-1][0] != key:
                samples.append((key, [], None))
            samples[-1][1].append((ext, data))
            if ext == "json":
                samples[-1] = (key, samples[-1][1], json.loads(data).get("path"))
    return samples


def rewrite_shard(out, entry: dict, rename: dict[str, str]) -> dict:
    """``entry``'s shard written again (as a fresh file, manifest entry returned) with keys renamed."""
    writer = TarShardWriter(out, entry["path"][:-len(".tar")] + "-edited")
    for key, members, _ in _samples(out / entry["path"]):
        writer.add_sample(rename.get(key, key), members)
    new = writer.commit()
    os.unlink(out / entry["path"])
    os.unlink(out / entry["index"])
    return {**entry, **new}


def test_verify_finds_non_adjacent_duplicate_keys_and_a_shared_class_index(tmp_path):
    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    manifest = read_manifest_json(out)
    first_key = _samples(out / manifest["shards"][0]["path"])[0][0]
    last = manifest["shards"][-1]
    last_key = _samples(out / last["path"])[0][0]
    manifest["shards"][-1] = rewrite_shard(out, last, {last_key: first_key})  # counts, sizes, sha256 all fixed
    (out / "manifest.json").write_text(json.dumps(manifest))
    found = run_repack("verify", out, check=False)
    assert found.returncode != 0 and f"sample key {first_key!r} is held 2 times" in found.stdout + found.stderr

    run_repack("images", src, tmp_path / "out2", "--shard-size", "4", "--quiet")
    manifest = read_manifest_json(tmp_path / "out2")
    manifest["classes"] = {"cat": 1, "dog": 1}  # every count still right: only the map is wrong
    (tmp_path / "out2" / "manifest.json").write_text(json.dumps(manifest))
    found = run_repack("verify", tmp_path / "out2", check=False)
    assert found.returncode != 0 and "index 1 is given to 2 names ('cat', 'dog')" in found.stdout + found.stderr


def test_ansi_colour_escapes_are_text(tmp_path):
    line = "\x1b[31mERROR\x1b[0m \x1b[1mdisk\x1b[0m \x1b[33mfull\x1b[0m on /dev/sda\n"
    assert line.count("\x1b") == 6 and binary_reason(line.encode()) is None
    assert binary_reason(b"\x1b" * 200).startswith("binary data")  # escape bytes alone are still counted
    src, tok = tmp_path / "logs", write_tokenizer(gpt2_tokenizer(), tmp_path / "tok")
    src.mkdir()
    (src / "app.txt").write_text(line)
    out = tmp_path / "out"
    run_repack("text", src, out, "--tokenizer", tok, "--quiet")
    manifest = read_manifest_json(out)
    assert manifest["quarantine"] == [] and manifest["totals"]["documents"] == 1


def forge_count(out, samples: int) -> None:
    """Make ``out``'s manifest declare ``samples`` samples in its first shard (totals to match)."""
    manifest = read_manifest_json(out)
    manifest["shards"][0]["samples"] = samples
    manifest["totals"]["samples"] = sum(s["samples"] for s in manifest["shards"])
    (out / "manifest.json").write_text(json.dumps(manifest))


def test_readers_refuse_declared_counts_the_files_cannot_hold(tmp_path):
    """10^15 declared samples: each reader names the shard before sizing memory from the count (before
    the change, the image reader's sample order raised MemoryError under a 6 GB address-space limit)."""
    import resource

    import pytest

    from pipelines.torch_lmdb import LmdbImageDataset
    from pipelines.torch_text import DocumentDataset
    from pipelines.torch_webdataset import ImageShardDataset
    from repack.manifest import ManifestError

    src = make_source(tmp_path / "src")
    run_repack("images", src, tmp_path / "wds", "--shard-size", "4", "--quiet")
    run_repack("images", src, tmp_path / "lmdb", "--to", "lmdb", "--quiet")
    texts, tok = tmp_path / "texts", write_tokenizer(gpt2_tokenizer(), tmp_path / "tok")
    texts.mkdir()
    (texts / "a.txt").write_text("one line\nanother line\n")
    run_repack("text", texts, tmp_path / "text", "--tokenizer", tok, "--quiet")
    assert len(ImageShardDataset(tmp_path / "wds", decode=False)) == 9  # the honest datasets read
    readers = {"wds": lambda root: list(ImageShardDataset(root, decode=False)),
               "lmdb": lambda root: list(LmdbImageDataset(root)),
               "text": lambda root: list(DocumentDataset(root))}
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, hard))
    try:
        for name, read in readers.items():
            forge_count(tmp_path / name, 10**15)
            with pytest.raises(ManifestError, match="declares 1000000000000000 samples, more than its"):
                read(tmp_path / name)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_a_manifest_over_the_size_cap_is_refused_unread(tmp_path, monkeypatch):
    import pytest

    from pipelines.manifest_access import open_manifest
    from repack.manifest import ManifestError

    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    size = (out / "manifest.json").stat().st_size
    assert open_manifest(out).num_samples == 9
    monkeypatch.setenv("REPACK_MAX_MANIFEST_BYTES", str(size - 1))
    with pytest.raises(ManifestError, match=f"over the {size - 1}-byte cap"):
        open_manifest(out)
    # the commands read manifests through the same capped read: refused by name, nothing parsed
    for args in (("verify", out), ("inspect", out), ("gc", out, "--keep", "1")):
        proc = run_repack(*args, check=False, env={"REPACK_MAX_MANIFEST_BYTES": str(size - 1)})
        assert proc.returncode != 0 and f"over the {size - 1}-byte cap" in proc.stderr, (args, proc.stderr)
    # a size with a unit is read as one ("1KB" was ignored in silence: the 256 MiB default); a bad one is named
    monkeypatch.setenv("REPACK_MAX_MANIFEST_BYTES", " 1KB ")
    with pytest.raises(ManifestError, match="over the 1000-byte cap"):
        open_manifest(out)
    monkeypatch.setenv("REPACK_MAX_MANIFEST_BYTES", "1e3")
    with pytest.raises(ManifestError, match="REPACK_MAX_MANIFEST_BYTES='1e3': bad size"):
        open_manifest(out)


def test_a_sample_never_gets_two_members_of_one_extension(tmp_path):
    """The writer refuses it (a video named x.cls made a sample of two .cls members, which verify passed)."""
    import pytest

    writer = TarShardWriter(tmp_path, "shard-000000")
    with pytest.raises(ValueError, match=r"two members of one extension \(cls, cls\)"):
        writer.add_sample("k", [("cls", b"1"), ("cls", b"2")])
    writer.abort()


def test_a_manifest_over_the_size_cap_is_never_published(tmp_path):
    # a --dedup run lists every duplicate group in the manifest: past the cap, the job used to publish a
    # manifest every reader (and repack itself) refuses, and exit 0
    import shutil

    src = make_source(tmp_path / "src")
    for i in range(30):
        shutil.copy(src / "cat" / "c0.jpg", src / "cat" / f"copy{i:02d}.jpg")
    full = tmp_path / "full"
    run_repack("images", src, full, "--dedup", "--quiet")
    size = (full / "manifest.json").stat().st_size
    assert len(json.dumps(read_manifest_json(full)["stats"]["duplicates"])) > 1_000
    cap = size - 1_000  # under the manifest by less than its duplicate groups (timings vary a few bytes)
    out = tmp_path / "out"
    proc = run_repack("images", src, out, "--dedup", "--quiet", check=False,
                      env={"REPACK_MAX_MANIFEST_BYTES": str(cap)})
    assert proc.returncode != 0
    assert f"over the {cap:,}-byte cap" in proc.stderr and "stats.duplicates" in proc.stderr, proc.stderr
    assert "nothing is published" in proc.stderr and not (out / "manifest.json").exists()
    run_repack("images", src, out, "--dedup", "--quiet", env={"REPACK_MAX_MANIFEST_BYTES": str(2 * size)})  # resumes
    assert read_manifest_json(out)["shards"] == read_manifest_json(full)["shards"]
    # an append's new version is refused the same way; the published version stays
    for i in range(30):
        shutil.copy(src / "dog" / "d0.jpg", src / "dog" / f"copy{i:02d}.jpg")
    before = (out / "manifest.json").read_bytes()
    proc = run_repack("images", src, out, "--append", "--dedup", "--quiet", check=False,  # version 2 holds more
                      env={"REPACK_MAX_MANIFEST_BYTES": str(len(before))})
    assert proc.returncode != 0 and "nothing is published" in proc.stderr, proc.stderr
    assert (out / "manifest.json").read_bytes() == before
    assert not list(out.glob("manifest.v2.json"))


def test_a_name_holding_a_carriage_return_removes_that_sample_and_only_it(tmp_path):
    """A names file's lines end at LF (or CRLF): a CR inside a line is part of the name, which a file name may
    hold. It was read as a line end: `a\\rb.jpg` removed the samples `a` and `b.jpg` and kept itself, and the
    output said all was well. --null takes NUL-separated names exactly (a name ending with a CR, or starting
    with U+FEFF, which a line drops as Notepad's byte order mark)."""
    from PIL import Image

    src, out = tmp_path / "flat", tmp_path / "out"
    src.mkdir()
    names = ["a\rb.jpg", "b.jpg", "c.jpg", "a", "\ufeffx.jpg", "x.jpg", "y.jpg\r"]
    for number, name in enumerate(names):
        Image.new("RGB", (8, 8), (number * 30, 0, 0)).save(src / name, format="JPEG")
    run_repack("images", src, out, "--quiet")

    def held() -> set[str]:
        from pipelines.torch_webdataset import ImageShardDataset

        return {sample["meta"]["path"] for sample in ImageShardDataset(str(out), decode=False, output="dict")}

    assert held() == set(names)
    (tmp_path / "cr.txt").write_bytes("a\rb.jpg\n".encode())
    done = run_repack("remove", out, "--sources", tmp_path / "cr.txt")
    assert "1 sample(s) removed, 0 name(s) not found" in done.stdout
    assert held() == set(names) - {"a\rb.jpg"}
    (tmp_path / "bom.txt").write_bytes("\ufeffx.jpg\r\n".encode())  # Notepad's: the mark and CRLF go
    run_repack("remove", out, "--sources", tmp_path / "bom.txt")
    assert held() == set(names) - {"a\rb.jpg", "x.jpg"}
    (tmp_path / "exact.bin").write_bytes("\ufeffx.jpg\0y.jpg\r\0".encode())
    done = run_repack("remove", out, "--sources", tmp_path / "exact.bin", "--null")
    assert "2 sample(s) removed, 0 name(s) not found" in done.stdout
    assert held() == {"b.jpg", "c.jpg", "a"}

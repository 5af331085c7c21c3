"""Reports users act on: read/decode time percentiles and the slowest inputs (long tail), exact
duplicates with their paths, and --dedup keeping the first copy in plan order."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import duplicate_groups, read_manifest_json, run_repack
from tests.tools.photos import make_photo_tree


@pytest.fixture(scope="module")
def dup_tree(tmp_path_factory) -> Path:
    """24 small photos, one huge noisy PNG (the long tail) and exact copies across classes."""
    root = tmp_path_factory.mktemp("reports")
    make_photo_tree(root, per_class=6, classes=4, seed=5, max_side=80, min_side=40)
    noise = np.random.default_rng(0).integers(0, 256, (1400, 1800, 3), dtype=np.uint8)
    Image.fromarray(noise).save(root / "chelsea" / "chelsea_huge.png", compress_level=1)
    shutil.copy(root / "astronaut" / "astronaut_0001.jpg", root / "coffee" / "zz_copy_of_astronaut.jpg")
    shutil.copy(root / "astronaut" / "astronaut_0001.jpg", root / "rocket" / "again.jpg")
    shutil.copy(root / "coffee" / "coffee_0003.jpg", root / "coffee" / "coffee_0003_dup.jpg")
    return root


def test_timing_percentiles_and_slowest_inputs(dup_tree, tmp_path):
    out = tmp_path / "out"
    run_repack("images", dup_tree, out, "--shard-size", "8", "--quiet")
    m = read_manifest_json(out)
    timing = m["run"]["timing"]
    for name in ("read_ms", "check_ms"):
        t = timing[name]
        assert t["count"] == m["totals"]["samples"] == 28
        assert 0 <= t["p50"] <= t["p90"] <= t["p99"] <= t["max"]
    slowest = timing["slowest"]
    # ~20 ms to decode vs < 1 ms for the others: at the top (top 3 tolerates a scheduler hiccup)
    top = next(s for s in slowest[:3] if s["source"] == "chelsea/chelsea_huge.png")
    assert (top["width"], top["height"]) == (1800, 1400)
    assert top["bytes"] == (dup_tree / "chelsea" / "chelsea_huge.png").stat().st_size
    assert [s["us"] for s in slowest] == sorted((s["us"] for s in slowest), reverse=True)
    lines = run_repack("inspect", out).stdout
    assert "read time per sample (ms): p50" in lines and "decode/check (+normalize) time per sample" in lines
    assert "chelsea/chelsea_huge.png" in "".join(lines.split("slowest inputs:")[1].splitlines()[1:4])
    assert "1800x1400" in lines


def test_duplicates_reported_with_paths(dup_tree, tmp_path):
    out = tmp_path / "out"
    run_repack("images", dup_tree, out, "--shard-size", "8", "--quiet")
    dups = read_manifest_json(out)["stats"]["duplicates"]
    assert dups["groups"] == 2 and dups["extra_copies"] == 3 and dups["dropped"] == 0
    assert [g["paths"] for g in dups["list"]] == [
        ["astronaut/astronaut_0001.jpg", "coffee/zz_copy_of_astronaut.jpg", "rocket/again.jpg"],
        ["coffee/coffee_0003.jpg", "coffee/coffee_0003_dup.jpg"]]
    digest = __import__("hashlib").sha256((dup_tree / "coffee" / "coffee_0003.jpg").read_bytes()).hexdigest()
    assert dups["list"][1]["sha256"] == digest
    assert read_manifest_json(out)["totals"]["samples"] == 28  # reported, not dropped
    assert "exact duplicates: 2 group(s), 3 extra cop(ies)" in run_repack("inspect", out).stdout


def tar_paths(out: Path) -> list[str]:
    paths = []
    for shard in sorted(out.glob("shard-*.tar")):
        with tarfile.open(shard) as tar:
            paths += [json.loads(tar.extractfile(m).read())["path"] for m in tar.getmembers() if m.name.endswith(".json")]
    return paths


def test_dedup_keeps_first_in_plan_order_deterministically(dup_tree, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    run_repack("images", dup_tree, a, "--shard-size", "5", "--dedup", "--workers", "1", "--quiet")
    run_repack("images", dup_tree, b, "--shard-size", "5", "--dedup", "--workers", "2", "--quiet")
    ma, mb = read_manifest_json(a), read_manifest_json(b)
    ma.pop("run"), mb.pop("run")
    assert ma == mb and [s["sha256"] for s in ma["shards"]] == [s["sha256"] for s in mb["shards"]]
    assert ma["totals"]["samples"] == 25 and ma["totals"]["duplicates_dropped"] == 3
    assert ma["stats"]["duplicates"]["dropped"] == 3 and ma["totals"]["quarantined"] == 0
    kept = tar_paths(a)
    assert "astronaut/astronaut_0001.jpg" in kept and "coffee/coffee_0003.jpg" in kept
    assert not {"coffee/zz_copy_of_astronaut.jpg", "rocket/again.jpg", "coffee/coffee_0003_dup.jpg"} & set(kept)
    assert len(kept) == len(set(kept)) == 25
    # shuffled: the first copy in the shuffled plan order is the one kept
    c = tmp_path / "c"
    run_repack("images", dup_tree, c, "--shard-size", "5", "--dedup", "--shuffle", "--seed", "7", "--quiet")
    order = tar_paths(c)
    groups = duplicate_groups(c, read_manifest_json(c)["stats"]["duplicates"])
    for group in groups:
        assert group["paths"][0] in order and not set(group["paths"][1:]) & set(order)


def test_dedup_into_lmdb(dup_tree, tmp_path):
    out = tmp_path / "lmdb"
    run_repack("images", dup_tree, out, "--to", "lmdb", "--shard-size", "5", "--dedup", "--quiet")
    m = read_manifest_json(out)
    assert m["totals"]["samples"] == m["shards"][0]["samples"] == 25
    from pipelines.torch_lmdb import LmdbImageDataset

    ds = LmdbImageDataset(out, output="dict", decode=False)
    paths = [ds[i]["meta"]["path"] for i in range(len(ds))]
    assert len(set(paths)) == 25 and "rocket/again.jpg" not in paths
    assert paths == sorted(paths, key=str.encode)
    image = Image.open(io.BytesIO(ds[0]["image"]))
    assert image.size[0] > 0


def test_the_report_reads_no_folder_a_manifest_alone_names(tmp_path):
    """The HTML report shows quarantined inputs read from the job's SOURCE only where the dataset's own job state
    names that SOURCE: a manifest edited (or received) to name another folder never has its files read."""
    from tests.test_images_job import jpeg_bytes

    src = tmp_path / "src" / "c"
    src.mkdir(parents=True)
    for i in range(3):
        (src / f"a{i}.jpg").write_bytes(jpeg_bytes(seed=i))
    (src / "bad.jpg").write_bytes(b"not an image")
    out = tmp_path / "out"
    run_repack("images", src.parent, out, "--quiet")
    private = tmp_path / "private" / "c"
    private.mkdir(parents=True)
    (private / "bad.jpg").write_bytes(jpeg_bytes(seed=9))  # a real image where the edited manifest points
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["created_by"]["options"]["source"] = str(private.parent)
    (out / "manifest.json").write_text(json.dumps(manifest))
    run_repack("inspect", out, "--html", tmp_path / "report.html")
    quarantine = (tmp_path / "report.html").read_text().split("Quarantined inputs", 1)[1]
    assert "source not available here" in quarantine and "data:image" not in quarantine.split("</div></div>")[0]


def test_inspect_json_of_an_index_damaged_at_its_own_size_exits_5_as_the_text_does(tmp_path):
    """An index overwritten with other bytes of its size: `inspect` said damaged (exit 5), `--json` exit 0."""
    src = tmp_path / "photos"
    make_photo_tree(src, per_class=2, classes=2, seed=3, max_side=48, min_side=32)
    out = tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    index = out / read_manifest_json(out)["shards"][0]["index"]
    size = index.stat().st_size
    index.write_bytes(bytes(range(256)) * (size // 256) + bytes(size % 256))
    for extra in ((), ("--json",)):
        done = run_repack("inspect", out, *extra, check=False)
        assert done.returncode == 5 and f"{index.name}: not a" in done.stderr, (extra, done.stdout, done.stderr)


def test_inspect_of_a_damaged_dataset_says_so(tmp_path):
    """A shard deleted or cut, a token index cut: `repack inspect` says so first and exits 5 naming the file (it
    printed the manifest's counts as facts with exit 0, or a traceback); the median of two shard sizes is their
    mean."""
    from tests.tools.text import gpt2_tokenizer, write_tokenizer

    src = tmp_path / "photos"
    make_photo_tree(src, per_class=3, classes=2, seed=1, max_side=64, min_side=32)
    out = tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    sizes = sorted(s["bytes"] for s in read_manifest_json(out)["shards"])
    assert len(sizes) == 2
    assert json.loads(run_repack("inspect", out, "--json").stdout)["shards"]["median_bytes"] == sum(sizes) // 2
    shard = out / read_manifest_json(out)["shards"][0]["path"]
    with open(shard, "r+b") as fh:
        fh.truncate(4096)
    done = run_repack("inspect", out, check=False)
    assert done.returncode == 5 and f"{shard.name} is 4096 bytes" in done.stderr
    assert done.stdout.startswith(f"DAMAGED: {out} is damaged: {shard.name} is 4096 bytes")
    shard.unlink()
    done = run_repack("inspect", out, "--html", tmp_path / "r.html", check=False)
    assert done.returncode == 5 and f"{shard.name} is missing" in done.stderr and "Traceback" not in done.stderr
    assert f"{shard.name} is missing" in (tmp_path / "r.html").read_text().split("<h2>DAMAGED</h2>")[1][:400]
    index = out / read_manifest_json(out)["shards"][1]["index"]
    with open(index, "r+b") as fh:  # an index cut short: --json said nothing of it, exit 0
        fh.truncate(100)
    for extra in ((), ("--json",)):
        done = run_repack("inspect", out, *extra, check=False)
        assert done.returncode == 5 and f"{index.name} is 100 bytes" in done.stdout + done.stderr, done.stdout
    assert any(f"{index.name} is 100 bytes" in p for p in json.loads(run_repack("inspect", out, "--json",
                                                                              check=False).stdout)["damaged"])
    index.unlink()  # the summary cannot be read without it: DAMAGED is said anyway, first
    done = run_repack("inspect", out, check=False)
    assert done.returncode == 5 and done.stdout.startswith(f"DAMAGED: {out} is damaged: ") and index.name in done.stdout

    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("one document of a few words\n" * 40)
    text = tmp_path / "text"
    run_repack("text", texts, text, "--tokenizer", write_tokenizer(gpt2_tokenizer(), tmp_path / "tok"), "--quiet")
    index = text / read_manifest_json(text)["shards"][0]["index"]
    with open(index, "r+b") as fh:
        fh.truncate(40)
    for extra in ((), ("--html", tmp_path / "t.html")):
        done = run_repack("inspect", text, *extra, check=False)
        assert done.returncode == 5 and "is damaged" in done.stderr and "Traceback" not in done.stderr


def test_inspect_counts_every_append_and_a_removal(tmp_path):
    """After --append the histograms, duplicates and token tables are the version's (they were the first
    pack's alone), the percentiles come from every prefix; after `remove` the per-file table drops the file."""
    from tests.tools.text import gpt2_tokenizer, write_tokenizer

    src = tmp_path / "photos"
    make_photo_tree(src, per_class=3, classes=2, seed=1, max_side=64, min_side=32)
    out = tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    (src / "new").mkdir()
    for name in ("big.jpg", "big_copy.jpg"):
        Image.new("RGB", (3000, 2000), (1, 2, 3)).save(src / "new" / name)
    run_repack("images", src, out, "--append", "--quiet")
    fresh = tmp_path / "fresh"
    run_repack("images", src, fresh, "--quiet")
    summary = json.loads(run_repack("inspect", out, "--json").stdout)["stats"]
    expected = json.loads(run_repack("inspect", fresh, "--json").stdout)["stats"]
    assert summary["histograms"] == expected["histograms"]
    assert summary["duplicates"]["groups"] == expected["duplicates"]["groups"] == 1

    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.jsonl").write_text('{"text": "one two three"}\n{"text": "four"}\n')
    tok = write_tokenizer(gpt2_tokenizer(), tmp_path / "tok")
    text = tmp_path / "text"
    run_repack("text", texts, text, "--tokenizer", tok, "--quiet")
    (texts / "b.jsonl").write_text("".join(json.dumps({"text": "word " * (20 * i)}) + "\n" for i in range(1, 51)))
    run_repack("text", texts, text, "--tokenizer", tok, "--append", "--quiet")
    lines = run_repack("inspect", text).stdout
    assert "tokens per document: p50 482 p90 902 p99 1002 max 1002" in lines
    percentiles = json.loads(run_repack("inspect", text, "--json").stdout)["stats"]["document_tokens"]
    assert (percentiles["count"], percentiles["p50"], percentiles["max"]) == (52, 482, 1002)  # --html draws these
    assert "tokens per file (2 file(s))" in lines and "6 tokens, 2 documents  a.jsonl" in lines
    (tmp_path / "gone.txt").write_text("a.jsonl\n")
    run_repack("remove", text, "--sources", tmp_path / "gone.txt")
    lines = run_repack("inspect", text).stdout
    assert "tokens per file (1 file(s))" in lines and "a.jsonl" not in lines.split("tokens per file")[1]
    files = read_manifest_json(text)["stats"]["files"]
    assert files["largest"] == [{"source": "b.jsonl", "documents": 50, "tokens": 25600}]


def test_histograms_say_they_count_what_was_packed_after_a_remove(tmp_path):
    """A remove updates class counts and formats, not the size and dimension histograms (nothing says a removed
    sample's source size or dimensions): they were shown as the version's."""
    from tests.test_images_job import write_jpegs

    src, out = write_jpegs(tmp_path / "src" / "c", 6, "a").parent, tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    (tmp_path / "gone.txt").write_text("c/a0.jpg\nc/a1.jpg\n")
    before = run_repack("inspect", out).stdout
    assert "source file sizes: " in before and "as packed" not in before
    run_repack("remove", out, "--sources", tmp_path / "gone.txt")
    after = run_repack("inspect", out).stdout
    for name in ("source file sizes", "widths (px)", "heights (px)"):
        assert f"{name} (as packed; 2 sample(s) removed since): " in after, after
    run_repack("inspect", out, "--html", tmp_path / "report.html")
    assert "Source file sizes (as packed; 2 sample(s) removed since)" in (tmp_path / "report.html").read_text()


def test_a_report_path_that_cannot_be_written_is_named_not_the_dataset(packed_photos, tmp_path):
    """`inspect --html` to a folder, or under a file, said the healthy dataset was damaged (exit 5); it names the
    report's path now (exit 2), and makes no folders for it."""
    (tmp_path / "afile").write_text("x")
    for target, words in ((tmp_path, "Is a directory"), (tmp_path / "afile" / "r.html", "Not a directory"),
                          (tmp_path / "missing" / "r.html", "No such file")):
        done = run_repack("inspect", packed_photos, "--html", target, check=False)
        assert done.returncode == 2 and "cannot write the report" in done.stderr and words in done.stderr, done.stderr
    assert not (tmp_path / "missing").exists()

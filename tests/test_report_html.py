"""The dataset report (`repack inspect --json/--html`) and `repack bench --html`, loaded in a real
headless Chromium: self-contained (nothing fetched), no console errors, charts that render."""

from __future__ import annotations

import base64
import html as html_lib
import io
import json
import re
import shutil
from pathlib import Path

from PIL import Image

import pytest

from repack.report.svg import PALETTE
from tests.conftest import run_repack
from tests.tools.browser import ink, render
from tests.tools.photos import make_photo_tree
from tests.tools.text import documents, train_bpe, write_tokenizer
from tests.tools.videos import CLIPS, make_clips

BAR = tuple(int(PALETTE[0][i:i + 2], 16) for i in (1, 3, 5))  # the bar colour, as RGB
SECOND = tuple(int(PALETTE[1][i:i + 2], 16) for i in (1, 3, 5))


@pytest.fixture(scope="module")
def images_out(tmp_path_factory) -> Path:
    """3 classes of small photos, a truncated JPEG, an empty file and an exact duplicate, packed."""
    root = tmp_path_factory.mktemp("report")
    src = root / "src"
    files = make_photo_tree(src, per_class=6, classes=3, seed=2, min_side=40, max_side=160)
    good = files[0].read_bytes()
    (files[0].parent / "truncated.jpg").write_bytes(good[: len(good) // 3])
    (files[0].parent / "empty.jpg").write_bytes(b"")
    shutil.copy(files[1], files[-1].parent / "copy_of_another.jpg")
    run_repack("images", src, root / "out", "--shard-size", "8", "--quiet")
    return root / "out"


def self_contained(html: str) -> None:
    """No script, and nothing the page could fetch: every URL is the SVG namespace or data:."""
    assert "<script" not in html.lower()
    urls = re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)""", html) + re.findall(r"url\(([^)]*)\)", html)
    assert all(u.startswith("data:") for u in urls), urls
    assert set(re.findall(r"https?://[^\s\"'<>]+", html)) <= {"http://www.w3.org/2000/svg"}


THUMB = re.compile(r'<img src="data:image/jpeg;base64,([A-Za-z0-9+/=]+)" alt="([^"]*)">')


def thumbnails(html: str) -> dict[str, Image.Image]:
    """{caption: decoded image} of every thumbnail on the page."""
    return {html_lib.unescape(alt): Image.open(io.BytesIO(base64.b64decode(data))) for data, alt in THUMB.findall(html)}


def images_load(page: Path, tmp_path: Path, count: int, height: int = 1600) -> None:
    """Chromium draws the page's ``count`` thumbnails: the page has far more ink than the same page
    without its <img> elements (a thumbnail that failed to load draws no photo)."""
    html = page.read_text()
    bare = page.with_name("bare-" + page.name)
    bare.write_text(re.sub(r"<img [^>]*>", "", html))
    with_images, without = (ink(load(p, tmp_path, height)) for p in (page, bare))
    assert with_images - without > count * 2_000, (with_images, without, count)


def load(page: Path, tmp_path: Path, height: int = 1600) -> Path:
    shot = tmp_path / (page.stem + ".png")
    console = render(page, shot, height=height)
    assert console == [], console
    return shot


def test_harness_sees_console_errors(tmp_path):
    """The check below is real: a page that logs an error and throws is caught."""
    page = tmp_path / "bad.html"
    page.write_text("<!DOCTYPE html><html><head><link rel=icon href='data:,'></head><body>x<script>"
                    "console.error('deliberate'); notDefined();</script></body></html>")
    console = render(page, tmp_path / "bad.png", width=400, height=300)
    assert any("deliberate" in m for m in console) and any("notDefined" in m for m in console), console


def test_images_report_renders(images_out, tmp_path):
    page = tmp_path / "images.html"
    run_repack("inspect", images_out, "--html", page)
    html = page.read_text()
    self_contained(html)
    for needle in ("Class balance (3 classes)", "Source file sizes", "Dimensions (px)", "Read + decode time per sample",
                   "slowest inputs", "Exact duplicates (1 groups, 1 extra copies)", "Quarantine (2)",
                   "copy_of_another.jpg", "truncated.jpg", "empty file"):
        assert needle in html, needle
    shot = load(page, tmp_path, height=3200)
    assert ink(shot) > 60_000  # text, tables and bars, not a blank page
    assert ink(shot, BAR) > 20_000  # the bar charts drew their bars
    # the data itself: a handful of thumbnails per class, the quarantined inputs with their reasons
    assert "Samples per class" in html and "Quarantined inputs" in html
    thumbs = thumbnails(html)
    classes = re.findall(r"<h3>(\w+) \((\d)\)</h3>", html)
    names = json.loads(run_repack("inspect", images_out, "--json").stdout)["classes"]
    assert [c for c, _ in classes] == sorted(names, key=names.get) and len(names) == 3
    per_class = [len(re.findall(r"<img ", part)) for part in html.split("<h3>")[1:4]]
    assert per_class == [6, 6, 6] and all(max(t.size) <= 96 for t in thumbs.values())
    quarantined = {k: v for k, v in thumbs.items() if ": " in k}
    assert not any("empty.jpg" in k for k in quarantined)  # an empty file gives no thumbnail, its reason shows
    assert "empty.jpg: empty file" in html_lib.unescape(html)
    images_load(page, tmp_path, len(thumbs), height=3200)
    again = tmp_path / "again.html"
    run_repack("inspect", images_out, "--html", again)
    assert again.read_text() == html  # chosen deterministically


def test_inspect_json_and_human_units(images_out):
    summary = json.loads(run_repack("inspect", images_out, "--json").stdout)
    assert summary["modality"] == "images" and summary["samples"] == 19
    assert summary["quarantine"]["count"] == 2 and sum(summary["quarantine"]["reasons"].values()) == 2
    stats = summary["stats"]
    assert sum(r["count"] for r in stats["histograms"]["source_bytes"]) == 19
    assert sum(stats["class_counts"].values()) == 19 and len(stats["class_counts"]) == 3
    assert sum(r["count"] for r in summary["timing"]["sample_us_histogram"]) == 19
    text = run_repack("inspect", images_out).stdout
    assert " KB" in text and "0.0 MB" not in text and not re.search(r"\b0\.0 [KMG]B", text)


def test_text_report_renders(tmp_path):
    docs = documents(120, seed=3)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"part{i}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[i::3][: 10 + 15 * i]))
    tok = write_tokenizer(train_bpe(docs), tmp_path / "tok")
    said = run_repack("text", corpus, tmp_path / "out", "--tokenizer", tok, "--quiet")
    printed = next(line for line in (said.stdout + said.stderr).splitlines() if line.startswith("Megatron --data-path "))
    summary = json.loads(run_repack("inspect", tmp_path / "out", "--json").stdout)
    assert f"Megatron --data-path {summary['text']['megatron_data_path']}" == printed  # the report shows what the CLI said
    files = summary["stats"]["files"]
    assert files["count"] == 3 and [e["documents"] for e in files["largest"]] == [40, 25, 10]
    assert sum(e["tokens"] for e in files["largest"]) == summary["totals"]["tokens"]
    page = tmp_path / "text.html"
    run_repack("inspect", tmp_path / "out", "--html", page)
    html = page.read_text()
    self_contained(html)
    assert "Document length (tokens)" in html and "Tokens per file (3 files)" in html and "part2.jsonl" in html
    assert html_lib.escape(printed.split(" ", 2)[2]) in html
    shot = load(page, tmp_path)
    assert ink(shot, BAR) > 10_000
    # the first document's start, decoded back from the token memmap with OUT's tokenizer
    starts = re.findall(r'<pre class="doc">(.*?)</pre>', html, re.S)
    assert len(starts) == 5 and html_lib.unescape(starts[0]).startswith(docs[0][:60])


def test_video_report_renders(tmp_path):
    chosen = [c for c in CLIPS if c.rel in ("good/h264.mp4", "good/vp9.webm", "bad/long_gop.mp4",
                                              "bad/odd.webm", "junk/empty.mp4")]
    make_clips(tmp_path / "src", chosen, workers=2)
    run_repack("video", tmp_path / "src", tmp_path / "out", "--quiet")
    text = run_repack("inspect", tmp_path / "out").stdout
    ok, transcode, reject = (sum(c.expected()[0] == d for c in chosen) for d in ("ok", "transcode", "reject"))
    assert (ok, transcode, reject) == (1, 3, 1)  # the default (legacy) reader transcodes VP9 too
    assert f"{ok} GPU-decodable as is, {transcode} need transcoding, {reject} rejected" in text and "long_gop" in text
    assert "resolutions (videos):" in text and "161x131" in text and "0.0 MB" not in text
    assert "video(s)" in text and "shard(s)" not in text  # a videos dataset's files are videos
    page = tmp_path / "video.html"
    run_repack("inspect", tmp_path / "out", "--html", page)
    html = page.read_text()
    self_contained(html)
    for needle in ("Decisions by reason", "long_gop", "odd_size", "161x131", "vp9", "bad/long_gop.mp4"):
        assert needle in html, needle
    shot = load(page, tmp_path)
    assert ink(shot, BAR) > 5_000
    # one frame per decision, extracted by ffmpeg from the sources (a probe-only job has no outputs)
    frames = thumbnails(html)
    assert [k.split(":")[0] for k in frames] == ["ok", "transcode"] and all(max(f.size) <= 160 for f in frames.values())
    assert "ok: good/h264.mp4" in frames and "reject: junk/empty.mp4; empty" in html_lib.unescape(html)
    images_load(page, tmp_path, len(frames))
    data = json.loads((tmp_path / "out" / "manifest.json").read_text())  # a received manifest's markup: escaped
    data["created_by"]["options"]["max_gop"] = '<img src=x onerror="alert(1)">'
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(data))
    run_repack("inspect", tmp_path / "out", "--html", page)
    assert "<img src=x" not in page.read_text() and "&lt;img src=x" in page.read_text()


def test_bench_report_renders(images_out, tmp_path):
    page = tmp_path / "bench.html"
    run_repack("bench", images_out, "--steps", "3", "--warmup", "1", "--batch-size", "4", "--loader-workers", "0,1",
               "--threads", "1", "--reader", "torch", "--html", page)
    html = page.read_text()
    self_contained(html)
    assert "against workers" in html and "torch workers, batch 4" in html
    shot = load(page, tmp_path, height=1300)
    assert ink(shot, BAR) > 500  # the samples/s and wait lines and their markers


def test_report_size_is_bounded(tmp_path):
    """30 classes of 8 images: the page shows 24 classes of 6 small thumbnails, and stays small."""
    import random

    rng = random.Random(5)
    for c in range(30):
        (tmp_path / "src" / f"class{c:02d}").mkdir(parents=True)
        for i in range(8):
            colour = tuple(rng.randrange(256) for _ in range(3))
            Image.new("RGB", (300, 200), colour).save(tmp_path / "src" / f"class{c:02d}" / f"{i}.jpg", quality=90)
    run_repack("images", tmp_path / "src", tmp_path / "out", "--shard-size", "50", "--quiet")
    page = tmp_path / "many.html"
    run_repack("inspect", tmp_path / "out", "--html", page)
    html = page.read_text()
    self_contained(html)
    grid = html.split("<h2>Samples per class</h2>")[1].split("</section>")[0]
    assert re.findall(r"<h3>(class\d+) \(\d+\)</h3>", grid) == [f"class{c:02d}" for c in range(24)]
    thumbs = thumbnails(grid)
    assert len(thumbs) == 24 * 6 and all(max(t.size) <= 96 for t in thumbs.values())
    assert len(html) < 400_000, len(html)


def test_report_of_a_damaged_dataset_says_so(images_out, tmp_path):
    """A shard gone missing: the page still renders, with a note where the thumbnails would be; exit 5."""
    damaged = tmp_path / "damaged"
    shutil.copytree(images_out, damaged)
    (damaged / "shard-000000.tar").unlink()
    page = tmp_path / "damaged.html"
    done = run_repack("inspect", damaged, "--html", page, check=False)
    assert done.returncode == 5 and "shard-000000.tar is missing" in done.stderr
    html = page.read_text()
    assert "samples not shown: FileNotFoundError" in html and "run `repack verify`" in html
    assert "Class balance (3 classes)" in html


def noisy_photo_tree(root: Path, classes: int, per_class: int) -> None:
    """Photos of ~120 KB each (noise compresses badly): a few make megabytes in one shard."""
    import random

    rng = random.Random(11)
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(per_class):
            noise = Image.frombytes("RGB", (320, 320), rng.randbytes(320 * 320 * 3))
            noise.save(root / f"class{c}" / f"{i}.jpg", quality=95)


def test_every_class_shown_whatever_the_shard_layout(tmp_path):
    """5 classes of 8 photos in one shard of ~5 MB (the default --shard-bytes): every class has its
    thumbnails, not only those in the shard's first megabytes; LMDB the same."""
    noisy_photo_tree(tmp_path / "src", classes=5, per_class=8)
    for name, extra in (("one", ()), ("lmdb", ("--to", "lmdb"))):
        run_repack("images", tmp_path / "src", tmp_path / name, "--quiet", *extra)
        page = tmp_path / f"{name}.html"
        run_repack("inspect", tmp_path / name, "--html", page)
        grid = page.read_text().split("<h2>Samples per class</h2>")[1].split("</section>")[0]
        shown = [part.split("</h3>")[0] for part in grid.split("<h3>")[1:]]
        assert shown == [f"class{c} ({c})" for c in range(5)], (name, shown)
        assert [len(re.findall(r"<img ", part)) for part in grid.split("<h3>")[1:]] == [6] * 5, name


def test_report_page_bounded_whatever_the_class_count(images_out, tmp_path):
    """200,000 class names: the page draws the largest classes and sums up the rest in one line."""
    from repack.report.collect import collect
    from repack.report.html import dataset_page, write_page

    summary = collect(images_out)
    summary["classes"] = {f"class-{i:06d}": i for i in range(200_000)}
    summary["stats"]["class_counts"] = {f"class-{i:06d}": 1 + i % 7 for i in range(200_000)}
    html = dataset_page(summary)
    assert len(html) < 100_000, len(html)
    assert "Class balance (200,000 classes)" in html and "the other 199,960 hold" in html
    write_page(tmp_path / "many.html", html)


def test_non_utf8_names_are_escaped_in_every_output(tmp_path):
    src = tmp_path / "src"
    make_photo_tree(src, per_class=3, classes=2, seed=3, min_side=40, max_side=96)
    folder = sorted(src.iterdir())[0]
    with open(bytes(folder) + b"/bad\xff.jpg", "wb") as f:  # a name that is not UTF-8
        f.write(b"\xff\xd8\xff\xe0 not really")
    run_repack("images", src, tmp_path / "out", "--quiet")
    page = tmp_path / "r.html"
    for args in ((), ("--json",), ("--html", page)):
        done = run_repack("inspect", tmp_path / "out", *args)
        assert "Traceback" not in done.stderr
    assert "bad\\udcff.jpg" in page.read_text(encoding="utf-8")


def test_bar_value_labels_fit_the_chart():
    from repack.report import svg

    chart = svg.bars([("part-0.jsonl", 123_456), ("part-1.jsonl", 99_999)], lambda v: f"{v:,.0f} tokens")
    width = int(re.search(r'<svg[^>]* width="(\d+)"', chart).group(1))
    for x, text in re.findall(r'<text x="([\d.]+)" y="[\d.]+">([^<]+)</text>', chart):
        assert float(x) + 7 * len(text) <= width, (x, text, width)


def test_quarantine_captions_read_as_words():
    from repack.report.html import STYLE, plain_reason, sample_sections

    assert plain_reason("cannot read: OSError: [Errno 5] Input/output error") == "cannot read: [Errno 5] Input/output error"
    assert plain_reason("PIL.UnidentifiedImageError: cannot identify") == "cannot identify"
    html = sample_sections({"quarantined": [{"source": "a/truncated.jpg", "reason": "cannot decode JPG: truncated",
                                             "note": "does not decode: OSError: image file is truncated"}]})
    assert "OSError" not in html and "break-all" not in STYLE

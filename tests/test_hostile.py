"""Hostile inputs (issue 11): nothing outside the source is read, nothing hangs, one bad record never
fails a task, resume notices changed sources, verify catches tampering, signals clean up."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from repack.jobs.base import PLAN_NAME
from repack.sources.confine import SourceChanged, open_input
from repack.transforms.image_check import BadImage, inspect_image
from tests.conftest import ROOT, read_manifest_json, run_repack
from tests.test_images_job import jpeg_bytes, png_bytes, shard_bytes, write_jpegs
from tests.tools.text import documents, gpt2_tokenizer, write_tokenizer


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gpt2")
    write_tokenizer(gpt2_tokenizer(), folder)
    return folder


def reasons_of(out: Path) -> dict[str, str]:
    return {q["source"]: q["reason"] for q in read_manifest_json(out)["quarantine"]}


def tokens(out: Path) -> bytes:
    return (out / "text_document.bin").read_bytes()


def png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    chunks, pos = [], 8
    while pos < len(data):
        length = int.from_bytes(data[pos:pos + 4], "big")
        chunks.append((data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]))
        pos += 12 + length
    return chunks


def build_png(chunks: list[tuple[bytes, bytes]], fix_crc: bool = True) -> bytes:
    out = b"\x89PNG\r\n\x1a\n"
    for kind, body in chunks:
        crc = zlib.crc32(kind + body) ^ (0 if fix_crc else 1)
        out += len(body).to_bytes(4, "big") + kind + body + crc.to_bytes(4, "big")
    return out


# ---- 1. symlinks: never read outside the source root; the real path wins over an alias ----------

def test_symlinks_leaving_the_source_are_quarantined_and_the_real_path_wins(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.jpg").write_bytes(jpeg_bytes(seed=9))
    (outside / "sub").mkdir()
    (outside / "sub" / "other.jpg").write_bytes(jpeg_bytes(seed=8))
    src = tmp_path / "src"
    for cls in ("cat", "dog"):
        (src / cls).mkdir(parents=True)
    (src / "cat" / "real.jpg").write_bytes(jpeg_bytes(seed=1))
    (src / "dog" / "own.jpg").write_bytes(jpeg_bytes(seed=2))
    (src / "cat" / "passwd.jpg").symlink_to("/etc/passwd")
    (src / "cat" / "stolen.jpg").symlink_to(outside / "secret.jpg")
    (src / "dog" / "linkdir").symlink_to(outside / "sub")
    (src / "dog" / "a_alias.jpg").symlink_to(src / "cat" / "real.jpg")  # sorts first in dog/, still loses
    out = tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    reasons = reasons_of(out)
    for rel in ("cat/passwd.jpg", "cat/stolen.jpg", "dog/linkdir"):
        assert reasons[rel] == "symlink leaves the source root"
    assert reasons["dog/a_alias.jpg"].startswith("same file as cat/real.jpg (symlink inside the source root)")
    metas = {json.loads(m)["path"]: json.loads(m) for m in tar_members(out, ".json")}
    assert set(metas) == {"cat/real.jpg", "dog/own.jpg"} and metas["cat/real.jpg"]["class"] == "cat"
    assert (outside / "secret.jpg").read_bytes() not in b"".join(shard_bytes(out).values())

    allowed = tmp_path / "allowed"
    run_repack("images", src, allowed, "--quiet", "--allow-outside-source")
    packed = {json.loads(m)["path"] for m in tar_members(allowed, ".json")}
    assert {"cat/stolen.jpg", "dog/linkdir/other.jpg"} <= packed
    assert "not a recognized image" in reasons_of(allowed)["cat/passwd.jpg"]  # read only when allowed

    listing = src / "list.csv"
    listing.write_text(f"path,label\ncat/real.jpg,a\n../outside/secret.jpg,b\n{outside / 'secret.jpg'},b\n"
                       "cat/stolen.jpg,b\n")
    listed = tmp_path / "listed"
    run_repack("images", listing, listed, "--list", "--quiet")
    reasons = reasons_of(listed)
    assert reasons["../outside/secret.jpg"] == "path leaves the source root (list.csv:3)"
    assert reasons[str(outside / "secret.jpg")] == "path leaves the source root (list.csv:4)"
    assert reasons["cat/stolen.jpg"] == "symlink leaves the source root (list.csv:5)"


def tar_members(out: Path, suffix: str) -> list[bytes]:
    import tarfile

    found = []
    for shard in read_manifest_json(out)["shards"]:
        with tarfile.open(out / shard["path"]) as tf:
            found += [tf.extractfile(m).read() for m in tf.getmembers() if m.name.endswith(suffix)]
    return found


def test_text_and_video_sources_are_confined_too(tmp_path, gpt2_dir):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "leak.jsonl").write_text(json.dumps({"text": "a secret document"}) + "\n")
    src = tmp_path / "text"
    src.mkdir()
    (src / "a.jsonl").write_text(json.dumps({"text": "hello there"}) + "\n")
    (src / "b.jsonl").symlink_to(outside / "leak.jsonl")
    (src / "c").symlink_to(outside)
    run_repack("text", src, tmp_path / "t", "--tokenizer", gpt2_dir, "--quiet")
    m = read_manifest_json(tmp_path / "t")
    assert m["totals"]["documents"] == 1
    assert {q["source"]: q["reason"] for q in m["quarantine"]} == {
        "b.jsonl": "symlink leaves the source root", "c": "symlink leaves the source root"}

    videos = tmp_path / "videos"
    videos.mkdir()
    (videos / "clip.mp4").symlink_to(outside / "leak.jsonl")
    (videos / "notes.txt").write_text("not a video")
    (videos / "list.mp4").write_text(f"ffconcat version 1.0\nfile '{outside / 'leak.jsonl'}'\n")
    (videos / "live.mkv").write_text(f"#EXTM3U\n#EXTINF:1,\nfile://{outside / 'leak.jsonl'}\n")
    proc = run_repack("video", videos, tmp_path / "v", "--quiet", check=False)
    assert proc.returncode == 7 and "nothing was packed" in proc.stderr  # a folder without videos
    reasons = reasons_of(tmp_path / "v")
    assert reasons["clip.mp4"] == "symlink leaves the source root"
    probes = {r["source"]: r for r in map(json.loads, (tmp_path / "v" / "probe.jsonl").read_text().splitlines())}
    # a concat list is refused by ffprobe's demuxer allow-list; a playlist named .mkv is no Matroska: never followed
    assert probes["list.mp4"]["decision"] == "reject" and "format_refused" in json.dumps(probes["list.mp4"])
    assert probes["live.mkv"]["decision"] == "reject"


# ---- 2. special files are never opened ----------------------------------------------------------

def test_fifos_sockets_and_devices_are_quarantined_without_blocking(tmp_path, gpt2_dir):
    src = tmp_path / "text"
    src.mkdir()
    (src / "a.txt").write_text("one line\n")
    os.mkfifo(src / "pipe.jsonl")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(src / "sock.txt"))
        run_repack("text", src, tmp_path / "t", "--tokenizer", gpt2_dir, "--quiet", timeout=60)
    reasons = reasons_of(tmp_path / "t")
    assert reasons == {"pipe.jsonl": "not a regular file (FIFO)", "sock.txt": "not a regular file (socket)"}

    images = tmp_path / "images"
    images.mkdir()
    (images / "ok.jpg").write_bytes(jpeg_bytes())
    os.mkfifo(images / "fifo.jpg")
    (images / "null.jpg").symlink_to("/dev/null")
    run_repack("images", images, tmp_path / "i", "--quiet", "--allow-outside-source", timeout=60)
    reasons = reasons_of(tmp_path / "i")
    assert reasons == {"fifo.jpg": "not a regular file (FIFO)", "null.jpg": "not a regular file (character device)"}

    listing = tmp_path / "list.txt"
    listing.write_text("text/pipe.jsonl\ntext/a.txt\n")
    run_repack("text", listing, tmp_path / "l", "--list", "--tokenizer", gpt2_dir, "--quiet", timeout=60)
    assert reasons_of(tmp_path / "l") == {"text/pipe.jsonl": "not a regular file (FIFO) (list.txt:1)"}


def test_open_input_never_blocks_and_notices_a_changed_file(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        open_input(str(fifo))
    path = tmp_path / "a.bin"
    path.write_bytes(b"x" * 100)
    st = path.stat()
    planned = [st.st_size, st.st_mtime_ns, st.st_ino]
    with open_input(str(path), planned) as fh:
        assert fh.read() == b"x" * 100
    replacement = tmp_path / "b.bin"
    replacement.write_bytes(b"y" * 100)
    os.replace(replacement, path)  # same size, other bytes, other inode
    with pytest.raises(SourceChanged, match="source changed"):
        open_input(str(path), planned)
    (tmp_path / "link").symlink_to(path)
    with pytest.raises(OSError, match="symlink"):
        open_input(str(tmp_path / "link"))


# ---- 3, 4, 6. text: per-record isolation, BOM, bounded memory ------------------------------------

def test_one_bad_json_line_quarantines_that_line_only(tmp_path, gpt2_dir):
    src = tmp_path / "src"
    src.mkdir()
    docs = documents(30, seed=4)
    lines = [json.dumps({"text": d}) + "\n" for d in docs]
    lines.insert(7, "[" * 200_000 + "]" * 200_000 + "\n")  # RecursionError in json.loads
    (src / "a.jsonl").write_text("".join(lines))
    run_repack("text", src, tmp_path / "out", "--tokenizer", gpt2_dir, "--quiet")
    m = read_manifest_json(tmp_path / "out")
    assert m["totals"]["documents"] == 30
    assert m["quarantine"] == [{"source": "a.jsonl", "line": 8, "reason": "malformed JSON: nested too deeply"}]


@pytest.mark.parametrize("name", ["a.txt", "a.jsonl", "a.jsonl.gz"])
def test_a_leading_bom_is_stripped(tmp_path, gpt2_dir, name):
    import gzip

    body = (b"first document\nsecond one\n" if name == "a.txt"
            else b'{"text": "first document"}\n{"text": "second one"}\n')
    for folder, data in (("plain", body), ("bom", b"\xef\xbb\xbf" + body)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / name).write_bytes(gzip.compress(data, mtime=0) if name.endswith(".gz") else data)
        run_repack("text", tmp_path / folder, tmp_path / f"out-{folder}", "--tokenizer", gpt2_dir, "--quiet")
    assert read_manifest_json(tmp_path / "out-bom")["quarantine"] == []
    assert tokens(tmp_path / "out-bom") == tokens(tmp_path / "out-plain")


def peak_rss_mb(args: list) -> tuple[int, float]:
    """(exit code, peak RSS in MB) of `repack ARGS` run in a fresh process tree."""
    probe = ("import resource, subprocess, sys; rc = subprocess.run([sys.executable, '-m', 'repack'] + sys.argv[1:])"
             ".returncode; print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    proc = subprocess.run([sys.executable, "-c", probe, *map(str, args)], capture_output=True, text=True, cwd=ROOT)
    rc, kb = proc.stdout.split()[-2:]
    return int(rc), int(kb) / 1024


def test_very_long_documents_are_quarantined_with_bounded_memory(tmp_path, gpt2_dir):
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "a.txt", "wb") as fh:
        fh.write(b"short one\n" + b"word " * (40 * 2**20 // 5) + b"\nshort two\n")  # one 40 MiB line
    rc, peak = peak_rss_mb(["text", src, tmp_path / "out", "--tokenizer", gpt2_dir, "--quiet", "--workers", "1"])
    assert rc == 0
    m = read_manifest_json(tmp_path / "out")
    assert m["totals"]["documents"] == 2
    assert m["quarantine"] == [{"source": "a.txt", "line": 2, "reason": "document longer than the 8388608-byte "
                                "cap (--max-doc-bytes): quarantined, not read whole"}]
    assert peak < 400, f"peak RSS {peak:.0f} MB"

    (src / "a.txt").unlink()
    (src / "b.txt").write_bytes(b"x" * 3000 + b"\n\npara two\n")
    run_repack("text", src, tmp_path / "files", "--tokenizer", gpt2_dir, "--doc-per", "blank-line",
               "--max-doc-bytes", "1KB", "--quiet")
    assert [q["line"] for q in read_manifest_json(tmp_path / "files")["quarantine"]] == [1]


def test_huge_sparse_image_is_quarantined_from_its_size(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok.jpg").write_bytes(jpeg_bytes())
    with open(src / "huge.jpg", "wb") as fh:
        fh.write(jpeg_bytes()[:100])
        fh.truncate(300 * 2**20)  # sparse: 300 MiB declared, nothing written
    rc, peak = peak_rss_mb(["images", src, tmp_path / "out", "--quiet", "--workers", "1"])
    assert rc == 0 and peak < 300
    assert reasons_of(tmp_path / "out") == {"huge.jpg": f"file of {300 * 2**20} bytes is over the size cap of "
                                            f"{256 * 2**20} bytes (--max-file-size): not read"}


# ---- 5. nothing packed ---------------------------------------------------------------------------

def test_a_job_that_packs_nothing_exits_7(tmp_path, gpt2_dir):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text(json.dumps({"body": "the text is under another key"}) + "\n")
    for attempt in range(2):  # a re-run of the finished (empty) job says the same
        proc = run_repack("text", src, tmp_path / "out", "--tokenizer", gpt2_dir, "--quiet", check=False)
        assert proc.returncode == 7, proc.stderr
        assert "1 input(s) found but nothing was packed" in proc.stderr and "missing field 'text'" in proc.stderr
    images = tmp_path / "images"
    images.mkdir()
    (images / "a.jpg").write_bytes(b"not an image")
    proc = run_repack("images", images, tmp_path / "i", "--quiet", check=False)
    assert proc.returncode == 7 and "nothing was packed" in proc.stderr


# ---- 7, 10. full decode, bounded; stable reasons -------------------------------------------------

def test_decode_proves_the_whole_image_and_reasons_are_stable(tmp_path):
    good = jpeg_bytes(size=(64, 48))
    sof = good.index(b"\xff\xc0")
    huge = good[:sof + 5] + (65500).to_bytes(2, "big") * 2 + good[sof + 9:]  # declares 65500x65500
    png = png_bytes()
    chunks = png_chunks(png)
    idat = next(i for i, (kind, _) in enumerate(chunks) if kind == b"IDAT")
    body = bytearray(chunks[idat][1])
    body[len(body) // 2] ^= 0xFF
    corrupt_idat = build_png(chunks[:idat] + [(b"IDAT", bytes(body))] + chunks[idat + 1:])  # CRC fixed
    bad_crc = build_png(chunks, fix_crc=False)
    src = tmp_path / "src"
    src.mkdir()
    for name, data in {"ok.jpg": good, "fake_end.jpg": good[:len(good) // 2] + b"\xff\xd9", "huge.jpg": huge,
                       "ok.png": png, "corrupt_idat.png": corrupt_idat, "bad_crc.png": bad_crc}.items():
        (src / name).write_bytes(data)
    outs = []
    for n, extra in enumerate(([], ["--normalize"], [])):
        outs.append(tmp_path / f"out{n}")
        rc, peak = peak_rss_mb(["images", src, outs[-1], "--quiet", "--workers", "1", "--max-pixels", str(2**33),
                                *extra])
        assert rc == 0 and peak < 600, peak
        reasons = reasons_of(outs[-1])
        assert set(reasons) == {"fake_end.jpg", "huge.jpg", "corrupt_idat.png", "bad_crc.png"}, reasons
        assert all("0x" not in r and "object at" not in r for r in reasons.values())
        assert reasons["fake_end.jpg"].startswith("cannot decode JPG: ")
    m0, m2 = read_manifest_json(outs[0]), read_manifest_json(outs[2])
    assert m0["quarantine"] == m2["quarantine"]  # the same text on every run
    assert reasons_of(outs[0])["bad_crc.png"] == "corrupt PNG: bad CRC in chunk 'IHDR'" or \
        "not identified by Pillow" in reasons_of(outs[0])["bad_crc.png"]
    with pytest.raises(BadImage, match="corrupt PNG|cannot decode PNG"):
        inspect_image(corrupt_idat, "decode")
    assert inspect_image(corrupt_idat, "header").ext == "png"  # what the cheaper level cannot see


def sample_images() -> list[Image.Image]:
    rng = np.random.default_rng(0)
    images = []
    for w, h in ((1, 1), (7, 5), (33, 17)):
        rgba = Image.fromarray(rng.integers(0, 256, size=(h, w, 4), dtype=np.uint8), "RGBA")
        images += [rgba, rgba.convert("RGB"), rgba.convert("L"), rgba.convert("LA"), rgba.convert("P"),
                   rgba.convert("1"), Image.fromarray(rng.integers(0, 65536, size=(h, w), dtype=np.uint16))]
    return images


def test_png_verifier_accepts_every_valid_layout():
    for image in sample_images():
        buf = io.BytesIO()
        image.save(buf, "PNG")
        assert inspect_image(buf.getvalue(), "decode").width == image.width, image.mode
        if image.mode in ("L", "LA", "RGB", "RGBA", "I;16"):
            interlaced = adam7_png(image)
            decoded = Image.open(io.BytesIO(interlaced))
            assert np.array_equal(np.asarray(decoded), np.asarray(image)), image.mode  # the encoder is right
            assert inspect_image(interlaced, "decode").width == image.width
            with pytest.raises(BadImage):
                inspect_image(interlaced[:-20] + build_png([(b"IEND", b"")])[8:], "decode")


def adam7_png(image: Image.Image) -> bytes:
    """An interlaced PNG of ``image`` (Pillow writes none): Adam7 passes, filter 0 on every row."""
    channels = {"L": 1, "LA": 2, "RGB": 3, "RGBA": 4, "I;16": 1}[image.mode]
    pixels = np.asarray(image).reshape(image.height, image.width, channels)
    depth = 16 if image.mode == "I;16" else 8
    if depth == 16:
        pixels = pixels.astype(">u2")
    stream = b""
    for x0, y0, dx, dy in ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2),
                           (0, 1, 1, 2)):
        sub = pixels[y0::dy, x0::dx]
        if sub.size:
            stream += b"".join(b"\x00" + row.tobytes() for row in sub)
    color = {1: 0, 2: 4, 3: 2, 4: 6}[channels]
    ihdr = image.width.to_bytes(4, "big") + image.height.to_bytes(4, "big") + bytes([depth, color, 0, 0, 1])
    return build_png([(b"IHDR", ihdr), (b"IDAT", zlib.compress(stream)), (b"IEND", b"")])


# ---- 8. resume fingerprints ----------------------------------------------------------------------

def test_a_source_changed_after_its_shard_is_refused_on_resume(tmp_path):
    src = write_jpegs(tmp_path / "src", 4)
    out = tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "2", "--quiet")
    data = (src / "0.jpg").read_bytes()
    (src / "new.jpg").write_bytes(data[:-10] + bytes([data[-10] ^ 1]) + data[-9:])  # other bytes, same size
    os.replace(src / "new.jpg", src / "0.jpg")
    proc = run_repack("images", src, out, "--shard-size", "2", "--quiet", check=False)
    assert proc.returncode == 2 and "source changed" in proc.stderr and "0.jpg" in proc.stderr


# ---- 9. verify catches tampering -----------------------------------------------------------------

def test_verify_reports_truncated_lmdb_bad_meta_and_readers_refuse(photo_tree, tmp_path):
    out = tmp_path / "lmdb"
    run_repack("images", photo_tree, out, "--to", "lmdb", "--quiet")
    db = out / "data.lmdb"
    original = db.read_bytes()
    db.write_bytes(original[: len(original) // 2])
    proc = run_repack("verify", out, check=False)
    assert proc.returncode == 5 and "not opened as LMDB" in proc.stderr and "Traceback" not in proc.stderr
    reader = subprocess.run([sys.executable, "-c", "from pipelines.torch_lmdb import LmdbImageDataset as D; "
                             f"D({str(out)!r})[0]"], capture_output=True, text=True, cwd=ROOT)
    assert reader.returncode == 1 and "truncated or changed" in reader.stderr  # an exception, not SIGBUS

    import lmdb

    db.write_bytes(original)
    env = lmdb.open(str(db), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        txn.put(b"__meta__", b"\x00not json")
    env.close()
    manifest = read_manifest_json(out)  # a manifest rewritten to match: only the database's content can tell
    manifest["shards"][0].update(bytes=db.stat().st_size, sha256=hashlib.sha256(db.read_bytes()).hexdigest())
    (out / "manifest.json").write_text(json.dumps(manifest))
    proc = run_repack("verify", out, check=False)
    assert proc.returncode == 5 and "__meta__ record is not a JSON object" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_verify_reports_tokenizer_and_unlisted_files(tmp_path, gpt2_dir, packed_photos):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("one\ntwo\n")
    out = tmp_path / "out"
    run_repack("text", src, out, "--tokenizer", gpt2_dir, "--quiet")
    assert run_repack("verify", out).returncode == 0
    tok = out / "tokenizer.json"
    tok.write_text(tok.read_text().replace('"<|endoftext|>"', '"<|endoftxet|>"', 1))
    proc = run_repack("verify", out, check=False)
    assert proc.returncode == 5 and "tokenizer.json: sha256 differs" in proc.stderr
    tok.unlink()
    proc = run_repack("verify", out, check=False)
    assert proc.returncode == 5 and "tokenizer.json: missing" in proc.stderr

    images = tmp_path / "images"
    shutil.copytree(packed_photos, images)
    (images / "shard-000099.tar").write_bytes(b"")
    (images / "sub").mkdir()
    (images / "sub" / "extra.bin").write_bytes(b"x")
    proc = run_repack("verify", images, check=False)
    assert proc.returncode == 5
    assert "shard-000099.tar: a file the manifest does not name" in proc.stderr and "sub/extra.bin" in proc.stderr


# ---- 11. signals -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def normalized(photo_tree, tmp_path_factory):
    """photo_tree packed with --normalize in shards of 5, uninterrupted, without chunks (read only)."""
    ref = tmp_path_factory.mktemp("normalized") / "ref"
    run_repack("images", photo_tree, ref, "--shard-size", "5", "--quiet", "--normalize")
    return ref


@pytest.mark.parametrize("signum,code,chunking", [(signal.SIGTERM, 143, ()), (signal.SIGINT, 130, ()),
                                                  (signal.SIGTERM, 143, ("--chunk-size", "2"))])
def test_signals_stop_workers_remove_temps_and_resume(photo_tree, normalized, tmp_path, signum, code, chunking):
    """Also with shards assembled from chunk tasks: no chunk or shard temp is left, and the resumed
    shards equal those written without chunks."""
    ref = normalized
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "repack", "images", photo_tree, out, "--shard-size", "5",
                             "--quiet", "--normalize", "--workers", "2", *chunking], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    tasks = out / ".repack" / "tasks"
    deadline = time.time() + 60
    while time.time() < deadline and not (tasks.exists() and list(tasks.glob("*.json"))):
        time.sleep(0.005)
    os.killpg(proc.pid, signum)  # to the whole process group, as a terminal's Ctrl-C or `kill -- -PGID` does
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert "re-run the same command to resume" in err and "Traceback" not in err
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]
    assert not (out / "manifest.json").exists()
    run_repack("images", photo_tree, out, "--shard-size", "5", "--quiet", "--normalize", "--workers", "2", *chunking)
    assert shard_bytes(out) == shard_bytes(ref)


def test_a_signal_ignored_at_start_stays_ignored(photo_tree, normalized, tmp_path):
    """A job started with SIGINT ignored (`repack ... &` in a script) runs to its end through Ctrl-Cs, as a
    tool that respects an inherited ignore does (it installed its handler anyway and stopped with 130)."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "repack", "images", photo_tree, out, "--shard-size", "5",
                             "--quiet", "--normalize", "--workers", "2"], cwd=ROOT, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    while proc.poll() is None:
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(0.01)
    assert proc.returncode == 0, proc.stderr.read()
    assert shard_bytes(out) == shard_bytes(normalized)


# ---- 12. one-line failures ------------------------------------------------------------------------

def test_unreadable_tokenizer_is_one_line_exit_2(gpt2_dir):
    base = Path(tempfile.mkdtemp())
    try:
        base.chmod(0o755)
        (base / "src").mkdir(mode=0o755)
        (base / "src" / "a.txt").write_text("hello\n")
        tok = base / "tokenizer.json"
        tok.write_bytes((gpt2_dir / "tokenizer.json").read_bytes())
        tok.chmod(0)
        (base / "out").mkdir(mode=0o777)
        command = [sys.executable, "-m", "repack", "text", str(base / "src"), str(base / "out" / "o"),
                   "--tokenizer", str(tok)]
        if os.getuid() == 0:  # root reads any file: run as nobody
            command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *command]
        proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().count("\n") == 0 and "cannot read it (Permission denied)" in proc.stderr
    finally:
        shutil.rmtree(base)


def test_zst_without_zstandard_fails_before_planning(tmp_path, gpt2_dir):
    import zstandard

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "hi"}\n'))
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "zstandard.py").write_text("raise ImportError('zstandard is not installed (test)')\n")
    proc = run_repack("text", src, tmp_path / "out", "--tokenizer", gpt2_dir, check=False,
                      env={"PYTHONPATH": f"{blocker}{os.pathsep}{ROOT}"})
    assert proc.returncode == 2 and "reading .zst needs zstandard" in proc.stderr
    assert not (tmp_path / "out" / ".repack" / PLAN_NAME).exists()


# ---- 13. 16-bit grayscale PNG ------------------------------------------------------------------------

def test_16_bit_gray_png_reads_back_scaled(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    ramp = np.tile(np.linspace(0, 65535, 64).astype(np.uint16), (32, 1))
    Image.fromarray(ramp).save(src / "gray16.png")
    out = tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    from pipelines.torch_lmdb import LmdbImageDataset
    from pipelines.torch_webdataset import ImageShardDataset

    (image, _), = list(ImageShardDataset(out))
    got = np.asarray(image)
    assert image.mode == "RGB" and np.array_equal(got[..., 0], (ramp >> 8).astype(np.uint8))
    assert abs(got.mean() - 127.5) < 1
    lmdb_out = tmp_path / "lmdb"
    run_repack("images", src, lmdb_out, "--to", "lmdb", "--quiet")
    image, _ = LmdbImageDataset(lmdb_out)[0]
    assert np.array_equal(np.asarray(image)[..., 0], (ramp >> 8).astype(np.uint8))

    from pipelines.dali_lmdb import build_lmdb_pipeline, read_epoch
    from pipelines.dali_webdataset import build_image_pipeline

    pipe = build_image_pipeline(out, batch_size=1, num_threads=1, device_id=None, size=None)
    dali = np.asarray(pipe.run()[0].at(0))
    assert np.abs(dali[..., 0].astype(int) - (ramp >> 8)).max() <= 1  # DALI's own decoder scales 16 bits right
    lmdb_images = read_epoch(build_lmdb_pipeline(lmdb_out, batch_size=1, num_threads=1, device_id=None, size=None))
    assert np.abs(np.asarray(lmdb_images[0][0])[..., 0].astype(int) - (ramp >> 8)).max() <= 1


# ---- list files: one hostile row never fails the job ----------------------------------------------

def test_hostile_list_rows_are_quarantined_and_the_rest_packed(tmp_path, gpt2_dir):
    (tmp_path / "a.png").write_bytes(png_bytes((16, 12)))
    (tmp_path / "l.jsonl").write_text(json.dumps({"path": "a.png"}) + "\n" + "[" * 200_000 + "\n")
    run_repack("images", tmp_path / "l.jsonl", tmp_path / "o1", "--list", "--quiet")
    m = read_manifest_json(tmp_path / "o1")
    assert m["totals"]["samples"] == 1
    assert [q["reason"] for q in m["quarantine"]] == ["malformed JSON line: nested too deeply"]

    (tmp_path / "l.csv").write_text("path\na.png\n" + "x" * 200_000 + "\n")
    run_repack("images", tmp_path / "l.csv", tmp_path / "o2", "--list", "--quiet")
    m = read_manifest_json(tmp_path / "o2")
    assert m["totals"]["samples"] == 1 and len(m["quarantine"]) == 1
    assert m["quarantine"][0]["reason"].startswith("malformed CSV row: field larger than field limit")

    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.jsonl").write_text(json.dumps({"text": "hello there"}) + "\n")
    (tmp_path / "t" / "list.txt").write_bytes(b"a.jsonl\nb\x00c.jsonl\n")
    run_repack("text", tmp_path / "t" / "list.txt", tmp_path / "o3", "--list", "--tokenizer", gpt2_dir, "--quiet")
    m = read_manifest_json(tmp_path / "o3")
    assert m["totals"]["documents"] == 1
    assert [q["reason"] for q in m["quarantine"]] == ["unusable path (embedded NUL byte) (list.txt:2)"]


def test_a_tampered_task_record_never_reaches_outside_out(photo_tree, tmp_path):
    """A record naming a path outside OUT is treated as damaged: its task is redone, nothing outside is touched."""
    out = tmp_path / "out"
    run_repack("images", photo_tree, out, "--shard-size", "10", "--quiet")
    reference = shard_bytes(out)
    outside = tmp_path / "outside.tar"
    outside.write_bytes(b"keep me")
    record_path = out / ".repack" / "tasks" / "shard-000000.json"
    record = json.loads(record_path.read_text())
    record["outputs"][0] = {**record["outputs"][0], "path": "../outside.tar", "bytes": len(b"keep me")}
    record_path.write_text(json.dumps(record))
    (out / "manifest.json").unlink()
    proc = run_repack("images", photo_tree, out, "--shard-size", "10", "--quiet")
    assert "1 task(s) run" in proc.stdout or "1 task(s) run" in proc.stderr
    assert outside.read_bytes() == b"keep me" and shard_bytes(out) == reference


@pytest.mark.parametrize("bad_row", [None, 0, 2500, 4999])
def test_png_filter_bytes_checked_on_every_row_of_a_tall_image(bad_row):
    """Rows are checked many at a time (a tall thin PNG costs no Python step per row); one invalid
    filter byte anywhere, first or last row included, still refuses the image."""
    rows = bytearray(b"\x00\x07\x07\x07" * 5000)
    if bad_row is not None:
        rows[4 * bad_row] = 9
    ihdr = (3).to_bytes(4, "big") + (5000).to_bytes(4, "big") + bytes([8, 0, 0, 0, 0])
    png = build_png([(b"IHDR", ihdr), (b"IDAT", zlib.compress(bytes(rows))), (b"IEND", b"")])
    if bad_row is None:
        assert (inspect_image(png, "decode").width, inspect_image(png, "decode").height) == (3, 5000)
    else:
        with pytest.raises(BadImage, match="1 row\\(s\\) with an invalid filter type"):
            inspect_image(png, "decode")


def test_cut_gifs_and_a_cut_jpeg_with_a_thumbnail_are_truncated_at_every_check_level():
    """--verify header's trailer check: the file must end as a whole one does (a cut GIF almost always holds a
    ';' byte, a cut small JPEG its thumbnail's end marker); --verify decode decodes every frame of an animation."""
    rng = np.random.default_rng(3)
    noise = lambda size: Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))  # noqa: E731
    still, anim, jpeg, thumb = io.BytesIO(), io.BytesIO(), io.BytesIO(), io.BytesIO()
    noise(64).save(still, format="GIF")
    frames = [noise(64) for _ in range(4)]
    frames[0].save(anim, format="GIF", save_all=True, append_images=frames[1:])
    Image.new("RGB", (16, 16), (5, 5, 5)).save(thumb, "JPEG")
    noise(48).save(jpeg, "JPEG", quality=90)
    app1 = b"\xff\xe1" + (len(thumb.getvalue()) + 8).to_bytes(2, "big") + b"Exif\0\0" + thumb.getvalue()
    with_thumb = jpeg.getvalue()[:2] + app1 + jpeg.getvalue()[2:]
    for whole, cut_at in ((still.getvalue(), 0.6), (anim.getvalue(), 0.8), (with_thumb, 0.8)):
        for level in ("header", "decode"):
            assert inspect_image(whole, level).width in (48, 64)
            with pytest.raises(BadImage):
                inspect_image(whole[:int(len(whole) * cut_at)], level)
    assert inspect_image(anim.getvalue() + b"\0\0", "header").ext == "gif"  # zero padding after the trailer


def test_a_folder_nested_deeper_than_the_walk_goes_is_quarantined_not_a_crash(tmp_path):
    """600 levels (a 1,230-byte path, under PATH_MAX): the walk recursed per level and died with RecursionError
    (exit 1, no manifest); the folder past MAX_DEPTH is quarantined by name and the rest packed."""
    from repack.sources.walk import MAX_DEPTH

    src = tmp_path / "src"
    (src / "cls").mkdir(parents=True)
    (src / "cls" / "shallow.jpg").write_bytes(jpeg_bytes(seed=1))
    deep = src / "cls"
    fd = os.open(deep, os.O_RDONLY)
    try:
        for _ in range(600):  # relative to an open folder: no path grows past PATH_MAX on the way
            os.mkdir("d", dir_fd=fd)
            inner = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = inner
        with open(os.open("deep.jpg", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "wb") as fh:
            fh.write(jpeg_bytes(seed=2))
    finally:
        os.close(fd)
    for workers in ("1", "2"):
        out = tmp_path / f"out{workers}"
        run_repack("images", src, out, "--workers", workers, "--quiet")
        manifest = read_manifest_json(out)
        assert manifest["totals"]["samples"] == 1
        [record] = manifest["quarantine"]
        assert record["source"] == "cls/" + "/".join(["d"] * MAX_DEPTH)
        assert f"nested over {MAX_DEPTH} levels" in record["reason"]


def test_a_whole_image_with_data_after_its_end_is_packed(tmp_path):
    """A Motion Photo is a JPEG with an MP4 after its end marker (an appended ZIP likewise): every decoder reads
    it, and it was quarantined as "truncated (no end marker)" once more than 4 KiB followed. The image's own
    end is found by walking its segments now; a JPEG cut inside its scan is still truncated."""
    import random

    from repack.transforms.image_check import BadImage, inspect_image

    tail = b"\xff\xda\x00\x0c" + random.Random(0).randbytes(8192) + b"\xff\xd9mp4"
    for fmt in ("JPEG", "PNG"):
        buf = io.BytesIO()
        Image.new("RGB", (64, 48), (200, 30, 30)).save(buf, fmt)
        for level in ("header", "decode"):
            assert inspect_image(buf.getvalue() + tail, level).width == 64
    whole = io.BytesIO()
    Image.effect_noise((64, 48), 40).convert("RGB").save(whole, "JPEG", exif=Image.Exif().tobytes())
    cut = whole.getvalue()[:len(whole.getvalue()) * 2 // 3]
    with pytest.raises(BadImage, match="truncated"):
        inspect_image(cut, "header")


def test_a_later_tiff_page_over_the_cap_and_float_samples_are_quarantined(tmp_path):
    """A multi-page TIFF's 8x8 first page then a 20000x20000 second one: only the first was measured, and the
    second was decoded (~800 MB) and packed. A float (mode F) TIFF passed and read back as 0s and 1s."""
    from repack.transforms.image_check import BadImage, inspect_image

    import struct
    import zlib

    def ifd(width: int, height: int, compression: int, offset: int, count: int, following: int) -> bytes:
        entries = [(256, 4, 1, width), (257, 4, 1, height), (258, 3, 1, 8), (259, 3, 1, compression), (262, 3, 1, 1),
                   (273, 4, 1, offset), (277, 3, 1, 1), (278, 4, 1, height), (279, 4, 1, count)]
        return struct.pack("<H", len(entries)) + b"".join(struct.pack("<HHII", *e) for e in entries) + \
            struct.pack("<I", following)

    strip = zlib.compress(bytes(100))  # page 2's data: never read, its size refuses it first
    first_ifd = 8 + 64 + len(strip)
    second_ifd = first_ifd + 2 + 12 * 9 + 4
    pages = (b"II*\x00" + struct.pack("<I", first_ifd) + bytes(64) + strip + ifd(8, 8, 1, 8, 64, second_ifd)
             + ifd(20000, 20000, 8, 72, len(strip), 0))
    assert Image.open(io.BytesIO(pages)).n_frames == 2
    with pytest.raises(BadImage, match="20000x20000 needs .* over the .*-byte decode cap"):
        inspect_image(pages, "decode")
    floats = io.BytesIO()
    Image.fromarray(np.linspace(0.1, 1.0, 64, dtype=np.float32).reshape(8, 8), mode="F").save(floats, "TIFF")
    for level in ("header", "decode"):
        with pytest.raises(BadImage, match="floating-point samples"):
            inspect_image(floats.getvalue(), level)


def test_a_progressive_jpeg_over_the_cap_in_coefficients_is_quarantined():
    """A progressive JPEG's decoder holds every coefficient of the image whatever the reduction asked for: a
    9000x9000 4:4:4 one took ~500 MB (a 568-byte one declaring 13000x13000: 1 GB, before it failed) where the
    check promises 256 MiB. Measured from its SOF first now; 4:2:0 (243 MB) still fits."""
    from repack.transforms.image_check import BadImage, inspect_image, progressive_coefficient_bytes

    for subsampling, fits in ((0, False), (2, True)):
        buf = io.BytesIO()
        Image.new("RGB", (9000, 9000), (120, 30, 200)).save(buf, "JPEG", progressive=True, subsampling=subsampling,
                                                              quality=50)
        assert progressive_coefficient_bytes(buf.getvalue()) == (243_432_192 if fits else 486_000_000)
        if fits:
            assert inspect_image(buf.getvalue(), "decode").progressive
            continue
        app = b"\xff\xe2" + (65535).to_bytes(2, "big") + bytes(65533)  # APP segments: the SOF past the first MiB
        for data in (buf.getvalue(), buf.getvalue()[:2] + app * 17 + buf.getvalue()[2:]):
            with pytest.raises(BadImage, match="multi-scan JPG of 9000x9000 holds 486000000 bytes of coefficients"):
                inspect_image(data, "decode")


def test_extraneous_bytes_between_jpeg_segments_are_no_truncation():
    """Two stray bytes before a marker: libjpeg skips them (its decode warns, which the strict check refuses,
    saying so); the end-marker walk skips them too, where it called the file truncated."""
    from repack.transforms.image_check import BadImage, inspect_image

    buf = io.BytesIO()
    Image.new("RGB", (32, 24), (10, 120, 200)).save(buf, "JPEG")
    data = buf.getvalue()
    dqt = data.find(b"\xff\xdb")
    stray = data[:dqt] + b"\x00\x00" + data[dqt:]
    assert inspect_image(stray, "header").width == 32
    with pytest.raises(BadImage, match="extraneous bytes"):
        inspect_image(stray, "decode")


def test_a_signal_in_a_child_forked_before_its_own_handlers_ends_it_quietly():
    """A pool worker forked as SIGTERM came to the process group still ran the driver's handler: its raise during
    the worker's start printed multiprocessing's traceback (the signals test saw it once in a full run). In a child
    the handler ends it as the default action does; in the driver it still raises Interrupted."""
    code = (
        "import os, signal, sys, time\n"
        "import repack.cli as cli\n"
        "cli._HANDLER_PID[0] = os.getpid()\n"
        "signal.signal(signal.SIGTERM, cli._on_signal)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    time.sleep(30)\n"
        "    os._exit(0)\n"
        "time.sleep(0.3)\n"
        "os.kill(pid, signal.SIGTERM)\n"
        "print('child', os.waitpid(pid, 0)[1] & 0x7f)\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(5)\n"
        "except BaseException as exc:\n"
        "    print('driver', type(exc).__name__)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["child", str(int(signal.SIGTERM)), "driver", "Interrupted"], done
    assert "Traceback" not in done.stderr, done.stderr

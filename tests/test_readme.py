"""Every `bash` and `python` block of README.md and docs/*.md runs as written.

Each block carries a marker on the line above it: ``<!-- readme-test: run SANDBOX -->``, or,
visible to readers, ``*Not run by the README test: REASON.*``. A sandbox is what a reader brings:
the inputs the placeholders name (``SRC``, ``TOK``, ``corpus/``, ``docs.txt.zst``, ``list.txt``,
``photos``), generated here, small. A docs page runs as a reader follows it: all its blocks in page
order in one folder holding the inputs of every sandbox the page names (they use distinct names),
so a page that reused an OUT for another kind of dataset, or used a file no block made, fails.
README.md's sections are three separate quick starts on the reader's own SRC and OUT (images,
videos, text): its blocks run per sandbox, each in a folder of its own.
The ``s3`` sandbox also starts moto's S3 server on loopback (tests/tools/s3server.py), fills the
buckets its blocks read and sets the standard AWS variables for them.
Bash runs with ``-euo pipefail`` and this checkout's ``repack`` first on PATH; Python blocks run
as scripts with this interpreter. A block that prints a Python warning fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_repack
from tests.tools.photos import make_photo_tree
from tests.tools.s3server import MotoServer, client, s3_env
from tests.tools.text import documents, gpt2_tokenizer, write_tokenizer
from tests.tools.videos import CLIPS, make_clips

MARKER = re.compile(r"^(?:<!-- readme-test: run (?P<sandbox>[\w-]+) -->|\*Not run by the README test: (?P<reason>.+\S)\.\*)$")
CODE = ("bash", "sh", "python")
WARNING = re.compile(r"\b[A-Z]\w*Warning: .*")  # what Python's warnings module prints (a block must print none)


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    language: str
    code: str
    sandbox: str | None
    reason: str | None


def pages() -> list[str]:
    """README.md and every docs/*.md page, as paths relative to the checkout."""
    return ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]


def page_blocks(page: str) -> list[Block]:
    """Every fenced block of ``page`` with its language and the marker right above it (if any)."""
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        start = i
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        above = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(above.strip())
        blocks.append(Block(page, start + 1, fence.group(1), "\n".join(lines[start + 1:end]) + "\n",
                            marker.group("sandbox") if marker else None, marker.group("reason") if marker else None))
        i = end + 1
    return blocks


def readme_blocks() -> list[Block]:
    """The blocks of every page, page by page."""
    return [block for page in pages() for block in page_blocks(page)]


# -- sandboxes: what the blocks' placeholders name ----------------------------------------------
def photos(root: Path, per_class: int, classes: int, max_side: int) -> None:
    make_photo_tree(root, per_class=per_class, classes=classes, seed=7, min_side=40, max_side=max_side)


def images_sandbox(cwd: Path) -> None:
    photos(cwd / "SRC", 8, 4, 120)


def report_sandbox(cwd: Path) -> dict[str, str]:
    """288 photos (one full batch of 64 for each of 4 loader workers) and a broken one. `repack bench`
    runs one round of its sweep after one warm-up step (REPACK_BENCH_ROUNDS, REPACK_BENCH_WARMUP: its
    defaults, 3 rounds and 5 steps, made the page's three sweeps most of a minute; the rounds, their
    order and spread are tests/test_bench_cli.py's)."""
    photos(cwd / "SRC", 48, 6, 64)
    (cwd / "SRC" / "astronaut" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really")
    return {"REPACK_BENCH_ROUNDS": "1", "REPACK_BENCH_WARMUP": "1"}


def text_sandbox(cwd: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    docs = documents(300, seed=11)
    (cwd / "corpus").mkdir()
    for i in range(3):
        (cwd / "corpus" / f"part-{i}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[i::3]))
    (cwd / "docs.txt.zst").write_bytes(zstandard.ZstdCompressor().compress("\n\n".join(docs[:50]).encode()))
    (cwd / "more").mkdir()
    pq.write_table(pa.table({"content": docs[50:100]}), cwd / "more" / "a.parquet")
    (cwd / "more" / "b.jsonl").write_text("".join(json.dumps({"content": d}) + "\n" for d in docs[100:150]))
    (cwd / "list.txt").write_text("more/a.parquet\nmore/b.jsonl\n")
    if not (cwd / "SRC").exists():  # the front page's `repack text SRC OUT --tokenizer TOK`
        shutil.copytree(cwd / "corpus", cwd / "SRC")
    write_tokenizer(gpt2_tokenizer(), cwd / "TOK")


def video_sandbox(cwd: Path) -> None:
    chosen = {"good/h264.mp4", "good/vp9.webm", "bad/long_gop.mp4", "junk/empty.mp4"}
    make_clips(cwd / "SRC", [c for c in CLIPS if c.rel in chosen], workers=2)


def confine_sandbox(cwd: Path) -> None:
    """SRC with what the confinement refuses (a symlink leaving SRC, a FIFO, a link inside SRC);
    corpus/ (JSON lines) and tokenizer tok/."""
    photos(cwd / "SRC", 4, 2, 120)
    first = sorted((cwd / "SRC").rglob("*.*"))[0]
    (cwd / "elsewhere.jpg").write_bytes(first.read_bytes())
    (first.parent / "outside.jpg").symlink_to(cwd / "elsewhere.jpg")
    (first.parent / "inside.jpg").symlink_to(first)
    os.mkfifo(first.parent / "pipe.jpg")
    (cwd / "corpus").mkdir()
    (cwd / "corpus" / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(40, seed=3)))
    write_tokenizer(gpt2_tokenizer(), cwd / "tok")


def s3_sandbox(cwd: Path, server: MotoServer) -> dict[str, str]:
    """raw-bucket/photos (an image tree), raw-bucket/corpus (JSON lines), an empty train-bucket, a
    local image tree photos/, a local video folder VIDEOS and tokenizer tok/; the environment a user
    sets for the endpoint."""
    photos(cwd / "photos", 6, 3, 120)
    s3 = client(server.endpoint)
    for bucket in ("raw-bucket", "train-bucket"):
        s3.create_bucket(Bucket=bucket)
    for path in sorted((cwd / "photos").rglob("*")):
        if path.is_file():
            s3.upload_file(str(path), "raw-bucket", f"photos/{path.relative_to(cwd / 'photos').as_posix()}")
    docs = documents(120, seed=5)
    for i in range(2):
        s3.put_object(Bucket="raw-bucket", Key=f"corpus/part-{i}.jsonl",
                      Body="".join(json.dumps({"text": d}) + "\n" for d in docs[i::2]).encode())
    write_tokenizer(gpt2_tokenizer(), cwd / "tok")
    make_clips(cwd / "VIDEOS", [c for c in CLIPS if c.rel == "good/h264.mp4"], workers=1)
    return {**s3_env(server.endpoint), "REPACK_SCRATCH": str(cwd / "scratch"), "REPACK_BENCH_ROUNDS": "1"}  # as report_sandbox


SANDBOXES = {"images": images_sandbox, "report": report_sandbox, "text": text_sandbox, "video": video_sandbox,
             "confine": confine_sandbox, "s3": s3_sandbox}  # a page's sandboxes are made in this order


def test_every_code_block_is_marked():
    blocks = [b for b in readme_blocks() if b.language in CODE]
    unmarked = [f"{b.page}:{b.line}" for b in blocks if b.sandbox is None and b.reason is None]
    assert not unmarked, f"code blocks at {unmarked} lack a readme-test marker"
    assert {b.sandbox for b in blocks if b.sandbox} == set(SANDBOXES)
    skipped = [b for b in blocks if b.reason]
    assert len(skipped) <= 8 and all(len(b.reason) > 20 for b in skipped)  # few, and each says why
    for page in pages():
        assert sum(1 for b in skipped if b.page == page) <= 4, f"{page}: more than 4 blocks not run"
    assert sum(1 for b in blocks if b.sandbox) >= 10
    assert any(b.page == "README.md" and b.sandbox for b in blocks)


def run_block(block: Block, cwd: Path, number: int, extra_env: dict[str, str]) -> None:
    env = {**os.environ, **extra_env, "PYTHONPATH": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    if block.language == "python":
        script = cwd / f"readme_block_{number}.py"
        script.write_text(block.code)
        command = [sys.executable, str(script)]
    else:
        command = ["bash", "-euo", "pipefail", "-c", block.code]
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (f"{block.page} line {block.line} ({block.language}) exited {proc.returncode}:\n"
                                  f"{block.code}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}")
    warned = WARNING.findall(proc.stdout + proc.stderr)
    assert not warned, f"{block.page} line {block.line} ({block.language}) printed warnings: {warned}\n{proc.stderr[-3000:]}"


LONG_PAGES = ("docs/report.md", "docs/dataset-over-time.md")  # run by tests/test_readme_long_pages.py (below)


def runs(long_pages: bool = False) -> list[tuple[str, tuple[str, ...]]]:
    """(page, the sandboxes its run prepares): a docs page once with all of them; README.md once per
    sandbox (its sections are separate quick starts). ``long_pages``: those of LONG_PAGES, else the
    others (two files, so that two pytest-xdist workers share the pages under ``--dist loadfile``)."""
    found = []
    for page in pages():
        if (page in LONG_PAGES) != long_pages:
            continue
        named = [name for name in SANDBOXES if any(b.sandbox == name for b in page_blocks(page))]
        found += [(page, (name,)) for name in named] if page == "README.md" else [(page, tuple(named))] if named else []
    return found


def run_page(page: str, sandboxes: tuple[str, ...], cwd: Path) -> None:
    """Make ``sandboxes`` in ``cwd`` (the ``s3`` one with a moto server, stopped at the end), run the
    page's blocks of those sandboxes there in page order; they must have made a dataset (or a report)."""
    with contextlib.ExitStack() as stack:
        env: dict[str, str] = {}
        for name in sandboxes:
            needs = ()
            if name == "s3":
                server = MotoServer()
                stack.callback(server.stop)
                needs = (server,)
            env.update(SANDBOXES[name](cwd, *needs) or {})
        blocks = [b for b in page_blocks(page) if b.sandbox in sandboxes]
        for number, block in enumerate(blocks):
            run_block(block, cwd, number, env)
    made = [p for p in cwd.rglob("manifest.json") if ".repack" not in p.parts]
    assert made or (cwd / "report.html").is_file(), "the blocks made no dataset"
    shutil.rmtree(cwd, ignore_errors=True)


def test_pages_are_split_between_the_two_files():
    assert {page for page, _ in runs(long_pages=True)} == set(LONG_PAGES)
    every = runs(False) + runs(True)
    assert len(every) == len(set(every)) and {page for page, _ in every} == {b.page for b in readme_blocks() if b.sandbox}


@pytest.mark.parametrize(("page", "sandboxes"), runs(), ids=[f"{p}::{'+'.join(s)}" for p, s in runs()])
def test_readme_blocks_run_as_written(page, sandboxes, tmp_path):
    run_page(page, sandboxes, tmp_path)

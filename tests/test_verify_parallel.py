"""`repack verify` on all cores (issue 26, item 4): shards checked on a process pool with results in
manifest order; each tar checked against its index with numpy (``tar_check``), the member-by-member
walk kept for whatever does not match, so a damaged shard is named with the walk's own message; on
s3:// the files of a shard fetched with concurrent ranged GETs (real S3 server on loopback)."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from repack.sinks.keys import index_key_hashes, index_keys, key_hashes
from repack.sinks.tar_format import end_of_archive, index_from_tar
from repack.sinks.tar_verify import matches_by_index, verify_by_walk
from tests.conftest import read_manifest_json, run_repack
from tests.tools.s3server import FaultProxy, MotoServer, client, s3_env


def walk_problems(out: Path, shard: dict) -> list[str]:
    problems: list[str] = []
    verify_by_walk(out, shard, lambda ok, message: ok or problems.append(message))
    return problems


def verify_json(target, *args, env: dict | None = None) -> tuple[int, list[str]]:
    proc = run_repack("verify", target, "--json", *args, env=env, check=False)
    return proc.returncode, json.loads(proc.stdout)["problems"]


def rewrite(out: Path, rel: str, data: bytes) -> None:
    """Replace ``out/rel`` and update the manifest's size and sha256 for it, so only the deeper checks can tell."""
    (out / rel).write_bytes(data)
    manifest = read_manifest_json(out)
    digest = hashlib.sha256(data).hexdigest()
    for shard in manifest["shards"]:
        if shard["path"] == rel:
            shard.update(bytes=len(data), sha256=digest)
        if shard.get("checksums") == rel:
            shard.update(checksums_bytes=len(data), checksums_sha256=digest)
    (out / "manifest.json").write_text(json.dumps(manifest))


def test_a_shard_repack_wrote_passes_the_index_check_and_the_walk_agrees(packed_photos):
    shards = read_manifest_json(packed_photos)["shards"]
    assert len(shards) > 1
    for shard in shards:
        assert matches_by_index(packed_photos, shard), shard["path"]
        assert walk_problems(packed_photos, shard) == []


def header_checksum_broken(out: Path) -> str:
    second = int((out / "shard-000001.idx").read_text().split("\n")[1].split(" ")[5]) - 512
    tar = bytearray((out / "shard-000001.tar").read_bytes())
    tar[second + 20] ^= 1  # a byte of the second member's name: its header checksum no longer holds
    rewrite(out, "shard-000001.tar", bytes(tar))
    return "unreadable tar (header checksum mismatch"


def index_offset_moved(out: Path) -> str:
    text = (out / "shard-000001.idx").read_text().split("\n")
    fields = text[2].split(" ")
    fields[1] = str(int(fields[1]) + 512)
    text[2] = " ".join(fields)
    (out / "shard-000001.idx").write_text("\n".join(text))
    return "shard-000001.idx: does not match the tar's members"


def checksums_of_other_bytes(out: Path) -> str:
    crc = bytearray((out / "shard-000001.crc").read_bytes())
    crc[-1] ^= 0xFF
    rewrite(out, "shard-000001.crc", bytes(crc))
    return "shard-000001.crc: does not match the samples' bytes"


def bytes_after_the_end(out: Path) -> str:
    rewrite(out, "shard-000001.tar", (out / "shard-000001.tar").read_bytes() + bytes(10240))
    return "bytes after the end-of-archive"


@pytest.mark.parametrize("damage", [header_checksum_broken, index_offset_moved, checksums_of_other_bytes,
                                    bytes_after_the_end])
def test_a_damaged_shard_is_named_with_the_walks_message_in_manifest_order(packed_photos, tmp_path, damage):
    out = tmp_path / "out"
    shutil.copytree(packed_photos, out)
    (out / "shard-000003.tar").write_bytes(b"")  # a second damage, later in the manifest
    expected = damage(out)
    shard = read_manifest_json(out)["shards"][1]
    assert not matches_by_index(out, shard)
    code, problems = verify_json(out, "--workers", "3")
    assert code == 5
    assert problems == verify_json(out, "--workers", "1")[1]  # the same list, in the same order
    assert [p for p in problems if p.startswith("shard-000001")] == walk_problems(out, shard)
    assert any(expected in p for p in problems), problems
    first_later = next(i for i, p in enumerate(problems) if p.startswith("shard-000003"))
    assert all(not p.startswith("shard-000001") for p in problems[first_later:])


def test_another_tools_header_bytes_fall_back_to_the_walk_and_pass(packed_photos, tmp_path):
    """A tar whose headers differ from repack's own bytes (a non-zero mtime, a checksum written as 7
    digits) but that is a valid archive matching its index is not rejected: the walk checks it."""
    out = tmp_path / "out"
    shutil.copytree(packed_photos, out)
    tar = bytearray((out / "shard-000002.tar").read_bytes())
    offset = 0
    while tar[offset:offset + 512] != bytes(512):
        header = tar[offset:offset + 512]
        header[136:148] = b"14700000000\x00"
        header[148:156] = b" " * 8
        header[148:156] = b"%07o\x00" % sum(header)
        tar[offset:offset + 512] = header
        size = int(header[124:135], 8)
        offset += 512 + size + (-size % 512)
    rewrite(out, "shard-000002.tar", bytes(tar))
    with open(out / "shard-000002.tar", "rb") as fh:
        assert index_from_tar(fh) == (out / "shard-000002.idx").read_text()
    shard = read_manifest_json(out)["shards"][2]
    assert not matches_by_index(out, shard)
    assert walk_problems(out, shard) == []
    assert verify_json(out) == (0, [])


def test_key_hashes_are_the_same_from_numpy_and_from_the_line_loop(packed_photos):
    raw = (packed_photos / "shard-000000.idx").read_bytes()
    keys = index_keys(raw)
    assert len(keys) == 25 and len(set(keys)) == 25
    assert np.array_equal(index_key_hashes(raw), key_hashes(keys))
    first_line = raw.index(b"\n")
    odd = raw[:first_line] + raw[first_line:].replace(b" ", b"  ", 1)  # not canonical: the loop reads it
    assert np.array_equal(index_key_hashes(odd), key_hashes(index_keys(odd)))
    assert len(set(key_hashes([*keys, "x" * 40, "x" * 41]).tolist())) == 27


def test_a_key_held_by_two_shards_is_reported_by_name(packed_photos, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(packed_photos, out)
    manifest = read_manifest_json(out)
    copy = dict(manifest["shards"][0])
    for field, suffix in (("path", "tar"), ("index", "idx"), ("checksums", "crc")):
        copy[field] = f"shard-000009.{suffix}"
        shutil.copy(out / f"shard-000000.{suffix}", out / copy[field])
    manifest["shards"].append(copy)  # the first shard's samples again, under other names
    manifest["totals"]["samples"] += copy["samples"]
    manifest["totals"].update(shards=manifest["totals"]["shards"] + 1, bytes=manifest["totals"]["bytes"] + copy["bytes"])
    (out / "manifest.json").write_text(json.dumps(manifest))
    key = index_keys((out / "shard-000000.idx").read_bytes())[0]
    code, problems = verify_json(out, "--workers", "2")
    assert code == 5
    keys = [problem for problem in problems if "sample key" in problem]
    assert keys[0] == (f"sample key {key!r} is held 2 times (shard-000000.tar, shard-000009.tar): "
                       "keys must be unique")
    assert len(keys) == 11  # ten named, then how many more
    assert any(problem.startswith("class 'astronaut' (index 0): 24 sample(s) hold it") for problem in problems)


# -- s3:// --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    moto = MotoServer()
    yield moto
    moto.stop()


def upload(endpoint: str, folder: Path, bucket: str, prefix: str) -> str:
    s3 = client(endpoint)
    s3.create_bucket(Bucket=bucket)
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and not rel.startswith(".repack/"):
            s3.put_object(Bucket=bucket, Key=f"{prefix}/{rel}", Body=path.read_bytes())
    return f"s3://{bucket}/{prefix}"


class InFlight:
    """Counts the GETs the proxy holds at once (each held 0.15 s after the store answered)."""

    def __init__(self) -> None:
        self.now = self.most = 0
        self.lock = threading.Lock()

    def __call__(self, method: str, path: str) -> None:
        if method != "GET" or "list-type" in path:
            return
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        time.sleep(0.15)
        with self.lock:
            self.now -= 1


def test_s3_verify_fetches_a_shards_files_with_concurrent_ranged_gets(server, photo_tree, tmp_path):
    run_repack("images", photo_tree, tmp_path / "one", "--shard-size", "1000", "--quiet")  # one shard
    url = upload(server.endpoint, tmp_path / "one", "ranged", "run")
    in_flight = InFlight()
    proxy = FaultProxy(server.port, on_answer=in_flight)
    try:
        env = {**s3_env(proxy.endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch")}
        assert verify_json(url, env=env) == (0, [])
        tar_gets = [r for r in proxy.requests if r[0] == "GET" and r[1].split("?")[0].endswith(".tar")]
        assert tar_gets and all(r[2] and r[2].startswith("bytes=") for r in tar_gets)
        assert in_flight.most >= 3, in_flight.most  # a shard's tar, index and checksums at least
    finally:
        proxy.stop()


def test_download_parts_fetches_parts_concurrently_and_names_a_change(server, tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from repack.store import s3_client
    from repack.store.s3 import S3Store

    data = np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    s3 = client(server.endpoint)
    s3.create_bucket(Bucket="parts")
    s3.put_object(Bucket="parts", Key="p/blob.bin", Body=data, Metadata={"sha256": hashlib.sha256(data).hexdigest()})
    in_flight = InFlight()
    proxy = FaultProxy(server.port, on_answer=in_flight)
    try:
        for name, value in s3_env(proxy.endpoint).items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(s3_client, "_clients", {})
        with ThreadPoolExecutor(8) as pool:
            got = S3Store("s3://parts/p").download_parts("blob.bin", tmp_path / "blob.bin", pool, part_bytes=40_000)
            assert S3Store("s3://parts/p").download_parts("absent.bin", tmp_path / "absent.bin", pool) is None
        assert got == (len(data), hashlib.sha256(data).hexdigest(), hashlib.sha256(data).hexdigest())
        assert (tmp_path / "blob.bin").read_bytes() == data
        ranges = sorted(r[2] for r in proxy.requests if r[0] == "GET" and r[2])
        assert len(ranges) == 8 and "bytes=280000-299999" in ranges
        assert in_flight.most >= 4, in_flight.most
    finally:
        proxy.stop()


# -- a shard's check in parts (the per-shard tail of issue 26 item 4) -----------------------------------
def tar_with_keys(keys: list[str]) -> tuple[bytes, bytes]:
    """(tar, idx) repack writes for samples ``keys`` (a 5-byte .jpg and a 1-byte .cls each), one index
    line per sample."""
    from repack.sinks.tar_format import index_text, ustar_header

    body, lines = bytearray(), []
    for key in keys:
        line = []
        for ext, data in (("jpg", b"\xff\xd8abc"), ("cls", b"3")):
            body += ustar_header(f"{key}.{ext}".encode(), len(data))
            line.append((ext, len(body), len(data), f"{key}.{ext}"))
            body += data + bytes(-len(data) % 512)
        lines.append(line)
    return bytes(body) + end_of_archive(len(body)), index_text(lines).encode()


def parts_of(tar: bytes, idx: bytes, parts: int, checksums: bytes | None = None):
    from repack.sinks.tar_check import check_part

    return [check_part(tar, idx, part, parts, checksums) for part in range(parts)]


def test_the_parts_of_a_shard_cover_each_line_once_and_agree_as_the_whole_does(packed_photos):
    from repack.sinks.tar_check import check_against_index, parts_agree

    shard = read_manifest_json(packed_photos)["shards"][0]
    tar, idx = (packed_photos / shard["path"]).read_bytes(), (packed_photos / shard["index"]).read_bytes()
    crc = (packed_photos / shard["checksums"]).read_bytes()
    whole = check_against_index(tar, idx)
    for parts in (1, 2, 3, 7, 25):
        found = parts_of(tar, idx, parts, crc)
        assert all(found) and parts_agree(found), parts
        assert [p.first_sample for p in found if p.samples] == sorted({p.first_sample for p in found if p.samples})
        assert sum(p.samples for p in found) == shard["samples"] == len(whole.keys)
        assert np.array_equal(np.concatenate([p.key_hashes for p in found]), index_key_hashes(idx))
    damaged = bytearray(crc)
    damaged[-1] ^= 1  # the last sample's crc32: only the last part reads it
    found = parts_of(tar, idx, 3, bytes(damaged))
    assert found[0] is not None and found[-1] is None


def test_adjacent_samples_with_one_key_across_a_part_boundary_do_not_pass():
    """Each part alone is a valid run of samples; only the join sees that the last key of one part is
    the first of the next (a reader would merge the two samples)."""
    from repack.sinks.tar_check import check_against_index, parts_agree

    keys = [f"{i:04d}" for i in range(8)]
    tar, idx = tar_with_keys(keys)
    found = parts_of(tar, idx, 2)
    assert all(found) and parts_agree(found)
    boundary = found[1].first_sample
    keys[boundary] = keys[boundary - 1]
    tar, idx = tar_with_keys(keys)
    assert check_against_index(tar, idx) is None
    found = parts_of(tar, idx, 2)
    assert all(found) and found[1].first_sample == boundary  # each part passes on its own
    assert not parts_agree(found)
    assert not parts_agree([found[1], found[0]])  # nor do parts out of order


def test_no_verify_task_holds_more_than_a_part_and_the_digests_start_first():
    """The biggest task bounds verify's wall: a 40,000-sample shard is cut into parts of at most
    PART_SAMPLES samples, and tasks start biggest first (the sequential sha256 of the biggest tar first)."""
    from repack.lifecycle.verify_shards import plan_tasks
    from repack.sinks.tar_verify import PART_SAMPLES

    shards = [{"path": f"s{i}.tar", "index": f"s{i}.idx", "samples": n, "bytes": n * 3584, "index_bytes": n * 118}
              for i, n in enumerate((40_000, 12_000, 1))]
    tasks = plan_tasks("webdataset", shards)
    parts = {i: [t for t in tasks if t.shard == i and t.kind == "part"] for i in range(3)}
    assert [len(parts[i]) for i in range(3)] == [-(-40_000 // PART_SAMPLES), 1, 1]
    assert (tasks[0].kind, tasks[0].shard) == ("digest", 0)  # the longest sequential task starts first
    assert [t.cost for t in tasks] == sorted((t.cost for t in tasks), reverse=True)
    assert [t.kind for t in plan_tasks("lmdb", shards[:1])] == ["whole"]


def test_totals_that_disagree_with_the_shards_are_reported(packed_photos, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(packed_photos, out)
    manifest = read_manifest_json(out)
    manifest["totals"].update(shards=manifest["totals"]["shards"] + 1, bytes=manifest["totals"]["bytes"] - 512)
    (out / "manifest.json").write_text(json.dumps(manifest))
    code, problems = verify_json(out)
    assert code == 5 and any(p.startswith("totals.shards ") for p in problems) and \
        any(p.startswith("totals.bytes ") for p in problems)


def test_a_class_map_that_does_not_match_the_samples_cls_members_is_named(tmp_path):
    """The labels a reader yields are the ``.cls`` members; the class map gives them names. A map edited (two
    classes swapped) or naming too few classes is caught by counting the members' values per shard part."""
    from tests.test_dataset_versions import make_source

    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    manifest = read_manifest_json(out)
    assert manifest["classes"] == {"cat": 0, "dog": 1} and manifest["stats"]["class_counts"] == {"cat": 5, "dog": 4}
    assert verify_json(out) == (0, [])
    (out / "manifest.json").write_text(json.dumps({**manifest, "classes": {"cat": 1, "dog": 0}}))
    code, problems = verify_json(out)
    assert code == 5 and problems == [
        "class index 0: its samples' .json names class 'cat', the class map 'dog'",
        "class index 1: its samples' .json names class 'dog', the class map 'cat'",
        "class 'dog' (index 0): 5 sample(s) hold it, stats.class_counts says 4: the class map does not match the "
        "samples' .cls members",
        "class 'cat' (index 1): 4 sample(s) hold it, stats.class_counts says 5: the class map does not match the "
        "samples' .cls members"]
    (out / "manifest.json").write_text(json.dumps({**manifest, "classes": {"cat": 0}}))
    code, problems = verify_json(out)
    assert code == 5 and "4 sample(s) hold class index 1, which the class map does not name" in problems


def test_zero_padded_class_members_are_counted_without_walking_the_tar(tmp_path):
    """With 11+ classes repack writes each ``.cls`` zero-padded to one width (DALI sums the digits): the cheap
    check counts them as they are (a leading zero is no damage), so verify never falls back to the member walk."""
    from repack.sinks.tar_verify import check_shard_part
    from tests.test_images_job import write_jpegs

    src = tmp_path / "src"
    for k in range(12):
        write_jpegs(src / f"c{k:02d}", 1 + k % 3, f"x{k}")
    out = tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    shard = read_manifest_json(out)["shards"][0]
    found = check_shard_part(out, shard, 0, 1)
    assert found is not None and found.classes == tuple((k, 1 + k % 3) for k in range(12))
    assert verify_json(out) == (0, [])


def test_a_verify_worker_that_dies_leaves_its_shard_not_checked(packed_photos):
    """A process that dies while it checks a shard (killed: OOM, a signal) leaves that shard "not checked",
    never passed (the shard check of shard-000001 kills its own process here)."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    script = """
import json, os, signal, sys
from repack.lifecycle import verify_shards
from repack.lifecycle.verify import verify_report
checked = verify_shards.run_task
def dying(task):
    if json.loads(task)["shard"]["path"] == "shard-000001.tar":
        os.kill(os.getpid(), signal.SIGKILL)
    return checked(task)
verify_shards.run_task = dying
print(json.dumps(list(verify_report(sys.argv[1], workers=2).problems)))
"""
    done = subprocess.run([sys.executable, "-c", script, str(packed_photos)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=True)
    problems = json.loads(done.stdout)
    assert any(p.startswith("shard-000001.tar: not checked: the process checking it died") for p in problems), problems

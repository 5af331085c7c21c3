"""`repack pull` copies what it checked: the version pinned when it starts (an append published while it
runs never yields a mixture), ``--versions all|K`` for readers pinned to older versions, and 503 answers
retried as every repack command retries them. moto's S3 server on loopback, real boto3."""

from __future__ import annotations

import json
import shutil
import threading

import pytest

from tests.conftest import run_repack
from tests.test_dataset_versions import add_inputs, labels_read, make_source
from tests.tools.s3server import FaultProxy, MotoServer, client, objects, s3_env


@pytest.fixture(scope="module")
def server():
    moto = MotoServer()
    yield moto
    moto.stop()


def env_for(endpoint: str, tmp_path) -> dict:
    return {**s3_env(endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch")}


def test_an_append_published_during_a_pull_never_yields_a_mixture(server, tmp_path):
    s3 = client(server.endpoint)
    s3.create_bucket(Bucket="race")
    src, url = make_source(tmp_path / "src"), "s3://race/ds"
    direct = env_for(server.endpoint, tmp_path)
    run_repack("images", src, url, "--shard-size", "4", "--quiet", env=direct)
    v1 = objects(s3, "race", "ds")["manifest.json"]
    add_inputs(src)
    appended = threading.Event()

    def append_once(method: str, path: str) -> None:  # the pull has asked for manifest.json: publish v2 now
        if method == "GET" and path.split("?")[0].endswith("/ds/manifest.json") and not appended.is_set():
            appended.set()
            run_repack("images", src, url, "--shard-size", "4", "--append", "--quiet",
                       env={**direct, "REPACK_SCRATCH": str(tmp_path / "appender")})

    proxy = FaultProxy(server.port, on_answer=append_once)
    try:
        run_repack("pull", url, tmp_path / "copy", env=env_for(proxy.endpoint, tmp_path))
    finally:
        proxy.stop()
    assert appended.is_set() and json.loads(objects(s3, "race", "ds")["manifest.json"])["dataset_version"]["number"] == 2
    assert (tmp_path / "copy" / "manifest.json").read_bytes() == v1  # exactly the version it checked
    assert run_repack("verify", tmp_path / "copy").returncode == 0
    assert sorted(p.name for p in (tmp_path / "copy").iterdir() if p.name != ".repack") == sorted(
        [s[key] for s in json.loads(v1)["shards"] for key in ("path", "index", "checksums")] + ["manifest.json"])


@pytest.fixture(scope="module")
def three_versions(server, tmp_path_factory) -> str:
    """s3://kept/ds with three versions: 9 images, 4 appended, 1 removed (the tests only read it)."""
    base = tmp_path_factory.mktemp("kept")
    client(server.endpoint).create_bucket(Bucket="kept")
    src, url, env = make_source(base / "src"), "s3://kept/ds", env_for(server.endpoint, base)
    run_repack("images", src, url, "--shard-size", "4", "--quiet", env=env)
    add_inputs(src)
    run_repack("images", src, url, "--shard-size", "4", "--append", "--quiet", env=env)
    (base / "takedown.txt").write_text("cat/c1.jpg\n")
    run_repack("remove", url, "--sources", base / "takedown.txt", "--quiet", env=env)
    return url


def test_pull_versions_all_or_k_serves_readers_pinned_to_older_versions(server, three_versions, tmp_path):
    s3 = client(server.endpoint)
    url, env = three_versions, env_for(server.endpoint, tmp_path)
    remote = objects(s3, "kept", "ds")

    latest = tmp_path / "latest"
    run_repack("pull", url, latest, env=env)
    assert (latest / "manifest.json").read_bytes() == remote["manifest.v3.json"] == \
        (latest / "manifest.v3.json").read_bytes()
    assert len(labels_read(latest, version=3)) == 12 and run_repack("verify", latest).returncode == 0
    with pytest.raises(Exception, match="no version 1"):
        labels_read(latest, version=1)

    run_repack("pull", url, latest, "--versions", "2", env=env)  # into the same folder: v2 added, v1 not
    assert sorted(p.name for p in latest.glob("manifest*.json")) == ["manifest.json", "manifest.v2.json",
                                                                     "manifest.v3.json"]
    assert len(labels_read(latest, version=2)) == 13

    every = tmp_path / "every"
    run_repack("pull", url, every, "--versions", "all", env=env)
    for name in ("manifest.json", "manifest.v1.json", "manifest.v2.json", "manifest.v3.json"):
        assert (every / name).read_bytes() == remote[name]
    assert [len(labels_read(every, version=n)) for n in (1, 2, 3)] == [9, 13, 12]
    for number in ("1", "2", "3"):
        assert run_repack("verify", every, "--version", number).returncode == 0
    assert run_repack("verify", every).returncode == 0
    bad = run_repack("pull", url, every, "--versions", "none", env=env, check=False)
    assert bad.returncode == 2 and "--versions 'none'" in bad.stderr


def test_pull_and_verify_retry_503_answers_like_the_other_commands(server, three_versions, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    url = three_versions
    proxy = FaultProxy(server.port, every=3)

    def attempt(number: int) -> None:
        copy = tmp_path / f"copy{number}"
        env = env_for(proxy.endpoint, tmp_path / f"attempt{number}")  # each its own scratch
        run_repack("pull", url, copy, env=env)
        assert run_repack("verify", copy).returncode == 0
        assert run_repack("verify", url, env=env).returncode == 0

    try:  # the three attempts side by side: their time is mostly botocore's backoff sleeps
        with ThreadPoolExecutor(3) as pool:
            for done in [pool.submit(attempt, number) for number in range(3)]:
                done.result()  # an attempt's failure raised here
    finally:
        proxy.stop()
    assert proxy.failed >= 20


def test_a_pull_into_an_earlier_copy_leaves_only_what_it_pulled(server, three_versions, tmp_path):
    """Every version pulled, then the latest alone into the same folder: the files only older versions name (the
    taken-down sample's shard among them) and a killed download's temp file are gone, and the copy verifies."""
    env = env_for(server.endpoint, tmp_path)
    dest = tmp_path / "dest"
    run_repack("pull", three_versions, dest, "--versions", "all", env=env)
    older = set(p.name for p in dest.iterdir())
    (dest / ".shard-000000.tar.tmp-4242").write_bytes(b"cut")  # a download killed mid-way
    run_repack("pull", three_versions, dest, env=env)
    manifest = json.loads((dest / "manifest.json").read_text())
    named = {name for s in manifest["shards"] for name in (s["path"], s["index"], s["checksums"])}
    assert {p.name for p in dest.iterdir() if p.name != ".repack"} == named | {"manifest.json", "manifest.v3.json"}
    assert older - named - {"manifest.json", "manifest.v1.json", "manifest.v2.json", "manifest.v3.json"}  # some went
    assert run_repack("verify", dest).returncode == 0


def test_a_pull_waits_its_turn_on_the_destination(server, three_versions, tmp_path):
    """A pull holds DEST's job lock, as every writer of a dataset does: a pull started while another process
    holds it (a second, slower pull of an older version would put DEST back to it after the first) is refused."""
    import fcntl
    import os

    env = env_for(server.endpoint, tmp_path)
    dest = tmp_path / "dest"
    (dest / ".repack").mkdir(parents=True)
    fd = os.open(dest / ".repack" / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        refused = run_repack("pull", three_versions, dest, env=env, check=False)
        assert refused.returncode == 3 and "already running a job" in refused.stderr
        assert not (dest / "manifest.json").exists()
    finally:
        os.close(fd)
    run_repack("pull", three_versions, dest, env=env)
    assert run_repack("verify", dest).returncode == 0


def test_pull_refuses_a_folder_it_must_not_replace(server, tmp_path):
    """DEST holding a repack job's output, a copy of another dataset, or files of no dataset: refused, untouched
    (a pull into a locally packed dataset deleted its shards and left its job state under the pulled manifest)."""
    s3 = client(server.endpoint)
    s3.create_bucket(Bucket="dest")
    env = env_for(server.endpoint, tmp_path)
    src = make_source(tmp_path / "src")
    for name in ("a", "b"):
        run_repack("images", src, f"s3://dest/{name}", "--shard-size", "4", "--quiet", env=env)
    packed = tmp_path / "packed"
    run_repack("images", src, packed, "--shard-size", "2", "--quiet")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine\n")
    (notes / "manifest.json").write_text('{"another": "tool"}\n')
    synced = tmp_path / "synced"  # a local dataset copied without its .repack/ (an rsync that skips it)
    shutil.copytree(packed, synced, ignore=shutil.ignore_patterns(".repack"))
    copy = tmp_path / "copy"
    run_repack("pull", "s3://dest/a", copy, env=env)
    for dest, said in ((packed, "holds the output of a repack job"), (copy, "holds a copy of s3://dest/a"),
                       (notes, "holds no copy of s3://dest/b"), (synced, "holds no copy of s3://dest/b")):
        before = {p.name: p.read_bytes() for p in dest.iterdir() if p.is_file()}
        proc = run_repack("pull", "s3://dest/b", dest, env=env, check=False)
        assert proc.returncode == 2 and said in proc.stderr, proc.stderr
        assert {p.name: p.read_bytes() for p in dest.iterdir() if p.is_file()} == before
    run_repack("pull", "s3://dest/a", copy, env=env)  # the same dataset again: updated in place


def test_a_pull_that_failed_leaves_nothing_of_the_older_copy_after_its_rerun(server, tmp_path):
    """A pull of v2 over a copy of v1 that fails (here: an object damaged at the source) removed the copy's
    manifests first; the re-run deleted only what the manifests left in DEST named, so v1's shard, holding a
    removed sample, stayed (verify: a file the manifest does not name)."""
    s3 = client(server.endpoint)
    s3.create_bucket(Bucket="rerun")
    env = env_for(server.endpoint, tmp_path)
    src, url = make_source(tmp_path / "src"), "s3://rerun/ds"
    run_repack("images", src, url, "--shard-size", "4", "--quiet", env=env)
    copy = tmp_path / "copy"
    run_repack("pull", url, copy, env=env)
    first = json.loads((copy / "manifest.json").read_text())
    gone = tmp_path / "gone.txt"
    gone.write_text("cat/c0.jpg\n")
    run_repack("remove", url, "--sources", gone, "--quiet", env=env)
    run_repack("gc", url, "--keep", "1", env=env)
    second = json.loads(objects(s3, "rerun", "ds")["manifest.json"])
    new_shard = next(s["path"] for s in second["shards"] if s["path"] not in {t["path"] for t in first["shards"]})
    good = objects(s3, "rerun", "ds")[new_shard]
    s3.put_object(Bucket="rerun", Key=f"ds/{new_shard}", Body=good[:600] + bytes([good[600] ^ 1]) + good[601:])
    assert run_repack("pull", url, copy, env=env, check=False).returncode == 5
    s3.put_object(Bucket="rerun", Key=f"ds/{new_shard}", Body=good)
    run_repack("pull", url, copy, env=env)
    assert run_repack("verify", copy, check=False).returncode == 0
    stale = {s["path"] for s in first["shards"]} - {s["path"] for s in second["shards"]}
    assert stale and not any((copy / rel).exists() for rel in stale)


def test_a_token_dataset_pulls_with_its_document_sources(server, tmp_path):
    """A text dataset's parts carry ``source_runs`` (.sources): the pull left them behind and failed its own check
    ("text_document.sources: missing") for every token dataset."""
    from tests.tools.text import gpt2_tokenizer, write_tokenizer

    client(server.endpoint).create_bucket(Bucket="tokens")
    env = env_for(server.endpoint, tmp_path)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"f{i}.txt").write_text("".join(f"document {i}-{j} of the corpus\n" for j in range(50)))
    write_tokenizer(gpt2_tokenizer(), tmp_path / "tok")
    run_repack("text", corpus, "s3://tokens/t", "--tokenizer", tmp_path / "tok", "--quiet", env=env)
    run_repack("pull", "s3://tokens/t", tmp_path / "copy", env=env)
    assert any(p.suffix == ".sources" for p in (tmp_path / "copy").iterdir())
    assert run_repack("verify", tmp_path / "copy", check=False).returncode == 0


def test_pulled_paths_are_spelled_as_the_manifest_names_them(tmp_path):
    """A manifest may spell a path ``./shard-000000.tar``: the pull's list of objects is spelled as
    ``Manifest.named_files`` spells it, or a re-pull took its own shards for an older copy's and deleted them."""
    from repack.lifecycle.pull import expected_objects
    from repack.manifest import Manifest

    out = tmp_path / "out"
    run_repack("images", make_source(tmp_path / "src"), out, "--shard-size", "4", "--quiet")
    data = json.loads((out / "manifest.json").read_text())
    for shard in data["shards"]:
        shard["path"] = "./" + shard["path"]
    manifest = Manifest(out, data)
    assert {item.rel for item in expected_objects(manifest)} <= set(manifest.named_files())


def test_a_pull_brings_the_copys_wids_index_to_the_pulled_version_and_drops_energons_stale_indexes(
        server, three_versions, tmp_path):
    """A wids shard index written in an earlier copy stayed that version's after a pull of a later one: wids read
    the sample taken down since (exit 0, verify then exit 5); energon's index of a tar no pulled version names
    stayed behind."""
    from repack.manifest import Manifest
    from repack.lifecycle.foreign import wids_shard_index

    env = env_for(server.endpoint, tmp_path)
    dest = tmp_path / "dest"
    run_repack("pull", three_versions, dest, "--versions", "all", env=env)
    version1 = json.loads((dest / "manifest.v1.json").read_text())
    (dest / "shardindex.json").write_text(json.dumps(wids_shard_index(Manifest(dest, version1))))  # as a user did
    only_v1 = sorted({s["path"] for s in version1["shards"]} - {s["path"] for s in json.loads(
        (dest / "manifest.json").read_text())["shards"]})
    assert only_v1
    (dest / (only_v1[0] + ".idx")).write_bytes(b"\0" * 16)  # energon prepare's <tar>.idx
    run_repack("pull", three_versions, dest, env=env)
    index = json.loads((dest / "shardindex.json").read_text())
    latest = json.loads((dest / "manifest.json").read_text())
    assert [s["url"] for s in index["shardlist"]] == [s["path"] for s in latest["shards"]]
    assert sum(s["nsamples"] for s in index["shardlist"]) == latest["totals"]["samples"] == 12
    assert not (dest / (only_v1[0] + ".idx")).exists()
    assert run_repack("verify", dest).returncode == 0


def test_a_pull_checks_what_the_manifest_declares_as_verify_does(server, tmp_path):
    """A manifest whose totals or class counts its shards do not hold (verify: exit 5, the readers refuse it) was
    pulled with exit 0, "checked"."""
    s3 = client(server.endpoint)
    s3.create_bucket(Bucket="declared")
    env = env_for(server.endpoint, tmp_path)
    run_repack("images", make_source(tmp_path / "src"), "s3://declared/ds", "--quiet", env=env)
    manifest = json.loads(objects(s3, "declared", "ds")["manifest.json"])
    manifest["totals"]["samples"] += 1
    s3.put_object(Bucket="declared", Key="ds/manifest.json", Body=json.dumps(manifest).encode())
    assert run_repack("verify", "s3://declared/ds", env=env, check=False).returncode == 5
    done = run_repack("pull", "s3://declared/ds", tmp_path / "copy", env=env, check=False)
    assert done.returncode == 5 and "totals.samples" in done.stderr, done.stderr
    assert not (tmp_path / "copy" / "manifest.json").exists()


def test_a_dataset_file_named_like_a_download_temp_file_is_pulled_and_kept(server, tmp_path):
    """The sweep of killed downloads' temp files (``.NAME.tmp-PID``) never deletes a file a pulled version names:
    it ran after the manifest was written, so the copy looked complete with a shard gone."""
    s3 = client(server.endpoint)
    s3.create_bucket(Bucket="tmpnames")
    local = tmp_path / "ds"
    run_repack("images", make_source(tmp_path / "src"), local, "--shard-size", "4", "--quiet")
    manifest = json.loads((local / "manifest.json").read_text())
    shard = manifest["shards"][1]
    hidden = f".{shard['path']}.tmp-1"
    (local / shard["path"]).rename(local / hidden)
    shard["path"] = hidden
    (local / "manifest.json").write_text(json.dumps(manifest))
    assert run_repack("verify", local).returncode == 0
    for path in local.rglob("*"):
        if path.is_file() and ".repack" not in path.relative_to(local).parts:
            s3.put_object(Bucket="tmpnames", Key=f"ds/{path.relative_to(local).as_posix()}", Body=path.read_bytes())
    dest = tmp_path / "dest"
    run_repack("pull", "s3://tmpnames/ds", dest, env=env_for(server.endpoint, tmp_path))
    assert (dest / hidden).read_bytes() == (local / hidden).read_bytes()
    assert run_repack("verify", dest).returncode == 0


def test_pull_into_an_s3_location_is_refused(server, three_versions, tmp_path):
    """DEST is a local folder: an s3:// DEST was written to a local folder named "s3:" with exit 0."""
    done = run_repack("pull", three_versions, "s3://kept/copy", env=env_for(server.endpoint, tmp_path), check=False)
    assert done.returncode == 2 and "DEST must be a local folder" in done.stderr
    assert not objects(client(server.endpoint), "kept", "copy")


def test_a_manifest_naming_a_file_below_a_folder_named_manifest_json_is_refused_before_any_download(server,
                                                                                                    tmp_path):
    """``manifest.json/x.tar`` passed the rule that refuses ``manifest.json``: the pull made a folder of that
    name in DEST, failed on "Is a directory" (exit 2), and every later pull of a mended bucket failed on it."""
    from repack.manifest.paths import PathEscapeError, check_dataset_path

    for rel in ("manifest.json/x.tar", "manifest.v2.json/a", ".repack/x"):
        with pytest.raises(PathEscapeError, match="names a manifest"):
            check_dataset_path(rel)
    assert check_dataset_path("sub/manifest.json") == "sub/manifest.json"
    s3 = client(server.endpoint)
    s3.create_bucket(Bucket="blocked")
    local = tmp_path / "ds"
    run_repack("images", make_source(tmp_path / "src"), local, "--shard-size", "4", "--quiet")
    manifest = json.loads((local / "manifest.json").read_text())
    manifest["shards"][0]["path"] = "manifest.json/x.tar"
    s3.put_object(Bucket="blocked", Key="ds/manifest.json", Body=json.dumps(manifest).encode())
    dest = tmp_path / "dest"
    done = run_repack("pull", "s3://blocked/ds", dest, env=env_for(server.endpoint, tmp_path), check=False)
    assert done.returncode == 5 and "manifest.json/x.tar" in done.stderr
    assert not (dest / "manifest.json").exists()

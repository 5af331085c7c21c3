"""One rule for every path a manifest names: a version naming ``../victim``, an absolute path, a path
through a symlinked folder or ``manifest.json`` in any path field is refused by every command that reads
it (gc deletes nothing, verify fails, readers refuse it), and the stores refuse to write or delete
outside OUT (local: no symlink on the way) or outside the prefix (s3)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import read_manifest_json, run_repack
from tests.test_dataset_versions import add_inputs, make_source
from tests.tools.s3server import MotoServer, client, objects, s3_env

FIELDS = ("shards.path", "shards.index", "videos", "files", "prefixes", "shards.prefix")


def hostile(field: str, rel: str, data: dict) -> dict:
    """``data`` (a manifest) naming ``rel`` in ``field``."""
    data = json.loads(json.dumps(data))
    if field == "shards.path":
        data["shards"][0]["path"] = rel
    elif field == "shards.index":
        data["shards"][0]["index"] = rel
    elif field == "shards.prefix":
        data["shards"][0]["prefix"] = rel
    elif field == "videos":
        data["videos"] = [{"path": rel}]
    elif field == "files":
        data["files"] = {"tokenizer": rel}
    else:
        data["prefixes"] = [rel]
    return data


def two_versions(tmp_path: Path, out: Path | str, env: dict | None = None) -> None:
    src = make_source(tmp_path / "src")
    run_repack("images", src, out, "--shard-size", "4", "--quiet", env=env)
    add_inputs(src)
    run_repack("images", src, out, "--shard-size", "4", "--append", "--quiet", env=env)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, Path]:
    """"one": an images dataset of one version; "two": one of two versions (an append), verified intact
    before any test tampers with a copy of it."""
    base = tmp_path_factory.mktemp("datasets")
    src = make_source(base / "src")
    run_repack("images", src, base / "one", "--shard-size", "4", "--quiet")
    shutil.copytree(base / "one", base / "two")
    add_inputs(src)
    run_repack("images", src, base / "two", "--shard-size", "4", "--append", "--quiet")
    assert run_repack("verify", base / "two").returncode == 0
    return {"one": base / "one", "two": base / "two"}


def copy_of(dataset: Path, tmp_path: Path) -> Path:
    """A copy of ``dataset`` as ``tmp_path/out``, for a test to tamper with."""
    shutil.copytree(dataset, tmp_path / "out", symlinks=True)
    return tmp_path / "out"


def victims(tmp_path: Path, out: Path) -> dict[str, str]:
    """A file outside OUT, and the ways a manifest can name it (or the live manifest)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"precious")
    (out / "link").symlink_to(outside, target_is_directory=True)
    return {"dotdot": "../outside/victim", "absolute": str(outside / "victim"), "symlink": "link/victim",
            "manifest": "manifest.json"}


@pytest.mark.parametrize("field", FIELDS)
def test_every_path_field_is_checked_when_a_manifest_is_read(datasets, tmp_path, field):
    from pipelines.manifest_access import open_manifest
    from repack.manifest import ManifestError, read_manifest

    out = copy_of(datasets["one"], tmp_path)
    good = read_manifest_json(out)
    for rel in [*victims(tmp_path, out).values(), ".repack/plan.json", "manifest.v3.json", "a\\..\\b", "x\x00y"]:
        (out / "manifest.json").write_text(json.dumps(hostile(field, rel, good)))
        for read in (read_manifest, open_manifest):
            with pytest.raises(ManifestError, match=r"version 1: .*(escapes|outside|names a manifest|invalid)"):
                read(out)
    (out / "manifest.json").write_text(json.dumps(hostile(field, "../outside/victim", good)))
    for args in (("inspect", out), ("verify", out)):  # the commands too, one line naming version and path
        proc = run_repack(*args, check=False)
        assert proc.returncode == 5 and "version 1: path '../outside/victim' escapes" in proc.stderr + proc.stdout
        assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("field,kind", list(zip(FIELDS, ("manifest", "dotdot", "absolute", "symlink", "dotdot",
                                                          "manifest"))) + [("videos", "manifest"),
                                                                           ("videos", "symlink")])
def test_gc_deletes_nothing_outside_and_verify_refuses_a_version_naming_a_hostile_path(datasets, tmp_path, field,
                                                                                      kind):
    out = copy_of(datasets["two"], tmp_path)  # verified intact (the fixture)
    rel = victims(tmp_path, out)[kind]
    v1 = json.loads((out / "manifest.v1.json").read_text())
    (out / "manifest.v1.json").write_text(json.dumps(hostile(field, rel, v1)))
    live = (out / "manifest.json").read_bytes()
    before = sorted(p.name for p in out.iterdir())

    gc = run_repack("gc", out, "--keep", "1", check=False)
    assert gc.returncode != 0, gc.stdout
    assert "manifest.v1.json" in gc.stderr and "version 1" in gc.stderr and repr(rel)[1:-1] in gc.stderr
    assert (tmp_path / "outside" / "victim").read_bytes() == b"precious"
    assert (out / "manifest.json").read_bytes() == live and sorted(p.name for p in out.iterdir()) == before
    for args in (("verify", out), ("verify", out, "--version", "1")):
        proc = run_repack(*args, check=False)
        said = proc.stdout + proc.stderr
        assert proc.returncode == 5 and "version 1" in said and repr(rel)[1:-1] in said, (args, said)


def test_local_store_writes_and_deletes_nothing_through_a_symlinked_folder(tmp_path):
    from repack.errors import ConfinementError
    from repack.store.local import LocalStore

    out, inside = tmp_path / "out", tmp_path / "out" / "real"
    inside.mkdir(parents=True)
    (inside / "kept").write_bytes(b"kept")
    (out / "alias").symlink_to(inside, target_is_directory=True)  # a link to a folder INSIDE OUT: refused too
    (out / "file-link").symlink_to(inside / "kept")
    store = LocalStore(out)
    for operation in (lambda: store.delete("alias/kept"), lambda: store.put_bytes("alias/new", b"x"),
                      lambda: store.delete("file-link"), lambda: store.put_bytes("../escaped", b"x"),
                      lambda: store.delete("/etc/hostname"), lambda: store.clear_state("alias")):
        with pytest.raises(ConfinementError, match="refused"):
            operation()
    assert (inside / "kept").read_bytes() == b"kept" and not (inside / "new").exists()
    assert not (tmp_path / "escaped").exists() and (out / "file-link").is_symlink()
    store.put_bytes("real/new", b"ok")  # plain folders are fine
    assert (inside / "new").read_bytes() == b"ok"


@pytest.fixture(scope="module")
def server():
    moto = MotoServer()
    yield moto
    moto.stop()


def test_s3_gc_and_verify_refuse_a_version_naming_a_key_outside_the_prefix_or_the_manifest(server, tmp_path):
    from repack.errors import ConfinementError
    from repack.store.s3 import S3Store

    s3 = client(server.endpoint)
    s3.create_bucket(Bucket="paths")
    s3.put_object(Bucket="paths", Key="victim", Body=b"precious")
    env = {**s3_env(server.endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch")}
    url = "s3://paths/ds"
    two_versions(tmp_path, url, env)
    v1 = json.loads(objects(s3, "paths", "ds")["manifest.v1.json"])
    for field, rel in (("videos", "../victim"), ("shards.path", "manifest.json"), ("files", "/victim")):
        s3.put_object(Bucket="paths", Key="ds/manifest.v1.json", Body=json.dumps(hostile(field, rel, v1)).encode())
        live = objects(s3, "paths", "ds")
        gc = run_repack("gc", url, "--keep", "1", env=env, check=False)
        assert gc.returncode != 0 and "version 1" in gc.stderr and rel in gc.stderr
        assert objects(s3, "paths", "ds") == live
        assert s3.get_object(Bucket="paths", Key="victim")["Body"].read() == b"precious"
        for args in (("verify", url), ("verify", url, "--version", "1")):
            proc = run_repack(*args, env=env, check=False)
            assert proc.returncode == 5 and rel in proc.stdout + proc.stderr, args
    store = S3Store(url)
    for rel in ("../victim", "/victim", "a/../../victim", "x\x00y", "a\\b"):
        with pytest.raises(ConfinementError, match="refused"):
            store.delete(rel)


def test_safe_join_resolves_only_through_a_symlink_and_refuses_one_leaving_the_root(tmp_path):
    """``safe_join``/``join_under_real``: lstat per component below the root, the whole path resolved only when
    one is a link; the verdicts are realpath's (a link inside stays inside, one leaving is refused at any depth,
    a missing component ends the check)."""
    from repack.manifest.paths import PathEscapeError, join_under_real, safe_join

    real_root = tmp_path / "data"
    (real_root / "sub").mkdir(parents=True)
    (real_root / "sub" / "a.tar").write_bytes(b"a")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "v").write_bytes(b"v")
    (tmp_path / "root-link").symlink_to(real_root, target_is_directory=True)
    (real_root / "inside-link").symlink_to(real_root / "sub", target_is_directory=True)
    (real_root / "sub" / "file-out").symlink_to(tmp_path / "outside" / "v")
    (real_root / "sub" / "dir-out").symlink_to(tmp_path / "outside", target_is_directory=True)
    root = tmp_path / "root-link"  # the root itself through a link: resolved once
    assert safe_join(root, "sub/a.tar") == real_root / "sub" / "a.tar"
    assert safe_join(root, "inside-link/a.tar") == real_root / "inside-link" / "a.tar"
    assert safe_join(root, "missing/deeper/x.tar") == real_root / "missing" / "deeper" / "x.tar"
    for rel in ("sub/file-out", "sub/dir-out/v", "sub/dir-out/missing"):
        with pytest.raises(PathEscapeError, match="resolves outside"):
            safe_join(root, rel)
        with pytest.raises(PathEscapeError, match="resolves outside"):
            join_under_real(real_root, rel)

"""Remote checks as strong as local ones (issue 21, items 3 and 7), against a real S3 HTTP server on
loopback (moto's server mode): each tamper, applied with the manifest's sizes and sha256 updated to
match, is reported by `repack verify` on a folder and on s3:// with the very same messages; `repack
pull` checks what verify checks, exits 5 on integrity failures, refuses a manifest naming a file
twice (readers too) and a symlink in DEST."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from repack.sinks.tar_format import end_of_archive, index_from_tar, ustar_header
from tests.conftest import read_manifest_json, run_repack
from tests.tools.s3server import MotoServer, client, s3_env
from tests.tools.text import gpt2_tokenizer, write_tokenizer


@pytest.fixture(scope="module")
def server():
    moto = MotoServer()
    yield moto
    moto.stop()


def env_for(server, tmp_path: Path) -> dict:
    return {**s3_env(server.endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch")}


def upload(server, folder: Path, bucket: str, prefix: str) -> str:
    """Every file of ``folder`` (job state aside) as objects under s3://bucket/prefix."""
    s3 = client(server.endpoint)
    try:
        s3.create_bucket(Bucket=bucket)
    except s3.exceptions.BucketAlreadyOwnedByYou:
        pass
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and not rel.startswith(".repack/"):
            s3.put_object(Bucket=bucket, Key=f"{prefix}/{rel}", Body=path.read_bytes())
    return f"s3://{bucket}/{prefix}"


def rewrite(out: Path, rel: str, data: bytes, field: str = "") -> None:
    """Replace ``out/rel`` and update the manifest's size and sha256 for it (as a careful attacker would)."""
    (out / rel).write_bytes(data)
    manifest = read_manifest_json(out)
    for shard in manifest["shards"]:
        if shard["path"] == rel:
            shard.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        if shard.get("index") == rel:
            shard.update(index_bytes=len(data), index_sha256=hashlib.sha256(data).hexdigest())
    (out / "manifest.json").write_text(json.dumps(manifest))


def unlisted(out: Path) -> None:
    (out / "extra").mkdir()
    (out / "extra" / "notes.txt").write_text("x")


def manifest_count(out: Path) -> None:
    manifest = read_manifest_json(out)
    manifest["shards"][0]["samples"] += 1
    manifest["totals"]["samples"] += 1
    (out / "manifest.json").write_text(json.dumps(manifest))


def index_skips_a_sample(out: Path) -> None:
    lines = (out / "shard-000000.idx").read_text().splitlines()
    count = int(lines[0].split()[1])
    rewrite(out, "shard-000000.idx", ("\n".join([f"v1.2 {count - 1}", lines[1], *lines[3:]]) + "\n").encode())


def hostile_member_names(out: Path) -> None:
    body = b"".join(ustar_header(name, 3) + b"abc" + bytes(509) for name in (b"../x.jpg", b".pickle"))
    tar = body + end_of_archive(len(body))
    rewrite(out, "shard-000000.tar", tar)
    with open(out / "shard-000000.tar", "rb") as fh:
        rewrite(out, "shard-000000.idx", index_from_tar(fh).encode())


def bytes_after_the_end(out: Path) -> None:
    rewrite(out, "shard-000001.tar", (out / "shard-000001.tar").read_bytes() + b"MORE" * 200)


def end_cut_short(out: Path) -> None:
    rewrite(out, "shard-000001.tar", (out / "shard-000001.tar").read_bytes()[:-512])


def missing_shard(out: Path) -> None:
    (out / "shard-000002.tar").unlink()


TAMPERS = {
    missing_shard: "shard-000002.tar: missing",
    unlisted: "extra/notes.txt: a file the manifest does not name",
    manifest_count: "shard-000000.tar: 25 samples, manifest says 26",
    index_skips_a_sample: "shard-000000.idx: does not match the tar's members",
    hostile_member_names: "member name '../x.jpg' is not a flat KEY.EXT name",
    bytes_after_the_end: "shard-000001.tar: 800 bytes after the end-of-archive",
    end_cut_short: "shard-000001.tar: the end-of-archive at byte",
}


def verify_json(target, env: dict) -> tuple[int, list[str]]:
    proc = run_repack("verify", target, "--json", env=env, check=False)
    assert "Traceback" not in proc.stderr
    return proc.returncode, json.loads(proc.stdout)["problems"]


@pytest.mark.parametrize("tamper", list(TAMPERS), ids=lambda t: t.__name__)
def test_remote_verify_reports_what_local_verify_reports(server, packed_photos, tmp_path, tamper):
    env = env_for(server, tmp_path)
    out = tmp_path / "copy"
    shutil.copytree(packed_photos, out)
    tamper(out)
    url = upload(server, out, "tamper", tamper.__name__)
    local_code, local_problems = verify_json(out, env)
    remote_code, remote_problems = verify_json(url, env)
    assert (local_code, remote_code) == (5, 5)
    assert local_problems == remote_problems
    assert any(TAMPERS[tamper] in p for p in remote_problems), remote_problems
    pulled = tmp_path / "pulled"
    proc = run_repack("pull", url, pulled, env=env, check=False)
    if tamper is unlisted:  # the copy holds the named files only: intact
        assert proc.returncode == 0 and run_repack("verify", pulled).returncode == 0
    else:
        assert proc.returncode == 5 and "Traceback" not in proc.stderr, proc.stderr
        assert not (pulled / "manifest.json").exists()


def test_intact_dataset_verifies_and_pulls_on_s3(server, packed_photos, tmp_path):
    env = env_for(server, tmp_path)
    url = upload(server, packed_photos, "tamper", "intact")
    assert verify_json(url, env) == (0, [])
    said = run_repack("pull", url, tmp_path / "pulled", env=env).stdout
    assert run_repack("verify", tmp_path / "pulled").returncode == 0
    assert "version 1, 5 shard(s), 120 samples, checked" in said, said


@pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="ffmpeg is not installed")
def test_pull_of_a_videos_dataset_counts_videos_not_shards(server, tmp_path):
    from tests.test_video_append import PREPARE, X264, clip

    clip(tmp_path / "src" / "x" / "a.mp4", X264)
    clip(tmp_path / "src" / "x" / "b.mp4", X264, seed=1)
    run_repack("video", tmp_path / "src", tmp_path / "out", *PREPARE, "--quiet")
    env = env_for(server, tmp_path)
    said = run_repack("pull", upload(server, tmp_path / "out", "videos", "ds"), tmp_path / "pulled", env=env).stdout
    assert "version 1, 2 video(s), checked (sizes, sha256)" in said and "shard" not in said, said
    pulled, packed = (tmp_path / folder / "videos" / "x" / "b.mp4" for folder in ("pulled", "out"))
    assert pulled.read_bytes() == packed.read_bytes()


def test_a_replaced_tokenizer_is_caught_by_remote_verify_and_pull(server, tmp_path):
    env = env_for(server, tmp_path)
    tok_dir = tmp_path / "tok"
    write_tokenizer(gpt2_tokenizer(), tok_dir)
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("one document\nanother one\n")
    out = tmp_path / "out"
    run_repack("text", src, out, "--tokenizer", tok_dir, "--quiet")
    tok = out / "tokenizer.json"
    tok.write_text(tok.read_text().replace('"<|endoftext|>"', '"<|endoftxet|>"', 1))
    url = upload(server, out, "tamper", "tokenizer")
    code, problems = verify_json(url, env)
    assert code == 5 and problems == ["tokenizer.json: sha256 differs from the tokenizer the dataset was made with"]
    proc = run_repack("pull", url, tmp_path / "pulled", env=env, check=False)
    assert proc.returncode == 5 and "tokenizer.json" in proc.stderr and "checked" not in proc.stdout


def test_a_file_named_twice_is_refused_by_verify_pull_and_readers(server, packed_photos, tmp_path):
    from pipelines.manifest_access import open_webdataset
    from repack.manifest import ManifestError

    env = env_for(server, tmp_path)
    out = tmp_path / "copy"
    shutil.copytree(packed_photos, out)
    manifest = read_manifest_json(out)
    manifest["shards"].append(dict(manifest["shards"][0]))
    manifest["totals"]["samples"] += manifest["shards"][0]["samples"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    url = upload(server, out, "tamper", "twice")
    for args in (("verify", out), ("verify", url), ("pull", url, tmp_path / "pulled")):
        proc = run_repack(*args, env=env, check=False)
        assert proc.returncode == 5 and "names 'shard-000000.tar' twice" in proc.stderr + proc.stdout, proc.stderr
        assert "Traceback" not in proc.stderr
    with pytest.raises(ManifestError, match="twice"):
        open_webdataset(out)


def test_pull_refuses_a_symlink_in_dest_and_writes_nothing_through_it(server, packed_photos, tmp_path):
    env = env_for(server, tmp_path)
    url = upload(server, packed_photos, "tamper", "links")
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me")
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "shard-000001.tar").symlink_to(outside)
    proc = run_repack("pull", url, dest, env=env, check=False)  # a folder that holds no copy: refused as it is
    assert proc.returncode == 2 and "holds no copy of" in proc.stderr and outside.read_text() == "keep me"
    (dest / "shard-000001.tar").unlink()
    run_repack("pull", url, dest, env=env)  # an earlier pull's copy, whose shard became a link
    (dest / "shard-000001.tar").unlink()
    (dest / "shard-000001.tar").symlink_to(outside)
    manifest = (dest / "manifest.json").read_bytes()
    proc = run_repack("pull", url, dest, env=env, check=False)
    assert proc.returncode == 2 and "shard-000001.tar: a symbolic link in the destination" in proc.stderr
    assert "Traceback" not in proc.stderr and outside.read_text() == "keep me"
    assert (dest / "manifest.json").read_bytes() == manifest  # refused before anything in DEST changed


def test_a_link_to_a_folder_in_out_is_reported_not_skipped(packed_photos, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(packed_photos, out)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "more.tar").write_bytes(b"x")
    (out / "extra").symlink_to(tmp_path / "elsewhere")
    code, problems = verify_json(out, {})
    assert code == 5 and problems == ["extra: a file the manifest does not name (added after the job, or left by "
                                      "another tool)"]

"""What a new user meets first: where OUT may be, refusals in one line, the summary on every path
(a run, --append, remove) and progress after a resume, all through the real CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import kill_after_records, run_repack
from tests.tools.photos import make_photo_tree
from tests.tools.s3server import MotoServer, client, objects, s3_env
from tests.tools.text import documents, gpt2_tokenizer, write_tokenizer


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """3 classes of 4 photos and one broken JPEG."""
    root = tmp_path_factory.mktemp("door") / "src"
    make_photo_tree(root, per_class=4, classes=3, seed=4, min_side=40, max_side=96)
    (sorted(root.iterdir())[0] / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really")
    return root


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_folder_of_no_repack_job_is_refused_and_untouched(src, tmp_path):
    out = tmp_path / "existing"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    (out / "shard-000000.tar").write_bytes(b"another tool's shard")
    before = snapshot(out)
    done = run_repack("images", src, out, "--quiet", check=False)
    assert done.returncode == 2, done.stderr
    assert "holds no repack job" in done.stderr and "notes.txt" in done.stderr and "--overwrite" in done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "shard-000000.tar"]  # no .repack/ either
    assert snapshot(out) == before
    run_repack("images", src, out, "--quiet", "--overwrite")  # the user says so: packed there
    assert (out / "manifest.json").is_file() and (out / "notes.txt").read_text() == "mine\n"
    run_repack("images", src, out, "--quiet")  # from now on it holds a repack job: a re-run is fine


def test_an_s3_prefix_of_no_repack_job_is_refused_and_untouched(src, tmp_path):
    server = MotoServer()
    try:
        s3 = client(server.endpoint)
        s3.create_bucket(Bucket="data")
        s3.put_object(Bucket="data", Key="theirs/part-0.parquet", Body=b"another tool's file")
        env = {**s3_env(server.endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch")}
        done = run_repack("images", src, "s3://data/theirs", "--quiet", check=False, env=env)
        assert done.returncode == 2 and "holds no repack job (part-0.parquet)" in done.stderr, done.stderr
        assert objects(s3, "data", "theirs") == {"part-0.parquet": b"another tool's file"}
    finally:
        server.stop()


def test_another_command_on_a_dataset_is_refused_in_one_line(src, tmp_path):
    out = tmp_path / "OUT"
    run_repack("images", src, out, "--quiet")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(5, seed=1)))
    write_tokenizer(gpt2_tokenizer(), tmp_path / "tok")
    before = snapshot(out)
    done = run_repack("text", tmp_path / "corpus", out, "--tokenizer", tmp_path / "tok", "--quiet", check=False)
    assert done.returncode == 2
    message = done.stderr.strip()
    assert message.count("\n") == 0 and "holds an images dataset; choose another OUT" in message, message
    assert "--known-classes" not in message and "null" not in message
    assert {k: v for k, v in snapshot(out).items() if not k.startswith(".repack/")} == \
        {k: v for k, v in before.items() if not k.startswith(".repack/")}  # the dataset; its lock and run id change


def test_inspect_and_verify_name_what_is_not_a_dataset(tmp_path):
    missing = run_repack("verify", tmp_path / "nothere", check=False)
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "a.txt").write_text("x")
    for command in ("inspect", "verify"):
        done = run_repack(command, tmp_path / "plain", check=False)
        assert done.returncode == 2 and "not a repack dataset" in done.stderr, (command, done.stderr)


def test_summary_is_the_same_on_every_path(src, tmp_path):
    """--quiet drops progress, never the summary; each summary names the first quarantined inputs."""
    first = tmp_path / "first"
    make_photo_tree(first, per_class=3, classes=2, seed=8, min_side=40, max_side=96)
    out = tmp_path / "OUT"
    run = run_repack("images", first, out, "--quiet")
    assert "inputs packed into" in run.stderr + run.stdout
    broken = sorted(first.iterdir())[0] / "broken_late.jpg"
    broken.write_bytes(b"\xff\xd8\xff\xe0 truncated")
    good = sorted(first.rglob("*_0000.*"))[0]
    (good.parent / f"late{good.suffix}").write_bytes(good.read_bytes())  # and one new good input
    appended = run_repack("images", first, out, "--append", "--quiet")
    said = appended.stdout + appended.stderr
    assert "published version 2" in said and "1 quarantined" in said
    assert f"quarantined: {broken.relative_to(first).as_posix()}: " in said, said
    keys = tmp_path / "keys.txt"
    manifest = json.loads((out / "manifest.json").read_text())
    keys.write_text(json.loads((out / "manifest.json").read_text())["shards"][0]["path"] + "\n")  # not a key
    removed = run_repack("remove", out, "--keys", keys, "--quiet")
    assert "unchanged, nothing published" in removed.stdout + removed.stderr and manifest
    packed = run_repack("images", src, tmp_path / "other", "--quiet")
    assert "quarantined: " in packed.stderr + packed.stdout and "broken.jpg: " in packed.stderr + packed.stdout
    quiet_json = run_repack("images", src, tmp_path / "other", "--quiet", "--json")
    assert quiet_json.stderr.strip() == "" and json.loads(quiet_json.stdout)["nothing_to_do"]


def test_progress_after_a_resume_counts_every_input(tmp_path):
    src = tmp_path / "src"
    make_photo_tree(src, per_class=10, classes=3, seed=9, min_side=40, max_side=64)
    out = tmp_path / "out"
    args = ["images", src, out, "--shard-size", "5", "--chunk-size", "5", "--workers", "1"]
    kill_after_records(args, out, records=2)
    done = run_repack(*args, "--log-json", "--progress-every", "0.001")
    lines = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    progress = [line for line in lines if line["event"] == "progress"]
    assert progress and all(p["total"] == 30 for p in progress), progress
    assert progress[0]["done"] >= 10 and all(p["done"] <= 30 for p in progress)  # resumed inputs count as done
    assert all("rates" not in p for p in progress)  # images have no extra rates: the key is left out

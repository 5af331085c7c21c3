"""`repack bench` through the real CLI on small datasets written by repack: every format's
readers run, the numbers add up, the table prints, the CPU warning and the --source row appear."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from pipelines.bench import BenchOptions, recommendation, usable_cpus
from tests.conftest import ROOT, run_repack

STEPS, BATCH = 3, 8
FAST = ("--steps", str(STEPS), "--warmup", "1", "--batch-size", str(BATCH), "--rounds", "1")
BUSY = "the machine was busy"  # the warning a loaded machine gives (the test machine may be one)


def bench_json(*args) -> dict:
    proc = run_repack("bench", *args, "--json")
    return json.loads(proc.stdout)


def check_rows(report: dict, readers: set[str], unit: str, compute: bool) -> None:
    assert {r["reader"] for r in report["results"]} == readers
    for row in report["results"]:
        assert "error" not in row, row
        assert row["unit"] == unit and row["steps"] == STEPS
        assert row["samples"] == STEPS * row["batch_size"]
        assert 0.0 <= row["wait_share"] <= 1.0
        assert row["samples_per_s"] == pytest.approx(row["samples"] / row["seconds"], rel=1e-3)
        assert row["wait_s"] + row["compute_s"] <= row["seconds"] * 1.001
        if compute:
            assert 0.0 <= row["gpu_util_bound"] <= 1.0
            assert row["gpu_util_bound"] + row["wait_share"] == pytest.approx(1.0, abs=2e-4)
            assert row["compute_s"] >= STEPS * 0.004  # --compute-ms 4 per step really happened
        else:
            assert row["gpu_util_bound"] is None
    best = report["best"]
    assert best["samples_per_s"] == max(r["samples_per_s"] for r in report["results"])
    assert report["recommendation"].startswith(f"fastest: {best['reader']} ")
    assert report["usable_cpus"] == usable_cpus()


def test_webdataset_with_source_json(packed_photos, photo_tree):
    report = bench_json(packed_photos, *FAST, "--loader-workers", "0,2", "--threads", "2", "--compute-ms", "4",
                        "--source", photo_tree)
    assert (report["modality"], report["format"]) == ("images", "webdataset")
    check_rows(report, {"torch", "dali", "files"}, "images", compute=True)
    kinds = sorted((r["reader"], r["workers"], r["threads"]) for r in report["results"])
    assert kinds == [("dali", None, 2), ("files", 0, None), ("files", 2, None), ("torch", 0, None),
                     ("torch", 2, None)]
    assert isinstance(report["data_bound"], bool)
    assert "packed vs original files, same DataLoader decode: " in report["recommendation"]
    assert [w for w in report["warnings"] if not w.startswith(BUSY)] == []


def test_lmdb_table_and_cpu_warning(photo_tree, tmp_path):
    out = tmp_path / "lmdb"
    run_repack("images", photo_tree, out, "--to", "lmdb", "--quiet")
    too_many = usable_cpus() + 1
    proc = run_repack("bench", out, *FAST, "--loader-workers", f"0,{too_many}", "--threads", "1",
                      "--persistent-workers", "--prefetch-factor", "3")
    lines = proc.stdout.splitlines()
    assert "(images/lmdb)" in lines[0]
    assert lines[1].split() == ["reader", "setting", "batch", "samples/s", "spread", "wait", "ms/step", "wait", "%",
                                "GPU", "util", "<="]
    rows = [line.split() for line in lines[2:5]]
    assert [(r[0].lstrip("*"), r[1]) for r in rows] == [("torch", "workers=0"), ("torch", f"workers={too_many}"),
                                                       ("dali", "threads=1")]
    assert sum(r[0].startswith("*") for r in rows) == 1
    assert all(float(r[3]) > 0 and r[2] == str(BATCH) for r in rows)
    assert f"warning: --loader-workers {too_many} exceeds the {usable_cpus()} CPU(s)" in proc.stdout
    assert any(line.startswith("fastest: ") for line in lines)
    assert "no --compute-ms given" in proc.stdout


def test_text_memmap(tmp_path):
    from tests.tools.text import documents, gpt2_tokenizer, write_tokenizer

    write_tokenizer(gpt2_tokenizer(), tmp_path / "tok")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(120, seed=4)))
    run_repack("text", src, tmp_path / "text", "--tokenizer", tmp_path / "tok", "--quiet")
    report = bench_json(tmp_path / "text", *FAST, "--loader-workers", "0,1", "--seq-len", "64", "--compute-ms", "4",
                        "--compute-mode", "busy")
    assert (report["modality"], report["format"]) == ("text", "memmap")
    check_rows(report, {"torch"}, "sequences", compute=True)


@pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="ffmpeg is not installed")
def test_video_clips(tmp_path):
    from tests.tools.videos import make_index_clip

    mjpeg = ("-c:v", "mjpeg", "-pix_fmt", "yuvj420p", "-q:v", "2")
    make_index_clip(tmp_path / "src/a/one.avi", 20, mjpeg, size=(64, 48))
    make_index_clip(tmp_path / "src/b/two.avi", 16, mjpeg, size=(64, 48))
    run_repack("video", tmp_path / "src", tmp_path / "video", "--transcode", "--quiet")
    report = bench_json(tmp_path / "video", "--steps", str(STEPS), "--warmup", "1", "--batch-size", "2",
                        "--clip-frames", "4", "--loader-workers", "0")
    check_rows(report, {"torch"}, "clips", compute=False)
    assert any("dali: skipped" in note and "--device gpu" in note for note in report["notes"])


def test_verdicts_follow_the_wait_share():
    row = {"reader": "torch", "kind": "dataloader", "workers": 2, "threads": None, "batch_size": 64,
           "unit": "images", "samples_per_s": 900.0, "gpu_util_bound": 0.95, "wait_share": 0.05}
    opts = BenchOptions(compute_ms=50)
    assert "the data path is not the bottleneck" in recommendation(row, [row], opts)
    slow = {**row, "samples_per_s": 300.0, "gpu_util_bound": 0.6, "wait_share": 0.4}
    text = recommendation(slow, [slow], opts)
    assert "the data path is a bottleneck: 40%" in text and "1280 images/s" in text
    assert "no --compute-ms given" in recommendation(row, [row], BenchOptions())


def test_bad_requests_fail_with_one_line(packed_photos, tmp_path):
    proc = run_repack("bench", tmp_path, check=False)
    assert proc.returncode == 5 and "manifest" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_repack("bench", packed_photos, "--batch-size", "0", check=False)
    assert proc.returncode == 2 and "--batch-size must be >= 1" in proc.stderr
    proc = run_repack("bench", packed_photos, "--workers", "two", check=False)
    assert proc.returncode == 2 and "comma-separated integers" in proc.stderr


def test_cli_import_stays_light():
    code = ("import sys, repack.cli; heavy = [m for m in ('torch', 'nvidia.dali', 'pipelines.bench') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def small_lmdb(tmp_path, name: str, per_class: int, classes: int):
    from tests.tools.photos import make_photo_tree

    make_photo_tree(tmp_path / f"{name}-src", per_class=per_class, classes=classes, seed=5, min_side=40, max_side=64)
    run_repack("images", tmp_path / f"{name}-src", tmp_path / name, "--to", "lmdb", "--quiet")
    return tmp_path / name


@pytest.fixture(scope="module")
def ten(tmp_path_factory):
    """An LMDB dataset of 10 samples: 2 full batches of 4, then 2 left (read only)."""
    return small_lmdb(tmp_path_factory.mktemp("ten"), "ten", per_class=5, classes=2)


def test_partial_batches_are_never_steps_and_epoch_crossing_is_flagged(ten, tmp_path):
    import torch

    out = ten
    report = bench_json(out, "--steps", "3", "--warmup", "1", "--batch-size", "4", "--loader-workers", "0,1",
                        "--threads", "1")
    rows = report["results"]
    assert sorted((r["reader"], r["workers"], r["threads"]) for r in rows) == [
        ("dali", None, 1), ("torch", 0, None), ("torch", 1, None)]
    for row in rows:
        assert "error" not in row, row
        assert row["samples"] == row["steps"] * row["batch_size"] == 12
        assert row["epochs_started"] >= 1  # 4 batches from 2-batch epochs
    assert [r["persistent_workers"] for r in rows if r["reader"] == "torch"] == [False, True]  # the default
    assert any("ran past the end of an epoch" in w for w in report["warnings"])
    assert report["options"]["device_requested"] == "auto"
    assert report["options"]["device"] == ("gpu" if torch.cuda.is_available() else "cpu")

    tiny = small_lmdb(tmp_path, "one", per_class=1, classes=1)  # 1 sample at batch 64: no row may be "fastest"
    proc = run_repack("bench", tiny, "--steps", "2", "--warmup", "0", "--batch-size", "64", "--loader-workers", "0",
                      "--threads", "1", check=False)
    assert proc.returncode == 2 and "every setting failed" in proc.stderr and "fastest" not in proc.stdout
    assert "less than one full batch" in proc.stderr and "Traceback" not in proc.stderr


def test_short_batch_fails_the_step_loop(ten):
    from pipelines.bench import BenchError, _dali_iterator, measure
    from pipelines.dali_lmdb import build_lmdb_pipeline

    pipe = build_lmdb_pipeline(ten, batch_size=4, num_threads=1, size=32)  # without drop_last: 4, 4, 2
    with pytest.raises(BenchError, match="batch of 2 samples, not 4"):
        measure(_dali_iterator(pipe, ["images", "labels"], None), BenchOptions(steps=3, warmup=0), 4)


def test_gpu_runs_measure_dali_on_both_devices():
    from pipelines.bench import READERS, settings_for

    image_dali = READERS[("images", "lmdb")][1]
    video_dali = READERS[("video", "videos")][1]
    gpu = BenchOptions(device="gpu", threads=(2,), batch_sizes=(32,))
    assert [(s.device, s.label()) for s in settings_for(image_dali, gpu)] == [("gpu", "threads=2 gpu"),
                                                                            ("cpu", "threads=2")]
    assert [s.device for s in settings_for(video_dali, gpu)] == ["gpu"]
    assert [s.device for s in settings_for(image_dali, BenchOptions(device="cpu", threads=(2,)))] == ["cpu"]
    assert BenchOptions().device == "auto" and BenchOptions().persistent_workers
    helptext = run_repack("bench", "--help").stdout
    assert "REPACK_BENCH_DEVICE; default: auto]" in helptext and "--no-persistent-workers" in helptext


def test_rounds_alternate_and_their_spread_is_reported(packed_photos):
    """Three rounds over two settings, the second in reverse order; each row is the median round."""
    from pipelines.bench import run_bench

    said = []
    report = run_bench(packed_photos, BenchOptions(steps=STEPS, warmup=1, batch_sizes=(BATCH,), workers=(0, 1),
                                                   readers=("torch",), rounds=3), said.append)
    assert [line.split(" batch=")[0] for line in said] == ["torch workers=0", "torch workers=1", "torch workers=1",
                                                         "torch workers=0", "torch workers=0", "torch workers=1"]
    for row in report["results"]:
        rates = row["rounds"]
        assert len(rates) == 3 and row["samples_per_s"] == sorted(rates)[1]
        assert row["spread"] == pytest.approx((max(rates) - min(rates)) / row["samples_per_s"], abs=1e-4)
    assert "load_before" in report


def test_noise_and_a_busy_machine_are_flagged():
    from pipelines.bench import noise_warnings

    row = {"reader": "torch", "kind": "dataloader", "workers": 2, "threads": None, "batch_size": 64}
    steady, noisy = {**row, "spread": 0.05}, {**row, "spread": 0.6}
    assert noise_warnings([steady], load_before=0.2, cpus=2) == []
    found = noise_warnings([steady, noisy], load_before=3.9, cpus=2)
    assert len(found) == 2 and found[0].startswith(BUSY) and "load average 3.9 on 2" in found[0]
    assert "1 setting(s) varied by more than 15% between rounds (up to 60%" in found[1]


def test_bench_of_a_dataset_without_samples_says_so(tmp_path):
    """Every source removed (a valid version of 0 samples): bench said "lower --batch-size", even at 1."""
    from tests.tools.photos import make_photo_tree

    src, out = tmp_path / "photos", tmp_path / "out"
    make_photo_tree(src, per_class=1, classes=2, seed=5, max_side=48, min_side=32)
    run_repack("images", src, out, "--quiet")
    (tmp_path / "all.txt").write_text("".join(f"{p.relative_to(src).as_posix()}\n" for p in sorted(src.rglob("*.*"))))
    run_repack("remove", out, "--sources", tmp_path / "all.txt", "--quiet")
    done = run_repack("bench", out, *FAST[:-4], "--batch-size", "1", check=False)
    assert done.returncode == 2 and "holds no samples" in done.stderr and "batch-size" not in done.stderr, done.stderr

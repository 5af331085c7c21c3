"""DALI GPU video decoding of `repack video` outputs; prints one JSON line per measurement.

    python -m tests.gpu.gpu_video --out DIR [--data DATA] [--prepare DATA]

``--prepare DATA`` (run where ffmpeg and repack's dependencies exist, e.g. the dev box):
generates the branch clips (tests.tools.videos) and a throughput set (24 clips of 640x360,
8 s at 30 fps, 1 s GOP, plus the same with a 250-frame GOP), and runs `repack video
--transcode --target h200` on each into DATA/{branches,gop1s,gop250}/out, keeping the sources
in DATA/*/src. Upload DATA (small) to the GPU machine.

On the GPU machine (``--data DATA``, or without it: prepares into a temp dir, needs ffmpeg):

  check          for every video in branches/out's manifest (each was judged GPU-decodable as
                 is, or transcoded), decode it alone with fn.readers.video on the GPU in a
                 subprocess and check frames, shape and content (not all zero); also tries the
                 *sources* judged "transcode", to show what the rule protects against
  throughput     clips/s and frames/s of pipelines.dali_video over gop1s/out and gop250/out
                 (sequence_length 16, stride 1, step 16, random_shuffle, batch 8, resize 224)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def emit(out: Path, record: dict) -> None:
    line = json.dumps(record, sort_keys=True)
    print(line, flush=True)
    with open(out / "gpu_video.jsonl", "a") as fh:
        fh.write(line + "\n")


def prepare(data: Path) -> None:
    from tests.tools.videos import make_clips, make_index_clip

    make_clips(data / "branches" / "src")
    for name, gop in (("gop1s", 30), ("gop250", 250)):
        for i in range(24):
            make_index_clip(data / name / "src" / f"c{i % 4}" / f"v{i:02d}.mp4", 240,
                            ("-c:v", "libx264", "-preset", "veryfast", "-g", str(gop), "-keyint_min", str(gop),
                             "-sc_threshold", "0", "-bf", "0", "-pix_fmt", "yuv420p"), size=(640, 360), fps=30)
    for name, extra in (("branches", []), ("gop1s", []), ("gop250", ["--max-gop", "10"])):
        subprocess.run([sys.executable, "-m", "repack", "video", str(data / name / "src"), str(data / name / "out"),
                        "--transcode", "--target", "h200", "--quiet", "--overwrite", *extra], check=True, cwd=ROOT)


def check_one(path: str) -> dict:
    """Decode one file on the GPU (runs in a child process: an NVDEC failure may abort)."""
    import numpy as np
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=1, num_threads=2, device_id=0)
    def pipe():
        return fn.readers.video(device="gpu", filenames=[path], sequence_length=8, dtype=types.UINT8,
                                name="r", pad_last_batch=True)

    p = pipe()
    p.build()
    (frames,) = p.run()
    arr = np.asarray(frames.as_cpu()[0])
    return {"shape": list(arr.shape), "mean": round(float(arr.mean()), 2), "frames_total": p.epoch_size("r")}


def run_checks(data: Path, out: Path) -> None:
    manifest = json.loads((data / "branches" / "out" / "manifest.json").read_text())
    probes = [json.loads(x) for x in (data / "branches" / "out" / "probe.jsonl").read_text().splitlines()]
    jobs = [(e["source"], str(data / "branches" / "out" / e["path"]), "transcoded" if e["transcoded"] else "as_is")
            for e in manifest["shards"]]
    jobs += [(p["source"], str(data / "branches" / "src" / p["source"]), "source_judged_transcode")
             for p in probes if p["decision"] == "transcode"]
    for source, path, kind in jobs:
        proc = subprocess.run([sys.executable, "-m", "tests.gpu.gpu_video", "--check-one", path], capture_output=True,
                              text=True, cwd=ROOT, timeout=120)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        result = json.loads(lines[-1]) if proc.returncode == 0 and lines else {
            "error": (proc.stderr.strip().splitlines() or ["?"])[-1][-300:]}
        ok = "error" not in result and result["mean"] > 1.0 and len(result["shape"]) == 4
        emit(out, {"measure": "decode_check", "source": source, "kind": kind, "ok": ok, **result})


def throughput(data: Path, out: Path, name: str, epochs: int = 2) -> None:
    sys.path.insert(0, str(ROOT))
    from pipelines.dali_video import DALIVideoLoader

    loader = DALIVideoLoader(data / name / "out", sequence_length=16, batch_size=8, stride=1, step=16,
                             random_shuffle=True, resize=(224, 224), num_threads=8)
    for frames, labels in loader:  # warm-up epoch
        pass
    clips, t0 = 0, time.perf_counter()
    for _ in range(epochs):
        for frames, labels in loader:
            clips += frames.shape[0]
    import torch
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    emit(out, {"measure": "dali_gpu_throughput", "dataset": name, "clips_s": round(clips / dt, 1),
               "frames_s": round(clips * 16 / dt, 1), "clips": clips, "seconds": round(dt, 2)})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu-video-out")
    ap.add_argument("--data", default=None)
    ap.add_argument("--prepare", default=None)
    ap.add_argument("--check-one", default=None)
    args = ap.parse_args()
    if args.check_one:
        print(json.dumps(check_one(args.check_one)))
        return
    if args.prepare:
        prepare(Path(args.prepare))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = Path(args.data) if args.data else Path(tempfile.mkdtemp(prefix="gpu-video-"))
    if not args.data:
        prepare(data)
    run_checks(data, out)
    for name in ("gop1s", "gop250"):
        try:
            throughput(data, out, name)
        except Exception as exc:  # report and go on
            emit(out, {"measure": "dali_gpu_throughput", "dataset": name, "error": str(exc)[-400:]})


if __name__ == "__main__":
    main()

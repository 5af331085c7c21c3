"""The bundled DALI pipelines resume exactly on the GPU (issue 18 item 3).

    python -m tests.gpu.gpu_resume --prepare DATA        # here (ffmpeg with libx264): the datasets
    python -m tests.gpu.gpu_resume --data DATA --out DIR # on the GPU machine (DALI, lmdb)

``--prepare`` writes into DATA, with the real CLI: 240 real photos (tests.tools.photos) as
WebDataset shards (``images``) and as LMDB (``lmdb``), and four clips (one per class, frame N of
luma 16 + 4*N) transcoded to H.264 for DALI's legacy reader (``video``).

The check runs, per pipeline, tests.tools.dali_resume_run.check_resume with shuffling on:
an uninterrupted run over two epochs, then loaders stopped after 3 batches, after the epoch's
last batch and 3 batches into the next epoch, their ``state_dict()`` saved as JSON and each
resumed in a new process: the batches after the restore must equal the uninterrupted run's
(labels, keys, the bytes of every output tensor) and the interrupted epoch must deliver every
sample once. Pipelines: images with ``device="mixed"`` decode and random-resized-crop + mirror
(``train=True``), LMDB decoded with ``device="mixed"``, video with ``fn.readers.video`` (NVDEC).
Prints a table, writes DIR/gpu_resume.jsonl, exits 1 when a restore differs. ``--cpu
--pipelines images,lmdb`` is a smoke run of the same on DALI's CPU backend.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = {
    "images": {"batch_size": 32, "num_threads": 4, "device_id": 0, "size": 64, "train": True,
               "random_shuffle": True, "seed": 11, "initial_fill": 128},
    "lmdb": {"batch_size": 32, "num_threads": 4, "device_id": 0, "size": 64, "random_shuffle": True, "seed": 11},
    "video": {"sequence_length": 8, "stride": 1, "step": 4, "batch_size": 4, "reader": "legacy", "device": "gpu",
              "device_id": 0, "num_threads": 4, "random_shuffle": True, "seed": 11, "initial_fill": 16},
}
MJPEG = ("-c:v", "mjpeg", "-pix_fmt", "yuvj420p", "-q:v", "2")


def repack(*args) -> None:
    subprocess.run([sys.executable, "-m", "repack", *map(str, args), "--quiet"], check=True, cwd=ROOT)


def prepare(data: Path) -> None:
    """The three datasets of the check, under ``data``."""
    from tests.tools.photos import make_photo_tree
    from tests.tools.videos import make_index_clip

    make_photo_tree(data / "photos", per_class=24, seed=4, max_side=200)
    repack("images", data / "photos", data / "images", "--shard-size", "40")
    repack("images", data / "photos", data / "lmdb", "--to", "lmdb")
    for name, frames in (("a", 60), ("b", 47), ("c", 35), ("d", 52)):
        make_index_clip(data / f"clips/{name}/{name}.avi", frames, MJPEG, size=(128, 96))
    repack("video", data / "clips", data / "video", "--transcode", "--crf", "10", "--target", "h200")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare", type=Path, help="write the datasets into this folder and stop")
    parser.add_argument("--data", type=Path, help="the prepared datasets")
    parser.add_argument("--out", type=Path, help="where gpu_resume.jsonl goes")
    parser.add_argument("--pipelines", default="images,lmdb,video")
    parser.add_argument("--cpu", action="store_true", help="smoke run on DALI's CPU backend (images, lmdb)")
    args = parser.parse_args()
    if args.prepare:
        prepare(args.prepare)
        return 0
    if not args.data or not args.out:
        parser.error("--data and --out are needed (or --prepare)")
    from tests.tools.dali_resume_run import check_resume

    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{'pipeline':8} {'stop (epoch, batch)':20} {'before':>6} {'after':>5} {'equal':>5} {'epoch once':>10} "
          f"{'state bytes':>11} {'restore s':>9}", flush=True)
    failed = False
    for kind in args.pipelines.split(","):
        options = {**OPTIONS[kind], "device_id": None} if args.cpu else OPTIONS[kind]
        try:
            rows = check_resume(kind, str(args.data / kind), options)
        except (AssertionError, RuntimeError) as error:
            print(f"{kind:8} FAILED: {error}", flush=True)
            failed = True
            continue
        with open(args.out / "gpu_resume.jsonl", "a") as handle:
            for row in rows:
                handle.write(json.dumps({**row, "options": options}, sort_keys=True) + "\n")
        for row in rows:
            _, _, epoch, batch = row["position"]
            print(f"{row['pipeline']:8} {f'({epoch}, {batch})':20} {row['before']:>6} {row['after']:>5} "
                  f"{'yes' if row['equal'] else 'NO':>5} {'yes' if row['epoch_once'] else 'NO':>10} "
                  f"{row['state_bytes']:>11} {row['restore_s']:>9.3f}", flush=True)
            failed = failed or not (row["equal"] and row["epoch_once"])
    return 1 if failed else 0

if __name__ == "__main__":
    sys.exit(main())

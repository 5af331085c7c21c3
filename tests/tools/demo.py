"""`make demo`: build a small photo dataset, repack it, verify it, read it back with both readers.

Photos are random crops, rescales and JPEG qualities of the real photographs that ship with
scikit-image; a few broken files are added so the quarantine has something to show.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from tests.tools.photos import make_photo_tree

OUT = Path("demo-out")


def repack(*args: str) -> None:
    print(f"\n$ repack {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "repack", *args], check=True)


def make_sample(src: Path) -> None:
    if src.exists():
        return
    files = make_photo_tree(src, per_class=30, classes=10, seed=0, min_side=96, max_side=512)
    good = files[0].read_bytes()
    (src / "coffee" / "truncated.jpg").write_bytes(good[: len(good) // 3])
    (src / "coffee" / "empty.jpg").write_bytes(b"")
    (src / "rocket" / "README.txt").write_text("not an image\n")
    print(f"made {len(files)} photos in {len(files) // 30} classes (+3 broken files) under {src}")


def read_with_torch(root: Path) -> None:
    import torch
    from torch.utils.data import DataLoader

    from pipelines.torch_webdataset import ImageShardDataset

    def to_tensor(image):
        image = image.resize((224, 224))
        return torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(224, 224, 3)

    dataset = ImageShardDataset(root, transform=to_tensor)
    started = time.perf_counter()
    labels: Counter = Counter()
    for images, batch_labels in DataLoader(dataset, batch_size=32, num_workers=2):
        labels.update(batch_labels.tolist())
    seconds = time.perf_counter() - started
    n = sum(labels.values())
    print(f"PyTorch DataLoader (2 workers, PIL decode + resize 224): {n} samples, {len(labels)} classes, "
          f"{n / seconds:.0f} images/s")


def read_with_dali(root: Path) -> None:
    from pipelines.dali_webdataset import dali_image_loader

    started = time.perf_counter()
    n = 0
    labels: Counter = Counter()
    for batch in dali_image_loader(root, batch_size=32, num_threads=2, device_id=None, size=224):
        n += batch[0]["images"].shape[0]
        labels.update(batch[0]["labels"].flatten().tolist())
    seconds = time.perf_counter() - started
    print(f"DALI pipeline (CPU backend, decode + resize + crop-normalize 224): {n} samples, {len(labels)} classes, "
          f"{n / seconds:.0f} images/s")


def main() -> None:
    src, out = OUT / "photos", OUT / "webdataset"
    make_sample(src)
    shutil.rmtree(out, ignore_errors=True)
    repack("images", str(src), str(out), "--to", "webdataset", "--shard-size", "64", "--shuffle", "--seed", "0")
    repack("images", str(src), str(out), "--to", "webdataset", "--shard-size", "64", "--shuffle", "--seed", "0")
    repack("verify", str(out))
    repack("inspect", str(out))
    print()
    read_with_torch(out)
    read_with_dali(out)
    print(f"\ndemo done: dataset in {out}/ (manifest.json, shard-*.tar, shard-*.idx)")


if __name__ == "__main__":
    main()

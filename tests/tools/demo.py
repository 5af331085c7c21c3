"""`make demo`: the three commands of the mission. Build a small photo dataset, repack it, verify
it, read it back with both readers; generate a few videos (one the GPU decoder reads as is, a few
that need transcoding, one that is rejected), probe and transcode them, verify, read clips back
with the PyTorch video reader; train a small tokenizer offline, tokenize a corpus into a Megatron
memmap, read it back. The HTML report of each dataset is written beside it.

Photos are random crops, rescales and JPEG qualities of the real photographs that ship with
scikit-image; a few broken files are added so the quarantine has something to show. The text is
documents made of sentences of Python's bundled documentation; the tokenizer is a byte-level BPE
trained on them with `tokenizers` and saved as a tokenizer.json (what any HuggingFace model folder
holds), so nothing is downloaded. The videos are made by ffmpeg (tests/tools/videos.py), 1-2 s each.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from tests.tools.photos import make_photo_tree
from tests.tools.text import documents, train_bpe, write_tokenizer
from tests.tools.videos import CLIPS, make_clips

OUT = Path("demo-out")
# one video NVDEC reads as is, three that need transcoding (a long keyframe gap, 10-bit, VP9 for the
# legacy DALI reader), one that is rejected (an empty file): every decision kind of `repack video`
DEMO_CLIPS = ("good/h264.mp4", "bad/long_gop.mp4", "bad/h264_10bit.mp4", "good/vp9.webm", "junk/empty.mp4")


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


def make_corpus(corpus: Path, tokenizer_dir: Path) -> None:
    """A JSON-lines corpus in 4 files and a tokenizer.json trained on it (the demo's own, offline)."""
    if corpus.exists() and (tokenizer_dir / "tokenizer.json").exists():
        return
    docs = documents(2000, seed=0)
    corpus.mkdir(parents=True, exist_ok=True)
    for i in range(4):
        (corpus / f"docs-{i}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[i::4]))
    write_tokenizer(train_bpe(docs, vocab_size=4000), tokenizer_dir, {"eos_token": "</s>", "bos_token": "<s>"})
    print(f"made {len(docs)} documents in 4 files under {corpus} and a BPE tokenizer {tokenizer_dir}/tokenizer.json")


def read_tokens(root: Path) -> None:
    from torch.utils.data import DataLoader

    from pipelines.torch_text import PackedTokenDataset

    dataset = PackedTokenDataset(root, seq_len=256, seed=0)
    batch = next(iter(DataLoader(dataset, batch_size=8)))
    print(f"PyTorch PackedTokenDataset: {len(dataset)} windows of 256+1 tokens; first batch {tuple(batch.shape)}")


def make_videos(src: Path) -> None:
    if src.exists():
        return
    made = make_clips(src, [c for c in CLIPS if c.rel in DEMO_CLIPS], workers=2)
    print(f"made {len(made)} videos under {src}: " + ", ".join(sorted(made)))


def read_clips(root: Path) -> None:
    from torch.utils.data import DataLoader

    from pipelines.torch_video import VideoClipDataset

    dataset = VideoClipDataset(root, 16, stride=1, step=16)
    started = time.perf_counter()
    shapes: Counter = Counter()
    for batch in DataLoader(dataset, batch_size=2, num_workers=2, collate_fn=clip_list):
        shapes.update(tuple(frames.shape) for frames, _label in batch)
    seconds = time.perf_counter() - started
    clips = sum(shapes.values())
    print(f"PyTorch VideoClipDataset (PyAV decode on the CPU, 2 workers): {clips} clips (frames x H x W x C: "
          f"{', '.join(f'{n} x {shape}' for shape, n in sorted(shapes.items()))}) from {len(dataset.paths)} videos, "
          f"{clips / seconds:.1f} clips/s")


def clip_list(batch: list) -> list:
    """The DataLoader's collate for clips of different sizes (the videos keep theirs): a list."""
    return batch


def main() -> None:
    src, out = OUT / "photos", OUT / "webdataset"
    make_sample(src)
    shutil.rmtree(out, ignore_errors=True)
    repack("images", str(src), str(out), "--to", "webdataset", "--shard-size", "64", "--shuffle", "--seed", "0")
    repack("images", str(src), str(out), "--to", "webdataset", "--shard-size", "64", "--shuffle", "--seed", "0")
    repack("verify", str(out))
    repack("inspect", str(out), "--html", str(OUT / "report.html"))
    print()
    read_with_torch(out)
    read_with_dali(out)

    videos, clips = OUT / "videos", OUT / "clips"
    print()
    make_videos(videos)
    shutil.rmtree(clips, ignore_errors=True)
    repack("video", str(videos), str(clips), "--probe", "--transcode")  # the mission's command, as users type it
    repack("verify", str(clips))
    repack("inspect", str(clips), "--html", str(OUT / "video-report.html"))
    print()
    read_clips(clips)

    corpus, tokenizer, tokens = OUT / "corpus", OUT / "tokenizer", OUT / "tokens"
    print()
    make_corpus(corpus, tokenizer)
    shutil.rmtree(tokens, ignore_errors=True)
    repack("text", str(corpus), str(tokens), "--tokenize", "memmap", "--tokenizer", str(tokenizer))
    repack("verify", str(tokens))
    repack("inspect", str(tokens), "--html", str(OUT / "text-report.html"))
    print()
    read_tokens(tokens)
    print(f"\ndemo done: images in {out}/ (manifest.json, shard-*.tar, shard-*.idx), report {OUT / 'report.html'}; "
          f"videos in {clips}/ (videos/, probe.jsonl, file_list.txt), report {OUT / 'video-report.html'}; "
          f"tokens in {tokens}/ (text_document.bin/.idx, tokenizer.json), report {OUT / 'text-report.html'}")


if __name__ == "__main__":
    main()

"""`make demo`: build a small photo dataset, repack it, verify it, read it back with both readers,
write its HTML report; then the text path: train a small tokenizer offline, tokenize a corpus
into a Megatron memmap, read it back.

Photos are random crops, rescales and JPEG qualities of the real photographs that ship with
scikit-image; a few broken files are added so the quarantine has something to show. The text is
documents made of sentences of Python's bundled documentation; the tokenizer is a byte-level BPE
trained on them with `tokenizers` and saved as a tokenizer.json (what any HuggingFace model folder
holds), so nothing is downloaded.
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

    corpus, tokenizer, tokens = OUT / "corpus", OUT / "tokenizer", OUT / "tokens"
    print()
    make_corpus(corpus, tokenizer)
    shutil.rmtree(tokens, ignore_errors=True)
    repack("text", str(corpus), str(tokens), "--tokenizer", str(tokenizer))
    repack("verify", str(tokens))
    print()
    read_tokens(tokens)
    print(f"\ndemo done: images in {out}/ (manifest.json, shard-*.tar, shard-*.idx), their report in "
          f"{OUT / 'report.html'}; tokens in {tokens}/ (text_document.bin/.idx, tokenizer.json)")


if __name__ == "__main__":
    main()

"""Drive the DALI loaders for the resume tests: a loader per kind, its batches as plain records.

``python -m tests.tools.dali_resume_run JOBS.json`` runs in a fresh process what a restarted
training job does: for each job ``{"kind", "root", "options", "state", "batches"}`` it builds the
loader from ``state`` and prints one JSON line per job with the records of the next ``batches``
batches. A record is ``"END"`` (the epoch ended; the next batch starts the next one) or
``{"labels": [...], "keys": [...], "pixels": [...]}``: per sample its label, its key (the image's
source path, the video clip's label (one video per class) and frame numbers; the pixel hash for LMDB, which stores no key) and
the sha256 of its output tensor's bytes.
"""

from __future__ import annotations

import hashlib
import json
import sys

KINDS = ("images", "lmdb", "video")


def make_loader(kind: str, root: str, options: dict, state: dict | None = None):
    """The loader of ``kind`` over ``root`` built with ``options`` (and ``state``)."""
    if kind == "images":
        from pipelines.dali_webdataset import dali_image_loader
        return dali_image_loader(root, with_meta=True, state=state, **options)
    if kind == "lmdb":
        from pipelines.dali_lmdb import dali_lmdb_loader
        return dali_lmdb_loader(root, state=state, **options)
    if kind == "video":
        from pipelines.dali_video import DALIVideoLoader
        return DALIVideoLoader(root, state=state, **options)
    raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")


def digest(tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def record(kind: str, batch) -> dict:
    """The plain record of one batch of a ``kind`` loader."""
    if kind == "video":
        frames, labels = batch
        numbers = ((frames.double().mean(dim=(2, 3, 4)) - 16) / 4).round().long().tolist()
        return {"labels": labels.tolist(), "keys": [json.dumps([label, n]) for label, n in zip(labels.tolist(), numbers)],
                "pixels": [digest(f) for f in frames]}
    out = batch[0]
    images = out["images"]
    pixels = [digest(image) for image in images]
    labels = out["labels"].view(-1).tolist() if "labels" in out else [-1] * len(images)
    if "meta" in out:
        keys = [json.loads(bytes(m.cpu().numpy().tobytes()).rstrip(b"\x00"))["path"] for m in out["meta"]]
    else:
        keys = pixels
    return {"labels": labels, "keys": keys, "pixels": pixels}


def take(kind: str, loader, batches: int) -> list:
    """Records of the next ``batches`` batches of ``loader`` (``"END"`` for an epoch's end)."""
    records, iterator = [], iter(loader)
    while len(records) < batches:
        try:
            records.append(record(kind, next(iterator)))
        except StopIteration:
            records.append("END")
            iterator = iter(loader)
    return records


def epoch_keys(records: list) -> list[list[str]]:
    """The keys each epoch of ``records`` delivered, epoch by epoch."""
    epochs = [[]]
    for item in records:
        if item == "END":
            epochs.append([])
        else:
            epochs[-1] += item["keys"]
    return epochs


def main(jobs_path: str) -> None:
    with open(jobs_path, encoding="utf-8") as handle:
        jobs = json.load(handle)
    for job in jobs:
        loader = make_loader(job["kind"], job["root"], job["options"], job["state"])
        print(json.dumps(take(job["kind"], loader, job["batches"])), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

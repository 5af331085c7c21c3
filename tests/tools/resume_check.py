"""Build a reader + torchdata StatefulDataLoader from a JSON spec, and fingerprint its batches;
run as ``python -m tests.tools.resume_check`` it resumes from saved states in a fresh process.

A spec: {"reader": lmdb | packed | packed-sampler | documents | grouped | video | mixture-images | mixture-tokens,
"roots": [...], "num_workers", "batch_size", "seed", "rank", "world_size", "epoch", "shuffle"}. Every sample
becomes a short string that names it (its index, or a hash of its bytes, with its label), so two
runs compare as lists of lists.

stdin: [{"spec": {...}, "state": loader state or null, "batches": N or null}, ...];
stdout: one JSON list of fingerprint lists per entry.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from pipelines.mixture import Mixture
from pipelines.sampler_resume import ResumableSampler
from pipelines.torch_lmdb import LmdbImageDataset
from pipelines.torch_text import DocumentDataset, LengthGroupedBatchSampler, PackedTokenDataset, collate_pad
from pipelines.torch_video import VideoClipDataset


def digest(value) -> str:
    data = value if isinstance(value, (bytes, bytearray)) else value.contiguous().numpy().tobytes()
    return hashlib.sha1(data).hexdigest()[:12]


def lmdb_ids(batch) -> list[str]:
    return [f"{s['index']}:{s['label']}:{digest(s['image'])}" for s in batch]


def padded_ids(batch) -> list[str]:
    return [digest(row[:n]) for row, n in zip(batch["input_ids"], batch["lengths"].tolist())]


def rows_ids(batch) -> list[str]:
    return [digest(row) for row in batch]


def clip_ids(batch) -> list[str]:
    clips, labels = batch
    return [f"{label}:{digest(clip)}" for clip, label in zip(clips, labels.tolist())]


def mixture_ids(batch) -> list[str]:
    out = []
    for source, sample in batch:
        out.append(f"{source}/" + (lmdb_ids([sample])[0] if isinstance(sample, dict) else digest(sample)))
    return out


def build(spec: dict):
    """(loader, sampler or None, fingerprint function) for ``spec``."""
    reader, roots, seed = spec["reader"], spec["roots"], spec.get("seed", 0)
    rank, world, shuffle = spec.get("rank", 0), spec.get("world_size", 1), spec.get("shuffle", True)
    common = {"num_workers": spec.get("num_workers", 0)}
    batch = spec.get("batch_size", 4)
    sampler = None
    if reader == "lmdb":
        ds = LmdbImageDataset(roots[0], decode=False, output="dict")
        sampler = ResumableSampler(len(ds), shuffle=shuffle, seed=seed, rank=rank, world_size=world)
        loader = StatefulDataLoader(ds, batch_size=batch, sampler=sampler, collate_fn=list, **common)
        ids = lmdb_ids
    elif reader == "packed":
        ds = PackedTokenDataset(roots[0], 16, shuffle=shuffle, seed=seed, rank=rank, world_size=world)
        loader = StatefulDataLoader(ds, batch_size=batch, **common)
        ids = rows_ids
    elif reader == "packed-sampler":  # the elastic route: the sampler orders the windows
        ds = PackedTokenDataset(roots[0], 16, shuffle=False)
        sampler = ResumableSampler(len(ds), shuffle=shuffle, seed=seed, rank=rank, world_size=world)
        loader = StatefulDataLoader(ds, batch_size=batch, sampler=sampler, **common)
        ids = rows_ids
    elif reader == "documents":
        ds = DocumentDataset(roots[0], max_len=48)
        sampler = ResumableSampler(len(ds), shuffle=shuffle, seed=seed, rank=rank, world_size=world)
        loader = StatefulDataLoader(ds, batch_size=batch, sampler=sampler, collate_fn=collate_pad, **common)
        ids = padded_ids
    elif reader == "grouped":
        ds = DocumentDataset(roots[0], max_len=48)
        sampler = LengthGroupedBatchSampler(ds.lengths, batch, seed=seed, mega=4, rank=rank, world_size=world)
        loader = StatefulDataLoader(ds, batch_sampler=sampler, collate_fn=collate_pad, **common)
        ids = padded_ids
    elif reader == "video":
        ds = VideoClipDataset(roots[0], sequence_length=3, stride=2, step=4)
        sampler = ResumableSampler(len(ds), shuffle=shuffle, seed=seed, rank=rank, world_size=world)
        loader = StatefulDataLoader(ds, batch_size=batch, sampler=sampler, **common)
        ids = clip_ids
    elif reader in ("mixture-images", "mixture-tokens"):
        if reader == "mixture-images":
            parts = [LmdbImageDataset(r, decode=False, output="dict") for r in roots]
        else:
            parts = [PackedTokenDataset(r, spec.get("seq_len", 16), shuffle=False) for r in roots]
        ds = Mixture(list(zip(parts, spec["weights"])), seed=seed, exhausted=spec.get("exhausted", "stop"),
                     samples=spec.get("samples"), tag_source=True, rank=rank, world_size=world)
        loader = StatefulDataLoader(ds, batch_size=batch, collate_fn=list, **common)
        ids = mixture_ids
    else:
        raise ValueError(f"unknown reader {reader!r}")
    if spec.get("epoch"):
        target = sampler if sampler is not None else ds
        target.set_epoch(spec["epoch"])
    return loader, sampler, ids


def run(spec: dict, state: dict | None = None, batches: int | None = None) -> tuple[list[list[str]], dict]:
    """Fingerprints of the next ``batches`` batches (None: to the end) and the loader's state then."""
    loader, _, ids = build(spec)
    if state is not None:
        loader.load_state_dict(state)
    out = []
    for batch in loader:
        out.append(ids(batch))
        if batches is not None and len(out) == batches:
            break
    return out, loader.state_dict()


def resume_in_new_process(jobs: list[dict]) -> list[list[list[str]]]:
    """Run this module in a fresh interpreter: each job's batches after its state."""
    import subprocess

    from tests.conftest import ROOT

    proc = subprocess.run([sys.executable, "-m", "tests.tools.resume_check"], input=json.dumps(jobs),
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"resume in a new process failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def main() -> None:
    torch.set_num_threads(1)
    jobs = json.load(sys.stdin)
    json.dump([run(job["spec"], job["state"], job.get("batches"))[0] for job in jobs], sys.stdout)


if __name__ == "__main__":
    main()

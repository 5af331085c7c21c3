"""Drive the DALI loaders for the resume checks (tests/test_dali_resume.py on the CPU,
tests/gpu/gpu_resume.py on the GPU): a loader per kind, its batches as plain records.

``check_resume`` runs a loader uninterrupted, then stops fresh loaders after k batches, saves
their states as JSON and resumes each in a new process, which is what a restarted training job
does: ``python -m tests.tools.dali_resume_run JOBS.json``, for each job ``{"kind", "root",
"options", "state", "batches"}``, builds the loader from ``state`` and prints one JSON line:
``{"restore_s": seconds to build it (imports done), "records": the records of the next batches}``
(and ``"state"``, the loader's state after them, when the job says ``"save_state": true``).

A record is ``"END"`` (the epoch ended; the next batch starts the next one) or
``{"labels": [...], "keys": [...], "pixels": [...]}``: per sample its label, its key (the image's
source path, the LMDB record's index, the video clip's label (one video per class) and frame
numbers) and the sha256 of its output tensor's bytes (GPU decoders may decode one image to other
pixels in another batch position, so samples are told apart by key, not pixels).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

KINDS = ("images", "lmdb", "video")


def make_loader(kind: str, root: str, options: dict, state: dict | None = None):
    """The loader of ``kind`` over ``root`` built with ``options`` (and ``state``)."""
    if kind == "images":
        from pipelines.dali_webdataset import dali_image_loader
        return dali_image_loader(root, with_meta=True, state=state, **options)
    if kind == "lmdb":
        from pipelines.dali_lmdb import dali_lmdb_loader
        return dali_lmdb_loader(root, with_index=True, state=state, **options)
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
        keys = [str(index) for index in out["index"].view(-1).tolist()]
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


def run_in_new_process(jobs: list[dict]) -> list[dict]:
    """The printed results of ``jobs``, run in a fresh interpreter."""
    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "jobs.json"
        path.write_text(json.dumps(jobs))
        proc = subprocess.run([sys.executable, "-m", "tests.tools.dali_resume_run", str(path)], cwd=ROOT,
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
                                  str(ROOT), os.environ.get("PYTHONPATH")]))})
    if proc.returncode != 0:
        raise RuntimeError(f"the resumed loaders failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines()]


def check_resume(kind: str, root: str, options: dict) -> list[dict]:
    """Stop a ``kind`` loader after 3 batches, after its epoch's last, and 3 into the next epoch;
    resume each in a new process. One row per stop: ``before``/``after`` (batches), ``equal``
    (the batches after the restore are the uninterrupted run's), ``epoch_once`` (the interrupted
    epoch delivered every sample of an uninterrupted epoch exactly once), ``position`` (the
    state's epoch and batch), ``state_bytes`` (its JSON size) and ``restore_s``. Raises when the
    uninterrupted run itself is not what the checks assume (two shuffled epochs of one sample set).
    """
    return check_resumes([(kind, root, options)])[0]


def check_resumes(loaders: list[tuple[str, str, dict]]) -> list[list[dict]]:
    """``check_resume`` of each (kind, root, options), every restore in one new process (one import
    of DALI for all): the rows of each, in order."""
    stopped = [_stop(kind, root, options) for kind, root, options in loaders]
    results = iter(run_in_new_process([job for _, _, jobs, _ in stopped for job in jobs]))
    return [_judge(*one, [next(results) for _ in one[2]]) for one in stopped]


def _stop(kind: str, root: str, options: dict) -> tuple[str, list, list[dict], dict]:
    """The uninterrupted run's records, and a resume job (the state after k batches) and the records
    before it per stop k."""
    whole = make_loader(kind, root, options)
    per_epoch = len(whole)
    total = 2 * per_epoch + 2  # two epochs (and their ends) plus a batch
    reference = take(kind, whole, total)
    epochs = epoch_keys(reference)
    if reference[per_epoch] != "END" or len(set(epochs[0])) != len(epochs[0]) or \
            Counter(epochs[0]) != Counter(epochs[1]) or epochs[0] == epochs[1]:
        raise AssertionError(f"{kind}: the uninterrupted run is not two shuffled epochs of one sample set")
    jobs, before = [], {}
    for k in (3, per_epoch, per_epoch + 3):  # mid-epoch, after the epoch's last batch, in the next epoch
        loader = make_loader(kind, root, options)
        before[k] = take(kind, loader, k)
        state = json.loads(json.dumps(loader.state_dict()))  # as a training checkpoint stores it
        jobs.append({"kind": kind, "root": root, "options": options, "state": state, "batches": total - k})
    return kind, reference, jobs, before


def _judge(kind: str, reference: list, jobs: list[dict], before: dict, results: list[dict]) -> list[dict]:
    """The rows of ``check_resume`` from the resumed loaders' ``results``."""
    epochs, rows = epoch_keys(reference), []
    for (k, head), job, result in zip(before.items(), jobs, results):
        after, state = result["records"], job["state"]
        interrupted = epoch_keys(head + after)[0]
        rows.append({"pipeline": kind, "before": k, "after": job["batches"],
                     "position": (state["kind"], state["version"], state["epoch"], state["batch"]),
                     "equal": head == reference[:k] and after == reference[k:],
                     "epoch_once": Counter(interrupted) == Counter(epochs[0]) and len(set(interrupted)) == len(interrupted),
                     "state_bytes": len(json.dumps(state)), "restore_s": result["restore_s"]})
    return rows


def main(jobs_path: str) -> None:
    import nvidia.dali.plugin.pytorch  # noqa: F401  (imported before timing: restore_s is the build alone)
    import pipelines.dali_lmdb, pipelines.dali_video, pipelines.dali_webdataset  # noqa: F401, E401

    with open(jobs_path, encoding="utf-8") as handle:
        jobs = json.load(handle)
    for job in jobs:
        started = time.perf_counter()
        loader = make_loader(job["kind"], job["root"], job["options"], job["state"])
        restore_s = time.perf_counter() - started
        result = {"restore_s": restore_s, "records": take(job["kind"], loader, job["batches"])}
        if job.get("save_state"):
            result["state"] = loader.state_dict()
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

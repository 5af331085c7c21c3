"""``repack bench``: how fast do the bundled readers feed a training loop on this dataset?

For every reader registered for the dataset's (modality, format) and every setting of the
sweep (DataLoader workers or DALI threads x batch sizes), the reader runs ``warmup`` steps,
then ``steps`` measured steps. A step is ``next(batch)`` (time waiting for data; with
``device="gpu"`` it includes the host-to-device copy) followed by a simulated compute step of
``compute_ms`` (sleep, or a busy-wait that occupies a core like a Python training loop does).
Per setting: samples/s, the data-wait share of the step and the implied upper bound on GPU
utilization, ``compute / (compute + wait)``.

Every step must deliver a full batch (readers drop the short last batch of an epoch); a short
batch fails the setting instead of being counted as a step. Epochs are chained; DataLoader
workers persist across epochs by default, and a setting whose measured steps cross an epoch
boundary is reported (``epochs_started``) and warned about. ``device="auto"`` (the default) is
``gpu`` when CUDA is visible, else ``cpu``; on ``gpu`` DALI runs both its GPU (mixed) decode and
its CPU decode, so the table compares them.

Readers are plugins: ``READERS`` maps (modality, format) to reader factories; each factory
returns a ``Run`` whose ``epoch()`` yields batches. Images are decoded and resized to ``size``
(224) by every image reader. Imports ``repack.manifest`` and nothing else from repack.
"""

from __future__ import annotations

import importlib.util
import os
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from pipelines.cpus import usable_cpus
from pipelines.manifest_access import open_manifest
from repack.manifest import Manifest
from repack.manifest.versions import number_of

DATA_BOUND_SHARE = 0.10  # below this wait share the data path is not the bottleneck
NOISY_SPREAD = 0.15  # rounds of one setting further apart than this (of their median): the figure is unreliable
BUSY_LOAD = 0.5  # a 1-minute load average above this share of the usable CPUs before the bench: a busy machine
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}


class BenchError(ValueError):
    """A benchmark that cannot run as asked (bad options, dataset too small, no reader)."""


@dataclass(frozen=True)
class BenchOptions:
    """What to measure: the sweep, the loader settings and the simulated compute step."""

    steps: int = 50
    warmup: int = 5
    rounds: int = 3  # rounds over every setting, alternating their order; each row reports the median round
    workers: tuple[int, ...] = field(default_factory=lambda: (0,) + doubling_sweep(2, usable_cpus()))
    threads: tuple[int, ...] = field(default_factory=lambda: doubling_sweep(2, usable_cpus()))
    batch_sizes: tuple[int, ...] = (64,)
    pin_memory: bool | None = None  # None: when CUDA is available
    persistent_workers: bool = True
    prefetch_factor: int = 2
    compute_ms: float = 0.0
    compute_mode: str = "sleep"  # or "busy"
    readers: tuple[str, ...] = ()  # empty: every reader available for the format
    device: str = "auto"  # "gpu": DALI mixed decode on device 0, batches copied to cuda:0; auto: gpu if CUDA
    size: int = 224
    seq_len: int = 1024
    clip_frames: int = 8
    source: str | None = None
    seed: int = 0

    def validate(self) -> None:
        if self.steps < 1 or self.warmup < 0 or self.rounds < 1:
            raise BenchError("--steps and --rounds must be >= 1 and --warmup >= 0")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise BenchError("--batch-size must be >= 1")
        if min(self.workers, default=0) < 0 or min(self.threads, default=1) < 1:
            raise BenchError("--loader-workers must be >= 0 and --threads >= 1")
        if self.prefetch_factor < 1 or not 0 <= self.compute_ms < float("inf"):  # a NaN is neither
            raise BenchError("--prefetch-factor must be >= 1 and --compute-ms >= 0")
        if self.compute_mode not in ("sleep", "busy") or self.device not in ("auto", "cpu", "gpu"):
            raise BenchError("--compute-mode is sleep|busy and --device auto|cpu|gpu")


@dataclass(frozen=True)
class Setting:
    """One point of the sweep."""

    reader: str
    kind: str  # "dataloader" or "dali"
    batch_size: int
    workers: int | None = None
    threads: int | None = None
    device: str = "cpu"  # DALI rows: where images are decoded ("gpu": mixed on device 0)

    def label(self) -> str:
        if self.kind == "dataloader":
            return f"workers={self.workers}"
        return f"threads={self.threads}" + (" gpu" if self.device == "gpu" else "")


@dataclass
class Run:
    """A ready reader: ``epoch()`` yields batches of one pass; ``count(batch)`` its samples."""

    epoch: Callable[[], Iterator[Any]]
    count: Callable[[Any], int]
    close: Callable[[], None] = lambda: None


@dataclass(frozen=True)
class Reader:
    """A registry entry: name, kind, the unit it yields, and a factory (root, manifest, setting, opts) -> Run."""

    name: str
    kind: str
    unit: str
    make: Callable[..., Run]
    needs: str = ""  # a module that must be importable (e.g. nvidia.dali)
    gpu_only: bool = False


def doubling_sweep(start: int, cpus: int) -> tuple[int, ...]:
    """The default sweep: start, 2*start, 4*start, ... below ``cpus``, then ``cpus`` itself."""
    values, v = [], start
    while v < cpus:
        values.append(v)
        v *= 2
    return tuple(values) + (max(cpus, start),)


# --- readers -----------------------------------------------------------------------------------

def _dataloader(dataset, setting: Setting, opts: BenchOptions, collate=None, shuffle: bool = False) -> Run:
    import torch
    from torch.utils.data import DataLoader

    args: dict[str, Any] = {"batch_size": setting.batch_size, "num_workers": setting.workers, "drop_last": True,
                            "pin_memory": _pin(opts), "shuffle": shuffle}
    if collate is not None:
        args["collate_fn"] = collate
    if setting.workers:
        args.update(persistent_workers=opts.persistent_workers, prefetch_factor=opts.prefetch_factor)
    if shuffle:
        args["generator"] = torch.Generator().manual_seed(opts.seed)
    with warnings.catch_warnings():  # run_bench warns about workers > usable CPUs itself
        warnings.filterwarnings("ignore", message=".*worker processes in total.*")
        loader = DataLoader(dataset, **args)

    def epoch():
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*worker processes in total.*")
            batches = iter(loader)  # persistent workers: the same processes, reset for a new epoch
        yield from batches

    def close():
        workers = getattr(loader, "_iterator", None)  # only set with persistent workers
        if workers is not None and hasattr(workers, "_shutdown_workers"):
            workers._shutdown_workers()  # now, not when the loader is garbage-collected
        loader._iterator = None

    return Run(epoch=epoch, count=_count_first, close=close)


def _pin(opts: BenchOptions) -> bool:
    if opts.pin_memory is not None:
        return opts.pin_memory
    import torch

    return torch.cuda.is_available()


def _count_first(batch) -> int:
    first = batch[0] if isinstance(batch, (list, tuple)) else batch
    return len(first)


def _image_transform(opts: BenchOptions):
    from pipelines.torch_lmdb import resize_to_tensor

    return resize_to_tensor(opts.size)


def torch_webdataset(root, manifest: Manifest, setting: Setting, opts: BenchOptions) -> Run:
    from pipelines.torch_webdataset import ImageShardDataset

    dataset = ImageShardDataset(root, transform=_image_transform(opts), shuffle=True, seed=opts.seed)
    return _dataloader(dataset, setting, opts)


def torch_lmdb(root, manifest: Manifest, setting: Setting, opts: BenchOptions) -> Run:
    from pipelines.torch_lmdb import LmdbImageDataset

    return _dataloader(LmdbImageDataset(root, transform=_image_transform(opts)), setting, opts, shuffle=True)


def _dali_iterator(pipe, names: list[str], reader_name: str | None) -> Run:
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    args = {"reader_name": reader_name} if reader_name else {}
    it = DALIGenericIterator([pipe], names, last_batch_policy=LastBatchPolicy.DROP, auto_reset=True, **args)

    def epoch():
        for batch in it:
            yield batch[0]

    return Run(epoch=epoch, count=lambda batch: len(batch[names[0]]))


def _device_id(setting: Setting) -> int | None:
    return 0 if setting.device == "gpu" else None


def dali_webdataset(root, manifest: Manifest, setting: Setting, opts: BenchOptions) -> Run:
    from pipelines.dali_webdataset import READER, build_image_pipeline, output_names

    pipe = build_image_pipeline(root, setting.batch_size, setting.threads, _device_id(setting), size=opts.size,
                                random_shuffle=True, seed=opts.seed, initial_fill=min(1024, manifest.num_samples),
                                prefetch_queue_depth=opts.prefetch_factor)
    return _dali_iterator(pipe, output_names(root), READER)


def dali_lmdb(root, manifest: Manifest, setting: Setting, opts: BenchOptions) -> Run:
    from pipelines.dali_lmdb import build_lmdb_pipeline

    if manifest.num_samples < setting.batch_size:
        raise BenchError(f"the dataset holds {manifest.num_samples} samples, less than one batch; lower --batch-size")
    pipe = build_lmdb_pipeline(root, setting.batch_size, setting.threads, _device_id(setting), size=opts.size,
                               random_shuffle=True, seed=opts.seed, prefetch_queue_depth=opts.prefetch_factor,
                               drop_last=True)  # no reader_name: the source itself ends an epoch before a short batch
    return _dali_iterator(pipe, ["images", "labels"], None)


def torch_text(root, manifest: Manifest, setting: Setting, opts: BenchOptions) -> Run:
    from pipelines.torch_text import PackedTokenDataset

    return _dataloader(PackedTokenDataset(root, opts.seq_len, shuffle=True, seed=opts.seed), setting, opts)


def collate_clips(batch):
    """Clips of one size are stacked; clips of different sizes stay a list (no resize in the bench)."""
    import torch

    clips, labels = zip(*batch)
    if len({tuple(c.shape) for c in clips}) == 1:
        return torch.stack(clips), torch.tensor(labels)
    return list(clips), torch.tensor(labels)


def torch_video(root, manifest: Manifest, setting: Setting, opts: BenchOptions) -> Run:
    from pipelines.torch_video import VideoClipDataset

    dataset = VideoClipDataset(root, sequence_length=opts.clip_frames)
    return _dataloader(dataset, setting, opts, collate=collate_clips, shuffle=True)


def dali_video(root, manifest: Manifest, setting: Setting, opts: BenchOptions) -> Run:
    from pipelines.dali_video import READER_NAME, build_video_pipeline

    pipe = build_video_pipeline(root, sequence_length=opts.clip_frames, batch_size=setting.batch_size,
                                num_threads=setting.threads, device_id=0, random_shuffle=True, seed=opts.seed,
                                resize=(opts.size, opts.size), prefetch_queue_depth=opts.prefetch_factor)
    return _dali_iterator(pipe, ["frames", "labels"], READER_NAME)


class FolderImageDataset:
    """The original small-file layout: one file per image under class folders, decoded + resized
    like the readers do. Inputs the manifest quarantined are left out."""

    def __init__(self, source: str | os.PathLike, classes: dict[str, int], exclude: set[str],
                 transform: Callable) -> None:
        self.root = Path(source)
        if not self.root.is_dir():
            raise BenchError(f"--source {source}: not a folder of images")
        files = sorted(p for p in self.root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()
                       and p.relative_to(self.root).as_posix() not in exclude)
        if not files:
            raise BenchError(f"--source {source}: no image files")
        names = sorted({p.relative_to(self.root).parts[0] for p in files if len(p.relative_to(self.root).parts) > 1})
        self.classes = classes or {name: i for i, name in enumerate(names)}
        self.files = [str(p) for p in files]
        self.labels = [self.classes.get(p.relative_to(self.root).parts[0], -1) for p in files]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int):
        from PIL import Image

        with Image.open(self.files[index]) as image:
            return self.transform(image.convert("RGB")), self.labels[index]


def torch_files(root, manifest: Manifest, setting: Setting, opts: BenchOptions) -> Run:
    from repack.manifest.quarantine_records import every_record

    def read(rel: str) -> bytes | None:
        path = manifest.path(rel)
        return path.read_bytes() if path.is_file() else None

    exclude = {str(q.get("source")) for q in every_record(manifest.data, read, str(manifest.root))}
    dataset = FolderImageDataset(opts.source, manifest.classes, exclude, _image_transform(opts))
    return _dataloader(dataset, setting, opts, shuffle=True)


_DALI = "nvidia.dali"
READERS: dict[tuple[str, str], tuple[Reader, ...]] = {
    ("images", "webdataset"): (Reader("torch", "dataloader", "images", torch_webdataset),
                               Reader("dali", "dali", "images", dali_webdataset, needs=_DALI)),
    ("images", "lmdb"): (Reader("torch", "dataloader", "images", torch_lmdb),
                         Reader("dali", "dali", "images", dali_lmdb, needs=_DALI)),
    ("text", "memmap"): (Reader("torch", "dataloader", "sequences", torch_text),),
    ("video", "videos"): (Reader("torch", "dataloader", "clips", torch_video, needs="av"),
                          Reader("dali", "dali", "clips", dali_video, needs=_DALI, gpu_only=True)),
    ("video", "webdataset"): (Reader("torch", "dataloader", "clips", torch_video, needs="av"),
                              Reader("dali", "dali", "clips", dali_video, needs=_DALI, gpu_only=True)),
}
SOURCE_READERS: dict[str, Reader] = {"images": Reader("files", "dataloader", "images", torch_files)}


def _cuda_visible() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def select_readers(manifest: Manifest, opts: BenchOptions, notes: list[str]) -> list[Reader]:
    """The readers to run for this dataset and options (unavailable ones explained in ``notes``)."""
    key = (manifest.modality, manifest.format)
    if key not in READERS:
        known = ", ".join(f"{m}/{f}" for m, f in sorted(READERS))
        raise BenchError(f"{getattr(manifest, 'url', '') or manifest.root}: no bundled reader for {key[0]}/{key[1]} (known: {known})")
    chosen = []
    candidates = list(READERS[key])
    if opts.source:
        if manifest.modality not in SOURCE_READERS:
            raise BenchError(f"--source is measured for image datasets only, not {manifest.modality}")
        candidates.append(SOURCE_READERS[manifest.modality])
    wanted = set(opts.readers) | ({"files"} if opts.source else set())
    for reader in candidates:
        if opts.readers and reader.name not in wanted:
            continue
        if reader.needs and not _installed(reader.needs):
            notes.append(f"{reader.name}: skipped, {reader.needs} is not installed")
        elif reader.gpu_only and opts.device != "gpu":
            notes.append(f"{reader.name}: skipped, it decodes {reader.unit} on the GPU only (--device gpu)")
        else:
            chosen.append(reader)
    if not chosen:
        raise BenchError(f"no reader to run for {key[0]}/{key[1]}: " + "; ".join(notes or ["none selected"]))
    return chosen


# --- measurement -------------------------------------------------------------------------------

def simulate_compute(ms: float, mode: str) -> None:
    """The stand-in for a training step: sleep (GPU-bound step) or busy-wait (a core stays busy)."""
    if ms <= 0:
        return
    if mode == "sleep":
        time.sleep(ms / 1000)
        return
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


def _to_device(batch, device: str):
    """With device gpu, copy tensors to cuda:0 (non_blocking when pinned) and wait for the copy."""
    if device != "gpu":
        return batch
    import torch

    if not torch.cuda.is_available():
        return batch
    moved = [t.to("cuda", non_blocking=True) if isinstance(t, torch.Tensor) else t
             for t in (batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple))
                       else [batch])]
    torch.cuda.synchronize()
    return moved


class Endless:
    """Batches across epochs (``epochs``: how many were started); an epoch without a batch is an error."""

    def __init__(self, run: Run) -> None:
        self.epochs = 0
        self._gen = self._batches(run)

    def _batches(self, run: Run) -> Iterator[Any]:
        while True:
            self.epochs += 1
            got = 0
            for batch in run.epoch():
                got += 1
                yield batch
            if not got:
                raise BenchError("the dataset holds less than one full batch per worker; lower --batch-size")

    def __iter__(self) -> Endless:
        return self

    def __next__(self) -> Any:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()


def endless(run: Run) -> Endless:
    """Batches across epochs; an epoch without a single full batch is an error."""
    return Endless(run)


def _full(run: Run, batch, batch_size: int | None) -> int:
    """The samples in ``batch``; a batch shorter than ``batch_size`` is an error, never a step."""
    n = run.count(batch)
    if batch_size is not None and n != batch_size:
        raise BenchError(f"the reader returned a batch of {n} samples, not {batch_size}: "
                         f"a partial batch is not a step (the dataset may be smaller than one batch)")
    return n


def measure(run: Run, opts: BenchOptions, batch_size: int | None = None) -> dict:
    """Run warm-up then measured steps; times and counts of the measured ones.

    ``batch_size`` given: every batch must hold exactly that many samples (BenchError otherwise).
    ``epochs_started``: epochs begun during the measured steps (their start-up counts as wait).
    """
    batches = endless(run)
    wait = compute = 0.0
    samples = 0
    try:
        for _ in range(opts.warmup):
            batch = next(batches)
            _full(run, batch, batch_size)
            _to_device(batch, opts.device)
        warm_epochs = batches.epochs
        start = time.perf_counter()
        for _ in range(opts.steps):
            t0 = time.perf_counter()
            batch = next(batches)
            samples += _full(run, batch, batch_size)
            _to_device(batch, opts.device)
            t1 = time.perf_counter()
            simulate_compute(opts.compute_ms, opts.compute_mode)
            t2 = time.perf_counter()
            wait += t1 - t0
            compute += t2 - t1
        seconds = time.perf_counter() - start
    finally:
        batches.close()
        run.close()
    step = wait + compute
    return {"steps": opts.steps, "samples": samples, "seconds": round(seconds, 6),
            "epochs_started": batches.epochs - warm_epochs,
            "samples_per_s": round(samples / seconds, 3) if seconds > 0 else None,
            "wait_s": round(wait, 6), "compute_s": round(compute, 6),
            "wait_ms_per_step": round(1000 * wait / opts.steps, 3),
            "wait_share": round(wait / step, 4) if step > 0 else 0.0,
            "gpu_util_bound": round(compute / step, 4) if opts.compute_ms > 0 and step > 0 else None}


def settings_for(reader: Reader, opts: BenchOptions) -> list[Setting]:
    """The sweep of one reader: batch sizes x (workers | threads); DALI on a GPU run: x (gpu, cpu) decode."""
    if reader.kind == "dali":
        devices = ["gpu"] if reader.gpu_only or opts.device == "gpu" else ["cpu"]
        if opts.device == "gpu" and not reader.gpu_only:
            devices.append("cpu")  # DALI's CPU decode too: what a GPU-less or GPU-busy node would get
        return [Setting(reader.name, "dali", b, threads=t, device=d)
                for d in devices for b in opts.batch_sizes for t in opts.threads]
    device = "gpu" if opts.device == "gpu" else "cpu"  # gpu: each batch is copied to cuda:0
    return [Setting(reader.name, "dataloader", b, workers=w, device=device)
            for b in opts.batch_sizes for w in opts.workers]


def run_bench(root: str | os.PathLike, opts: BenchOptions, progress: Callable[[str], None] | None = None) -> dict:
    """Measure every reader and setting on the dataset in ``root``; the report as a JSON-able dict."""
    opts.validate()
    manifest = open_manifest(root)  # a folder or s3://bucket/prefix
    location = getattr(manifest, "url", "") or str(manifest.root)  # what the readers are given
    if not manifest.num_samples:  # every sample removed, or all quarantined: no batch size would help
        raise BenchError(f"{location}: the dataset holds no samples (version {number_of(manifest.data)}): nothing to "
                         "read")
    requested = opts.device
    if opts.device == "auto":
        opts = replace(opts, device="gpu" if _cuda_visible() else "cpu")
    elif opts.device == "gpu" and not _cuda_visible():
        raise BenchError("--device gpu: no CUDA device is visible to this process")
    notes: list[str] = []
    readers = select_readers(manifest, opts, notes)
    cpus = usable_cpus()
    warnings = []
    if max(opts.workers, default=0) > cpus and any(r.kind == "dataloader" for r in readers):
        warnings.append(f"--loader-workers {max(opts.workers)} exceeds the {cpus} CPU(s) this process may use "
                        f"(affinity and cgroup quota): extra workers only compete for the same cores")
    if max(opts.threads, default=0) > cpus and any(r.kind == "dali" for r in readers):
        warnings.append(f"--threads {max(opts.threads)} exceeds the {cpus} usable CPU(s)")
    load_before = _load_average()
    plan = [(reader, setting) for reader in readers for setting in settings_for(reader, opts)]
    rounds: list[list[dict]] = [[] for _ in plan]
    for number in range(opts.rounds):  # every setting once per round; odd rounds in reverse (drift cancels)
        for i in (range(len(plan)) if number % 2 == 0 else reversed(range(len(plan)))):
            reader, setting = plan[i]
            if rounds[i] and "error" in rounds[i][-1]:
                continue  # a setting that failed is not tried again
            if progress:
                progress(f"{reader.name} {setting.label()} batch={setting.batch_size}"
                         + (f" (round {number + 1} of {opts.rounds})" if opts.rounds > 1 else ""))
            rounds[i].append(_measure_row(reader, setting, location, manifest, opts))
    results = [_median_row(r) for r in rounds]
    measured = [r for r in results if "error" not in r]
    warnings += _epoch_warnings(measured, opts) + noise_warnings(measured, load_before, cpus)
    if not measured:
        raise BenchError(f"every setting failed; first: {results[0]['reader']}: {results[0]['error']}")
    best = max(measured, key=lambda r: r["samples_per_s"] or 0.0)
    data_bound = None if opts.compute_ms <= 0 else best["wait_share"] >= DATA_BOUND_SHARE
    report = {"dataset": location, "modality": manifest.modality, "format": manifest.format,
              "usable_cpus": cpus, "load_before": load_before,
              "options": {**asdict(opts), "pin_memory": _pin(opts), "device_requested": requested},
              "results": results, "best": best, "data_bound": data_bound,
              "recommendation": recommendation(best, results, opts), "warnings": warnings, "notes": notes}
    return report


def _measure_row(reader: Reader, setting: Setting, location: str, manifest: Manifest, opts: BenchOptions) -> dict:
    """One round of one setting: its description and what ``measure`` found (or the error)."""
    row = {**asdict(setting), "unit": reader.unit}
    if reader.kind == "dataloader":
        row.update(pin_memory=_pin(opts), persistent_workers=bool(setting.workers and opts.persistent_workers),
                   prefetch_factor=opts.prefetch_factor if setting.workers else None)
    else:
        row.update(prefetch_queue_depth=opts.prefetch_factor)
    try:
        row.update(measure(reader.make(location, manifest, setting, opts), opts, setting.batch_size))
    except Exception as exc:  # one failing setting is a row with its reason; the sweep goes on
        row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    return row


def _median_row(rounds: list[dict]) -> dict:
    """A setting's row: its median round (by samples/s), with every round's rate and their spread,
    (max - min) / median; a failed round makes the row a failure."""
    if "error" in rounds[-1]:
        return rounds[-1]
    ranked = sorted(rounds, key=lambda r: r["samples_per_s"] or 0.0)
    median = ranked[(len(ranked) - 1) // 2]
    rates = [r["samples_per_s"] or 0.0 for r in rounds]
    spread = (max(rates) - min(rates)) / median["samples_per_s"] if median["samples_per_s"] else 0.0
    return {**median, "rounds": rates, "spread": round(spread, 4)}


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def noise_warnings(rows: list[dict], load_before: float | None, cpus: int) -> list[str]:
    """Warnings that the answer is unreliable: the machine was busy before the bench started, or the
    rounds of a setting disagree by more than NOISY_SPREAD."""
    found = []
    if load_before is not None and load_before > BUSY_LOAD * cpus:
        found.append(f"the machine was busy before the bench started (load average {load_before:g} on {cpus} "
                     f"usable CPU(s)): other work competes with the readers, so the rates and the comparisons are "
                     f"unreliable; re-run on a quiet machine")
    noisy = [r for r in rows if r.get("spread", 0.0) > NOISY_SPREAD]
    if noisy:
        worst = max(noisy, key=lambda r: r["spread"])
        found.append(f"{len(noisy)} setting(s) varied by more than {100 * NOISY_SPREAD:.0f}% between rounds (up to "
                     f"{100 * worst['spread']:.0f}%: {_describe(worst)}); differences smaller than that are noise: "
                     f"re-run with more --steps or --rounds, or on a quieter machine")
    return found


def _epoch_warnings(rows: list[dict], opts: BenchOptions) -> list[str]:
    """A warning when measured steps crossed an epoch boundary (its restart is measured as data wait)."""
    crossed = [r for r in rows if r.get("epochs_started")]
    if not crossed:
        return []
    text = (f"{len(crossed)} setting(s) ran past the end of an epoch during the {opts.steps} measured steps "
            f"(e.g. {_describe(crossed[0])}): the epoch restart counts as data wait")
    if any(r["kind"] == "dataloader" and r["workers"] and not r.get("persistent_workers") for r in crossed):
        text += ", including DataLoader worker start-up (--no-persistent-workers)"
    return [text + "; use fewer --warmup/--steps or a larger dataset for steady-state numbers"]


def _label(row: dict) -> str:
    if row["kind"] == "dataloader":
        return f"workers={row['workers']}"
    return f"threads={row['threads']}" + (" gpu" if row.get("device") == "gpu" else "")


def _describe(row: dict) -> str:
    return f"{row['reader']} {_label(row)} batch={row['batch_size']}"


def recommendation(best: dict, results: list[dict], opts: BenchOptions) -> str:
    """One or two plain sentences: the fastest setting, and whether data loading is the bottleneck."""
    lines = [f"fastest: {_describe(best)} at {best['samples_per_s']:.1f} {best['unit']}/s."]
    files = [r for r in results if r["reader"] == "files" and "error" not in r]
    packed = [r for r in results if r["reader"] == "torch" and "error" not in r]  # the same DataLoader decode path as files
    if files and packed:
        top_files = max(files, key=lambda r: r["samples_per_s"] or 0.0)
        top_packed = max(packed, key=lambda r: r["samples_per_s"] or 0.0)
        ratio = (top_packed["samples_per_s"] or 0.0) / max(top_files["samples_per_s"] or 0.0, 1e-9)
        pairs = list(zip(top_packed.get("rounds", ()), top_files.get("rounds", ())))  # the same round: alternated
        each = sorted(p / max(f, 1e-9) for p, f in pairs)
        within = f", {each[0]:.2f}-{each[-1]:.2f}x round by round" if len(each) > 1 else ""
        unsure = "; not reliably different from 1x" if len(each) > 1 and each[0] < 1 < each[-1] else ""
        lines.append(f"packed vs original files, same DataLoader decode: {ratio:.2f}x{within}{unsure} "
                     f"({_describe(top_packed)} vs {_describe(top_files)}).")
    if opts.compute_ms <= 0:
        lines.append("no --compute-ms given: these are raw reader rates; pass your model's step time "
                     "to see whether the data path is the bottleneck.")
    elif best["wait_share"] < DATA_BOUND_SHARE:
        lines.append(f"the data path is not the bottleneck: the step waits {100 * best['wait_share']:.1f}% "
                     f"of its time for data (GPU utilization up to {100 * best['gpu_util_bound']:.0f}%); "
                     f"a faster loader will not speed up training.")
    else:
        needed = best["batch_size"] / (opts.compute_ms / 1000)
        lines.append(f"the data path is a bottleneck: {100 * best['wait_share']:.0f}% of each step waits for data "
                     f"(GPU utilization at most {100 * best['gpu_util_bound']:.0f}%); the model could consume "
                     f"{needed:.0f} {best['unit']}/s.")
    return "\n".join(lines)


def format_table(report: dict) -> str:
    """The report as an aligned text table, the fastest row marked with '*', then the verdict."""
    head = ["reader", "setting", "batch", "samples/s", "spread", "wait ms/step", "wait %", "GPU util <="]
    rows, errors = [], []
    for r in report["results"]:
        setting = _label(r)
        if "error" in r:
            rows.append([" " + r["reader"], setting, str(r["batch_size"]), "failed", "-", "-", "-", "-"])
            errors.append(f"{r['reader']} {setting} batch={r['batch_size']}: {r['error']}")
            continue
        util = "-" if r["gpu_util_bound"] is None else f"{100 * r['gpu_util_bound']:.0f}%"
        mark = "*" if r is report["best"] else " "
        spread = f"{100 * r['spread']:.0f}%" if len(r.get("rounds", ())) > 1 else "-"
        rows.append([mark + r["reader"], setting, str(r["batch_size"]), f"{r['samples_per_s']:.1f}", spread,
                     f"{r['wait_ms_per_step']:.1f}", f"{100 * r['wait_share']:.0f}%", util])
    head[0] = " " + head[0]
    widths = [max(len(x[i]) for x in [head] + rows) for i in range(len(head))]

    def fmt(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    opts = report["options"]
    title = (f"{report['dataset']} ({report['modality']}/{report['format']}): {opts['steps']} steps after "
             f"{opts['warmup']} warm-up, median of {opts.get('rounds', 1)} alternated round(s), "
             f"compute {opts['compute_ms']:g} ms/step ({opts['compute_mode']}), "
             f"{report['usable_cpus']} usable CPU(s), device {opts['device']}")
    out = [title, fmt(head)] + [fmt(r) for r in rows]
    out += [f"failed: {e}" for e in errors] + [f"warning: {w}" for w in report["warnings"]] + [f"note: {n}" for n in report["notes"]]
    out.append(report["recommendation"])
    return "\n".join(out)

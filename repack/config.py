"""Typed, frozen option objects for jobs, and validation of option values."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from repack.errors import UsageError
from repack.sizes import parse_size  # noqa: F401 - the options' sizes (re-exported)

if TYPE_CHECKING:
    from repack.sources.confine import Confinement

def format_size(num_bytes: int | float) -> str:
    """Bytes for people: '512 B', '3.4 KB', '118.0 MB', '1.2 GB' (decimal units, as parse_size reads)."""
    value = float(num_bytes)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class EngineOptions:
    """How a job runs; none of this changes its output."""

    workers: int | None = None
    executor: str = "local"
    ray_address: str | None = None
    ray_driver_cpus: int | None = None  # Ray: the driver node's CPUs run by a local pool (None: what Ray can give)
    retries: int = 2
    num_nodes: int = 1
    node_rank: int = 0
    overwrite: bool = False
    strict: bool = False
    quiet: bool = False
    json_summary: bool = False
    progress_every: float = 30.0  # seconds between progress lines when stderr is not a terminal
    log_json: bool = False  # progress lines and the final summary as JSON lines on stderr
    command: str = ""

    def __post_init__(self) -> None:
        if self.workers is not None and self.workers < 1:
            raise UsageError(f"--workers must be at least 1, got {self.workers}")
        if self.num_nodes < 1:
            raise UsageError(f"--num-nodes must be at least 1, got {self.num_nodes}")
        if not 0 <= self.node_rank < self.num_nodes:
            raise UsageError(f"--node-rank must be in [0, {self.num_nodes}), got {self.node_rank}")
        if self.ray_driver_cpus is not None and self.ray_driver_cpus < 0:
            raise UsageError(f"--ray-driver-cpus must be >= 0, got {self.ray_driver_cpus}")
        if self.executor != "ray" and (self.ray_address is not None or self.ray_driver_cpus is not None):
            raise UsageError(f"--ray-address and --ray-driver-cpus apply to --executor ray (this run: --executor "
                             f"{self.executor}, which would ignore them)")
        if self.retries < 0:
            raise UsageError("--retries must be >= 0")
        if not self.progress_every > 0:
            raise UsageError(f"--progress-every must be a positive number of seconds, got {self.progress_every}")


@dataclass(frozen=True)
class JobSpec:
    """Base of every modality's spec: what determines the output, and nothing else."""

    source: str
    out: str

    def fields_dict(self) -> dict[str, Any]:
        """Every field by name: what ``dataclasses.asdict`` gives for a spec's plain values (str, numbers,
        tuples of them), without its deep copy (an --append's ``known_classes`` holds a pair per class)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def options(self) -> dict[str, Any]:
        """The output-determining options, as canonical JSON-able data (OUT excluded)."""
        data = self.fields_dict()
        data.pop("out")
        return data

    def to_json(self) -> str:
        return json.dumps(self.fields_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str):
        data = json.loads(text)
        for f in dataclasses.fields(cls):
            if isinstance(data.get(f.name), list):
                data[f.name] = tuple(data[f.name])
        return cls(**data)


DEFAULT_MAX_FILE_BYTES = 256 * 2**20  # images: --max-file-size (larger files are quarantined from stat)


@dataclass(frozen=True)
class ImagesSpec(JobSpec):
    """Options of `repack images`."""

    to: str = "webdataset"
    list_file: bool = False
    shard_size: int | None = None
    shard_bytes: int | None = None
    chunk_size: int = 1024
    shuffle: bool = False
    seed: int = 0
    verify: str = "decode"
    follow_symlinks: bool = True
    allow_outside_source: bool = False
    max_file_size: int = DEFAULT_MAX_FILE_BYTES
    normalize: bool = False
    quality: int = 90
    max_side: int | None = None
    dedup: bool = False
    max_pixels: int = 178_956_970
    source_format: str = "folder"     # --from: folder (a tree or --list), webdataset (tar shards), parquet
    image_field: str | None = None    # --from webdataset|parquet: the image member's extension / column
    label_field: str | None = None    # ... and the label's
    sample_json: bool = True          # a .json member per sample (path, class, size); --no-sample-json: none
    # set by `--append` (repack.lifecycle.append) for the job that packs only the new inputs:
    known_inputs: str | None = None   # the record of the inputs held (repack.lifecycle.input_columns): skipped
    known_classes: tuple[tuple[str, int], ...] = ()  # the dataset's classes (kept; a new class: the next index)
    cls_width: int | None = None      # the dataset's cls member width (kept)
    duplicates_file: str = "duplicates.groups"  # the side file of duplicate groups (an append's: duplicates-vN.groups)

    def options(self) -> dict[str, Any]:
        """As ``JobSpec.options``, without the name of the duplicate-groups file: it names an output, determines
        none (and a job.json of a repack before it has none: its options fingerprint stays the same)."""
        data = super().options()
        data.pop("duplicates_file")
        return data

    def __post_init__(self) -> None:
        if self.source_format not in ("folder", "webdataset", "parquet"):
            raise UsageError(f"--from must be folder, webdataset or parquet, got {self.source_format!r}")
        if self.source_format == "folder" and (self.image_field or self.label_field):
            raise UsageError("--image-field/--label-field name another tool's members or columns: use them "
                             "with --from webdataset or --from parquet")
        if self.source_format != "folder" and self.list_file:
            raise UsageError(f"--list reads a list of files: it cannot be combined with --from {self.source_format}")
        if not self.sample_json and self.to != "webdataset":
            raise UsageError("--no-sample-json drops a tar member per sample: it applies to --to webdataset, "
                             f"not --to {self.to}")
        if self.verify not in ("decode", "header", "none"):
            raise UsageError(f"--verify must be decode, header or none, got {self.verify!r}")
        if self.shard_bytes is not None and self.shard_bytes < MIN_SHARD_BYTES:
            raise UsageError(f"--shard-bytes {self.shard_bytes} is below one small sample's shard "
                             f"({MIN_SHARD_BYTES} bytes); use at least 64KiB")
        if self.shard_size is not None and self.shard_size < 1:
            raise UsageError(f"--shard-size must be at least 1, got {self.shard_size}")
        if self.chunk_size < 1:
            raise UsageError(f"--chunk-size must be at least 1, got {self.chunk_size}")
        if not 1 <= self.quality <= 100:
            raise UsageError(f"--quality must be in 1..100, got {self.quality}")
        if self.max_side is not None and self.max_side < 16:
            raise UsageError(f"--max-side must be at least 16, got {self.max_side}")
        if self.max_side is not None and not self.normalize:
            raise UsageError("--max-side re-encodes images: use it with --normalize")
        if self.max_file_size < 1:
            raise UsageError(f"--max-file-size must be positive, got {self.max_file_size}")
        if self.max_pixels < 1:
            raise UsageError(f"--max-pixels must be positive, got {self.max_pixels}")

    def confinement(self) -> Confinement:
        """The source's ``repack.sources.confine.Confinement`` (its rules; the scan roots it)."""
        from repack.sources.confine import Confinement

        return Confinement(follow_symlinks=self.follow_symlinks, allow_outside=self.allow_outside_source,
                           max_file_bytes=self.max_file_size)

    def walks_folder(self) -> bool:
        """Is SOURCE a local folder tree, walked by ``repack.sources.folder``?"""
        from repack.store import is_remote

        return self.source_format == "folder" and not self.list_file and not is_remote(self.source)

    def shard_limits(self) -> tuple[int | None, int | None]:
        """(inputs, bytes) a shard holds at most: the options given, else DEFAULT_SHARD_BYTES alone."""
        if self.shard_size is None and self.shard_bytes is None:
            return None, DEFAULT_SHARD_BYTES
        return self.shard_size, self.shard_bytes


DEFAULT_SHARD_BYTES = 512 * 10**6
MIN_SHARD_BYTES = 64 * 2**10

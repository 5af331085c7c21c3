"""PyTorch reader for ``repack images --to lmdb`` datasets: a map-style Dataset.

Random access by index (``len``, ``dataset[i]``), so any sampler works (``shuffle=True``,
``DistributedSampler``). The LMDB environment is opened lazily in the process that first
reads (each DataLoader worker opens its own: read-only, ``lock=False``; OS readahead stays on,
since an image value spans many pages) and is never pickled. Keys (see ``repack/sinks/lmdb_sink.py``): ``s/<index:010d>/img`` image bytes,
``.../cls`` ASCII decimal label, ``.../json`` metadata; ``__meta__`` JSON. No pickle.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

from torch.utils.data import Dataset

from pipelines.dataset_identity import identity
from pipelines.manifest_access import checked_pixels, parse_label
from pipelines.pil_images import decode_image
from pipelines.sample_errors import ShardIntegrityError, decode_error
from pipelines.sampler_resume import MapDatasetState
from repack.manifest import MANIFEST_NAME, Manifest, ManifestError, read_manifest
from repack.manifest.caps import check_declared_counts, check_manifest_size
from repack.manifest.lmdb_meta import lmdb_file_problem
from repack.manifest.versions import version_file

LAYOUT = "repack-lmdb/1"
UNLABELED = -1


def open_lmdb_dataset(root: str | os.PathLike, version: int | None = None) -> tuple[Manifest, str, int]:
    """Validate the manifest of an image LMDB dataset (the latest version, or ``version``): (manifest,
    absolute db path, samples)."""
    if str(root).startswith("s3://"):
        raise ManifestError(f"{root}: an LMDB is read from a local file (it is memory-mapped); copy it first "
                            f"with `repack pull {root} DIR`")
    for name in (MANIFEST_NAME, version_file(version) if version is not None else None):
        if name is not None and os.path.exists(os.path.join(root, name)):
            check_manifest_size(os.path.getsize(os.path.join(root, name)), os.path.join(root, name))
    manifest = read_manifest(root, version)
    if manifest.format != "lmdb":
        raise ManifestError(f"{manifest.root}: format {manifest.format!r}, this reader reads 'lmdb'")
    entries = manifest.data["shards"]
    if len(entries) != 1 or entries[0].get("layout") != LAYOUT:
        raise ManifestError(f"{manifest.root}: expected one database of layout {LAYOUT}")
    path = manifest.path(entries[0]["path"])
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        raise ManifestError(f"{path}: {exc.strerror}") from None
    if size != entries[0]["bytes"]:  # a short file would be mapped and read past its end: SIGBUS
        raise ManifestError(f"{path}: {size} bytes, the manifest says {entries[0]['bytes']} (truncated or "
                            "changed; run `repack verify`)")
    check_declared_counts(manifest.data, lambda rel: size, str(manifest.root))  # before sizing memory from it
    problem = lmdb_file_problem(path)  # its meta pages name pages past its end: mapped reads there are SIGBUS
    if problem:
        raise ManifestError(f"{path}: not safe to open as LMDB ({problem}; run `repack verify`)")
    return manifest, str(path), int(entries[0]["samples"])


def class_indices(manifest) -> frozenset | None:
    """The class indices a labeled LMDB dataset's samples may hold (its class map's), None when unlabeled."""
    if "cls" not in manifest.fields:
        return None
    return frozenset(index for index in (manifest.classes or {}).values() if isinstance(index, int))


def checked_label(raw: bytes | None, indices: frozenset | None) -> int:
    """A record's label: ``UNLABELED`` in an unlabeled dataset; in a labeled one (``indices``: its class map's)
    its class, which must be there and be one the map names (ValueError: the caller names the key)."""
    if indices is None:
        return parse_label(raw) if raw is not None else UNLABELED
    if raw is None:
        raise ValueError("no class, in a labeled dataset")
    label = parse_label(raw)
    if label not in indices:
        raise ValueError(f"class index {label} is not in the dataset's class map")
    return label


def sample_key(index: int) -> str:
    """The key prefix of sample ``index`` in the database (``s/<index:010d>``), as errors name it."""
    return f"s/{index:010d}"


# (path, file identity) -> (pid, environment): LMDB allows one per file per process. The file's identity
# is in the key: a database packed again at the same path (--overwrite) is another file, read through its
# own environment (a cache by path alone read the old file's samples under the new manifest)
_ENVS: dict[tuple[str, tuple | None], tuple[int, Any]] = {}


def file_identity(path: str) -> tuple | None:
    """(device, inode, size, mtime_ns) of ``path``; None when it cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _environment(path: str, identity: tuple | None = None):
    """This process's read-only environment of the file ``path`` was when ``identity`` was taken (a
    RuntimeError naming it when another file is there now); one inherited through fork is closed, not used."""
    pid, env = _ENVS.get((path, identity), (None, None))
    if pid != os.getpid():
        import lmdb

        if env is not None:  # a parent's handle (fork): unusable here, and it blocks a new open
            env.close()
        env = lmdb.open(path, subdir=False, readonly=True, lock=False, readahead=True, max_readers=1024,
                        meminit=False)
        if identity is not None and file_identity(path) != identity:
            env.close()
            raise RuntimeError(f"{path}: the database was replaced since this reader opened its dataset (another "
                               "pack into the same folder?); open the dataset again")
        _ENVS[(path, identity)] = (os.getpid(), env)
    return env


class LmdbReader:
    """Lazily opened, fork-safe read access to the samples of one database."""

    def __init__(self, path: str, count: int) -> None:
        self.path = path
        self.count = count
        self.identity = file_identity(path)  # the file this reader reads, whatever replaces it at the path

    def _read(self, keys: list[bytes], what: str) -> list[bytes | None]:
        """The values of ``keys`` (None where absent), in one read transaction. Damage the size and meta-page
        checks at open cannot see (a page overwritten in place) is a ``ShardIntegrityError`` naming the database
        and ``what`` (the sample's key), not LMDB's bare error. (A node's value length overwritten in place can
        still crash the process inside LMDB's own read: `repack verify` names that damage.)"""
        import lmdb

        try:
            with _environment(self.path, self.identity).begin(buffers=False) as txn:
                return [txn.get(key) for key in keys]
        except lmdb.Error as exc:
            raise ShardIntegrityError(self.path, what, f"the database cannot be read: {type(exc).__name__}: {exc} "
                                      "(run `repack verify`)") from exc

    def get(self, index: int, fields: tuple[str, ...] = ("img", "cls")) -> dict[str, bytes | None]:
        """Raw values of sample ``index`` (None for a missing field other than ``img``); a missing
        image is damage: a RuntimeError naming the database, the sample and its key."""
        if not 0 <= index < self.count:
            raise IndexError(f"sample {index} out of range 0..{self.count - 1}")
        raw = dict(zip(fields, self._read([b"s/%010d/%s" % (index, f.encode()) for f in fields], sample_key(index))))
        if "img" in raw and raw["img"] is None:
            raise RuntimeError(f"{self.path}: sample {index} has no image (key s/{index:010d}/img missing; "
                               "run `repack verify`)")
        return raw

    def meta(self) -> dict:
        data, = self._read([b"__meta__"], "__meta__")
        if data is None:
            raise ManifestError(f"{self.path}: no __meta__ record (not a repack LMDB)")
        try:
            meta = json.loads(data)
        except ValueError:
            meta = None
        if not isinstance(meta, dict):
            raise ManifestError(f"{self.path}: its __meta__ record is not a JSON object (run `repack verify`)")
        return meta

    def check_count(self) -> None:
        """Refuse a database that holds another number of samples than the manifest lists."""
        held = self.meta().get("count")
        if held != self.count:
            raise ManifestError(f"{self.path}: the manifest lists {self.count} samples, the database holds "
                                f"{held} (run `repack verify`)")
        if self.count and self._read([b"s/%010d/img" % (self.count - 1)], sample_key(self.count - 1))[0] is None:
            raise ManifestError(f"{self.path}: the manifest lists {self.count} samples, the database "
                                f"lacks sample {self.count - 1} (run `repack verify`)")


class LmdbImageDataset(MapDatasetState, Dataset):
    """``dataset[i] -> (image, label)`` (or a dict with ``output="dict"``) over an image LMDB.

    Order and resume come from the sampler: pass ``pipelines.sampler_resume.ResumableSampler``
    to a ``StatefulDataLoader`` for exact (and elastic) mid-epoch resume.

    Args:
        root: the dataset folder (holds ``manifest.json`` and ``data.lmdb``).
        transform: applied to each decoded PIL image.
        mode: PIL mode to convert to (``"RGB"``); None keeps the stored mode.
        decode: False returns the raw image bytes.
        output: ``"tuple"`` or ``"dict"`` ({"index", "image", "label", "meta"}).
        version: the dataset version to read (default: the latest; an older one until ``repack gc``).

    An image that does not decode, a bad ``cls``/``json`` value or a failing transform raise
    ``pipelines.sample_errors.SampleDecodeError`` naming the database and the sample (``s/<index>``),
    chained from the original error.
    """

    def __init__(self, root: str | os.PathLike, transform: Callable | None = None, mode: str | None = "RGB",
                 decode: bool = True, output: str = "tuple", version: int | None = None) -> None:
        if output not in ("tuple", "dict"):
            raise ValueError(f"output must be 'tuple' or 'dict', not {output!r}")
        self.root = str(root)
        self.use_version(version)
        self.transform, self.mode, self.decode, self.output = transform, mode, decode, output

    def use_version(self, version: int | None) -> None:
        """Read version ``version`` of the dataset (None: the latest)."""
        self.manifest, path, count = open_lmdb_dataset(self.root, version)
        if checked_pixels(self.manifest) is not None:  # over Pillow's own limit: the check's
            from pipelines.pil_images import allow_pixels

            allow_pixels(checked_pixels(self.manifest))
        self.dataset = identity(self.manifest)
        self.reader = LmdbReader(path, count)
        self.reader.check_count()
        self.labeled = "cls" in self.manifest.fields
        self.class_indices = class_indices(self.manifest)

    @property
    def classes(self) -> dict[str, int]:
        return self.manifest.classes

    def __len__(self) -> int:
        return self.reader.count

    def __getitem__(self, index: int) -> Any:
        if index < 0:
            index += len(self)
        fields = ("img", "cls", "json") if self.output == "dict" else ("img", "cls")
        raw = self.reader.get(index, fields)
        stage = "label"
        try:
            label = checked_label(raw["cls"], self.class_indices)
            image: Any = raw["img"]
            if self.decode:
                stage = "decode"
                image = decode_image(image, self.mode)
                if self.transform is not None:
                    stage = "transform"
                    image = self.transform(image)
            if self.output == "dict":
                stage = "meta"
                return {"index": index, "image": image, "label": label,
                        "meta": json.loads(raw["json"]) if raw.get("json") else None}
        except Exception as exc:
            raise decode_error(self.reader.path, sample_key(index), stage, exc) from exc
        return image, label


class ResizeToTensor:
    """Resize (shorter side, bilinear) + center crop to ``size``, then a uint8 CHW tensor.

    A plain class (not a closure), so it pickles into DataLoader workers under any start method
    (fork, spawn, forkserver).
    """

    def __init__(self, size: int = 224) -> None:
        self.size = size

    def __repr__(self) -> str:
        return f"ResizeToTensor(size={self.size})"

    def __call__(self, image):
        import numpy as np
        import torch
        from PIL import Image

        size = self.size
        w, h = image.size
        scale = size / min(w, h)
        image = image.resize((max(size, round(w * scale)), max(size, round(h * scale))), Image.BILINEAR)
        w, h = image.size
        left, top = (w - size) // 2, (h - size) // 2
        image = image.crop((left, top, left + size, top + size))
        return torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1)


def resize_to_tensor(size: int = 224) -> ResizeToTensor:
    """A transform: resize (shorter side, bilinear) + center crop to ``size``, then a uint8 CHW tensor."""
    return ResizeToTensor(size)

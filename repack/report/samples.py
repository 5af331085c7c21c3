"""What the HTML report shows of the data itself, chosen deterministically (the same dataset gives
the same page): a few thumbnails per class, thumbnails of quarantined inputs that decode at all,
one frame per video decision, the starts of a few text documents. Everything is bounded (counts
capped, thumbnails small), so the page stays small whatever the dataset's size."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from repack.errors import RepackError
from repack.report.collect import probe_records
from repack.report.dataset_files import DatasetFiles
from repack.report.thumbnails import FRAME_SIDE, ThumbnailError, thumbnail_uri

PER_CLASS = 6  # thumbnails per class
MAX_CLASSES = 24  # classes shown
MAX_QUARANTINED = 12  # quarantined inputs shown
SHARD_WINDOW = 2 << 20  # bytes read from the start of each shard when looking for samples
MAX_SHARDS = 64  # shards looked into
MAX_SOURCE_BYTES = 32 << 20  # a quarantined input larger than this is not read for a thumbnail
MAX_VIDEO_BYTES = 256 << 20  # a video larger than this is not fetched from object storage for a frame
DOCUMENTS = 5  # text documents shown
DOCUMENT_TOKENS = 160  # tokens decoded from the start of each
FFMPEG_TIMEOUT = 30.0


def gather(files: DatasetFiles) -> dict:
    """The samples the report shows for this dataset (JSON-able; thumbnails as data: URIs). A file
    that cannot be read (a damaged dataset: `repack verify` says what) gives a note, not a failure."""
    modality = files.manifest.modality
    try:
        if modality == "images":
            return {"classes": class_thumbnails(files), "quarantined": quarantined_thumbnails(files)}
        if modality == "video":
            return {"frames": decision_frames(files)}
        if modality == "text":
            return {"documents": document_starts(files)}
    except (OSError, ValueError, RepackError) as exc:
        return {"note": f"samples not shown: {type(exc).__name__}: {exc} (run `repack verify`)"}
    return {}


# -- images ----------------------------------------------------------------------------------------
def class_thumbnails(files: DatasetFiles) -> list[dict]:
    """[{class, index, thumbnails: [{key, uri}]}] for up to MAX_CLASSES classes, in class order:
    the first PER_CLASS samples of each in dataset order, looked for in the first SHARD_WINDOW bytes
    of each of the first MAX_SHARDS shards (or the first LMDB records)."""
    manifest = files.manifest
    found: dict[int, list[dict]] = {}
    for label, key, data in _image_samples(files):
        shown = found.setdefault(label, [])
        if len(shown) >= PER_CLASS:
            continue
        try:
            shown.append({"key": key, "uri": thumbnail_uri(data)})
        except ThumbnailError as exc:
            shown.append({"key": key, "error": str(exc)})
        full = sum(1 for v in found.values() if len(v) >= PER_CLASS)
        if full >= min(MAX_CLASSES, max(1, len(manifest.classes))):
            break
    names = {index: name for name, index in manifest.classes.items()}
    return [{"class": names.get(label, "unlabeled"), "index": label, "thumbnails": thumbs}
            for label, thumbs in sorted(found.items())][:MAX_CLASSES]


def _image_samples(files: DatasetFiles):
    """(label, key, image bytes) of samples in dataset order, from tar shards or the LMDB file."""
    if files.manifest.format == "lmdb":
        yield from _lmdb_samples(files)
        return
    for shard in files.manifest.data["shards"][:MAX_SHARDS]:
        if not shard.get("index") or not shard.get("samples"):
            continue
        window = files.read(shard["path"], 0, min(shard["bytes"], SHARD_WINDOW))
        for members in _index_samples(files.read(shard["index"]).decode("ascii", errors="replace")):
            label, image = members.get("cls"), next(((n, o, s) for e, (n, o, s) in members.items()
                                                     if e not in ("cls", "json")), None)
            if image is None or any(o + s > len(window) for _, o, s in members.values()):
                break  # past the window: the next shard
            try:
                cls = int(window[label[1]:label[1] + label[2]]) if label else -1
            except ValueError:
                cls = -1
            name, offset, size = image
            yield cls, name.rsplit(".", 1)[0], window[offset:offset + size]


def _index_samples(index: str):
    """{ext: (member name, offset, size)} per sample of a DALI index (``v1.2 N`` + 4 tokens a member)."""
    for line in index.splitlines()[1:]:
        tokens = line.split()
        members = {}
        for i in range(0, len(tokens) - 3, 4):
            ext, offset, size, name = tokens[i:i + 4]
            members[ext] = (name, int(offset), int(size))
        if members:
            yield members


def _lmdb_samples(files: DatasetFiles):
    """(label, key, image bytes) of the first records of a local LMDB dataset (its size checked first)."""
    if not files.local:
        return
    import lmdb

    shard = files.manifest.data["shards"][0]
    path = files.manifest.path(shard["path"])
    if not path.is_file() or path.stat().st_size != shard["bytes"]:
        return  # `repack verify` reports it; never map a file whose size differs (SIGBUS)
    env = lmdb.open(str(path), readonly=True, lock=False, subdir=False, readahead=False)
    try:
        with env.begin() as txn:
            for index in range(min(shard.get("samples", 0), MAX_SHARDS * PER_CLASS * 4)):
                image, label = txn.get(f"s/{index:010d}/img".encode()), txn.get(f"s/{index:010d}/cls".encode())
                if image is None:
                    break
                try:
                    cls = int(label) if label is not None else -1
                except ValueError:
                    cls = -1
                yield cls, f"{index:010d}", bytes(image)
    finally:
        env.close()


def source_root(options: dict) -> str | None:
    """The local folder a job's inputs were confined to (None for an s3:// source)."""
    source = options.get("source")
    if not source or "://" in source:
        return None
    return os.path.dirname(source) if options.get("list_file") else source


def quarantined_thumbnails(files: DatasetFiles) -> list[dict]:
    """[{source, reason, uri | note}] for the first MAX_QUARANTINED quarantined inputs, read from the
    job's source through the same confinement as the job (regular files inside its root, capped)."""
    from repack.sources.confine import Confinement, read_input

    options = files.manifest.data.get("created_by", {}).get("options", {})
    root = source_root(options)
    shown = []
    for entry in files.manifest.quarantine[:MAX_QUARANTINED]:
        item = {"source": str(entry.get("source", "?")), "reason": str(entry.get("reason", "?"))}
        shown.append(item)
        if root is None or not os.path.isdir(root):
            item["note"] = "source not available here"
            continue
        path = os.path.join(root, item["source"])
        checked = Confinement(max_file_bytes=MAX_SOURCE_BYTES).rooted(root).check(path)
        if checked.reason or checked.is_dir:
            item["note"] = f"not read: {checked.reason or 'a folder'}"
            continue
        try:
            item["uri"] = thumbnail_uri(read_input(checked.real))
        except (ThumbnailError, OSError, ValueError) as exc:
            item["note"] = str(exc) or type(exc).__name__
    return shown


# -- video -----------------------------------------------------------------------------------------
def decision_frames(files: DatasetFiles) -> list[dict]:
    """One frame per decision kind (ok, transcode, reject): the first video of each in source order,
    a frame extracted by ffmpeg from its output in OUT, else from its source; with its reasons."""
    probes = sorted(probe_records(files), key=lambda p: str(p.get("source")))
    outputs = {s.get("source"): s["path"] for s in files.manifest.data["shards"] if s.get("source")}
    frames = []
    for decision in ("ok", "transcode", "reject"):
        probe = next((p for p in probes if p.get("decision") == decision), None)
        if probe is None:
            continue
        item = {"decision": decision, "source": str(probe.get("source")),
                "reasons": [f"{r.get('code')}: {r.get('message')}" for r in probe.get("reasons", [])]}
        try:
            item["uri"] = _frame(files, item["source"], outputs.get(item["source"]))
        except (ThumbnailError, OSError, ValueError) as exc:
            item["note"] = str(exc)
        frames.append(item)
    return frames


def _frame(files: DatasetFiles, source: str, output: str | None) -> str:
    """A thumbnail of the first frame of the video (its output in OUT when there is one)."""
    if output is not None and files.local:
        return _ffmpeg_frame(str(files.manifest.path(output)))
    if output is not None:
        size = next((s["bytes"] for s in files.manifest.data["shards"] if s.get("path") == output), 0)
        if size > MAX_VIDEO_BYTES:
            raise ThumbnailError(f"{output}: {size} bytes, not fetched for a frame")
        with tempfile.TemporaryDirectory(prefix="repack-frame-") as tmp:
            local = Path(tmp) / Path(output).name
            local.write_bytes(files.read(output))
            return _ffmpeg_frame(str(local))
    from repack.sources.confine import Confinement

    root = source_root(files.manifest.data.get("created_by", {}).get("options", {}))
    if root is None or not os.path.isdir(root):
        raise ThumbnailError("no output, and the source is not available here")
    checked = Confinement(max_file_bytes=MAX_VIDEO_BYTES).rooted(root).check(os.path.join(root, source))
    if checked.reason or checked.is_dir:
        raise ThumbnailError(f"not read: {checked.reason or 'a folder'}")
    return _ffmpeg_frame(checked.real)


def _ffmpeg_frame(path: str) -> str:
    """The first frame of ``path`` as a thumbnail (ffmpeg confined to that one file)."""
    from repack.transforms.ffmpeg_cli import compile_ffmpeg, run, safe_input

    cmd = compile_ffmpeg(safe_input(path).output("pipe:", vframes=1, vf=f"scale={FRAME_SIDE}:-2", format="image2",
                                                 vcodec="mjpeg"))
    result = run(cmd, timeout=FFMPEG_TIMEOUT)
    if result.returncode != 0 or not result.stdout:
        raise ThumbnailError(f"no frame: {result.error_line(path)}")
    return thumbnail_uri(result.stdout, FRAME_SIDE)


# -- text ------------------------------------------------------------------------------------------
def document_starts(files: DatasetFiles) -> list[dict]:
    """[{index, tokens, text}]: up to DOCUMENTS documents spread evenly over the first output file
    (first, last and between), their first DOCUMENT_TOKENS tokens decoded with OUT's tokenizer."""
    import numpy as np

    from repack.sinks.megatron import DTYPE_CODES, HEADER, HEADER_SIZE, MAGIC

    manifest = files.manifest
    shards = [s for s in manifest.data["shards"] if s.get("index") and s.get("samples")]
    rel = manifest.data.get("files", {}).get("tokenizer")
    if not shards or not rel:
        return []
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(files.read_text(rel))
    shard = shards[0]
    magic, _, code, count, _ = HEADER.unpack(files.read(shard["index"], 0, HEADER_SIZE))
    if magic != MAGIC or code not in DTYPE_CODES or count < 1:
        return []
    dtype = DTYPE_CODES[code]
    picks = sorted({round(i * (count - 1) / max(1, DOCUMENTS - 1)) for i in range(DOCUMENTS)})
    shown = []
    for index in picks:
        length = int(np.frombuffer(files.read(shard["index"], HEADER_SIZE + 4 * index, 4), "<i4")[0])
        pointer = int(np.frombuffer(files.read(shard["index"], HEADER_SIZE + 4 * count + 8 * index, 8), "<i8")[0])
        take = min(length, DOCUMENT_TOKENS)
        ids = np.frombuffer(files.read(shard["path"], pointer, take * dtype.itemsize), dtype).tolist()
        shown.append({"index": index, "tokens": length, "text": tokenizer.decode(ids, skip_special_tokens=False),
                      "truncated": length > take})
    return shown

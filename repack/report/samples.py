"""What the HTML report shows of the data itself, chosen deterministically (the same dataset gives
the same page): a few thumbnails per class, thumbnails of quarantined inputs that decode at all,
one frame per video decision, the starts of a few text documents. Everything is bounded (counts
capped, thumbnails small), so the page stays small whatever the dataset's size."""

from __future__ import annotations

import bisect
import itertools
import json
import os
import tempfile
from pathlib import Path

from repack.errors import RepackError
from repack.report.collect import probe_records
from repack.store.files import DatasetFiles
from repack.report.thumbnails import FRAME_SIDE, ThumbnailError, thumbnail_uri

PER_CLASS = 6  # thumbnails per class
MAX_CLASSES = 24  # classes shown
MAX_QUARANTINED = 12  # quarantined inputs shown
MAX_PROBES = 4096  # places in the dataset probed for samples (local files)
MAX_REMOTE_PROBES = 512  # the same for object storage (each probe is a few ranged GETs)
INDEX_WINDOW = 4096  # bytes of a shard's index read per probe (the whole sample lines in it are probed)
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
            classes = len(files.manifest.classes)
            note = f"the {MAX_CLASSES} largest of {classes:,} classes" if classes > MAX_CLASSES else ""
            return {"classes": class_thumbnails(files), "classes_note": note,
                    "quarantined": quarantined_thumbnails(files)}
        if modality == "video":
            return {"frames": decision_frames(files)}
        if modality == "text":
            return {"documents": document_starts(files)}
    except (OSError, ValueError, RepackError) as exc:
        return {"note": f"samples not shown: {type(exc).__name__}: {exc} (run `repack verify`)"}
    return {}


# -- images ----------------------------------------------------------------------------------------
def spread(total: int, limit: int):
    """Up to ``limit`` distinct positions in ``range(total)``, each prefix spread evenly over the whole
    range (0, 1/2, 1/4, 3/4, 1/8, ...: the base-2 van der Corput sequence), so a scan stopped at any
    point has looked at every part of the dataset, whatever its shard layout or order."""
    seen: set[int] = set()
    i = 0
    while len(seen) < min(total, limit):
        fraction, weight, n = 0.0, 0.5, i
        while n:
            fraction += (n & 1) * weight
            weight /= 2
            n >>= 1
        i += 1
        position = int(fraction * total)
        if position not in seen:
            seen.add(position)
            yield position


def wanted_classes(manifest) -> dict[int, str]:
    """{label: name} of the classes the report shows: the MAX_CLASSES largest (by samples packed, ties by
    index), or -1 "unlabeled" for a dataset without classes."""
    classes = manifest.classes
    if not classes:
        return {-1: "unlabeled"}
    counts = manifest.data.get("stats", {}).get("class_counts", {})
    counts = {name: count for name, count in counts.items() if isinstance(count, int)} if isinstance(counts, dict) else {}
    indexed = [(name, index) for name, index in classes.items()  # a class map of a received dataset: indices only
               if isinstance(index, int) and not isinstance(index, bool) and index >= 0]
    ranked = sorted(indexed, key=lambda kv: (-counts.get(kv[0], 1), kv[1]))
    return {index: name for name, index in ranked[:MAX_CLASSES] if counts.get(name, 1) > 0}


def class_thumbnails(files: DatasetFiles) -> list[dict]:
    """[{class, index, thumbnails: [{key, uri}]}] for the classes ``wanted_classes`` picks, in class
    order: up to PER_CLASS samples of each, found by probing samples spread over the whole dataset
    (``spread``; at most MAX_PROBES probes, fewer for object storage). A wanted class no probe found is
    still listed, with no thumbnails and a note (never silently absent)."""
    wanted = wanted_classes(files.manifest)
    counts = files.manifest.data.get("stats", {}).get("class_counts", {})
    need = {label: min(PER_CLASS, counts.get(name, PER_CLASS)) for label, name in wanted.items()}
    found: dict[int, list[dict]] = {label: [] for label in wanted}
    for label, key, image in _image_samples(files):
        shown = found.get(label)
        if shown is None or len(shown) >= need[label]:
            continue
        try:
            shown.append({"key": key, "uri": thumbnail_uri(image())})
        except ThumbnailError as exc:
            shown.append({"key": key, "error": str(exc)})
        if all(len(found[c]) >= need[c] for c in found):
            break
    return [{"class": wanted[label], "index": label, "thumbnails": found[label],
             **({} if found[label] else {"note": "no sample found by the report's bounded scan"})}
            for label in sorted(found)]


def _image_samples(files: DatasetFiles):
    """(label, key, image loader) of samples probed over the whole dataset (``spread``): tar shards
    through their DALI index, or the LMDB file's records. Labels are read first (a few bytes); the
    image only when its loader is called."""
    if files.manifest.format == "lmdb":
        yield from _lmdb_samples(files)
        return
    shards = [s for s in files.manifest.data["shards"] if s.get("index") and s.get("samples")]
    starts = list(itertools.accumulate((s["samples"] for s in shards), initial=0))
    index_sizes: dict[str, int] = {}
    seen: set[tuple[int, str]] = set()
    for position in spread(starts[-1], MAX_PROBES if files.local else MAX_REMOTE_PROBES):
        number = bisect.bisect_right(starts, position) - 1
        shard = shards[number]
        if shard["index"] not in index_sizes:
            index_sizes[shard["index"]] = files.size(shard["index"])
        size = index_sizes[shard["index"]]
        start = int(size * (position - starts[number]) / shard["samples"])
        window = files.read(shard["index"], start, INDEX_WINDOW).decode("ascii", errors="replace")
        lines = window.split("\n")[1:-1]  # whole lines only (at offset 0 the first is the header)
        for members in list(_index_samples(lines))[:PER_CLASS]:
            image = next(((n, o, s) for e, (n, o, s) in members.items() if e not in ("cls", "json")), None)
            if image is None or (number, image[0]) in seen:
                continue
            seen.add((number, image[0]))
            label = members.get("cls")
            yield (_label(files.read(shard["path"], label[1], min(label[2], 32))) if label else -1,
                   image[0].rsplit(".", 1)[0], _loader(files, shard["path"], image[1], image[2]))


def _label(raw: bytes) -> int:
    try:
        return int(raw)
    except ValueError:
        return -1


def _loader(files: DatasetFiles, rel: str, offset: int, size: int):
    """A call that reads one image member (capped at MAX_SOURCE_BYTES: a larger one gives no thumbnail)."""
    def load() -> bytes:
        if size > MAX_SOURCE_BYTES:
            raise ThumbnailError(f"{size} bytes: not read for a thumbnail")
        return files.read(rel, offset, size)
    return load


def _index_samples(lines):
    """{ext: (member name, offset, size)} per sample line of a DALI index (4 tokens a member)."""
    for line in lines:
        tokens = line.split()
        members = {}
        try:
            for i in range(0, len(tokens) - 3, 4):
                ext, offset, size, name = tokens[i:i + 4]
                members[ext] = (name, int(offset), int(size))
        except ValueError:
            continue  # not a sample line (the header, or damage: `repack verify` reports it)
        if members:
            yield members


def _lmdb_samples(files: DatasetFiles):
    """(label, key, image loader) of records probed over a local LMDB dataset (its size checked first)."""
    if not files.local:
        return
    import lmdb

    shard = files.manifest.data["shards"][0]
    path = files.manifest.path(shard["path"])
    from repack.manifest.lmdb_meta import lmdb_file_problem

    if not path.is_file() or path.stat().st_size != shard["bytes"] or lmdb_file_problem(path):
        return  # `repack verify` reports it; never map a file short of the pages it names (SIGBUS)
    env = lmdb.open(str(path), readonly=True, lock=False, subdir=False, readahead=False)
    try:
        with env.begin() as txn:
            def image(key: bytes) -> bytes:  # called before the scan goes on
                try:
                    return bytes(txn.get(key) or b"")
                except lmdb.Error as exc:  # a page damaged in place: that thumbnail's error
                    raise ValueError(f"{shard['path']}: its records cannot be read ({exc}); run `repack verify`") \
                        from None

            for index in spread(shard.get("samples", 0), MAX_PROBES * PER_CLASS):
                key = f"s/{index:010d}/img".encode()
                try:
                    label = txn.get(f"s/{index:010d}/cls".encode())
                except lmdb.Error:  # a page damaged in place (`repack verify` names it): no more probes
                    return
                yield (_label(label) if label is not None else -1, f"{index:010d}", lambda key=key: image(key))
    finally:
        env.close()


def source_root(options: dict) -> str | None:
    """The local folder a job's inputs were confined to (None for an s3:// source)."""
    source = options.get("source")
    if not source or "://" in source:
        return None
    return os.path.dirname(source) if options.get("list_file") else source


def vouched_source_root(files: DatasetFiles) -> str | None:
    """``source_root`` of the manifest's job options, only where the dataset's own job state (a local
    ``.repack/job.json``, written by the run that packed it here) names the same source: a manifest alone (a
    pulled or received copy, an s3:// dataset) never makes the report read files from a folder it names."""
    options = files.manifest.data.get("created_by", {}).get("options", {})
    root = source_root(options)
    if root is None or not files.local:
        return None
    try:
        state = json.loads((Path(files.manifest.root) / ".repack" / "job.json").read_bytes())
    except (OSError, ValueError):
        return None
    spec = state.get("spec") if isinstance(state, dict) else None
    if not isinstance(spec, dict) or spec.get("source") != options.get("source") or \
            bool(spec.get("list_file")) != bool(options.get("list_file")):
        return None
    if not isinstance(spec.get("out"), str) or \
            os.path.realpath(spec["out"]) != os.path.realpath(files.manifest.root):  # packed here, not copied here
        return None
    return root


def quarantined_thumbnails(files: DatasetFiles) -> list[dict]:
    """[{source, reason, uri | note}] for the first MAX_QUARANTINED quarantined inputs, read from the
    job's source through the same confinement as the job (regular files inside its root, capped)."""
    from repack.sources.confine import Confinement, read_input

    root = vouched_source_root(files)
    shown = []
    for entry in files.manifest.quarantine[:MAX_QUARANTINED]:
        item = {"source": str(entry.get("source", "?")), "reason": str(entry.get("reason", "?"))}
        shown.append(item)
        if root is None or not os.path.isdir(root):
            item["note"] = "source not available here (read only where the dataset's own job state names it)"
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

    root = vouched_source_root(files)
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

"""Megatron-LM indexed token datasets ("MMIDIDX" ``.bin``/``.idx`` pairs): writer, merger, reader, verify.

A dataset *prefix* P is two files, ``P.bin`` and ``P.idx`` (what Megatron-LM, NeMo and
GPT-NeoX read with ``--data-path P``). One document = one sequence.

``P.bin``: the token ids of every document back to back, little-endian, C order, no header,
no padding. Element type = the dtype code of the ``.idx``: uint16 (code 8) when every id the
tokenizer can produce is < 65536, else int32 (code 4; Megatron has no uint32). Size =
total tokens x itemsize.

``P.idx`` (all little-endian, no padding between fields)::

  offset        size  field
  0             9     magic b"MMIDIDX\\x00\\x00"
  9             8     version <Q = 1
  17            1     dtype code <B (8 uint16, 4 int32)
  18            8     sequence_count <Q = N (documents)
  26            8     document_count <Q = D = N + 1 (the leading 0 counts)
  34            4N    sequence_lengths int32[N]: tokens per document
  34+4N         8N    sequence_pointers int64[N]: BYTE offset of each document in .bin
                      (exclusive cumulative sum of lengths x itemsize)
  34+12N        8D    document_indices int64[D]: 0, 1, ..., N (one sequence per document)

File size = 34 + 12N + 8D. Offsets are int64 end to end (numpy int64 cumsum on int64
lengths, plus an int64 base when parts are merged), so they stay exact past 2^32 tokens.

Writing: a part is written to hidden temp names and renamed into place (``.idx`` first, then
``.bin``) only when complete; its sha256 is computed while writing. Merging parts (Megatron's
``add_index``) appends lengths, re-bases pointers and concatenates the ``.bin`` files, streaming
(bounded memory apart from one part's index at a time).
"""

from __future__ import annotations

import errno
import hashlib
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from repack.manifest.io import fsync_dir
from repack.manifest.source_runs import SourceRunsError, decode_runs
from repack.sinks.checks import check_file, file_and_index_outputs

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence_count, document_count
HEADER_SIZE = HEADER.size  # 34
DTYPE_CODES = {8: np.dtype("<u2"), 4: np.dtype("<i4")}
CODE_OF = {"uint16": 8, "int32": 4}
MAX_DOC_TOKENS = 2**31 - 1  # sequence_lengths are int32
COPY_BLOCK = 8 << 20


class MegatronFormatError(ValueError):
    """An .idx/.bin pair that does not follow the MMIDIDX layout."""


def megatron_data_path(manifest: dict, root: str) -> str:
    """Megatron's ``--data-path`` value for a token dataset at ``root`` (a folder or URL): its one
    prefix, or the weighted list ``TOKENS PREFIX ...`` of its parts. The job's summary and the reports
    both print this."""
    if len(manifest.get("prefixes", ())) > 1:
        return " ".join(f"{entry['tokens']} {root}/{entry['prefix']}" for entry in manifest["shards"])
    return " ".join(f"{root}/{prefix}" for prefix in manifest.get("prefixes", ()))


def token_dtype(max_token_id: int) -> str:
    """'uint16' when every id up to ``max_token_id`` fits 16 bits, else 'int32' (never wraps)."""
    if max_token_id < 0:
        raise ValueError(f"bad max token id {max_token_id}")
    if max_token_id < 2**16:
        return "uint16"
    if max_token_id < 2**31:
        return "int32"
    raise ValueError(f"token id {max_token_id} does not fit int32 (Megatron has no wider token dtype)")


def sequence_pointers(lengths: np.ndarray, itemsize: int, base: int = 0) -> np.ndarray:
    """Byte offset of each sequence: ``base`` + exclusive cumsum(lengths) x itemsize, in int64."""
    lengths = np.asarray(lengths, dtype=np.int64)
    pointers = np.empty(len(lengths), dtype=np.int64)
    if len(lengths):
        pointers[0] = 0
        np.cumsum(lengths[:-1], out=pointers[1:])
        pointers *= itemsize
        pointers += np.int64(base)
    return pointers


def index_size(num_sequences: int) -> int:
    """Bytes of an .idx holding ``num_sequences`` one-sequence documents."""
    return HEADER_SIZE + 12 * num_sequences + 8 * (num_sequences + 1)


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.write(fd, view)
        view = view[written:]


@dataclass(frozen=True)
class IndexArrays:
    """The arrays of a parsed .idx (views on a memmap when read from a file)."""

    dtype: np.dtype
    lengths: np.ndarray
    pointers: np.ndarray
    doc_idx: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum(dtype=np.int64))


def parse_index(buf) -> IndexArrays:
    """Parse an .idx held in ``buf`` (bytes or a uint8 memmap); raises MegatronFormatError."""
    if len(buf) < HEADER_SIZE:
        raise MegatronFormatError(f"index of {len(buf)} bytes is shorter than its {HEADER_SIZE}-byte header")
    magic, version, code, n, d = HEADER.unpack(bytes(buf[:HEADER_SIZE]))
    if magic != MAGIC:
        raise MegatronFormatError(f"bad magic {magic!r}")
    if version != VERSION:
        raise MegatronFormatError(f"index version {version} (expected {VERSION})")
    if code not in DTYPE_CODES:
        raise MegatronFormatError(f"dtype code {code} is not a token dtype (4 int32 or 8 uint16)")
    expected = HEADER_SIZE + 12 * n + 8 * d
    if len(buf) != expected:
        raise MegatronFormatError(f"index is {len(buf)} bytes; header (N={n}, D={d}) implies {expected}")
    lengths = np.frombuffer(buf, dtype="<i4", count=n, offset=HEADER_SIZE)
    pointers = np.frombuffer(buf, dtype="<i8", count=n, offset=HEADER_SIZE + 4 * n)
    doc_idx = np.frombuffer(buf, dtype="<i8", count=d, offset=HEADER_SIZE + 12 * n)
    return IndexArrays(DTYPE_CODES[code], lengths, pointers, doc_idx)


def read_index(path: str | os.PathLike) -> IndexArrays:
    """Memory-map and parse an .idx file."""
    if os.path.getsize(path) == 0:
        raise MegatronFormatError(f"{path}: empty index")
    return parse_index(np.memmap(path, dtype=np.uint8, mode="r"))


class PartWriter:
    """Writes one prefix (``.bin`` + ``.idx``) from documents of token ids, atomically."""

    def __init__(self, folder: Path, stem: str, dtype: str) -> None:
        self.folder = Path(folder)
        self.stem = stem
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.code = CODE_OF[dtype]
        self._tmp = self.folder / f".{stem}.bin.tmp-{os.getpid()}"
        self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_TRUNC, 0o644)
        self._sha = hashlib.sha256()
        self._lengths: list[np.ndarray] = []
        self.documents = 0
        self.tokens = 0
        self.max_id = -1

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents given as their concatenated ids and their lengths (same order)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        tokens = np.asarray(tokens)
        if int(lengths.sum()) != len(tokens):
            raise ValueError("lengths do not add up to the number of tokens")
        if len(lengths) and int(lengths.max()) > MAX_DOC_TOKENS:
            raise ValueError(f"a document of {int(lengths.max())} tokens exceeds the int32 length field")
        if len(tokens):
            low, high = int(tokens.min()), int(tokens.max())
            limit = np.iinfo(self.dtype).max
            if low < 0 or high > limit:  # never a silent wrap-around
                raise ValueError(f"token id {high if high > limit else low} does not fit {self.dtype.name}")
            self.max_id = max(self.max_id, high)
        data = tokens.astype(self.dtype, copy=False)
        _write_all(self._fd, data)
        self._sha.update(memoryview(data).cast("B"))
        self._lengths.append(lengths.astype(np.int32))
        self.documents += len(lengths)
        self.tokens += len(tokens)

    def commit(self) -> dict:
        """Write the index, rename both into place; the part's entry (paths, counts, sha256)."""
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        index = b"".join(index_chunks(self.code, lengths))
        idx_name, bin_name = f"{self.stem}.idx", f"{self.stem}.bin"
        idx_tmp = self.folder / f".{idx_name}.tmp-{os.getpid()}"
        with open(idx_tmp, "wb") as fh:
            fh.write(index)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(idx_tmp, self.folder / idx_name)
        os.replace(self._tmp, self.folder / bin_name)
        fsync_dir(self.folder)
        return {"bin": bin_name, "idx": idx_name, "documents": self.documents, "tokens": self.tokens,
                "bytes": self.tokens * self.dtype.itemsize, "sha256": self._sha.hexdigest(),
                "index_bytes": len(index), "index_sha256": hashlib.sha256(index).hexdigest(),
                "max_token_id": self.max_id}

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._tmp.unlink(missing_ok=True)


def index_chunks(code: int, lengths: np.ndarray, base: int = 0) -> Iterable[bytes]:
    """The bytes of a one-part .idx, in order (header, lengths, pointers, document indices)."""
    n = len(lengths)
    itemsize = DTYPE_CODES[code].itemsize
    yield HEADER.pack(MAGIC, VERSION, code, n, n + 1)
    yield np.asarray(lengths, dtype="<i4").tobytes()
    yield sequence_pointers(lengths, itemsize, base).astype("<i8").tobytes()
    yield np.arange(n + 1, dtype="<i8").tobytes()


def write_merged_index(idx_paths: list[Path], code: int, out) -> tuple[int, int, str]:
    """Write to the binary file ``out`` the .idx of the parts' concatenation; (N, .bin bytes, sha256).

    Each part index is read once (its lengths kept: 4 bytes per document); the sections are streamed,
    pointers re-based on an int64 running byte offset (exact past 2^32 tokens).
    """
    itemsize = DTYPE_CODES[code].itemsize
    sha = hashlib.sha256()
    parts = []
    for idx in idx_paths:
        arrays = read_index(idx)
        if arrays.dtype != DTYPE_CODES[code]:
            raise MegatronFormatError(f"{idx}: dtype {arrays.dtype} differs from {DTYPE_CODES[code]}")
        parts.append(np.array(arrays.lengths, dtype="<i4"))  # a copy: the part's memmap is closed with it
        del arrays
    n = sum(len(lengths) for lengths in parts)

    def emit(data) -> None:
        out.write(data)
        sha.update(data)

    emit(HEADER.pack(MAGIC, VERSION, code, n, n + 1))
    for lengths in parts:
        emit(memoryview(lengths).cast("B"))
    base = 0
    for lengths in parts:
        emit(memoryview(sequence_pointers(lengths, itemsize, base).astype("<i8", copy=False)).cast("B"))
        base += int(lengths.sum(dtype=np.int64)) * itemsize
    start = 0
    for lengths in parts:  # document indices 0..N, written per part to bound memory
        emit(memoryview(np.arange(start, start + len(lengths), dtype="<i8")).cast("B"))
        start += len(lengths)
    emit(np.array([n], dtype="<i8").tobytes())
    return n, base, sha.hexdigest()


def copy_file(path: Path, out_fd: int, buffer: bytearray) -> int:
    """Append the file ``path`` to ``out_fd`` (at its position); its size. Copied in the kernel
    (``os.copy_file_range``), never through Python; a file system without it gets ``buffer``-sized blocks
    read and written instead."""
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as src:
        size = os.fstat(src.fileno()).st_size
        copied = 0
        try:
            while copied < size:
                done = os.copy_file_range(src.fileno(), out_fd, size - copied, copied)
                if not done:
                    raise MegatronFormatError(f"{path}: shorter than its {size} bytes")
                copied += done
            return size
        except (AttributeError, OSError) as exc:  # no copy_file_range here (an older kernel, another fs)
            if copied or (isinstance(exc, OSError) and exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL,
                                                                         errno.EOPNOTSUPP)):
                raise
        size = 0
        while n := src.readinto(buffer):
            _write_all(out_fd, view[:n])
            size += n
        return size


# -- merging: a prefix's .bin grown part by part ---------------------------------------------------------------
# ``BinAppender`` copies each part in the kernel (``copy_file``) and hashes it from the part (just written: the
# page cache) on a helper thread beside the copy, so the sha256 of the whole .bin is known when the last part is
# in. ``merge_parts`` uses one for the whole merge; a text job's driver uses one while its tasks still run
# (``repack.jobs.text_merge_ahead``), so that its finish step only appends the last parts. ``write_back=True``
# starts the disk's write-back every APPEND_SYNC_EVERY bytes (``fdatasync``), keeping the final ``fsync`` short
# when the appends run ahead of it. The temp file lands under the final name only through ``merge_parts``
# (renamed whole); ``abort`` removes it.

APPEND_SYNC_EVERY = 64 << 20  # bytes appended between write-backs (as a tar shard's copies: repack.sinks.webdataset)
APPEND_BLOCK = 1 << 20  # bytes read at a time to hash (and to copy where the kernel cannot): allocated once


def temp_bin(out_bin: Path) -> Path:
    """The temp file an appender for ``out_bin`` writes (renamed whole by ``merge_parts``)."""
    return out_bin.parent / f".{out_bin.name}.tmp-{os.getpid()}"


class BinAppender:
    """Parts' ``.bin`` files appended in order to ``temp_bin(out_bin)``; ``sha256`` and ``bytes`` of what
    is in, and ``parts`` appended so far."""

    def __init__(self, out_bin: Path, write_back: bool = False) -> None:
        self.tmp = temp_bin(out_bin)
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        self.sha = hashlib.sha256()
        self.bytes = 0
        self.parts = 0
        self._write_back = write_back
        self._unsynced = 0
        self._buffer = bytearray(APPEND_BLOCK)  # the hash's
        self._copy_buffer = bytearray(APPEND_BLOCK)  # used only without copy_file_range

    def extend(self, paths: list[Path]) -> None:
        """Append ``paths`` in order: the kernel's copies on this thread, their hashing on a helper thread
        (hashlib and the copies release the GIL: the two overlap)."""
        if not paths:
            return
        with ThreadPoolExecutor(1, thread_name_prefix="repack-append-hash") as side:
            hashed = side.submit(self._hash, list(paths))
            copied = 0
            try:
                for path in paths:
                    size = copy_file(path, self.fd, self._copy_buffer)
                    copied += size
                    self._unsynced += size
                    if self._write_back and self._unsynced >= APPEND_SYNC_EVERY:
                        os.fdatasync(self.fd)
                        self._unsynced = 0
            finally:
                read = hashed.result()  # waited for (its error raised) before the buffers go
        if read != copied:
            raise MegatronFormatError(f"{len(paths)} part(s) changed while they were appended ({copied} bytes "
                                      f"copied, {read} hashed)")
        self.bytes += copied
        self.parts += len(paths)

    def _hash(self, paths: list[Path]) -> int:
        view = memoryview(self._buffer)
        total = 0
        for path in paths:
            with open(path, "rb", buffering=0) as src:
                while n := src.readinto(self._buffer):
                    self.sha.update(view[:n])
                    total += n
        return total

    def sync(self) -> None:
        """Everything appended on disk (``fsync``)."""
        os.fsync(self.fd)

    def close(self) -> None:
        """Close the file (kept: ``merge_parts`` renames it)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def abort(self) -> None:
        """Close and remove the temp file."""
        self.close()
        self.tmp.unlink(missing_ok=True)


def merge_parts(parts: list[tuple[Path, Path]], code: int, out_bin: Path, out_idx: Path,
                appended: BinAppender | None = None) -> dict:
    """Concatenate parts [(bin, idx)] in order into one prefix, atomically; returns its entry.

    Three streams at once (hashing, kernel copies, writes and fsync release the GIL): the merged .idx
    (write_merged_index) in a side thread while the .bin files are appended and hashed
    (``BinAppender``); both files land under their final names only when complete.
    ``appended``: an appender that holds the first ``appended.parts`` parts already (a text job's merge ahead);
    it is taken over (renamed or removed here).
    """
    itemsize = DTYPE_CODES[code].itemsize
    idx_tmp = out_idx.parent / f".{out_idx.name}.tmp-{os.getpid()}"

    def write_index() -> tuple[int, int, str]:
        with open(idx_tmp, "wb") as fh:
            written = write_merged_index([idx for _, idx in parts], code, fh)
            fh.flush()
            os.fsync(fh.fileno())
        return written

    appender = appended
    try:
        with ThreadPoolExecutor(1) as side:  # a failure of the copy waits for the index (the pool's exit)
            index = side.submit(write_index)
            if appender is None:
                appender = BinAppender(out_bin)
            appender.extend([bin_path for bin_path, _ in parts[appender.parts:]])
            appender.sync()
            n, expected, idx_sha = index.result()
        total = appender.bytes
        if total != expected:
            raise MegatronFormatError(f"parts hold {total} bytes of tokens; their indices say {expected}")
        appender.close()
        os.replace(appender.tmp, out_bin)  # the .bin first: an appender's temp gone from under it lands nothing
        os.replace(idx_tmp, out_idx)
        fsync_dir(out_bin.parent)
    finally:
        idx_tmp.unlink(missing_ok=True)
        if appender is not None:
            appender.abort()  # closed, its temp gone (a no-op once renamed)
    return {"documents": n, "tokens": total // itemsize, "bytes": total, "sha256": appender.sha.hexdigest(),
            "index_bytes": index_size(n), "index_sha256": idx_sha}


def file_sha256_and_max(path: Path, dtype: np.dtype) -> tuple[str, int, int]:
    """sha256, size and the largest token id of a .bin, read in blocks."""
    sha = hashlib.sha256()
    size = 0
    high = -1
    carry = b""
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(COPY_BLOCK), b""):
            sha.update(block)
            size += len(block)
            data = carry + block
            usable = len(data) - len(data) % dtype.itemsize
            carry = data[usable:]
            if usable:
                high = max(high, int(np.frombuffer(data[:usable], dtype=dtype).max()))
    return sha.hexdigest(), size, high


BOUNDARY_CHUNK = 1 << 20  # documents checked at a time (``check_boundaries``): its memory stays flat


def check_boundaries(bin_path: Path, arrays, shard: dict, check) -> None:
    """Each document of the index starts with the BOS and ends with the EOS the dataset promises
    (``MemmapSink.verify_facts``, carried in ``shard["dataset_facts"]``): an index whose boundaries were
    moved, even with its sha256 recorded again, cuts documents where the tokens say they do not end. The
    pointers are known to be the documents back to back; read ``BOUNDARY_CHUNK`` documents at a time."""
    facts = shard.get("dataset_facts") or {}
    if not facts:
        return
    tokens = np.memmap(bin_path, dtype=arrays.dtype, mode="r")
    wrong = {name: [0, None] for name in facts}  # documents that do not, and the first of them
    empty = None
    for lo in range(0, len(arrays.lengths), BOUNDARY_CHUNK):
        lengths = arrays.lengths[lo:lo + BOUNDARY_CHUNK]
        firsts = arrays.pointers[lo:lo + BOUNDARY_CHUNK] // arrays.dtype.itemsize
        filled = np.flatnonzero(lengths > 0)
        if empty is None and len(filled) < len(lengths):
            empty = lo + int(np.flatnonzero(lengths == 0)[0])
        for name in facts:
            where = firsts[filled] if name == "starts_with" else firsts[filled] + lengths[filled] - 1
            found = tokens[where]
            bad = np.flatnonzero(found != facts[name])
            if len(bad) and wrong[name][1] is None:
                wrong[name][1] = (lo + int(filled[bad[0]]), int(found[bad[0]]))
            wrong[name][0] += len(bad)
    check(empty is None, f"{shard['index']}: document {empty} is empty, but every document of this dataset holds "
                         "its BOS or EOS token")
    for name, (count, first) in wrong.items():
        if count:
            what = "starts" if name == "starts_with" else "ends"
            check(False, f"{shard['index']}: document {first[0]} {what} with token {first[1]}, not {facts[name]} as "
                         f"every document of this dataset does ({count} of {len(arrays.lengths)} do not): the "
                         f"index's boundaries do not match {shard['path']}")


def version_document_tokens(manifest) -> dict:
    """The percentiles of a local token dataset's document lengths: the manifest's, or, after an ``--append``
    (whose documents are in no run's figures), the version's, from every prefix's index."""
    stats = manifest.data.get("stats", {})
    if not stats.get("appended") or not manifest.data["shards"]:
        return stats.get("document_tokens", {})
    from repack.jobs.token_stats import token_stats

    return token_stats(np.concatenate([np.asarray(read_index(manifest.path(shard["index"])).lengths)
                                       for shard in manifest.data["shards"]]))[0]


class MemmapSink:
    """The ``--tokenize memmap`` plugin: Megatron MMIDIDX prefixes, one manifest shard per prefix."""

    name = "memmap"

    outputs = staticmethod(file_and_index_outputs)

    @staticmethod
    def verify_facts(data: dict) -> dict:
        """What every document of the dataset starts and ends with (``verify_shard`` checks the index's
        boundaries against them): the BOS id under ``--add-bos``, the EOS id under ``--append-eos``."""
        tok = data.get("tokenizer") or {}
        facts = {"starts_with": tok.get("bos_id") if tok.get("add_bos") else None,
                 "ends_with": tok.get("eos_id") if tok.get("append_eos") else None}
        return {name: token for name, token in facts.items() if isinstance(token, int)}

    @staticmethod
    def verify_shard(root: Path, shard: dict, check) -> None:
        """Re-read one prefix: sizes, sha256 of both files, the index against the .bin (each document's
        first and last token where the dataset promises them: ``verify_facts``)."""
        bin_path, idx_path = Path(root) / shard["path"], Path(root) / shard["index"]
        try:
            idx_bytes = idx_path.read_bytes()
        except OSError as exc:
            check(False, f"{shard['index']}: missing ({exc.strerror})")
            return
        check(len(idx_bytes) == shard["index_bytes"],
              f"{shard['index']}: {len(idx_bytes)} bytes, manifest says {shard['index_bytes']}")
        check(hashlib.sha256(idx_bytes).hexdigest() == shard["index_sha256"], f"{shard['index']}: sha256 mismatch")
        try:
            arrays = parse_index(idx_bytes)
        except MegatronFormatError as exc:
            check(False, f"{shard['index']}: {exc}")
            return
        check(arrays.dtype.name == shard["dtype"], f"{shard['index']}: dtype {arrays.dtype.name}, "
                                                   f"manifest says {shard['dtype']}")
        n = len(arrays.lengths)
        check(n == shard["samples"], f"{shard['index']}: {n} documents, manifest says {shard['samples']}")
        check(bool((arrays.lengths >= 0).all()), f"{shard['index']}: negative sequence length")
        check(np.array_equal(arrays.doc_idx, np.arange(n + 1)),
              f"{shard['index']}: document_indices are not 0..N (one sequence per document)")
        laid_out = bool((arrays.lengths >= 0).all()) and \
            np.array_equal(arrays.pointers, sequence_pointers(arrays.lengths, arrays.dtype.itemsize))
        check(laid_out, f"{shard['index']}: sequence_pointers are not the byte offsets of the lengths")
        tokens = arrays.num_tokens
        check(tokens == shard["tokens"], f"{shard['index']}: {tokens} tokens, manifest says {shard['tokens']}")
        try:
            sha, size, high = file_sha256_and_max(bin_path, arrays.dtype)
        except OSError as exc:
            check(False, f"{shard['path']}: missing ({exc.strerror})")
            return
        check(size == tokens * arrays.dtype.itemsize,
              f"{shard['path']}: {size} bytes, but the index describes {tokens * arrays.dtype.itemsize}")
        check(size == shard["bytes"], f"{shard['path']}: {size} bytes, manifest says {shard['bytes']}")
        check(sha == shard["sha256"], f"{shard['path']}: sha256 mismatch")
        check(high == shard.get("max_token_id", high),
              f"{shard['path']}: largest token id {high}, manifest says {shard.get('max_token_id')}")
        if size == tokens * arrays.dtype.itemsize and n and laid_out:  # pointers inside the .bin
            check_boundaries(bin_path, arrays, shard, check)
        if shard.get("source_runs") and check_file(root, shard["source_runs"], shard.get("source_runs_bytes", -1),
                                                   shard.get("source_runs_sha256"), check):
            try:
                runs = decode_runs((Path(root) / shard["source_runs"]).read_bytes())
                check(runs.documents() == n, f"{shard['source_runs']}: {runs.documents()} documents, the index "
                                             f"holds {n}")
            except SourceRunsError as exc:
                check(False, f"{shard['source_runs']}: {exc}")

    @staticmethod
    def inspect_lines(manifest) -> list[str]:
        """Text counts and the first document decoded back to text (tokenizer copy in OUT); the length
        percentiles are the report's (``report.inspect``, from ``report.collect``: read once)."""
        data = manifest.data
        tok = data.get("tokenizer", {})
        lines = [f"documents {data['totals'].get('documents')}, tokens {data['totals'].get('tokens')}, "
                 f"dtype {data.get('dtype')}, prefixes: {' '.join(data.get('prefixes', []))}",
                 f"tokenizer sha256 {tok.get('sha256', '?')[:16]}..., vocab {tok.get('vocab_size')}, "
                 f"eos {tok.get('eos_id')}, bos {tok.get('bos_id')}",
                 f"empty documents skipped: {data['totals'].get('empty_documents', 0)}"]
        shards = data["shards"]
        if not shards or not shards[0]["samples"]:
            return lines
        first = shards[0]
        arrays = read_index(manifest.path(first["index"]))
        count = int(arrays.lengths[0])
        ids = np.memmap(manifest.path(first["path"]), dtype=arrays.dtype, mode="r", shape=(count,),
                        offset=int(arrays.pointers[0])) if count else np.zeros(0, np.int64)
        shown = ids[:64].tolist()
        lines.append(f"first document: {count} tokens: {shown}{' ...' if count > 64 else ''}")
        rel = data.get("files", {}).get("tokenizer")
        if rel:
            try:
                from tokenizers import Tokenizer

                text = Tokenizer.from_file(str(manifest.path(rel))).decode(ids.tolist(), skip_special_tokens=False)
                lines.append("first document decoded: " + repr(text[:500]) + (" ..." if len(text) > 500 else ""))
            except Exception as exc:  # noqa: BLE001 - inspect reports, it does not fail
                lines.append(f"first document: cannot decode ({exc})")
        return lines

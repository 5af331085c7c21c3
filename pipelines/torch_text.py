"""PyTorch readers for token memmaps written by ``repack text --tokenize memmap``.

- ``PackedTokenDataset``: fixed ``seq_len + 1`` token windows over the concatenated stream
  of every document (crossing document and prefix boundaries, like nanoGPT and Megatron's
  GPTDataset), window ``w`` = tokens ``[w*seq_len, w*seq_len + seq_len + 1)``; a seeded
  permutation per epoch (``set_epoch``), split evenly across ranks.
- ``DocumentDataset``: one document per item (optionally truncated to ``max_len``), with
  ``collate_pad`` (dynamic padding to the longest in the batch, attention mask) and
  ``LengthGroupedBatchSampler`` (batches of similar lengths; ``padding_fraction`` measures
  what it saves against random batching).

Types: both readers yield int64 token ids by default (what ``nn.Embedding`` and ``cross_entropy``
take). ``dtype=None`` yields the storage dtype instead (``uint16`` when every id of the tokenizer is
below 65536, else ``int32``; the manifest's ``dtype``): each item a copy of its window in that dtype
(never a view of the ``.bin`` memmap, whose pages an in-place edit would change for later epochs; the file
is never written); cast on the GPU with ``.long()``, which moves 2-4x fewer bytes.
Any other ``dtype=`` (a torch dtype) casts each item. The memmaps are opened
lazily in each process (DataLoader workers included) and never pickled: only paths travel.

Imports ``repack.manifest`` and nothing else from repack; the ``.idx`` layout
(Megatron MMIDIDX) is parsed here independently.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections import abc
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from pipelines import object_store
from pipelines.dataset_identity import follow_version, identity, on_version, resolve
from pipelines.manifest_access import open_manifest
from pipelines.sample_order import continued_epoch
from pipelines.sampler_resume import STATE_VERSION, MapDatasetState, OrderPosition, check_state, global_order

_HEADER = struct.Struct("<9sQBQQ")
_DTYPES = {8: np.dtype("<u2"), 4: np.dtype("<i4")}


@dataclass
class _Prefix:
    bin_path: str
    idx_path: str
    documents: int
    tokens: int


def _parse_idx(buf: np.ndarray, path: str) -> tuple[np.dtype, np.ndarray, np.ndarray]:
    """(dtype, lengths int32[N], byte pointers int64[N]) of a Megatron .idx held in ``buf`` (uint8)."""
    if len(buf) < _HEADER.size:
        raise ValueError(f"{path}: not a Megatron MMIDIDX v1 token index (too short)")
    magic, version, code, n, d = _HEADER.unpack(bytes(buf[:_HEADER.size]))
    if magic != b"MMIDIDX\x00\x00" or version != 1 or code not in _DTYPES:
        raise ValueError(f"{path}: not a Megatron MMIDIDX v1 token index")
    if len(buf) != _HEADER.size + 12 * n + 8 * d:
        raise ValueError(f"{path}: size does not match its header")
    lengths = np.frombuffer(buf, dtype="<i4", count=n, offset=_HEADER.size)
    pointers = np.frombuffer(buf, dtype="<i8", count=n, offset=_HEADER.size + 4 * n)
    return _DTYPES[code], lengths, pointers


class RemoteTokens:
    """The tokens of an s3:// ``.bin`` as a sliceable sequence: ``tokens[a:b]`` is one ranged GET of
    exactly those bytes (nothing else is fetched; no local copy)."""

    def __init__(self, url: str, dtype: np.dtype, count: int) -> None:
        self.url, self.dtype, self.count = url, dtype, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, window: slice) -> np.ndarray:
        start, stop, _ = window.indices(self.count)
        if stop <= start:
            return np.zeros(0, self.dtype)
        size = self.dtype.itemsize
        with object_store.open_range(self.url, start * size, stop * size, (stop - start) * size) as stream:
            data = bytearray(stream.read())
        if len(data) != (stop - start) * size:
            raise ValueError(f"{self.url}: tokens {start}..{stop} lie past the end of the object "
                             f"({len(data)} of {(stop - start) * size} bytes; run `repack verify`)")
        return np.frombuffer(data, dtype=self.dtype)  # writable (a bytearray): torch takes it as is


class TokenMemmap:
    """The prefixes of one repack text dataset (a folder or ``s3://bucket/prefix``), opened lazily
    (and re-opened after a fork). Local ``.bin`` files are memory-mapped; remote ones are read by
    ranged GETs of exactly the tokens asked for; the ``.idx`` files are read whole (one GET each).
    ``version=N`` reads that version of the dataset (default: the latest)."""

    def __init__(self, root: str | os.PathLike, version: int | None = None) -> None:
        manifest = open_manifest(root, version)
        if manifest.format != "memmap":
            raise ValueError(f"{root}: format {manifest.format!r}, not a token memmap")
        self.root = str(root)
        self.dataset = identity(manifest)
        self.remote = object_store.is_remote(root)
        self.prefixes = [_Prefix(str(manifest.path(s["path"])), str(manifest.path(s["index"])), int(s["samples"]),
                                 int(s["tokens"])) for s in manifest.data["shards"]]
        self.dtype = np.dtype(manifest.data["dtype"])
        self.eos_id = manifest.data.get("tokenizer", {}).get("eos_id")
        self.tokenizer_sha256 = manifest.data.get("tokenizer", {}).get("sha256")  # what an id means
        self.num_documents = sum(p.documents for p in self.prefixes)
        self.num_tokens = sum(p.tokens for p in self.prefixes)
        self.doc_starts = np.cumsum([0] + [p.documents for p in self.prefixes], dtype=np.int64)
        self.token_starts = np.cumsum([0] + [p.tokens for p in self.prefixes], dtype=np.int64)
        self._pid = -1
        self._bins: list = []
        self._lengths: list[np.ndarray] = []
        self._pointers: list[np.ndarray] = []
        self._open()  # refuse a damaged dataset here, not at some step of the epoch

    def __getstate__(self) -> dict:  # only paths and counts travel to workers
        state = dict(self.__dict__)
        state.update(_pid=-1, _bins=[], _lengths=[], _pointers=[])
        return state

    def _index(self, p: _Prefix) -> tuple[np.ndarray, np.ndarray]:
        """A prefix's (lengths, pointers), after checking them against the manifest and the .bin's size."""
        buf = (np.frombuffer(object_store.read_bytes(p.idx_path), np.uint8) if self.remote
               else np.memmap(p.idx_path, dtype=np.uint8, mode="r"))
        dtype, lens, ptrs = _parse_idx(buf, p.idx_path)
        if dtype != self.dtype:
            raise ValueError(f"{p.idx_path}: dtype {dtype} differs from the manifest's {self.dtype}")
        if len(lens) != p.documents or int(np.sum(lens, dtype=np.int64)) != p.tokens:
            raise ValueError(f"{self.root}: {p.idx_path} lists {len(lens)} documents of "
                             f"{int(np.sum(lens, dtype=np.int64))} tokens, the manifest {p.documents} of {p.tokens}")
        starts = np.zeros(len(lens), dtype=np.int64)  # documents back to back, as repack writes them
        np.cumsum(np.asarray(lens[:-1], dtype=np.int64), out=starts[1:])
        if (np.asarray(lens) < 0).any() or not np.array_equal(np.asarray(ptrs, dtype=np.int64),
                                                               starts * self.dtype.itemsize):
            raise ValueError(f"{self.root}: {p.idx_path}: its sequence pointers are not its documents back to back "
                             "(a document would read another's tokens, or none; run `repack verify`)")
        if not self.remote:
            held = os.path.getsize(p.bin_path) // self.dtype.itemsize
            if held != p.tokens:
                raise ValueError(f"{self.root}: {p.bin_path} holds {held} tokens, its index says {p.tokens} "
                                 "(truncated or changed; run `repack verify`)")
        return lens, ptrs

    def _open(self) -> None:
        if self._pid == os.getpid():
            return
        bins, lengths, pointers = [], [], []
        for p in self.prefixes:
            lens, ptrs = self._index(p)
            if self.remote:
                bins.append(RemoteTokens(p.bin_path, self.dtype, p.tokens))
            else:
                bins.append(np.memmap(p.bin_path, dtype=self.dtype, mode="c") if p.tokens else np.zeros(0, self.dtype))
            lengths.append(lens)
            pointers.append(ptrs)
        self._bins, self._lengths, self._pointers, self._pid = bins, lengths, pointers, os.getpid()

    def lengths(self) -> np.ndarray:
        """Tokens per document, all prefixes in order (int64; one copy, index-sized)."""
        self._open()
        return np.concatenate([np.asarray(x, dtype=np.int64) for x in self._lengths]) if self._lengths \
            else np.zeros(0, np.int64)

    def document(self, index: int, max_len: int | None = None) -> np.ndarray:
        """Document ``index`` (global), a view on the memmap."""
        self._open()
        if not 0 <= index < self.num_documents:
            raise IndexError(index)
        p = int(np.searchsorted(self.doc_starts, index, side="right")) - 1
        i = index - int(self.doc_starts[p])
        start = int(self._pointers[p][i]) // self.dtype.itemsize
        count = int(self._lengths[p][i])
        if max_len is not None:
            count = min(count, max_len)
        return self._bins[p][start:start + count]

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the concatenated stream: a view when inside one prefix."""
        self._open()
        p = int(np.searchsorted(self.token_starts, start, side="right")) - 1
        local = start - int(self.token_starts[p])
        if stop <= int(self.token_starts[p + 1]):
            return self._bins[p][local:local + (stop - start)]
        pieces = []
        while start < stop:  # a window crossing prefixes: the one case that copies
            p = int(np.searchsorted(self.token_starts, start, side="right")) - 1
            local = start - int(self.token_starts[p])
            take = min(stop, int(self.token_starts[p + 1])) - start
            pieces.append(self._bins[p][local:local + take])
            start += take
        return np.concatenate(pieces)


TOKEN_DTYPE = torch.int64  # what the token readers yield unless told otherwise


def _as_tensor(array: np.ndarray, dtype: torch.dtype | None) -> torch.Tensor:
    """Tokens as a tensor of ``dtype`` (None: the storage dtype), always a copy of its own: a view of the memmap's
    copy-on-write pages, edited in place (a loss mask: ``w[w == pad] = -100``), changed that window for every later
    epoch of the process."""
    tensor = torch.from_numpy(array)
    return tensor.clone() if dtype is None else tensor.to(dtype)


class PackedTokenDataset(Dataset):
    """Map-style dataset of ``seq_len + 1``-token windows (inputs = w[:-1], targets = w[1:]).

    With ``shuffle`` the dataset orders the windows itself (a seeded permutation per epoch, rank
    ``r`` taking every ``world_size``-th): use the loader's default sequential sampler; a
    ``StatefulDataLoader`` then resumes exactly (it skips indices, never bytes; the epoch is in this
    dataset's state). For elastic resume (another world size), build it with ``shuffle=False`` and
    the default ``rank=0, world_size=1`` (the sampler splits by rank, not the dataset), and pass
    ``ResumableSampler(len(ds), seed=..., rank=..., world_size=..., dataset=ds)``: the same permutation.

    Items are int64 by default; ``dtype=None``: the storage dtype (see the module docstring). ``len(ds)`` is
    this rank's windows per epoch (equal on every rank).
    """

    def __init__(self, root: str | os.PathLike, seq_len: int, *, shuffle: bool = True, seed: int = 0,
                 rank: int = 0, world_size: int = 1, dtype: torch.dtype | None = TOKEN_DTYPE,
                 version: int | None = None) -> None:
        if seq_len < 1:
            raise ValueError("seq_len must be >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, {world_size})")
        self.seq_len = seq_len
        self.shuffle, self.seed, self.rank, self.world_size, self.dtype = shuffle, seed, rank, world_size, dtype
        self.data = TokenMemmap(root, version)
        self.data_built_version = self.data.dataset["version"]
        self._count_windows()
        # the epoch lives in shared memory: DataLoader workers (persistent ones included) hold a
        # copy of the dataset made when they started, and still see set_epoch()
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()
        self._epoch_chosen = torch.zeros((), dtype=torch.bool).share_memory_()

    def order_options(self) -> dict:
        """What decides which tokens window ``i`` holds (a Mixture refuses a state of another): the window length, the
        order this dataset gives its windows (shuffled: its seed) and this rank's share of them. The epoch is not
        among them: the loop moves it with the mixture's (``set_epoch(e + 1)`` after a state of epoch e's end)."""
        return {"seq_len": self.seq_len, "shuffle": self.shuffle, "seed": self.seed if self.shuffle else None,
                "rank": self.rank, "world_size": self.world_size}

    def use_version(self, version: int | None) -> None:
        """Read version ``version`` of the dataset (None: the latest): its tokens and windows."""
        self.data = TokenMemmap(self.data.root, version)
        self._count_windows()

    def follow_state(self, state: dict):
        """Open the dataset version ``state`` was taken on, as the DataLoader's workers do when they load it: the
        workers start as copies of this process's reader, and one built on another version refused the state
        (``pipelines.stateful_loader`` calls this). Returns what re-opens the version it was on."""
        return follow_version(state.get("dataset"), self.dataset, self.root, type(self).__name__, self.use_version)

    def _count_windows(self) -> None:
        self.num_windows = max(0, (self.data.num_tokens - 1) // self.seq_len)
        self.per_rank = self.num_windows // self.world_size  # equal counts on every rank (tail dropped)
        self._order: np.ndarray | None = None
        self._order_epoch: int | None = None

    @property
    def root(self) -> str:
        return self.data.root

    @property
    def dataset(self) -> dict:
        return self.data.dataset

    @property
    def epoch(self) -> int:
        return int(self._epoch.item())

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle deterministically for ``epoch`` (same on every rank and in every worker,
        also with ``persistent_workers=True``)."""
        self._epoch.fill_(int(epoch))
        self._epoch_chosen.fill_(True)

    @property
    def chosen_epoch(self) -> int | None:
        """The epoch ``set_epoch`` chose (None: none yet): ``pipelines.stateful_loader`` ends a loaded state's
        finished epoch with it, as for the iterable readers."""
        return self.epoch if bool(self._epoch_chosen) else None

    def window_ids(self) -> np.ndarray:
        """The global window numbers this rank reads, in order, for the current epoch."""
        epoch = self.epoch
        if self._order is None or self._order_epoch != epoch:
            total = self.per_rank * self.world_size
            order = global_order(self.num_windows, self.seed, epoch, self.shuffle)[:total]
            # this rank's share alone (a view would keep the whole epoch's order in every worker)
            self._order, self._order_epoch = order[self.rank::self.world_size].copy(), epoch
        return self._order

    def __len__(self) -> int:
        return self.per_rank

    def state_dict(self) -> dict:
        """The epoch and what fixes the order (the loader's sampler holds the position)."""
        return {"kind": type(self).__name__, "version": STATE_VERSION, "dataset": dict(self.dataset),
                "epoch": self.epoch, "seed": self.seed, "shuffle": self.shuffle, "windows": self.num_windows,
                "seq_len": self.seq_len, "rank": self.rank, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        """Continue on the state's dataset version (this one, or a kept older one, re-opened here) and
        epoch, unless ``set_epoch`` chose another (``sample_order.continued_epoch``). The position is
        the loader sampler's: with another epoch chosen, build the loader with ``ResumableSampler`` (it
        drops the position) or iterate the loader once (it ends the state's epoch) before
        ``set_epoch``; a state whose epoch differs from the chosen one is refused here."""
        check_state(state, type(self).__name__)
        version = resolve(state.get("dataset"), self.dataset, self.root, type(self).__name__)
        sized = self.per_rank
        with on_version(self.use_version, dict(self.dataset), version):
            self._check_loaded(state, version, sized)
        self.set_epoch(int(state["epoch"]))

    def _check_loaded(self, state: dict, version: int | None, sized: int) -> None:
        """ValueError unless ``state`` is of this reader's window count (``sized`` before the state's ``version``
        was re-opened), epoch, options, rank and world size."""
        if version is not None and self.per_rank != sized:  # the loader's sampler was sized on the other version
            raise ValueError(f"{self.root}: this PackedTokenDataset state was taken on version {version} "
                             f"({self.per_rank} windows per rank), the reader was built on version "
                             f"{self.data_built_version} ({sized}); the loader's sampler was sized for that: "
                             f"build the reader with version={version} to continue")
        if bool(self._epoch_chosen) and not continued_epoch(int(state["epoch"]), self.epoch)[1]:
            raise ValueError(f"{self.root}: a PackedTokenDataset state of epoch {state['epoch']} loaded after "
                             f"set_epoch({self.epoch}): the loader's sampler holds the position of epoch "
                             f"{state['epoch']}; iterate the loader (it ends that epoch) before set_epoch, or "
                             "order the windows with ResumableSampler")
        mine = self.state_dict()
        for key in ("seed", "shuffle", "windows", "seq_len", "rank", "world_size"):
            if key == "seq_len" and key not in state:  # a state of an older reader
                continue
            if state[key] != mine[key]:
                raise ValueError(f"{self.data.root}: PackedTokenDataset state has {key} {state[key]!r}, "
                                 f"this dataset {mine[key]!r}")

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.per_rank:
            raise IndexError(index)
        w = int(self.window_ids()[index])
        start = w * self.seq_len
        return _as_tensor(self.data.tokens(start, start + self.seq_len + 1), self.dtype)


def split_inputs_targets(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of a batch of windows, as int64."""
    batch = batch.long()
    return batch[:, :-1], batch[:, 1:]


class DocumentDataset(MapDatasetState, Dataset):
    """One document per item (a 1-D tensor), truncated to ``max_len`` tokens when given; int64 by
    default, ``dtype=None``: the storage dtype. Order and resume come from the
    sampler: ``ResumableSampler`` or ``LengthGroupedBatchSampler`` (both stateful)."""

    def __init__(self, root: str | os.PathLike, max_len: int | None = None,
                 dtype: torch.dtype | None = TOKEN_DTYPE, version: int | None = None) -> None:
        self.data = TokenMemmap(root, version)
        self.max_len = max_len
        self.dtype = dtype
        self._lengths: np.ndarray | None = None

    def use_version(self, version: int | None) -> None:
        """Read version ``version`` of the dataset (None: the latest)."""
        self.data = TokenMemmap(self.data.root, version)
        self._lengths = None

    @property
    def root(self) -> str:
        return self.data.root

    @property
    def dataset(self) -> dict:
        return self.data.dataset

    @property
    def lengths(self) -> np.ndarray:
        """Item lengths after truncation (for LengthGroupedBatchSampler)."""
        if self._lengths is None:
            lengths = self.data.lengths()
            self._lengths = np.minimum(lengths, self.max_len) if self.max_len else lengths
        return self._lengths

    def __len__(self) -> int:
        return self.data.num_documents

    def __getitem__(self, index: int) -> torch.Tensor:
        return _as_tensor(self.data.document(index, self.max_len), self.dtype)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_lengths"] = None
        return state


def collate_pad(batch: Sequence[torch.Tensor], pad_id: int = 0, pad_to_multiple_of: int = 1) -> dict:
    """Pad to the longest document of the batch: {input_ids int64 [B, L], attention_mask [B, L], lengths [B]}."""
    lengths = torch.tensor([len(x) for x in batch], dtype=torch.int64)
    longest = int(lengths.max()) if len(batch) else 0
    longest = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    ids = torch.full((len(batch), longest), pad_id, dtype=torch.int64)
    for row, x in enumerate(batch):
        ids[row, :len(x)] = x
    mask = torch.arange(longest)[None, :] < lengths[:, None]
    return {"input_ids": ids, "attention_mask": mask.to(torch.int64), "lengths": lengths}


def lengths_sha256(lengths: np.ndarray) -> str:
    """The sha256 of ``lengths`` as int64 (a length-grouped order's input, in its sampler's state)."""
    return hashlib.sha256(np.ascontiguousarray(lengths, np.int64).tobytes()).hexdigest()


class LengthGroupedBatchSampler(Sampler[list[int]]):
    """Batches of similar length: a seeded shuffle cut into mega-batches of ``mega`` batches,
    each sorted by length and cut into batches, then the batch order shuffled.

    With ``world_size > 1`` each rank gets every ``world_size``-th batch (equal counts). The
    epoch's batch list does not depend on the world size, so the sampler resumes exactly under a
    ``StatefulDataLoader`` (pass it as ``batch_sampler``) and elastically (``elastic_state``).
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, *, seed: int = 0, mega: int = 50,
                 drop_last: bool = False, rank: int = 0, world_size: int = 1, dataset=None) -> None:
        self.lengths = np.asarray(lengths)
        self.batch_size, self.seed, self.mega, self.drop_last = batch_size, seed, mega, drop_last
        self._lengths_sha = lengths_sha256(self.lengths)
        self.position = OrderPosition(type(self).__name__, 0, seed, rank, world_size, world_size > 1, dataset,
                                      self._order)
        self._cached: tuple[int, BatchTable] | None = None
        self.position.size = len(self.global_batches())

    @property
    def epoch(self) -> int:
        return self.position.epoch

    @property
    def rank(self) -> int:
        return self.position.rank

    @property
    def world_size(self) -> int:
        return self.position.world_size

    @property
    def padding(self) -> int:
        """Repeated batches at the end of this rank's share: 0 (the ranks' counts are evened out by
        cutting the batch list to a multiple of the world size)."""
        return self.position.padding()

    def set_epoch(self, epoch: int) -> None:
        self.position.set_epoch(epoch)

    def global_batches(self) -> "BatchTable":
        """Every batch of the epoch, in order, before the split among ranks (computed once per epoch), as columns:
        ``[i]`` is batch i's list of indices."""
        if self._cached is not None and self._cached[0] == self.epoch:
            return self._cached[1]
        rng = np.random.default_rng([self.seed, self.epoch])
        order = rng.permutation(len(self.lengths))
        span = self.batch_size * self.mega
        flat = np.empty_like(order)
        firsts = []
        for start in range(0, len(order), span):  # each mega-batch sorted by length, longest first (stable)
            chunk = order[start:start + span]
            flat[start:start + len(chunk)] = chunk[np.argsort(-self.lengths[chunk], kind="stable")]
            firsts.append(np.arange(start, start + len(chunk), self.batch_size))
        starts = np.concatenate(firsts) if firsts else np.zeros(0, np.int64)
        ends = np.minimum(starts + self.batch_size,  # a mega-batch's last batch ends with it
                          (starts // span + 1) * span).clip(max=len(order))
        if self.drop_last:
            full = ends - starts == self.batch_size
            starts, ends = starts[full], ends[full]
        shuffled = rng.permutation(len(starts))
        self._cached = self.epoch, BatchTable(flat, starts[shuffled], ends[shuffled])
        return self._cached[1]

    def batches(self) -> list[list[int]]:
        """This rank's batches of the epoch (after any resumed history), in order."""
        every = self.global_batches()
        return [every[i] for i in self.position.share(np.arange(len(every))).tolist()]

    def __iter__(self) -> Iterator[list[int]]:
        start = self.position.begin()
        every = self.global_batches()
        return (every[i] for i in self.position.iterate(self.position.share(np.arange(len(every))), start))

    def __len__(self) -> int:
        return len(self.position.share(np.arange(len(self.global_batches()))))

    def state_dict(self) -> dict:
        """Epoch, history and how many of this rank's batches were handed out."""
        return self.position.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; with ``dataset=``, on the state's dataset version (re-opened). A refused state
        leaves the lengths this sampler had (re-counted for the state's version on the way)."""
        counted = self.lengths, self._cached, self._lengths_sha
        try:
            self.position.load_state_dict(state, resize=self._relength)
        except ValueError:
            self.lengths, self._cached, self._lengths_sha = counted
            raise

    def _order(self) -> dict:
        """What makes the epoch's batches besides the seed: batch size, mega, drop_last and the lengths."""
        return {"batch_size": int(self.batch_size), "mega": int(self.mega), "drop_last": bool(self.drop_last),
                "lengths": self._lengths_sha}

    def _relength(self) -> int:
        """The batch count after ``dataset`` re-opened another version (its lengths)."""
        self.lengths, self._cached = np.asarray(self.position.dataset.lengths), None
        self._lengths_sha = lengths_sha256(self.lengths)
        return len(self.global_batches())


class BatchTable(abc.Sequence):
    """An epoch's batches as columns: the indices of every batch one after the other in ``flat``, batch i being
    ``flat[starts[i]:ends[i]]``; ``[i]`` gives it as a list (a batch sampler's yield), made when asked."""

    def __init__(self, flat: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        self.flat, self.starts, self.ends = flat, starts, ends

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> list[int]:
        if not -len(self.starts) <= i < len(self.starts):
            raise IndexError(f"batch {i} of {len(self.starts)}")
        return self.flat[self.starts[i]:self.ends[i]].tolist()


def random_batches(n: int, batch_size: int, seed: int = 0) -> list[list[int]]:
    """Plain shuffled batches (the baseline for padding_fraction)."""
    order = np.random.default_rng(seed).permutation(n)
    return [order[i:i + batch_size].tolist() for i in range(0, n, batch_size)]


def padding_fraction(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> float:
    """Share of padded positions when each batch is padded to its longest item."""
    lengths = np.asarray(lengths)
    real = padded = 0
    for batch in batches:
        ls = lengths[np.asarray(batch, dtype=np.int64)]
        real += int(ls.sum())
        padded += int(ls.max()) * len(ls) if len(ls) else 0
    return 1.0 - real / padded if padded else 0.0

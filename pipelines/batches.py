"""Batches made inside DataLoader workers, carried to the training process without copying.

A DataLoader moves what a worker yields through a pipe: every ``bytes`` object is pickled, written,
read and unpickled (four copies, and Python work per sample), while a tensor in shared memory
crosses as one file descriptor. A reader that makes whole batches in its workers therefore
yields:

- raw bytes as ``PackedBytes``: the batch's byte strings in one uint8 tensor in shared memory,
  plus where each lies in it (a tuple of (start, end) pairs, pickled inline);
- tensors of one shape (decoded, transformed images) stacked into such a buffer, numbers (labels)
  by ``torch.utils.data.default_collate``: what ``DataLoader(batch_size=B)`` would do.

Hand such a reader to ``DataLoader(dataset, batch_size=None, ...)``: the batch is already made.

Fresh shared memory is slow to fill (every page faults in: measured 3.4-5.7 ms for 7 MB, against
0.7 ms into pages already there), so a worker recycles its batch buffers (``BufferRing``): the
training process, when it receives a batch, watches the buffer's storage and, once every tensor
viewing it is gone, tells the worker through a shared board that the buffer may be filled again.
A batch that travels on to a third process is not watched there: ``clone()`` what you forward.
"""

from __future__ import annotations

import itertools
import os
import secrets
import threading
import weakref
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import default_collate, get_worker_info


def shared_bytes(size: int) -> torch.Tensor:
    """An uninitialized uint8 tensor of ``size`` bytes, in shared memory inside a DataLoader worker
    (so it crosses to the training process as a file descriptor), in ordinary memory elsewhere."""
    if get_worker_info() is None:
        return torch.empty(size, dtype=torch.uint8)
    storage = torch.UntypedStorage._new_shared(size)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


RING = 8  # buffers a worker may have out at once before it allocates fresh ones
# board id -> board, in the training process and its workers; weak: a board lives as long as its dataset
_BOARDS: "weakref.WeakValueDictionary[str, torch.Tensor]" = weakref.WeakValueDictionary()
_TOKENS = itertools.count(1)


def new_board(slots: int) -> tuple[str, torch.Tensor]:
    """A release board for ``slots`` workers (made before the workers start: it is shared memory)."""
    board_id = secrets.token_hex(8)
    board = torch.zeros((slots, RING), dtype=torch.int64).share_memory_()
    _BOARDS[board_id] = board
    return board_id, board


def _release(board_id: str, slot: int, index: int, token: int) -> None:
    board = _BOARDS.get(board_id)
    if board is not None:
        board.numpy()[slot, index] = token  # numpy's item store: ~0.1 us, torch's indexing ~10 us


def _sent_claim(claim: tuple | None) -> tuple | None:
    """The claim a pickled batch carries: only from a DataLoader worker (a copy made anywhere else,
    e.g. ``copy.deepcopy`` in the training process, must not release the worker's buffer)."""
    return claim if get_worker_info() is not None else None


def _watch(tensor: torch.Tensor, claim: tuple | None) -> torch.Tensor:
    """In the receiving process: release the claimed buffer when the last view of it dies (only a
    tensor that arrived in shared memory is the buffer itself; a copy is not)."""
    if claim is not None and claim[0] in _BOARDS and tensor.is_shared():
        weakref.finalize(tensor.untyped_storage(), _release, *claim)
    return tensor


class BufferRing:
    """A worker's reusable shared-memory buffers: ``take(n)`` gives a uint8 tensor of ``n`` bytes and
    the claim the receiving process releases (None for a one-off buffer when all are out)."""

    def __init__(self, board_id: str, board: torch.Tensor, slot: int) -> None:
        _BOARDS.setdefault(board_id, board)  # a spawned worker got the board with the dataset
        self.board_id, self.board, self.slot = board_id, board, slot % board.shape[0]
        self.buffers: list[torch.Tensor | None] = [None] * RING
        self.tokens = [0] * RING
        self._lock = threading.Lock()  # a reader's prefetch threads take buffers too

    def take(self, size: int) -> tuple[torch.Tensor, tuple | None]:
        with self._lock:
            return self._take(size)

    def _take(self, size: int) -> tuple[torch.Tensor, tuple | None]:
        released = self.board[self.slot].numpy().tolist()
        free = [i for i in range(RING) if self.buffers[i] is None or released[i] == self.tokens[i]]
        if not free:
            return shared_bytes(size), None
        fits = [i for i in free if self.buffers[i] is not None and self.buffers[i].numel() >= size]
        i = fits[0] if fits else free[0]
        if not fits:  # room to grow: later batches a little larger still fit
            self.buffers[i] = shared_bytes(size + size // 8 + (1 << 16))
        token = (os.getpid() << 32) | next(_TOKENS)
        self.tokens[i] = token
        return self.buffers[i][:size], (self.board_id, self.slot, i, token)


class Watched:
    """A tensor a worker yields from its ``BufferRing``: it arrives as the plain tensor, watched."""

    def __init__(self, tensor: torch.Tensor, claim: tuple | None) -> None:
        self.tensor, self.claim = tensor, claim

    def __reduce__(self):
        return _watch, (self.tensor, _sent_claim(self.claim))


@dataclass(frozen=True)
class PackedBytes:
    """Byte strings in one uint8 tensor: item ``i`` is ``data[spans[i][0]:spans[i][1]]``.

    ``batch[i]`` is that item as a uint8 tensor view (what ``torchvision.io.decode_jpeg`` and
    nvImageCodec take; no copy), ``batch.tobytes(i)`` as ``bytes``, ``len(batch)`` the count.
    ``data`` may hold more than the items (a reader's buffer also holds tar headers)."""

    data: torch.Tensor
    spans: tuple[tuple[int, int], ...]
    claim: tuple | None = None  # the BufferRing claim of ``data`` (released when it dies where it arrives)

    def __reduce__(self):
        return _received, (self.data, self.spans, _sent_claim(self.claim))

    @classmethod
    def pack(cls, items: Sequence[bytes], ring: "BufferRing | None" = None) -> "PackedBytes":
        """``items`` copied once, end to end, into one tensor (from ``ring`` in a DataLoader worker)."""
        spans, at = [], 0
        for item in items:
            spans.append((at, at + len(item)))
            at += len(item)
        data, claim = ring.take(at) if ring is not None else (shared_bytes(at), None)
        view = memoryview(data.numpy())
        for item, (start, end) in zip(items, spans):
            view[start:end] = item
        return cls(data, tuple(spans), claim)

    @classmethod
    def of_views(cls, data: torch.Tensor, views: Sequence[memoryview], claim: tuple | None = None) -> "PackedBytes":
        """The items ``views`` already are: memoryviews of ``data``'s bytes (no copy; their place in
        ``data`` found from their addresses, and checked)."""
        base, size = data.data_ptr(), data.numel()
        spans = []
        for view in views:
            start = np.frombuffer(view, dtype=np.uint8).ctypes.data - base if len(view) else 0
            if not 0 <= start <= start + len(view) <= size:
                raise ValueError("PackedBytes.of_views: a view that is not of this tensor's bytes")
            spans.append((start, start + len(view)))
        return cls(data, tuple(spans), claim)

    def __len__(self) -> int:
        return len(self.spans)

    def __getitem__(self, i: int) -> torch.Tensor:
        start, end = self.spans[i]
        return self.data[start:end]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self.data[start:end] for start, end in self.spans)

    def tobytes(self, i: int) -> bytes:
        """Item ``i`` as ``bytes`` (a copy)."""
        return self[i].numpy().tobytes()

    def sizes(self) -> list[int]:
        """Each item's length in bytes."""
        return [end - start for start, end in self.spans]

    def pin_memory(self) -> "PackedBytes":
        """The same batch in pinned memory (``DataLoader(pin_memory=True)`` calls this)."""
        return PackedBytes(self.data.pin_memory(), self.spans)


def _received(data: torch.Tensor, spans: tuple, claim: tuple | None) -> PackedBytes:
    return PackedBytes(_watch(data, claim), spans)


class OneBuffer(tuple):
    """A batch (a tuple) whose items, ``PackedBytes`` and tensors, all view one ``buffer`` (its ring
    ``claim``): pickled on its way from a DataLoader worker, it crosses as that buffer once (one shared-
    memory transfer, where each tensor of a plain tuple is one) and arrives as a plain tuple of the same
    items. Each tensor item must be a contiguous view of ``buffer``."""

    def __new__(cls, items: Sequence, buffer: torch.Tensor, claim: tuple | None = None) -> "OneBuffer":
        batch = super().__new__(cls, items)
        batch.buffer, batch.claim = buffer, claim
        return batch

    def __reduce__(self):
        base, parts = self.buffer.data_ptr(), []
        for item in self:
            if isinstance(item, PackedBytes):
                shift = item.data.data_ptr() - base
                parts.append(("bytes", tuple((a + shift, b + shift) for a, b in item.spans) if shift else item.spans))
            else:
                parts.append(("tensor", item.data_ptr() - base, item.dtype, tuple(item.shape)))
        return _received_one, (self.buffer, tuple(parts), _sent_claim(self.claim))


def _received_one(buffer: torch.Tensor, parts: tuple, claim: tuple | None) -> tuple:
    data = _watch(buffer, claim)
    items = []
    for kind, *where in parts:
        if kind == "bytes":
            items.append(PackedBytes(data, where[0]))
        else:
            at, dtype, shape = where
            count = int(np.prod(shape, dtype=np.int64))
            nbytes = count * torch.empty(0, dtype=dtype).element_size()
            items.append(data[at:at + nbytes].view(dtype).view(shape))
    return tuple(items)


def collate_column(values: list, ring: BufferRing | None = None) -> object:
    """One field of a batch: ``bytes`` become ``PackedBytes``; tensors, arrays and numbers are
    ``default_collate``d (stacked; into shared memory inside a worker); anything else (strings,
    None, dicts, PIL images, tensors of different shapes) stays a list."""
    first = values[0]
    if any(type(v) is not type(first) for v in values):
        return list(values)
    if isinstance(first, (bytes, bytearray, memoryview)):
        return PackedBytes.pack(values, ring)
    if isinstance(first, (torch.Tensor, np.ndarray, int, float)) and not isinstance(first, bool):
        shapes = {tuple(getattr(v, "shape", ())) for v in values}
        if len(shapes) == 1:
            if ring is not None and isinstance(first, torch.Tensor) and first.device.type == "cpu":
                return _stack_into(ring, values)
            return default_collate(values)
    return list(values)


def _stack_into(ring: BufferRing, tensors: list[torch.Tensor]):
    """``torch.stack(tensors)`` into a buffer of ``ring`` (what default_collate does, into reused memory)."""
    first = tensors[0]
    nbytes = len(tensors) * first.numel() * first.element_size()
    raw, claim = ring.take(nbytes)
    out = raw.view(first.dtype).view(len(tensors), *first.shape)
    torch.stack(tensors, out=out)
    return Watched(out, claim)

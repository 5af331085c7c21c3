"""A seekable, read-only file over an s3:// object, for decoders that need one (PyAV opens it like
a local file). Reads are served from aligned blocks of ``block`` bytes, each fetched with one
ranged GET received straight into the block (``pipelines.object_store.read_range_into``) and kept in a small LRU cache; nothing is
downloaded whole. What a decode costs: the container's header (and its index: an MP4 whose
``moov`` is at the end costs a block at the tail), plus the blocks holding the frames it decodes.
"""

from __future__ import annotations

import io
from collections import OrderedDict

from pipelines import object_store

BLOCK = 1 << 20
CACHED_BLOCKS = 8


class RangedObjectFile(io.RawIOBase):
    """Bytes of ``url`` (``size`` bytes long, as the manifest records) as a seekable stream."""

    def __init__(self, url: str, size: int, block: int = BLOCK, cached: int = CACHED_BLOCKS) -> None:
        self.url, self.size, self.block, self.cached = url, int(size), block, cached
        self.pos = 0
        self.fetched_bytes = 0  # what the network delivered (for the docs' cost figures and tests)
        self._blocks: OrderedDict[int, bytearray] = OrderedDict()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise ValueError(f"{self.url}: seek to {base + offset}")
        self.pos = base + offset
        return self.pos

    def _block(self, number: int) -> bytearray:
        data = self._blocks.get(number)
        if data is None:
            start = number * self.block
            end = min(self.size, start + self.block)
            data = bytearray(end - start)  # the GET's body is received straight into it
            try:
                got = object_store.read_range_into(self.url, start, data)
            except FileNotFoundError:
                raise FileNotFoundError(f"{self.url}: no such object") from None
            if got != end - start:
                raise OSError(f"{self.url}: object shorter than the manifest's {self.size} bytes")
            self.fetched_bytes += len(data)
            self._blocks[number] = data
            if len(self._blocks) > self.cached:
                self._blocks.popitem(last=False)
        else:
            self._blocks.move_to_end(number)
        return data

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        want = min(len(view), self.size - self.pos)
        if want <= 0:
            return 0
        number, offset = divmod(self.pos, self.block)
        data = memoryview(self._block(number))[offset:offset + want]
        view[:len(data)] = data
        self.pos += len(data)
        return len(data)

"""Minimal, fast ustar writing and reading, plus DALI's webdataset index format.

Byte layout of every member we write (POSIX ustar, no PAX or GNU long-name records):

  offset  size  field
  0       100   name (ASCII, <= 100 bytes, NUL padded)
  100     8     mode "0000644\\0"
  108     8     uid  "0000000\\0"          116  8  gid "0000000\\0"
  124     12    size, 11 octal digits + NUL (members < 8 GiB)
  136     12    mtime "00000000000\\0" (integer 0: byte-identical reruns)
  148     8     checksum, 6 octal digits + NUL + space
  156     1     typeflag "0" (regular file)
  257     6     magic "ustar\\0"           263  2  version "00"
  265/297 32/32 uname/gname (empty)
  then the data, NUL-padded to a multiple of 512. The archive ends with two zero blocks and is
  padded to a multiple of 10240 bytes, as GNU tar does.

DALI index (``.idx``, what nvidia-dali's ``wds2idx`` writes, version v1.2)::

  v1.2 <number of samples>\\n
  then one line per sample: for each member "<ext> <data offset> <size> <member name>",
  joined by single spaces; a sample's members are adjacent and share the key before the
  first dot of the name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import BinaryIO, Iterator

BLOCK = 512
RECORD = 10240
MAX_MEMBER_SIZE = 8**11 - 1
INDEX_VERSION = "v1.2"

_HEADER_TEMPLATE = bytearray(BLOCK)
_HEADER_TEMPLATE[100:108] = b"0000644\x00"
_HEADER_TEMPLATE[108:116] = b"0000000\x00"
_HEADER_TEMPLATE[116:124] = b"0000000\x00"
_HEADER_TEMPLATE[136:148] = b"00000000000\x00"
_HEADER_TEMPLATE[156:157] = b"0"
_HEADER_TEMPLATE[257:263] = b"ustar\x00"
_HEADER_TEMPLATE[263:265] = b"00"
_TEMPLATE_SUM = sum(_HEADER_TEMPLATE) + 8 * 32  # checksum field counted as spaces
_DIGITS = {c: c - 48 for c in b"01234567"}


_NAME_PADS = tuple(bytes(n) for n in range(101))
_MODE_UID_GID = bytes(_HEADER_TEMPLATE[100:124])
_MTIME = bytes(_HEADER_TEMPLATE[136:148])
_AFTER_CHECKSUM = bytes(_HEADER_TEMPLATE[156:BLOCK])


def ustar_header(name: bytes, size: int, name_sum: int | None = None) -> bytes:
    """A 512-byte ustar header for a regular file ``name`` of ``size`` bytes (``name_sum``: ``sum(name)``,
    when the caller has it from parts it reuses)."""
    if len(name) > 100:
        raise ValueError(f"member name longer than 100 bytes: {name!r}")
    if size > MAX_MEMBER_SIZE:
        raise ValueError(f"member of {size} bytes exceeds the ustar limit")
    size_field = b"%011o\x00" % size
    checksum = _TEMPLATE_SUM + (sum(name) if name_sum is None else name_sum) + sum(size_field)
    return b"%s%s%s%s%s%06o\x00 %s" % (name, _NAME_PADS[100 - len(name)], _MODE_UID_GID, size_field, _MTIME,
                                       checksum, _AFTER_CHECKSUM)


PADDING = tuple(b"\x00" * n for n in range(BLOCK))  # PADDING[n]: n zero bytes



def end_of_archive(offset: int) -> bytes:
    """Two zero blocks, then zeros up to the next 10240-byte record boundary."""
    total = offset + 2 * BLOCK
    return b"\x00" * (2 * BLOCK + (-total % RECORD))


@dataclass(frozen=True)
class Member:
    name: str
    offset: int  # offset of the data (header offset + 512)
    size: int
    typeflag: bytes


class TarFormatError(ValueError):
    """The bytes are not a tar archive we can trust."""


def iter_members(fh: BinaryIO) -> Iterator[Member]:
    """Walk the headers of a tar archive (seeking over data); validates header checksums."""
    yield from _walk(fh)


def read_archive(fh: BinaryIO) -> tuple[list[Member], int]:
    """Every member, and the offset of the end-of-archive (the first zero block)."""
    members: list[Member] = []
    walk = _walk(fh)
    while True:
        try:
            members.append(next(walk))
        except StopIteration as stop:
            return members, stop.value


def _walk(fh: BinaryIO):
    """Yield each member; return the offset of the zero block that ends the archive."""
    offset = 0
    while True:
        fh.seek(offset)
        header = fh.read(BLOCK)
        if len(header) < BLOCK:
            raise TarFormatError(f"archive ends inside a header at byte {offset}")
        if header == b"\x00" * BLOCK:
            return offset
        try:
            stored = int(header[148:156].split(b"\x00", 1)[0].strip() or b"0", 8)
            size = int(header[124:136].split(b"\x00", 1)[0].strip() or b"0", 8)
        except ValueError:
            raise TarFormatError(f"bad header at byte {offset}") from None
        if stored != sum(header[:148]) + 8 * 32 + sum(header[156:]):
            raise TarFormatError(f"header checksum mismatch at byte {offset}")
        name = header[:100].split(b"\x00", 1)[0]
        if header[257:262] == b"ustar" and header[345:500].strip(b"\x00"):
            name = header[345:500].split(b"\x00", 1)[0] + b"/" + name
        yield Member(os.fsdecode(name), offset + BLOCK, size, header[156:157])
        offset += BLOCK + size + (-size % BLOCK)


def tail_problem(fh: BinaryIO, end: int, size: int) -> str | None:
    """What is wrong after the members (``end``: where the zero block starts, ``size``: the file's
    bytes), None when the file ends with exactly the end-of-archive repack writes (zeros to the
    next 10240-byte record)."""
    expected = end + len(end_of_archive(end))
    if size > expected:
        return f"{size - expected} bytes after the end-of-archive at byte {end}"
    if size < expected:
        return f"the end-of-archive at byte {end} is cut short ({size} bytes, {expected} expected)"
    fh.seek(end)
    if fh.read(size - end).strip(b"\x00"):
        return f"non-zero bytes in the end-of-archive after byte {end}"
    return None


def split_key(name: str) -> tuple[str, str]:
    """WebDataset's split: key = everything before the first dot of the basename."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1:]


def index_text(samples: list[list[tuple[str, int, int, str]]]) -> str:
    """The DALI index for samples given as [(ext, data offset, size, name), ...] each."""
    return index_from_lines([" ".join([f"{ext} {off} {size} {name}" for ext, off, size, name in sample])
                             for sample in samples])


def index_from_lines(lines: list[str]) -> str:
    """The DALI index from its per-sample lines."""
    return "\n".join([f"{INDEX_VERSION} {len(lines)}", *lines]) + "\n"


def index_from_tar(fh: BinaryIO) -> str:
    """Rebuild the DALI index by reading a tar's headers."""
    return index_from_members(iter_members(fh))


def index_from_members(members) -> str:
    """The DALI index of the regular-file members (in archive order) of a tar."""
    samples: list[list[tuple[str, int, int, str]]] = []
    last_key = None
    for member in members:
        if member.typeflag not in (b"0", b"\x00"):
            continue
        key, ext = split_key(member.name)
        if not key or key.endswith("/"):
            continue
        if key != last_key:
            samples.append([])
            last_key = key
        samples[-1].append((ext, member.offset, member.size, member.name))
    return index_text(samples)

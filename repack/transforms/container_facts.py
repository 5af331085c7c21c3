"""Facts read straight from container headers, without a demuxer: MP4/MOV box layout and
display rotation, Matroska/WebM projection.

MP4/MOV: a box is ``size (u32 BE) + type (4 bytes)``, ``size == 1`` means a 64-bit size
follows, ``size == 0`` means "to the end of the enclosing range". ``moov_after_mdat`` walks
the top-level boxes; ``mp4_rotations`` reads ``moov/mvhd`` and every ``moov/trak/tkhd``
display matrix (nine 32-bit fixed-point numbers, columns 16.16, 16.16, 2.30) and returns the
rotation ffprobe reports for each track id: the track matrix times the movie matrix, then
``-atan2(m[1], m[0])`` in degrees on the scale-normalized matrix (libavutil's
``av_display_rotation_get``), as ``rotation`` in ``repack.transforms.probe`` turns it into
0/90/180/270.

Matroska/WebM: elements are ``ID (EBML VINT, marker kept) + size (VINT, marker dropped; all
ones = unknown)``. ``matroska_has_projection`` walks Segment -> Tracks -> TrackEntry ->
Video and tells whether any video track carries a ``Projection`` element (the only place a
Matroska file stores a rotation); None when the header cannot be walked that way (unknown
sizes, Tracks after the first Cluster, damage).
"""

from __future__ import annotations

import math
import os
import struct
from typing import BinaryIO, Iterator

_FIXED_SHIFT = (16, 16, 30)  # fractional bits of the display matrix's three columns


def _boxes(fh: BinaryIO, start: int, end: int, limit: int = 4096) -> Iterator[tuple[bytes, int, int]]:
    """(type, payload offset, box end) of the boxes in ``[start, end)``; a damaged header ends the walk."""
    offset, count = start, 0
    while offset + 8 <= end and count < limit:
        fh.seek(offset)
        header = fh.read(16)
        if len(header) < 8:
            return
        size, kind, payload = int.from_bytes(header[:4], "big"), header[4:8], offset + 8
        if size == 1 and len(header) == 16:
            size, payload = int.from_bytes(header[8:16], "big"), offset + 16
        elif size == 0:
            size = end - offset
        if size < payload - offset:
            return
        yield kind, payload, min(offset + size, end)
        offset += size
        count += 1


def moov_after_mdat(path: str, limit: int = 4096) -> bool:
    """True if an MP4/MOV file's top-level ``moov`` box comes after its ``mdat`` (not faststart).

    Walks the top-level box headers only (at most ``limit`` boxes)."""
    with open(path, "rb") as fh:
        kinds = [kind for kind, _, _ in _boxes(fh, 0, os.fstat(fh.fileno()).st_size, limit) if kind in (b"moov", b"mdat")]
    return b"mdat" in kinds and b"moov" in kinds and kinds.index(b"mdat") < kinds.index(b"moov")


def _matrix(fh: BinaryIO, offset: int) -> list[list[float]] | None:
    fh.seek(offset)
    raw = fh.read(36)
    if len(raw) < 36:
        return None
    values = struct.unpack(">9i", raw)
    return [[values[3 * row + col] / (1 << _FIXED_SHIFT[col]) for col in range(3)] for row in range(3)]


def _full_box_matrix(fh: BinaryIO, payload: int, v0_offset: int, v1_offset: int) -> list[list[float]] | None:
    fh.seek(payload)
    version = fh.read(1)
    if not version:
        return None
    return _matrix(fh, payload + (v1_offset if version[0] == 1 else v0_offset))


def display_rotation(matrix: list[list[float]]) -> float:
    """Degrees as libavutil's ``av_display_rotation_get`` gives them for a row-major 3x3 matrix."""
    a, b, c, d = matrix[0][0], matrix[0][1], matrix[1][0], matrix[1][1]
    scale_0, scale_1 = math.hypot(a, c), math.hypot(b, d)
    if not scale_0 or not scale_1:
        return 0.0
    return -math.degrees(math.atan2(b / scale_1, a / scale_0))


def mp4_rotations(path: str) -> dict[int, int] | None:
    """{track id: rotation degrees (0, 90, 180, 270)} from an MP4/MOV's ``moov``; None if it cannot be read."""
    orientations = mp4_orientations(path)
    return None if orientations is None else {track: degrees for track, (degrees, _) in orientations.items()}


def is_mirror(matrix: list[list[float]]) -> bool:
    """Whether a display matrix mirrors the picture (a negative determinant of its 2x2 part): a flip that
    no rotation angle says (ffprobe's rotation of a vertical flip is 0)."""
    return matrix[0][0] * matrix[1][1] - matrix[0][1] * matrix[1][0] < 0


def mp4_orientations(path: str) -> dict[int, tuple[int, bool]] | None:
    """{track id: (rotation degrees, mirrored)} from an MP4/MOV's ``moov``; None if it cannot be read."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        moov = next(((p, e) for kind, p, e in _boxes(fh, 0, size) if kind == b"moov"), None)
        if moov is None:
            return None
        movie, traks = None, []
        for kind, payload, end in _boxes(fh, *moov):
            if kind == b"mvhd":
                movie = _full_box_matrix(fh, payload, 36, 48)
            elif kind == b"trak":
                traks.append((payload, end))
        if movie is None:
            return None
        rotations = {}
        for trak in traks:
            tkhd = next(((p, e) for kind, p, e in _boxes(fh, *trak) if kind == b"tkhd"), None)
            if tkhd is None:
                return None
            fh.seek(tkhd[0])
            version = fh.read(1)
            fh.seek(tkhd[0] + (20 if version == b"\x01" else 12))
            track_id = int.from_bytes(fh.read(4), "big")
            track = _full_box_matrix(fh, tkhd[0], 40, 52)
            if track is None:
                return None
            product = [[sum(track[i][e] * movie[e][j] for e in range(3)) for j in range(3)] for i in range(3)]
            rotations[track_id] = (int(round(display_rotation(product))) % 360, is_mirror(product))
    return rotations


_SEGMENT, _TRACKS, _TRACK_ENTRY, _VIDEO, _PROJECTION, _CLUSTER = (
    0x18538067, 0x1654AE6B, 0xAE, 0xE0, 0x7670, 0x1F43B675)


def _vint(fh: BinaryIO, keep_marker: bool) -> tuple[int, int, bool] | None:
    """(value, length, all ones) of an EBML variable-size integer at the file position."""
    first = fh.read(1)
    if not first or first[0] == 0:
        return None
    length = 8 - first[0].bit_length() + 1
    rest = fh.read(length - 1)
    if len(rest) < length - 1:
        return None
    value = first[0] if keep_marker else first[0] & (0xFF >> length)
    for byte in rest:
        value = (value << 8) | byte
    ones = (1 << (7 * length)) - 1
    return value, length, not keep_marker and value == ones


def _elements(fh: BinaryIO, start: int, end: int, limit: int = 4096) -> Iterator[tuple[int, int, int | None]]:
    """(id, payload offset, element end or None for an unknown size) in ``[start, end)``."""
    offset, count = start, 0
    while offset < end and count < limit:
        fh.seek(offset)
        ident, size = _vint(fh, True), _vint(fh, False)
        if ident is None or size is None:
            raise ValueError("damaged EBML element header")
        payload = offset + ident[1] + size[1]
        if size[2]:
            yield ident[0], payload, None
            return
        yield ident[0], payload, payload + size[0]
        offset = payload + size[0]
        count += 1


def matroska_has_projection(path: str) -> bool | None:
    """Whether a Matroska/WebM video track has a ``Projection`` element; None if the header can't be walked."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            segment = next(((p, e) for ident, p, e in _elements(fh, 0, size) if ident == _SEGMENT), None)
            if segment is None:
                return None
            for ident, payload, end in _elements(fh, segment[0], segment[1] or size):
                if ident == _CLUSTER or end is None:
                    return None
                if ident != _TRACKS:
                    continue
                for entry_id, entry, entry_end in _elements(fh, payload, end):
                    if entry_id != _TRACK_ENTRY or entry_end is None:
                        continue
                    for video_id, video, video_end in _elements(fh, entry, entry_end):
                        if video_id == _VIDEO and video_end is not None and any(
                                i == _PROJECTION for i, _, _ in _elements(fh, video, video_end)):
                            return True
                return False
    except (OSError, ValueError):
        return None
    return None

"""Whether a file can be memory-mapped as an LMDB database without reading past its end (a mapped read past
the end of a file is SIGBUS, not an exception): its two meta pages against its size. Stdlib only: the LMDB
readers (``pipelines``), ``repack verify`` and the report check a database with it before opening it."""

from __future__ import annotations

import os
from pathlib import Path

_META_MAGIC = 0xBEEFC0DE


def lmdb_file_problem(path: Path) -> str | None:
    """Why ``path`` cannot safely be memory-mapped as an LMDB file, from its two meta pages (magic,
    page size, last page): None when the file holds every page its newest meta page names. LMDB
    meta page: 16-byte page header, then magic u32, version u32, address, mapsize, two 48-byte
    MDB_db records (the first's md_pad = page size), last_pg u64 at 136, txnid u64 at 144."""
    import struct

    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(152)
            if len(head) < 152 or struct.unpack_from("<I", head, 16)[0] != _META_MAGIC:
                return "no LMDB meta page"
            psize = struct.unpack_from("<I", head, 40)[0]
            if psize < 512 or psize & (psize - 1) or size < 2 * psize:
                return f"bad page size {psize} for a file of {size} bytes"
            fh.seek(psize)
            metas = [head, fh.read(152)]
    except OSError as exc:
        return f"unreadable: {exc.strerror}"
    valid = [struct.unpack_from("<QQ", m, 136)[::-1] for m in metas
             if len(m) == 152 and struct.unpack_from("<I", m, 16)[0] == _META_MAGIC]
    txnid, last_page = max(valid)
    if (last_page + 1) * psize > size:
        return f"truncated: its meta page names {last_page + 1} pages of {psize} bytes, the file has {size} bytes"
    return None

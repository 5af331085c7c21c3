"""The one ``.idx`` parser as verify and remove use it: best-of-7 seconds of verify's column check
(``tar_check.check_against_index``) and remove's ``lifecycle.shard_index.parse_index`` on one shard of
SAMPLES two-member samples whose keys differ in length, built in memory.

    PYTHONPATH=. python -m tests.benchmarks.bench_index_parse [SAMPLES]
"""

from __future__ import annotations

import io
import sys
import time

from repack.lifecycle.shard_index import parse_index
from repack.sinks.tar_check import check_against_index
from repack.sinks.tar_format import end_of_archive, index_from_tar, ustar_header


def shard(samples: int) -> tuple[bytes, bytes]:
    """(tar, idx) of ``samples`` samples ``%08d_img<i>`` with a 7-byte .jpg and a 1-byte .cls."""
    buf = io.BytesIO()
    for i in range(samples):
        for ext, data in (("jpg", b"x" * 7), ("cls", b"3")):
            buf.write(ustar_header(f"{i:08d}_img{i}.{ext}".encode(), len(data)))
            buf.write(data + b"\0" * (-len(data) % 512))
    buf.write(end_of_archive(buf.tell()))
    tar = buf.getvalue()
    return tar, index_from_tar(io.BytesIO(tar)).encode()


def best_of(fn, rounds: int = 7) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        assert fn() is not None
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    samples = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
    tar, idx = shard(samples)
    print(f"{samples} samples: verify column check {best_of(lambda: check_against_index(tar, idx)):.3f} s, "
          f"remove parse_index {best_of(lambda: parse_index(idx)):.3f} s")


if __name__ == "__main__":
    main()

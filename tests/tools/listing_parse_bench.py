"""CPU per listed object of a ListObjectsV2 page read by ``columns_by_pattern`` (keys, sizes, ETag values):
a page of 1,000 objects with MD5 ETags, the best of 200 parses. `python -m tests.tools.listing_parse_bench`."""

from __future__ import annotations

import hashlib
import time

from repack.store.s3_listing import columns_by_pattern


def page(count: int = 1000) -> bytes:
    contents = "".join(f"<Contents><Key>tree/c{i % 10:03d}/img{i:09d}.jpg</Key><LastModified>2026-01-01T00:00:00.000Z"
                       f"</LastModified><ETag>&quot;{hashlib.md5(str(i).encode()).hexdigest()}&quot;</ETag>"
                       f"<Size>{700 + i % 97}</Size><StorageClass>STANDARD</StorageClass></Contents>"
                       for i in range(count))
    return ('<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<Name>b</Name><KeyCount>{count}</KeyCount><IsTruncated>true</IsTruncated>{contents}"
            "<NextContinuationToken>t</NextContinuationToken></ListBucketResult>").encode()


def best_us_per_object(rounds: int = 200, count: int = 1000) -> float:
    body = page(count)
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        columns_by_pattern(body)
        best = min(best, time.perf_counter() - started)
    return best / count * 1e6


if __name__ == "__main__":
    print(f"{best_us_per_object():.2f} us per listed object")

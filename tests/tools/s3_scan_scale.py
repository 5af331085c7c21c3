"""An s3:// image source of N objects planned without a server: time and peak memory of the scan.

``python -m tests.tools.s3_scan_scale N [--folders F]`` feeds ``repack.sources.s3.scan_s3`` synthetic
ListObjectsV2 pages (1,000 keys each, F class folders, sizes of ~700 B) in place of the listing, then
lays the inputs out as the planner does (``InputColumns.of`` and each sample's byte bound), and prints
the wall and CPU seconds (the pages' own making included) and the process's peak RSS. No request is made: what is measured is the
driver's own cost per listed object at sizes no test server holds (10,000,000 objects and more). Run it
with ``PYTHONPATH`` set to another checkout to compare two versions.
"""

from __future__ import annotations

import argparse
import resource
import time
from contextlib import contextmanager


def synthetic_pages(count: int, folders: int):
    """``list_pages``' shape: a first-level page with no object, then each folder's pages in order."""
    per = count // folders

    def pages(bucket, base, threads=8):
        yield [], []
        for folder in range(folders):
            for first in range(0, per, 1000):
                keys = [f"c{folder:05d}/img{folder * per + i:09d}.jpg" for i in range(first, min(per, first + 1000))]
                yield keys, [700 + i % 97 for i in range(len(keys))]

    return pages


def with_etags(pages):
    """``list_pages``' (keys, sizes, ETag values) of pages given with or without their ETag values."""
    return (page if len(page) == 3 else (*page, [0] * len(page[0])) for page in pages)


@contextmanager
def listed_as(pages):
    """Within: ``repack.sources.s3`` lists any s3:// URL as the (keys, sizes[, ETag values]) pages
    ``pages(bucket, base)`` yields (no ETag: 0), with no request made; the real listing is put back after."""
    import repack.sources.s3 as s3

    listed, parsed = s3.list_pages, s3.parse_url
    s3.list_pages, s3.parse_url = (lambda bucket, base, threads=8: with_etags(pages(bucket, base))), \
        (lambda url: ("synthetic", ""))
    try:
        yield
    finally:
        s3.list_pages, s3.parse_url = listed, parsed


def measure(count: int, folders: int) -> dict:
    """Seconds, CPU-seconds and peak RSS (MB) of scanning and laying out ``count`` synthetic objects."""
    import repack.sources.s3 as s3
    from repack.jobs.image_plan import InputColumns, sample_bounds
    from repack.sources.confine import Confinement

    started, cpu = time.perf_counter(), time.process_time()
    with listed_as(synthetic_pages(count, folders)):
        scan = s3.scan_s3("s3://synthetic", Confinement())
    items = scan.items if hasattr(scan.items, "take") else list(scan.items)
    columns = InputColumns.of(items, None)
    sample_bounds(columns)
    return {"objects": len(columns), "classes": len(scan.classes), "seconds": time.perf_counter() - started,
            "cpu_s": time.process_time() - cpu, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("count", type=int)
    parser.add_argument("--folders", type=int, default=1000)
    args = parser.parse_args()
    found = measure(args.count, args.folders)
    print(f"{found['objects']:,} objects in {found['classes']:,} folders: scan and layout {found['seconds']:.1f} s, "
          f"{found['cpu_s']:.1f} CPU-s, peak RSS {found['peak_rss_mb']:,.0f} MB")


if __name__ == "__main__":
    main()

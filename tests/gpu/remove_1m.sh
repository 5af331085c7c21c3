#!/usr/bin/env bash
# There (the device machine, from the repo root; carry ".whl"): `repack remove` at 1M tiny files on 16 cores with
# a timeline per step (tests/tools/remove_timeline.py), this tree against an older one given as a tar of its
# repack/ folder (`git archive <commit> repack > old-repack.tar` here, beside this checkout), alternated, each
# remove of another class folder (1,000 files, one or two shards); then 1,000 random names once per tree; the
# full default pack timed twice beside them, and one shard's sha256 and copy (copy_file_range + fsync) alone.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tests/gpu/device_env.sh
W=${W:-/tmp/rmw}; N=${N:-1000000}; ROUNDS=${ROUNDS:-3}
mkdir -p "$W/old" && tar -x -C "$W/old" -f old-repack.tar && python3 -m compileall -q -j 0 "$W/old" >/dev/null
echo "nproc $(nproc); $(python3 -V); load $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$W" "$N" <<'PY'
import sys, time, random
from pathlib import Path
from tests.benchmarks.tiny_files import tiny_jpegs, file_path, CLASSES
w, n = Path(sys.argv[1]), int(sys.argv[2])
if not (w / "jpg.complete").exists():
    t = time.perf_counter(); tiny_jpegs(w / "jpg", 0, n); (w / "jpg.complete").write_text("ok")
    print(f"generated {n} in {time.perf_counter() - t:.1f} s", flush=True)
for folder in range(100, 130):
    (w / f"names{folder}.txt").write_text("".join(f"{file_path(Path(''), i, '.jpg').as_posix()}\n" for i in range(folder, n, CLASSES)))
for k in range(4):
    chosen = sorted(random.Random(k).sample(range(n), 1000))
    (w / f"random{k}.txt").write_text("".join(f"{file_path(Path(''), i, '.jpg').as_posix()}\n" for i in chosen))
PY
timed() { python3 -c 'import subprocess, sys, time; t = time.perf_counter(); r = subprocess.run(sys.argv[1:])
print(f"wall {time.perf_counter() - t:.3f} s, rc {r.returncode}", flush=True)' "$@"; }
for r in 1 2; do rm -rf "$W/out"; sync; timed python3 -m repack images "$W/jpg" "$W/out" --quiet >/dev/null; done
ls -la "$W/out" | grep tar
python3 - "$W/out" <<'PY'
import hashlib, mmap, os, sys, time
from pathlib import Path
tar = sorted(Path(sys.argv[1]).glob("*.tar"))[0]
fd = os.open(tar, os.O_RDONLY); n = os.fstat(fd).st_size
with mmap.mmap(fd, n, prot=mmap.PROT_READ) as m:
    t = time.perf_counter(); hashlib.sha256(memoryview(m)).digest(); print(f"sha256 {n >> 20} MiB {time.perf_counter() - t:.3f} s")
for rnd in range(2):
    out = os.open(tar.parent / "copy.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC); t = time.perf_counter(); at = 0
    while at < n: at += os.copy_file_range(fd, out, n - at, at, at)
    t1 = time.perf_counter(); os.fsync(out); t2 = time.perf_counter(); os.close(out); os.unlink(tar.parent / "copy.tmp")
    print(f"copy_file_range {t1 - t:.3f} s, fsync {t2 - t1:.3f} s")
PY
folder=100
for r in $(seq 1 "$ROUNDS"); do
  for tree in old new; do
    sync
    pp=$([ $tree = old ] && echo "$W/old:$PYTHONPATH" || echo "$PYTHONPATH")
    echo "== $tree class folder $folder, the command"
    PYTHONPATH=$pp timed python3 -m repack remove "$W/out" --sources "$W/names$folder.txt" --quiet
    folder=$((folder + 1))
    sync
    echo "== $tree class folder $folder, its steps"
    PYTHONPATH=$pp timed python3 -m tests.tools.remove_timeline "$W/out" "$W/names$folder.txt"
    folder=$((folder + 1))
  done
done
k=0
for tree in old new; do
  sync; pp=$([ $tree = old ] && echo "$W/old:$PYTHONPATH" || echo "$PYTHONPATH")
  echo "== $tree random 1000 names ($k), the command"
  PYTHONPATH=$pp timed python3 -m repack remove "$W/out" --sources "$W/random$k.txt" --quiet
  k=$((k + 1))
done

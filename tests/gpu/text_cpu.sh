#!/usr/bin/env bash
# There (the device machine, from the repo root; carry ".whl"): where `repack text` spends its CPU at N tiny
# files (default 1,000,000) on all cores against the bare per-core tokenizer script, each run measured by
# tests/tools/cpu_timeline.py (user/system CPU, faults, switches, the driver's CPU, CPUs in use over time) and
# each repack run's manifest `run` (its workers' seconds in encode_batch); shapes in SHAPES (PxT as
# tests/tools/text_shapes.py, auto: the default), ROUNDS rounds alternated; TARS: tars of other trees' repack/
# folders beside the checkout (`git archive REV repack > NAME.tar` here), each run too; the trees' order turns
# each round (round 1: this tree first).
set -uo pipefail
cd "$(dirname "$0")/../.."
. tests/gpu/device_env.sh
W=${W:-/tmp/textw}; N=${N:-1000000}; ROUNDS=${ROUNDS:-2}; SHAPES=${SHAPES:-auto}
echo "nproc $(nproc); $(python3 -V); load $(cut -d' ' -f1-3 /proc/loadavg)"
lscpu | grep -E "^(Model name|Thread|Core|Socket|CPU\(s\)|L3|NUMA node0)" || true
python3 - "$W" "$N" <<'PY'
import sys, time
from pathlib import Path
from tests.tools.text_shapes import prepare
from tests.benchmarks.bench_scale import warm
t = time.perf_counter(); src, tok = prepare(Path(sys.argv[1]), int(sys.argv[2])); warm(src)
print(f"data ready in {time.perf_counter() - t:.1f} s", flush=True)
PY
python3 -c 'from tests.tools.cpu_timeline import BARE_TIMED; print(BARE_TIMED)' > "$W/bare_timed.py"
SRC="$W/txt-$N"; TOK="$W/gpt2/tokenizer.json"; TREES=("")  # "": this checkout
for tar in ${TARS:-}; do
  mkdir -p "$W/trees/$tar" && tar -x -C "$W/trees/$tar" -f "$tar" && python3 -m compileall -q -j 0 "$W/trees/$tar" >/dev/null
  TREES+=("$W/trees/$tar")
done
for r in $(seq 1 "$ROUNDS"); do
  sync
  python3 -m tests.tools.cpu_timeline --label "bare r$r" -- python3 "$W/bare_timed.py" "$TOK" "$SRC" "$(nproc)"
  n=${#TREES[@]}; order=()  # the trees' order turns each round: no tree always runs right after the bare script
  for i in $(seq 0 $((n - 1))); do order+=("${TREES[$(( (i + r - 1) % n ))]}"); done
  for tree in "${order[@]}"; do
  for shape in ${SHAPES//,/ }; do
    rm -rf "$W/out"; sync
    if [ "$shape" = auto ]; then env=(); else env=(REPACK_TOKENIZER_THREADS="${shape#*x}"); fi
    workers=(); [ "$shape" = auto ] || workers=(--workers "${shape%x*}")
    env "${env[@]}" PYTHONPATH="${tree:+$tree:}$PYTHONPATH" python3 -m tests.tools.cpu_timeline --cwd "${tree:-.}" \
      --label "repack ${tree:-this} $shape r$r" -- python3 -m repack text "$SRC" "$W/out" --doc-per file \
      --tokenizer "$TOK" --quiet "${workers[@]}"
    python3 -c 'import json, sys; print(json.dumps({"run": json.load(open(sys.argv[1]))["run"]}))' "$W/out/manifest.json"
  done
  done
done

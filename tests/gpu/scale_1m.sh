#!/usr/bin/env bash
# There (the device machine, from the repo root; carry ".whl"): issue 26's scale bench at N files on 16 cores, in
# parts that each fit one call (10 minutes): `bash tests/gpu/scale_1m.sh PARTS` with PARTS one of
#   pack,verify,change   (~200 s at 1M: the 1M tiny JPEGs are generated first, ~20 s)
#   readers              (packs once more, then the reader rows and the many-shards row)
#   text                 (N/2 text files; ~50 s)
# Make the calls back to back: the data under $BO (default /tmp/bo) is reused only while the machine stays warm.
# N: REPACK_BENCH_SCALE_FILES (default 1,000,000); rounds: REPACK_BENCH_REPEATS (default 2).
set -uo pipefail
cd "$(dirname "$0")/../.."
. tests/gpu/device_env.sh
export REPACK_BENCH_SCALE_FILES=${REPACK_BENCH_SCALE_FILES:-1000000} REPACK_BENCH_REPEATS=${REPACK_BENCH_REPEATS:-2}
export REPACK_BENCH_SCALE_PARTS=${1:-pack,verify,change}
echo "nproc $(nproc); $(nvidia-smi -L 2>/dev/null | head -1); $(python3 -V); parts $REPACK_BENCH_SCALE_PARTS"
python3 -m tests.benchmarks.run_all "${BO:-/tmp/bo}" --only scale

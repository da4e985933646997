#!/usr/bin/env bash
# Builds .whl/ (ignored by git): the Python packages a GPU machine without network needs beyond
# its image (Python 3.12, a CUDA build of torch, nvcc, ninja, numpy, psutil, py-cpuinfo, msgpack,
# einops: see docs/gpu.md "A lent GPU machine") to run benchmarks/gpu_zero_offload.py's DeepSpeed
# row. scripts/gpu_session.sh installs it there.
#
# DeepSpeed's PyPI release is a source tarball: it is built here into a pure-Python wheel
# (DS_BUILD_OPS=0: its CPU Adam op is compiled on first use on the GPU machine, with nvcc and
# ninja). Its dependencies missing from the image are downloaded as wheels for CPython 3.12.
# Environment: WHEELHOUSE (default .whl), GPU_PYVER (3.12), DEEPSPEED_VERSION (0.19.8), PY (the
# interpreter building the wheel; default .venv/bin/python, which has torch).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${WHEELHOUSE:-.whl}"
PYVER="${GPU_PYVER:-3.12}"
DS="${DEEPSPEED_VERSION:-0.19.8}"
PY="${PY:-.venv/bin/python}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
rm -rf "$OUT" && mkdir -p "$OUT"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
  "deepspeed==$DS" -d "$TMP"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --disable-pip-version-check --no-deps \
  --no-build-isolation "$TMP"/deepspeed-*.tar.gz -w "$OUT"
# pydantic-core is pinned by pydantic: resolve it from the pydantic wheel's metadata
plat=(--only-binary=:all: --python-version "$PYVER" --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
"$PY" -m pip download -q --disable-pip-version-check --no-deps "${plat[@]}" -d "$OUT" \
  hjson pydantic annotated-types typing-inspection "typing-extensions>=4.16"
core="$(unzip -p "$OUT"/pydantic-2*.whl '*/METADATA' | sed -n 's/^Requires-Dist: \(pydantic-core==[^ ;]*\).*/\1/p')"
"$PY" -m pip download -q --disable-pip-version-check --no-deps "${plat[@]}" -d "$OUT" "$core"
ls -l "$OUT"
du -sh "$OUT"

#!/usr/bin/env bash
# Compiles the CUDA Adam kernel sources (csrc/cuda/*.cu) with nvcc alone, without torch, as a
# check that cannot pass silently: it fails when nvcc is missing or any source fails to
# compile. Used by CI (`make cuda-check`).
#   NVCC=/path/to/nvcc  CUDA_ARCHS="80 90"  scripts/check_cuda.sh
set -euo pipefail
cd "$(dirname "$0")/.."

NVCC="${NVCC:-}"
if [[ -z "$NVCC" ]]; then
  if command -v nvcc >/dev/null 2>&1; then NVCC="$(command -v nvcc)"
  elif [[ -x /usr/local/cuda/bin/nvcc ]]; then NVCC=/usr/local/cuda/bin/nvcc
  else
    echo "check_cuda: FAILED: nvcc not found (set NVCC=/path/to/nvcc)" >&2
    exit 1
  fi
fi
ARCHS="${CUDA_ARCHS:-80 90}"
gencode=()
for a in $ARCHS; do gencode+=("-gencode=arch=compute_${a},code=sm_${a}"); done

shopt -s nullglob
sources=(csrc/cuda/*.cu)
if (( ${#sources[@]} == 0 )); then
  echo "check_cuda: FAILED: no csrc/cuda/*.cu sources" >&2
  exit 1
fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
echo "check_cuda: $("$NVCC" --version | tail -1)"
for src in "${sources[@]}"; do
  obj="$out/$(basename "${src%.cu}").o"
  # the flags setup.py gives nvcc, plus warnings as errors
  if ! "$NVCC" -O3 -std=c++20 --fmad=false -Icsrc "${gencode[@]}" \
       -Xcompiler -Wall -Werror all-warnings -c "$src" -o "$obj"; then
    echo "check_cuda: FAILED: $src" >&2
    exit 1
  fi
  echo "check_cuda: ok $src (archs: $ARCHS)"
done
# the header shared with the CPU kernels must also compile as plain C++ without CUDA
if ! echo '#include "adam_math.h"' | "${CXX:-c++}" -std=c++20 -fsyntax-only -Wall -Werror -Icsrc -x c++ -; then
  echo "check_cuda: FAILED: csrc/adam_math.h as plain C++" >&2
  exit 1
fi
echo "check_cuda: ok csrc/adam_math.h (host C++, no CUDA header)"

# the torch binding: syntax-checked against torch's headers when a Python with torch is at hand
# (the CPU wheel ships the ATen/c10 CUDA headers); skipped, and said so, otherwise
PY="${PYTHON:-.venv/bin/python}"
if [[ -x "$PY" ]] && incs="$("$PY" -c 'from torch.utils.cpp_extension import include_paths; print(" ".join("-I"+p for p in include_paths()))' 2>/dev/null)"; then
  cuda_inc=""
  for d in "${CUDA_HOME:-}" "$(dirname "$(dirname "$(readlink -f "$NVCC")")")" /usr/local/cuda; do
    if [[ -n "$d" && -f "$d/include/cuda_runtime_api.h" ]]; then cuda_inc="$d/include"; break; fi
  done
  if [[ -z "$cuda_inc" ]]; then
    echo "check_cuda: FAILED: cuda_runtime_api.h not found (set CUDA_HOME)" >&2
    exit 1
  fi
  # a CPU-only torch wheel lacks the build-generated c10 CUDA macro header: stand in for it
  stub="$out/stub"
  mkdir -p "$stub/c10/cuda/impl"
  echo '#pragma once' >"$stub/c10/cuda/impl/cuda_cmake_macros.h"
  # and the CPU op's CUDA route (StepPlan on CUDA, the bindings a CUDA build adds), which a
  # CPU build never compiles
  pyinc="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
  for src in csrc/cuda/*.cpp csrc/adam/adam_ops.cpp; do
    # shellcheck disable=SC2086
    if ! "${CXX:-c++}" -std=c++20 -fsyntax-only -DSTATESTORE_WITH_CUDA=1 \
         -DTORCH_EXTENSION_NAME=_C_adam -Icsrc $incs -I"$pyinc" \
         -I"$cuda_inc" -idirafter "$stub" -w "$src"; then
      echo "check_cuda: FAILED: $src (syntax against torch headers)" >&2
      exit 1
    fi
    echo "check_cuda: ok $src (syntax against torch headers)"
  done
else
  echo "check_cuda: note: no Python with torch at $PY; binding syntax check skipped"
fi

#!/usr/bin/env bash
# `make gpu-test`: builds statestore with CUDA and runs every CUDA test (pytest -m cuda) and a
# short GPU benchmark (benchmarks/gpu_step.py --quick) on a machine with an NVIDIA GPU.
#
# It never touches .venv or the extensions `make test` builds in the source tree:
#   * Python: $GPU_PYTHON when set (an interpreter whose torch is a CUDA build of the project's torch);
#     otherwise .venv-gpu/ (created on first use; the Makefile's TORCH from PyPI, whose Linux x86-64
#     wheel is the CUDA build, or from $GPU_TORCH_INDEX, e.g.
#     https://download.pytorch.org/whl/cu128). Machines without internet: set GPU_PYTHON.
#   * Build: the sources are copied to build/gpu/src and the extensions built there in place
#     (nvcc from $CUDA_HOME, PATH or /usr/local/cuda; its major version must be torch's);
#     later runs rebuild only what changed.
#   * Tests run with STATESTORE_REQUIRE_CUDA=1: without a usable GPU they fail, never skip.
#   * torch must be the Makefile's TORCH, the project's pin. GPU_TORCH_VERSION=any accepts another CUDA build
#     of torch, said loudly in the output (a machine whose image has only another version, e.g.
#     GPU_PYTHON=python3 GPU_TORCH_VERSION=any make gpu-test).
# Environment: GPU_PYTHON, GPU_VENV (default .venv-gpu), GPU_TORCH_INDEX, GPU_TORCH_VERSION,
# TORCH_CUDA_ARCH_LIST
# (default: the visible GPUs'), GPU_PYTEST_ARGS (extra pytest arguments), GPU_BENCH_ARGS
# (default --quick; "skip" to leave the benchmark out).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
# the project's torch (the Makefile's TORCH, exported by make; read from the Makefile otherwise)
TORCH_VERSION="${TORCH:-$(sed -n 's/^TORCH *:= *//p' Makefile)}"
[[ -n "$TORCH_VERSION" ]] || { echo "gpu-test: FAILED: no TORCH in the Makefile" >&2; exit 1; }
WANT_TORCH="${GPU_TORCH_VERSION:-$TORCH_VERSION}"
say() { echo "gpu-test: $*"; }
die() { echo "gpu-test: FAILED: $*" >&2; exit 1; }

# ---- 1. an interpreter with a CUDA build of the project's torch
if [[ -n "${GPU_PYTHON:-}" ]]; then
  PY="$GPU_PYTHON"
  [[ -x "$PY" ]] || die "GPU_PYTHON=$PY is not an executable"
else
  VENV="${GPU_VENV:-.venv-gpu}"
  PY="$VENV/bin/python"
  if [[ ! -x "$PY" ]]; then
    say "creating $VENV"
    python3 -m venv "$VENV"
  fi
  if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' and torch.version.cuda else 1)" 2>/dev/null; then
    idx=()
    [[ -n "${GPU_TORCH_INDEX:-}" ]] && idx=(--index-url "$GPU_TORCH_INDEX")
    say "installing torch==$TORCH_VERSION (CUDA build) into $VENV"
    "$PY" -m pip install -q --disable-pip-version-check ${idx[@]+"${idx[@]}"} "torch==$TORCH_VERSION"
  fi
  # the package's own (setup.py's REQUIRES) and its test dependencies (pyproject.toml); torch
  # stays pinned
  mapfile -t deps < <("$PY" - <<'EOF'
import ast, re
deps = []
for node in ast.parse(open("setup.py").read()).body:
    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "REQUIRES":
        deps += ast.literal_eval(node.value)
text = open("pyproject.toml").read()
block = re.search(r"^test = \[(.*?)\]", text, re.S | re.M).group(1)
deps += re.findall(r'"([^"]+)"', block)
for d in deps:
    if not d.replace(" ", "").startswith("torch"):
        print(d)
EOF
)
  "$PY" -m pip install -q --disable-pip-version-check -c <(echo "torch==$TORCH_VERSION") \
    setuptools wheel ninja ${deps[@]+"${deps[@]}"}
fi
"$PY" - <<EOF || exit 1
import sys, torch
v = torch.__version__.split("+")[0]
if "$WANT_TORCH" != "any" and v != "$WANT_TORCH":
    sys.exit(f"gpu-test: FAILED: torch {torch.__version__} at {sys.executable}; $WANT_TORCH is "
             "required (GPU_TORCH_VERSION=any accepts another CUDA build)")
if v != "$TORCH_VERSION":
    print(f"gpu-test: NOTE: torch {torch.__version__}, not the project's pinned $TORCH_VERSION "
          "(GPU_TORCH_VERSION=any)")
if not torch.version.cuda:
    sys.exit(f"gpu-test: FAILED: torch {torch.__version__} at {sys.executable} is a CPU build; "
             "set GPU_PYTHON to an interpreter with a CUDA build, or GPU_TORCH_INDEX")
if not torch.cuda.is_available():
    sys.exit(f"gpu-test: FAILED: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU")
print(f"gpu-test: torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"{torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}")
EOF

# ---- 2. nvcc, of torch's CUDA major version
NVCC=""
for c in "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" "$(command -v nvcc || true)" /usr/local/cuda/bin/nvcc; do
  if [[ -n "$c" && -x "$c" ]]; then NVCC="$c"; break; fi
done
[[ -n "$NVCC" ]] || die "nvcc not found (set CUDA_HOME)"
export CUDA_HOME="${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$NVCC")")")}"
nv_major="$("$NVCC" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p' | head -1)"
torch_major="$("$PY" -c 'import torch; print(torch.version.cuda.split(".")[0])')"
[[ "$nv_major" == "$torch_major" ]] || die "nvcc at $NVCC is CUDA $nv_major, torch was built with CUDA $torch_major: set CUDA_HOME to a CUDA $torch_major toolkit"
say "nvcc: $NVCC ($("$NVCC" --version | tail -1))"

# ---- 3. a copy of the sources, built in place with CUDA
SRC="$ROOT/build/gpu/src"
mkdir -p "$SRC"
# a fresh copy each run: files moved or deleted since the last one must not stay behind (old
# test files would be collected); the build's objects (build/gpu/src/build) are kept, and
# tar keeps the sources' times, so only what changed is compiled again
find "$SRC" -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +
if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  # the index may still name files deleted or moved in the work tree: copy those that exist
  git -C "$ROOT" ls-files -z --cached --others --exclude-standard | grep -zv '\.so$' \
    | (cd "$ROOT" && while IFS= read -r -d '' f; do [[ -e "$f" ]] && printf '%s\0' "$f"; done) \
    | (cd "$ROOT" && tar --null -cf - -T -) | tar -xf - -C "$SRC"
else
  (cd "$ROOT" && tar --exclude='*.so' --exclude='__pycache__' --exclude='.venv*' --exclude=./.git \
     --exclude='./build' -cf - .) | tar -xf - -C "$SRC"
fi
say "building the extensions with CUDA in $SRC"
(cd "$SRC" && MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$PY" setup.py -q build_ext --inplace) \
  || die "the CUDA build failed"
(cd "$SRC" && PYTHONPATH="$SRC" "$PY" -c '
import sys, statestore
from statestore import kernels_info
info = kernels_info()
print("gpu-test: statestore from", statestore.__file__, "kernels:", info)
if info["cuda"] != "fused-cuda":
    sys.exit("gpu-test: FAILED: the fused CUDA kernel is not in use: %s" % info)
') || exit 1

# ---- 4. every CUDA test, then the benchmark
rc=0
# shellcheck disable=SC2086
(cd "$SRC" && STATESTORE_REQUIRE_CUDA=1 PYTHONPATH="$SRC" "$PY" -m pytest -q -p no:cacheprovider \
   -m cuda -rs ${GPU_PYTEST_ARGS:-} tests) || rc=$?
if [[ "${GPU_BENCH_ARGS:-}" != "skip" ]]; then
  # shellcheck disable=SC2086
  (cd "$SRC" && PYTHONPATH="$SRC" "$PY" benchmarks/gpu_step.py ${GPU_BENCH_ARGS:---quick}) || rc=$?
fi
[[ $rc -eq 0 ]] && say "ok" || say "FAILED (status $rc)"
exit $rc

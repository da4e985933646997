#!/usr/bin/env bash
# The GPU checks of a session that is lent a GPU machine, in one run (issue 44's GPU half):
# `make gpu-test` (every CUDA test), benchmarks/gpu_step.py's table 1 at 64M and 1G parameters
# in 50 tensors with fp32/bf16/int8 moments, its compressed-moment rows again with the "wide"
# layout of that kernel (STATESTORE_CUDA_MOMENTS=wide; the CUDA tests check both layouts bit
# for bit), table 2's offloaded 1G bf16 step (its floors), and benchmarks/gpu_zero_offload.py
# (DeepSpeed ZeRO-Offload side by side).
#
# Made for a machine whose image has Python with a CUDA build of torch, nvcc and ninja but no
# network: the torch there is used whatever its release (GPU_TORCH_VERSION=any), and DeepSpeed
# comes from .whl/ (scripts/gpu_wheelhouse.sh builds it here; carry it). Each phase has a time
# limit so that one slow phase cannot take the others' time; each phase's whole log goes to
# $OUT (or build/gpu-session) and its tail to stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG="${OUT:-build/gpu-session}"
mkdir -p "$LOG"
PY="${GPU_PYTHON:-python3}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
status=0
phase() {  # phase NAME SECONDS COMMAND...
  local name="$1" limit="$2" rc
  shift 2
  echo "=== $name: start $(date -u +%T), limit ${limit}s"
  timeout "$limit" "$@" >"$LOG/$name.log" 2>&1
  rc=$?
  echo "=== $name: rc=$rc at $(date -u +%T)"
  tail -n "${TAIL_LINES:-40}" "$LOG/$name.log"
  [[ $rc -eq 0 ]] || status=1
}
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")'
phase gpu_test "${T_TEST:-250}" env GPU_PYTHON="$PY" GPU_TORCH_VERSION=any GPU_BENCH_ARGS=skip \
  GPU_PYTEST_ARGS="${GPU_PYTEST_ARGS:--n 8}" bash scripts/gpu_test.sh
SRC=build/gpu/src  # gpu_test.sh's build, with the CUDA extensions
if [[ -f "$SRC/benchmarks/gpu_step.py" ]]; then
  SRCPATH="$PWD/$SRC${PYTHONPATH:+:$PYTHONPATH}"
  phase step_table "${T_STEP:-90}" env -C "$SRC" PYTHONPATH="$SRCPATH" "$PY" benchmarks/gpu_step.py --tables 1 --sizes 64M,1G \
    --tensors 50 --dtypes fp32,bf16 --moments fp32,bf16,int8 --reps 5
  phase step_table_wide "${T_WIDE:-45}" env -C "$SRC" PYTHONPATH="$SRCPATH" STATESTORE_CUDA_MOMENTS=wide \
    "$PY" benchmarks/gpu_step.py --tables 1 --sizes 64M,1G --tensors 50 --dtypes fp32 --moments bf16,int8 --reps 5
  phase offload_table "${T_OFFLOAD:-90}" env -C "$SRC" PYTHONPATH="$SRCPATH" "$PY" benchmarks/gpu_step.py --tables 2 \
    --offload-sizes 1G --dtypes bf16 --stores pinned --reps 3
  phase zero_offload "${T_ZERO:-110}" env -C "$SRC" PYTHONPATH="$SRCPATH" "$PY" benchmarks/gpu_zero_offload.py --layers 8
fi
echo "=== done: status $status"
exit $status

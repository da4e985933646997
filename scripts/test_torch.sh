#!/usr/bin/env bash
# `make test-torch` (CI runs it after `make test`): the README's install into a second
# environment with another torch release, then the build, kernel, store-conformance and
# checkpoint tests there, and a short training run.
#
#   scripts/test_torch.sh [TORCH_VERSION]     (default: the newest release the Makefile names)
#
# * The environment is a virtual environment OUTSIDE the checkout, kept between runs:
#   $STATESTORE_CACHE/venv-torch-X.Y.Z (STATESTORE_CACHE defaults to ~/.cache/statestore).
#   torch's Linux wheels on PyPI are CUDA builds (a few GB with their NVIDIA libraries):
#   installed once, reused by every later run on the machine.
# * A clean clone of the checkout's HEAD (committed work only) is installed with the
#   README's command, `pip install --no-build-isolation <clone>`, on whatever host this is:
#   no GPU and no TORCH_CUDA_ARCH_LIST on CI, so the CUDA kernels are built for the
#   architectures the torch wheel was built for (the build's summary line names them).
# * The tests run from outside the clone, so `import statestore` is the installed package,
#   not the clone's sources. pytest's exit status goes through (5, no test collected, fails).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
VERSION="${1:?usage: scripts/test_torch.sh TORCH_VERSION}"
CACHE="${STATESTORE_CACHE:-$HOME/.cache/statestore}"
VENV="$CACHE/venv-torch-$VERSION"
PY="$VENV/bin/python"
say() { echo "test-torch $VERSION: $*" >&2; }
quiet_pip() { "$PY" -m pip "$@" 2> >(grep -v "^WARNING: Location" >&2); }
now() { date +%s; }

t0=$(now)
if [ ! -x "$PY" ]; then
    say "creating $VENV"
    mkdir -p "$CACHE"
    python3 -m venv "$VENV"
fi
have="$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)"
if [ "$have" != "$VERSION" ]; then
    say "installing torch==$VERSION into $VENV (the CUDA wheel: a few GB, kept for later runs)"
    quiet_pip install -q --disable-pip-version-check "torch==$VERSION" setuptools wheel ninja
fi
# the test tools only (the integrations' frameworks are not among the tests run here)
quiet_pip install -q --disable-pip-version-check "torch==$VERSION" setuptools wheel ninja \
    "pytest>=7" "pytest-xdist>=3" "hypothesis>=6" "psutil>=5"
say "torch $("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)' 2>/dev/null) in $VENV ($(( $(now) - t0 )) s)"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
git clone -q --no-hardlinks "$REPO" "$work/statestore"
say "clean clone of $(git -C "$work/statestore" rev-parse --short HEAD) in $work/statestore"

t1=$(now)
"$PY" -m pip uninstall -q -y statestore >/dev/null 2>&1 || true
log="$work/build.log"
if ! "$PY" -m pip install -v --disable-pip-version-check --no-build-isolation "$work/statestore" >"$log" 2>&1; then
    grep -v "^WARNING: Location" "$log" | tail -60 >&2
    say "FAILED: pip install --no-build-isolation <clone> (the README's command)"
    exit 1
fi
grep "statestore build:" "$log" | sed 's/^ *//' | sort -u >&2
say "built and installed in $(( $(now) - t1 )) s"

cd "$work"       # not the clone: the tests import the installed package
"$PY" - <<'EOF'
import statestore, torch
from statestore.kernels import kernels_info
from statestore.optim import HybridAdam
info = kernels_info()
assert info["extension"], info
print(f"test-torch: statestore {statestore.__version__} from {statestore.__file__}, "
      f"torch {torch.__version__}, CPU path {info['simd']} of {info['simd_supported']}")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
with statestore.NVMeStore(None) as store:
    opt = HybridAdam(model.named_parameters(), lr=1e-3, state_store=store)
    for step in range(20):
        x = torch.randn(32, 64)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    store.save_checkpoint("ckpt")
print(f"test-torch: trained 20 steps on NVMeStore and saved a checkpoint (loss {loss.item():.4f})")
EOF

t2=$(now)
T="$work/statestore/tests"
jobs=$(n=$(nproc 2>/dev/null || echo 2); [ "$n" -gt 4 ] && n=4; echo "$n")
# (the kernel benchmarks' tests are left out: the benchmark scripts import the checkout's
# statestore, built in place by make test, not an installed one)
"$PY" -m pytest -q -p no:cacheprovider --rootdir "$work/statestore" -c "$work/statestore/pyproject.toml" \
    -n "$jobs" --dist worksteal --ignore "$T/kernels/test_kernels_benchmarks.py" \
    "$T/test_build.py" "$T/kernels" "$T/stores/test_store_conformance.py" "$T/checkpoint"
say "tests passed in $(( $(now) - t2 )) s; $(( $(now) - t0 )) s in all"

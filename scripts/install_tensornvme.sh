#!/usr/bin/env bash
# Builds and installs TensorNVMe 0.1.0 (the `tensornvme` engine of NVMeStore) into the
# virtual environment of python $1 (default: .venv/bin/python), from its PyPI source release,
# against Debian's liburing-dev and libaio-dev (scripts/system_deps.sh installs them).
#
# Idempotent: does nothing when that environment already imports tensornvme 0.1.0 with a
# backend. Any failure stops the set-up with the reason (exit status 1) and the build log's
# end. docs/nvme.md ("TensorNVMe") says what the steps are for.
#
#   * --no-build-isolation: its setup.py imports torch (the environment's, which stays as is:
#     pip runs with a constraint pinning it, and the wheel is installed with --no-deps);
#   * WITH_ROOT=1 (as root) keeps its setup.py from appending to ~/.bashrc and installing
#     under ~/.tensornvme; without root, HOME points at a scratch directory instead;
#   * LIBRARY_PATH: where its setup.py looks for liburing.a, which it links statically;
#   * cmake: its setup.py runs it to find the libraries (it then prints
#     "No rule to make target 'extern_uring'", which it ignores: the libraries were found).
set -euo pipefail

PY=${1:-.venv/bin/python}
VERSION=0.1.0

say() { echo "statestore setup: $*" >&2; }
fail() { say "building tensornvme $VERSION FAILED: $*"; exit 1; }

[ -x "$PY" ] || fail "no python at $PY"
# the environment's torch release (the Makefile's TORCH in .venv): pinned while building
TORCH_RELEASE="$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])' 2>&1)" \
    || fail "$PY cannot import torch: ${TORCH_RELEASE##*$'\n'}"
TORCH_PIN="torch==$TORCH_RELEASE"
if "$PY" - "$VERSION" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import version
from tensornvme._C import get_backends
sys.exit(0 if version("tensornvme") == sys.argv[1] and get_backends() else 1)
EOF
then
    exit 0          # already installed and working
fi

BIN=$(dirname "$PY")
export PATH="$BIN:$PATH"
multiarch=$(gcc -dumpmachine 2>/dev/null) || fail "gcc is missing (apt-get install build-essential)"
libdir=/usr/lib/$multiarch
for lib in liburing.a libaio.so; do
    [ -e "$libdir/$lib" ] || fail "$libdir/$lib is missing: install liburing-dev and libaio-dev \
(scripts/system_deps.sh does, as root with apt-get)"
done

work=$(mktemp -d "${TMPDIR:-/tmp}/statestore-tensornvme.XXXXXX")
trap 'rm -rf "$work"' EXIT
log=$work/build.log
constraint=$work/constraint.txt
echo "$TORCH_PIN" >"$constraint"
pip() { "$PY" -m pip --disable-pip-version-check "$@"; }

say "building tensornvme $VERSION from its source release (a few minutes)"
need=(packaging wheel setuptools click)
command -v cmake >/dev/null 2>&1 || need+=(cmake)
pip install -q -c "$constraint" "${need[@]}" >>"$log" 2>&1 \
    || { tail -n 20 "$log" >&2; fail "pip install ${need[*]} failed (see above)"; }
pip download -q --no-deps --no-binary :all: -d "$work" "tensornvme==$VERSION" >>"$log" 2>&1 \
    || { tail -n 20 "$log" >&2; fail "downloading the tensornvme $VERSION source release failed (see above)"; }
sdist=$(ls "$work"/tensornvme-"$VERSION".tar.gz 2>/dev/null) \
    || fail "pip download left no tensornvme-$VERSION.tar.gz"

if [ "$(id -u)" = 0 ]; then
    export WITH_ROOT=1
else
    mkdir -p "$work/home"
    export HOME="$work/home"
fi
LIBRARY_PATH="$libdir${LIBRARY_PATH:+:$LIBRARY_PATH}" \
    pip wheel --no-deps --no-build-isolation -w "$work/wheel" "$sdist" >>"$log" 2>&1 \
    || { tail -n 40 "$log" >&2; fail "its build failed (the log's end is above)"; }
pip install -q --no-deps "$work"/wheel/tensornvme-*.whl >>"$log" 2>&1 \
    || { tail -n 20 "$log" >&2; fail "installing the built wheel failed (see above)"; }

TORCH_RELEASE="$TORCH_RELEASE" "$PY" - <<'EOF' || fail "tensornvme was installed but does not work (see above)"
import os
import torch
from tensornvme._C import get_backends, probe_backend
assert torch.__version__.split("+")[0] == os.environ["TORCH_RELEASE"], f"torch changed to {torch.__version__}"
backends = get_backends()
assert backends, "tensornvme was built with neither io_uring nor libaio"
working = sorted(b for b in backends if probe_backend(b))
assert working, f"none of tensornvme's backends {sorted(backends)} works here"
print(f"statestore setup: tensornvme installed (backends {sorted(backends)}, working {working})")
EOF

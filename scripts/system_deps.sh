#!/usr/bin/env bash
# Installs the Debian packages the build needs (liburing-dev, libaio-dev for the I/O
# engines; fio for the disk benchmarks), only when missing. Without root or apt-get it
# says what is missing and goes on: the thread-pool I/O engine needs nothing.
set -u
need=()
for pkg in liburing-dev libaio-dev fio; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "statestore setup: installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null && apt-get install -y -qq "${need[@]}" >/dev/null \
        || echo "statestore setup: apt-get install ${need[*]} failed; continuing" >&2
else
    echo "statestore setup: missing ${need[*]} (no root/apt-get); io_uring/libaio engines will be disabled" >&2
fi
exit 0

"""Measurements the benchmarks share: the process's memory figures (``/proc/self/status``),
the disk a folder holds, and the disk's sequential O_DIRECT bandwidth.

Imported as ``from _common import ...``: a benchmark run as ``python benchmarks/NAME.py``
has this folder first on ``sys.path``.
"""
from __future__ import annotations

import ctypes
import gc
import mmap
import os
import sys
import time
import traceback
from typing import Callable, NoReturn, Optional, Set, Tuple


def proc_status(field: str) -> int:
    """A ``/proc/self/status`` figure given in kB (``VmRSS``, ``VmHWM``, ...), in bytes; 0 if
    absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak(trim: bool = False) -> int:
    """Reset VmHWM to the current RSS (``/proc/self/clear_refs``); returns that RSS. With
    ``trim``, collect garbage and trim the heap (``malloc_trim``) first."""
    if trim:
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return proc_status("VmRSS")


def peak_growth(base: int) -> int:
    """VmHWM above ``base`` (an RSS from :func:`reset_peak`), at least 0."""
    return max(0, proc_status("VmHWM") - base)


def folder_bytes(root: str, follow_symlinks: bool = False,
                 seen: Optional[Set[int]] = None) -> int:
    """Bytes of disk (allocated blocks) that the files under ``root`` hold, each inode once.
    ``seen``, if given, collects the inodes counted (and skips those already in it)."""
    seen = set() if seen is None else seen
    total = 0
    for d, _, files in os.walk(root):
        for n in files:
            try:
                st = os.stat(os.path.join(d, n), follow_symlinks=follow_symlinks)
            except OSError:
                continue
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_blocks * 512
    return total


def probe_disk(d: str, nbytes: int) -> Tuple[float, float]:
    """Sequential O_DIRECT write (then fdatasync) and read of ``nbytes`` in 64 MiB requests,
    through a file in ``d``: (write GB/s, read GB/s)."""
    path = os.path.join(d, "probe.bin")
    chunk = 64 << 20
    buf = mmap.mmap(-1, chunk)
    buf.write(os.urandom(1 << 20) * (chunk >> 20))
    mv = memoryview(buf)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        t = time.perf_counter()
        for off in range(0, nbytes, chunk):
            os.pwrite(fd, mv, off)
        os.fdatasync(fd)
        w = nbytes / (time.perf_counter() - t) / 1e9
        t = time.perf_counter()
        for off in range(0, nbytes, chunk):
            os.preadv(fd, [mv], off)
        r = nbytes / (time.perf_counter() - t) / 1e9
    finally:
        os.close(fd)
        os.unlink(path)
        mv.release()
        buf.close()
    return w, r


def run_forked_child(fn: Callable[[], None]) -> NoReturn:
    """In a child process just forked (``os.fork()``): run ``fn`` and end the process as an
    interpreter ends a script: status 0, ``SystemExit``'s code (its message on stderr, 1), or
    1 with the traceback on stderr; the standard streams flushed, and nothing of the parent's
    (atexit handlers, finalizers) run again (``os._exit``)."""
    code = 1
    try:
        fn()
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)

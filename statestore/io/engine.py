"""Asynchronous I/O engines behind one interface.

Order of calls on an :class:`IOEngine`:

0) ``make_engine(name, ...)`` builds one (``"auto"`` probes what works here);
1) ``read(file, buffer, offset)`` / ``write(file, buffer, offset)`` any number of times, from any
   thread; each returns an :class:`IOFuture` whose result is the number of bytes transferred, or
   whose exception is a :class:`~statestore.errors.StateStoreIOError` (an ``OSError`` with
   ``errno``) naming the file, the offset and the cause. The buffer must stay untouched until the
   future is done; the engine keeps a reference to it until then;
2) ``close()``: waits for every request, then releases the engine. Also a context manager.

Engines: ``io_uring`` (liburing), ``libaio`` (Linux native AIO) and ``threads`` (a pool of
pread/pwrite workers), all in ``statestore._C_io``; ``pythreads``, a pure-Python pool that
stands in for ``threads`` when the extension is not built. ``tensornvme`` (when that package is
installed) is probed and listed here too, but it is a *keyed* engine, not an ``IOEngine``: it
cannot write at a file's offsets (see :mod:`statestore.io._tensornvme`), so
:func:`make_engine` refuses it; the store made for it is
:class:`~statestore.backends.tensornvme.TensorNVMeStore`.

Large requests are split into ``block_size`` blocks with at most ``queue_depth`` in flight;
short transfers are retried, and a read past the end of the file fails with ``ENODATA``.

Error injection, for tests only: ``engine._inject_fault_for_testing(...)`` (native engines)
makes later block completions fail with an errno or come back short. Nothing else arms it.
"""
from __future__ import annotations

import abc
import atexit
import errno as _errno
import os
import tempfile
import threading
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from statestore._trace import span
from statestore.errors import StateStoreClosedError, StateStoreIOError, StateStoreValueError

from ._native import native, native_error
from .buffers import buffer_address, byte_view
from .requests import IOFuture, Op
from .files import DIRECT_ALIGNMENT, IOFile

__all__ = [
    "IOEngine",
    "IOFuture",
    "NativeEngine",
    "PyThreadsEngine",
    "ENGINE_NAMES",
    "available_engines",
    "make_engine",
    "probe_engine",
]

ENGINE_NAMES = ("io_uring", "libaio", "threads", "tensornvme")
_AUTO_ORDER = ("io_uring", "libaio", "threads")
DEFAULT_QUEUE_DEPTH = 32
DEFAULT_BLOCK_SIZE = 1 << 20
DEFAULT_THREADS = 8


class IOEngine(abc.ABC):
    """Reads into / writes from host buffers at file offsets, asynchronously."""

    name: str = "?"
    #: True when writes land at (file, offset) as asked. NVMeStore reads slices of its named
    #: files and hard-links them into checkpoints: it refuses an engine where this is False.
    writes_in_place: bool = True

    def __init__(self) -> None:
        self._closed = False

    # -- primitives ----------------------------------------------------------------------------
    @abc.abstractmethod
    def _submit(self, op: Op, file: IOFile, ptr: int, nbytes: int, offset: int, keep: Any,
                sync: bool) -> IOFuture:
        """Submits one validated request."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Waits for every request and releases the engine."""

    def stats(self) -> dict:
        return {}

    # -- derived -------------------------------------------------------------------------------
    def read(self, file: IOFile, buffer: Any, offset: int, nbytes: int | None = None) -> IOFuture:
        """Reads ``nbytes`` (default: the buffer's size) at ``offset`` into ``buffer``."""
        return self._request(Op.READ, file, buffer, offset, nbytes, False)

    def write(self, file: IOFile, buffer: Any, offset: int, nbytes: int | None = None, *,
              sync: bool = False) -> IOFuture:
        """Writes ``nbytes`` (default: the buffer's size) of ``buffer`` at ``offset``;
        ``sync=True`` also ``fdatasync``\\ s the file before the future completes."""
        return self._request(Op.WRITE, file, buffer, offset, nbytes, sync)

    def _request(self, op, file, buffer, offset, nbytes, sync) -> IOFuture:
        if self._closed:
            raise StateStoreClosedError(f"I/O engine {self.name} is closed")
        if not isinstance(file, IOFile):
            raise StateStoreValueError(f"file must be an IOFile, got {type(file).__name__}")
        if file.closed:
            raise StateStoreIOError(_errno.EBADF, f"'{file.path}' is closed", file.path)
        ptr, size, keep = buffer_address(buffer)
        if nbytes is None:
            nbytes = size
        if not isinstance(nbytes, int) or nbytes < 0 or nbytes > size:
            raise StateStoreValueError(f"nbytes must be an int in [0, {size}] (the buffer's size), "
                                       f"got {nbytes!r}")
        if not isinstance(offset, int) or offset < 0:
            raise StateStoreValueError(f"offset must be a non-negative int, got {offset!r}")
        if file.direct:
            a = DIRECT_ALIGNMENT
            for what, v in (("buffer address", ptr), ("offset", offset), ("nbytes", nbytes)):
                if v % a:
                    raise StateStoreValueError(
                        f"{what} {v} is not a multiple of {a}, which direct I/O on "
                        f"'{file.path}' requires (use statestore.io.alloc_buffer and pad sizes)")
            if op == Op.WRITE and nbytes and self.writes_in_place:
                file.ensure_allocated(offset + nbytes)
        return self._submit(op, file, ptr, nbytes, offset, keep, sync)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "IOEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


def _make_error(err: int, message: str, path: str) -> StateStoreIOError:
    return StateStoreIOError(err, message, path)


_live_engines: "weakref.WeakSet[IOEngine]" = weakref.WeakSet()


@atexit.register
def _close_live_engines() -> None:
    # At interpreter exit, finish every request and stop the reaper threads while Python can
    # still run them: a daemon thread left waiting inside the extension would be torn down
    # mid-call when the interpreter finalizes.
    for eng in list(_live_engines):
        try:
            eng.close()
        except Exception:  # noqa: BLE001 - exiting; nothing to report to
            pass


def _reap(q, lock: threading.Lock, pending: dict) -> None:
    """The reaper thread of a :class:`NativeEngine`: completes the futures of finished
    requests until the queue is closed. It holds no reference to the engine."""
    while True:
        done = q.wait(1, 1024, 100)
        if not done:
            if q.closed:
                return
            continue
        with span("statestore::io_complete"):       # a profiler's trace of this thread
            for rid, nbytes, err, msg in done:
                with lock:
                    fut, _keep, path = pending.pop(rid, (None, None, None))
                if fut is None:
                    continue
                if err == 0:
                    fut.set_result(nbytes)
                else:
                    fut.set_exception(_make_error(err, msg, path))
        del done, fut, _keep


def _in_span(name: str, fn) -> None:
    with span(name):
        fn()


def _close_queue(q, reaper_box: list) -> None:
    """Close a native queue (waiting for its requests) and stop its reaper thread: at
    ``close()``, or when the engine was dropped without it."""
    q.close()
    for t in reaper_box:
        if t is not threading.current_thread():
            t.join()


class NativeEngine(IOEngine):
    """An engine of ``statestore._C_io``: ``io_uring``, ``libaio`` or ``threads``."""

    def __init__(self, name: str, *, queue_depth: int = DEFAULT_QUEUE_DEPTH,
                 block_size: int = DEFAULT_BLOCK_SIZE, threads: int = DEFAULT_THREADS) -> None:
        super().__init__()
        if native is None:
            raise StateStoreIOError(_errno.ENOSYS, f"engine {name!r} unavailable: {native_error}")
        self.name = name
        self.queue_depth = queue_depth
        self.block_size = block_size
        try:
            self._q = native.Queue(name, queue_depth, block_size, threads)
        except ValueError as e:  # std::invalid_argument: names the argument
            raise StateStoreValueError(str(e)) from e
        except OSError as e:  # std::system_error from the kernel (seccomp, limits)
            raise StateStoreIOError(e.errno, f"engine {name!r} cannot start here: {e}") from e
        except RuntimeError as e:  # not compiled in
            raise StateStoreIOError(_errno.ENOSYS, f"engine {name!r} unavailable: {e}") from e
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[IOFuture, Any, str]] = {}
        self._reaper: threading.Thread | None = None
        _live_engines.add(self)
        # An engine dropped without close() (its store or optimizer became unreachable)
        # still closes its queue: the reaper thread holds the queue, the lock and the
        # pending map, never the engine, so nothing keeps an unreachable engine alive, and
        # this finalizer references none of it either (no dependence on collection order).
        self._reaper_box: list = []
        self._finalizer = weakref.finalize(self, _close_queue, self._q, self._reaper_box)

    def _submit(self, op, file, ptr, nbytes, offset, keep, sync) -> IOFuture:
        flags = 0
        if file.drop_cache:
            flags |= native.DROP_CACHE
        if sync and op == Op.WRITE:
            flags |= native.DATA_SYNC
        fut = IOFuture()
        fut.set_running_or_notify_cancel()
        with self._lock:
            if self._closed:
                raise StateStoreClosedError(f"I/O engine {self.name} is closed")
            try:
                rid = self._q.submit(op, file.fd, ptr, nbytes, offset, file.path, flags)
            except ValueError as e:
                raise StateStoreValueError(str(e)) from e
            self._pending[rid] = (fut, keep, file.path)
            if self._reaper is None:
                self._reaper = threading.Thread(target=_reap,
                                                args=(self._q, self._lock, self._pending),
                                                name=f"statestore-io-{self.name}", daemon=True)
                self._reaper_box.append(self._reaper)
                self._reaper.start()
        return fut

    def _close(self) -> None:
        self._finalizer()    # waits for every request (GIL released), then stops the reaper

    def stats(self) -> dict:
        s = dict(self._q.stats())
        s.update(engine=self.name, queue_depth=self.queue_depth, block_size=self.block_size)
        return s

    def _inject_fault_for_testing(self, *, op: str = "any", skip: int = 0, count: int = 1,
                                  kind: str = "error", err: int = _errno.EIO) -> None:
        """TESTS ONLY. After ``skip`` matching block completions, the next ``count`` fail with
        ``err`` (``kind="error"``) or transfer half their bytes (``kind="short"``, which the
        engine must retry transparently). ``op``: ``"read"``, ``"write"`` or ``"any"``."""
        ops = {"any": -1, "read": Op.READ, "write": Op.WRITE}
        kinds = {"error": 0, "short": 1}
        if op not in ops:
            raise StateStoreValueError(f"op must be one of {sorted(ops)}, got {op!r}")
        if kind not in kinds:
            raise StateStoreValueError(f"kind must be one of {sorted(kinds)}, got {kind!r}")
        self._q._inject_fault_for_testing(ops[op], skip, count, kinds[kind], err)

    def _clear_faults_for_testing(self) -> None:
        self._q._clear_faults_for_testing()


class PyThreadsEngine(IOEngine):
    """Pure-Python stand-in for the ``threads`` engine (``os.preadv``/``os.pwritev`` release the
    GIL). Used only when ``statestore._C_io`` is not built."""

    name = "pythreads"

    def __init__(self, *, queue_depth: int = DEFAULT_QUEUE_DEPTH,
                 block_size: int = DEFAULT_BLOCK_SIZE, threads: int = DEFAULT_THREADS) -> None:
        super().__init__()
        if block_size < DIRECT_ALIGNMENT or block_size % DIRECT_ALIGNMENT:
            raise StateStoreValueError(f"block_size must be a multiple of 4096, got {block_size}")
        self.block_size = block_size
        self.queue_depth = queue_depth
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads),
                                        thread_name_prefix="statestore-pyio")
        self._stats = {"requests": 0, "bytes_read": 0, "bytes_written": 0}

    def _submit(self, op, file, ptr, nbytes, offset, keep, sync) -> IOFuture:
        fut = IOFuture()
        fut.set_running_or_notify_cancel()
        self._stats["requests"] += 1

        def run():
            try:
                mv = byte_view(keep, ptr, nbytes)
                done = 0
                while done < nbytes:
                    n = min(self.block_size, nbytes - done)
                    chunk = mv[done:done + n]
                    if op == Op.READ:
                        r = os.preadv(file.fd, [chunk], offset + done)
                        if r == 0:
                            raise StateStoreIOError(
                                _errno.ENODATA, f"short read of '{file.path}': wanted {nbytes} bytes "
                                f"at offset {offset}, the file ends at offset {offset + done} "
                                "(end of file)", file.path)
                    else:
                        r = os.pwritev(file.fd, [chunk], offset + done)
                    done += r
                if op == Op.WRITE and sync:
                    os.fdatasync(file.fd)
                if file.drop_cache and nbytes:
                    if op == Op.WRITE:
                        os.fdatasync(file.fd)
                    os.posix_fadvise(file.fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
                self._stats["bytes_read" if op == Op.READ else "bytes_written"] += nbytes
                fut.set_result(nbytes)
            except StateStoreIOError as e:
                fut.set_exception(e)
            except OSError as e:
                what = "read" if op == Op.READ else "write"
                fut.set_exception(StateStoreIOError(
                    e.errno, f"{what} of {nbytes} bytes at offset {offset} in '{file.path}' failed: "
                    f"{e.strerror}", file.path))

        self._pool.submit(_in_span, "statestore::io_read" if op == Op.READ
                          else "statestore::io_write", run)
        return fut

    def _close(self) -> None:
        self._pool.shutdown(wait=True)

    def stats(self) -> dict:
        return dict(self._stats, engine=self.name, queue_depth=self.queue_depth,
                    block_size=self.block_size)


# --- registry and probing ---------------------------------------------------------------------
_probe_lock = threading.Lock()
_probe_cache: dict[str, str | None] = {}   # name -> None (works) or the reason it does not


def _tensornvme_available() -> str | None:
    try:
        from . import _tensornvme
        return _tensornvme.unavailable_reason()
    except ImportError as e:
        return str(e)


def probe_engine(name: str) -> str | None:
    """``None`` when engine ``name`` works here (a real 4 KiB direct write and read round trip
    in the temporary directory), else the reason it does not. Cached per process."""
    if name not in ENGINE_NAMES:
        raise StateStoreValueError(f"engine must be one of {ENGINE_NAMES + ('auto',)}, got {name!r}")
    with _probe_lock:
        if name in _probe_cache:
            return _probe_cache[name]
        if name == "tensornvme":
            reason = _tensornvme_available()
        elif native is None:
            reason = native_error
        else:
            reason = _round_trip(name)
        _probe_cache[name] = reason
        return reason


def _round_trip(name: str) -> str | None:
    from .buffers import alloc_buffer

    try:
        with tempfile.TemporaryDirectory(prefix="statestore-probe-") as d:
            eng = NativeEngine(name, queue_depth=2, block_size=4096, threads=1)
            try:
                with IOFile(os.path.join(d, "probe"), create=True) as f:
                    # Unlinked at once: a process killed mid-probe leaves nothing behind.
                    os.unlink(f.path)
                    src = alloc_buffer(8192, pinned=False)
                    dst = alloc_buffer(8192, pinned=False)
                    src.tensor.copy_(torch.arange(8192, dtype=torch.int64).to(torch.uint8))
                    eng.write(f, src, 0).result(timeout=10)
                    eng.read(f, dst, 0).result(timeout=10)
                    if not torch.equal(src.tensor, dst.tensor):
                        return "round trip returned different bytes"
            finally:
                eng.close()
    except Exception as e:  # noqa: BLE001 - any failure means "not usable here", with the reason
        return f"{type(e).__name__}: {e}"
    return None


def available_engines() -> list[str]:
    """Engines that work here, best first (the order ``"auto"`` tries)."""
    out = [n for n in _AUTO_ORDER if probe_engine(n) is None]
    if not out:
        out.append("pythreads")
    if probe_engine("tensornvme") is None:
        out.append("tensornvme")
    return out


def make_engine(name: str = "auto", *, queue_depth: int = DEFAULT_QUEUE_DEPTH,
                block_size: int = DEFAULT_BLOCK_SIZE, threads: int = DEFAULT_THREADS,
                directory: str | None = None) -> IOEngine:
    """Builds engine ``name``: ``"auto"`` (the first of io_uring, libaio, threads that works
    here, overridable with the environment variable ``STATESTORE_IO_ENGINE``), ``"io_uring"``,
    ``"libaio"`` or ``"threads"``. Raises :class:`StateStoreIOError` with the reason when the
    engine cannot work, and :class:`StateStoreValueError` for ``"tensornvme"``, a keyed engine
    that cannot serve file offsets (``TensorNVMeStore`` is the store built on it). ``directory`` is accepted for compatibility and unused."""
    if not isinstance(name, str):
        raise StateStoreValueError(f"engine must be a str, got {type(name).__name__}")
    for arg, v in (("queue_depth", queue_depth), ("block_size", block_size), ("threads", threads)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise StateStoreValueError(f"{arg} must be a positive int, got {v!r}")
    if name == "auto":
        name = os.environ.get("STATESTORE_IO_ENGINE", "auto")
        if name == "auto":
            for cand in _AUTO_ORDER:
                if probe_engine(cand) is None:
                    name = cand
                    break
            else:
                warnings.warn(f"statestore: no native I/O engine works here ({native_error or 'probes failed'}); "
                              "using the pure-Python thread pool", RuntimeWarning, stacklevel=2)
                return PyThreadsEngine(queue_depth=queue_depth, block_size=block_size, threads=threads)
    if name == "pythreads":
        return PyThreadsEngine(queue_depth=queue_depth, block_size=block_size, threads=threads)
    if name not in ENGINE_NAMES:
        raise StateStoreValueError(f"engine must be one of {('auto',) + ENGINE_NAMES}, got {name!r}")
    if name == "tensornvme":
        raise StateStoreValueError(
            "engine 'tensornvme' is keyed: TensorNVMe stores bytes under keys at offsets of its "
            "own choosing and cannot read or write a file's offsets, so it is no IOEngine; "
            "statestore.TensorNVMeStore(dir) is the store built on it, and "
            "statestore.io.TensorNVMeEngine is its keyed interface")
    if name == "threads" and native is None:
        warnings.warn(f"statestore: {native_error}; engine 'threads' uses the pure-Python pool",
                      RuntimeWarning, stacklevel=2)
        return PyThreadsEngine(queue_depth=queue_depth, block_size=block_size, threads=threads)
    return NativeEngine(name, queue_depth=queue_depth, block_size=block_size, threads=threads)

"""``TensorNVMeEngine``: TensorNVMe's ``Offloader`` behind a *keyed* interface that contains
its defects.

TensorNVMe is never a dependency: this module imports it lazily and reports why it cannot be
used. Facts about tensornvme 0.1.0 (read from its source release) that shape this adapter:

* **Keyed, not addressed.** Its Python binding exposes only ``Offloader(path, n_entries,
  backend)``: ``async_write(tensor, key)`` stores a tensor's bytes in ONE file of its own, at
  an offset its space manager picks and never exposes; ``async_read(tensor, key)`` reads them
  back into a tensor of exactly that size. The lower-level asynchronous I/O (reads and writes
  at a descriptor and offset) is not bound. So this engine cannot write into statestore's named
  files: its interface is ``write(key, buffer)`` / ``read(key, buffer)``, not the
  ``(file, buffer, offset)`` of :class:`~statestore.io.IOEngine`, and ``writes_in_place`` is
  False. :class:`~statestore.NVMeStore` refuses it; :class:`~statestore.backends.tensornvme.
  TensorNVMeStore` is the store built on it.
* **Reading a key frees it.** A read erases the key and returns its space; writing a key that
  exists allocates new space and leaks the old. The adapter makes reads non-destructive (each
  verified read is written back under its key before its future completes) and frees a key's
  old bytes (by reading them into a scratch buffer) before writing it again or discarding it,
  so the file never grows past the live bytes plus what is in flight.
* **Unchecked results.** Neither read nor write results are checked: a failed or short
  transfer goes unreported. The adapter keeps an xxh3-64 of every block it writes and checks
  it on every read: a block that does not read back as written raises
  :class:`~statestore.errors.StateStoreIOError` (``EIO``) naming the block and the file,
  never wrong data. Writes are checked against the free space first (``ENOSPC`` named here,
  not lost in the page cache).
* **No ``O_DIRECT``, no ``fsync``.** I/O goes through the page cache. :meth:`flush` runs
  ``fdatasync`` on a descriptor of its file the adapter opens itself, and drops the file's
  pages from the cache (``posix_fadvise(DONTNEED)``), so data is durable and the next reads
  come from the disk; so does the worker each time ``cache_bytes`` were written since, which
  bounds how much of the file the page cache holds.
* **``sync_read_events`` waits for write events** (the binding maps it to
  ``sync_write_events``), so reads it should wait for may still be in flight when it returns:
  the adapter only ever waits with ``synchronize()``.
* **It transfers a tensor's whole storage** (``storage().nbytes()``, not the tensor's own
  bytes): the adapter hands it tensors whose storage is exactly the request's bytes.
* **In-flight limits.** Its libaio backend ignores ``io_submit`` failures (a request over
  ``n_entries`` never completes and ``synchronize()`` would wait forever): the adapter keeps
  at most ``queue_depth`` requests in flight.
* **Not thread-safe, and it holds the GIL** while it submits and waits: every call runs on
  one worker thread of the adapter.
"""
from __future__ import annotations

import atexit
import errno
import os
import queue
import threading
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
import xxhash

from statestore.errors import StateStoreClosedError, StateStoreIOError, StateStoreValueError

from .buffers import buffer_address, byte_view
from .requests import IOFuture

__all__ = ["TensorNVMeEngine", "unavailable_reason"]

#: Scratch RAM for freeing old bytes of keys being rewritten, per batch of requests.
_SCRATCH_BYTES = 8 << 20


def unavailable_reason() -> str | None:
    """``None`` when ``tensornvme`` imports and offers a backend, else why not."""
    try:
        from tensornvme._C import get_backends  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError or a broken build
        return (f"tensornvme is not installed ({type(e).__name__}: {e}); `make setup` builds it "
                "(scripts/install_tensornvme.sh)")
    try:
        backends = get_backends()
    except Exception as e:  # noqa: BLE001
        return f"tensornvme.get_backends() failed: {e}"
    if not backends:
        return "tensornvme was built without io_uring or libaio"
    return None


_live: "weakref.WeakSet[TensorNVMeEngine]" = weakref.WeakSet()


@atexit.register
def _close_live() -> None:
    for eng in list(_live):
        try:
            eng.close()
        except Exception:  # noqa: BLE001 - exiting
            pass


def _exact_tensor(keep: torch.Tensor, ptr: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` at ``ptr`` whose *storage* is exactly those bytes
    (tensornvme transfers ``storage().nbytes()``, whatever the tensor's own size)."""
    t = torch.from_numpy(byte_view(keep, ptr, nbytes))
    if t.untyped_storage().nbytes() != nbytes or t.data_ptr() != ptr:
        raise StateStoreValueError(f"internal: a tensor over {nbytes} bytes has a storage of "
                                   f"{t.untyped_storage().nbytes()} bytes")
    return t


def _digest(t: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(memoryview(t.numpy()))


class _Req:
    __slots__ = ("op", "key", "ptr", "nbytes", "keep", "fut", "tensor", "fault", "freed",
                 "digest")

    def __init__(self, op, key=None, ptr=0, nbytes=0, keep=None):
        self.op, self.key, self.ptr, self.nbytes, self.keep = op, key, ptr, nbytes, keep
        self.fut = IOFuture()
        self.fut.set_running_or_notify_cancel()
        self.tensor = None
        self.fault = None
        self.freed = False
        self.digest = 0


class TensorNVMeEngine:
    """Blocks of bytes kept under string keys in one TensorNVMe file.

    Args:
        path: the file TensorNVMe keeps (created; it must not exist; removed at :meth:`close`).
        queue_depth: most TensorNVMe requests in flight (its ``n_entries``).
        backend: ``"uring"`` or ``"aio"`` (default: ``uring`` where built).
        cache_bytes: after this many bytes written since the last :meth:`flush`, the file is
            written back and dropped from the page cache (its I/O is buffered), so the cache
            holds about that much of it at most (default 1 GiB).

    Calls (any thread; they run in order on one worker thread): :meth:`write` (replaces the
    key's bytes), :meth:`read` (non-destructive, verified), :meth:`discard`, :meth:`flush`,
    :meth:`reset`, :meth:`close`. Each returns an :class:`~statestore.io.IOFuture` whose
    result is the number of bytes transferred, or whose exception is a
    :class:`~statestore.errors.StateStoreIOError` naming the key, the file and the cause.
    A buffer must stay untouched until its future is done.
    """

    name = "tensornvme"
    #: Writes land where TensorNVMe chooses, keyed: never at a (file, offset) of ours.
    writes_in_place = False

    def __init__(self, path: str, *, queue_depth: int = 32, backend: Optional[str] = None,
                 cache_bytes: int = 1 << 30):
        reason = unavailable_reason()
        if reason is not None:
            raise StateStoreIOError(errno.ENOSYS, f"engine 'tensornvme' unavailable: {reason}")
        from tensornvme._C import get_backends

        if isinstance(queue_depth, bool) or not isinstance(queue_depth, int) or queue_depth < 2:
            raise StateStoreValueError(f"queue_depth must be an int >= 2, got {queue_depth!r}")
        if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes <= 0:
            raise StateStoreValueError(f"cache_bytes must be a positive int, got {cache_bytes!r}")
        backends = get_backends()
        if backend is None:
            backend = "uring" if "uring" in backends else sorted(backends)[0]
        if backend not in backends:
            raise StateStoreValueError(f"backend must be one of {sorted(backends)}, got {backend!r}")
        if os.path.exists(path):
            raise StateStoreValueError(f"TensorNVMe's file {path!r} exists already")
        self.path = path
        self.backend = backend
        self.queue_depth = queue_depth
        #: bytes written (writes and put-backs) after which the file is written back and
        #: dropped from the page cache (TensorNVMe has no O_DIRECT)
        self.cache_bytes = cache_bytes
        self._dirty = 0
        self._closed = False
        self._off = None            # TensorNVMe's Offloader: its file exists only while keys do
        self._fd = -1
        self._sums: Dict[str, Tuple[int, int]] = {}     # key -> (nbytes, xxh3-64) on disk
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self._faults: List[list] = []                   # [op, skip, count, kind, err]
        self._lock = threading.Lock()
        self._stats = {"requests": 0, "bytes_read": 0, "bytes_written": 0, "put_back": 0,
                       "freed": 0, "fsyncs": 0, "cache_drops": 0, "errors": 0,
                       "checksum_errors": 0}
        self._q: "queue.Queue[Optional[_Req]]" = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="statestore-tensornvme", daemon=True)
        self._worker.start()
        _live.add(self)

    def _open(self) -> None:
        from tensornvme._C import Offloader
        if self._off is not None:
            return
        try:
            self._off = Offloader(self.path, self.queue_depth, self.backend)
        except Exception as e:  # noqa: BLE001 - RuntimeError from its backend probe
            raise StateStoreIOError(errno.EIO, f"tensornvme cannot open '{self.path}' with "
                                    f"backend {self.backend!r}: {e}", self.path) from e
        try:
            # Our own descriptor of its file: fdatasync, the page cache, fstat.
            self._fd = os.open(self.path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            self._off = None
            raise StateStoreIOError(e.errno, f"cannot open TensorNVMe's file '{self.path}': "
                                    f"{e.strerror}", self.path) from e

    # ------------------------------------------------------------------ requests
    def _submit(self, req: _Req) -> IOFuture:
        if self._closed:
            raise StateStoreClosedError(f"I/O engine {self.name} is closed")
        self._q.put(req)
        return req.fut

    def _data_request(self, op: str, key: str, buffer: Any, nbytes: Optional[int]) -> IOFuture:
        if not isinstance(key, str) or not key:
            raise StateStoreValueError(f"key must be a non-empty str, got {key!r}")
        ptr, size, keep = buffer_address(buffer)
        if nbytes is None:
            nbytes = size
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 < nbytes <= size:
            raise StateStoreValueError(f"nbytes must be an int in [1, {size}] (the buffer's "
                                       f"size), got {nbytes!r}")
        return self._submit(_Req(op, key, ptr, nbytes, keep))

    def write(self, key: str, buffer: Any, nbytes: Optional[int] = None) -> IOFuture:
        """Store ``nbytes`` (default: the buffer's size) of ``buffer`` under ``key``, replacing
        (and freeing) what the key held."""
        return self._data_request("w", key, buffer, nbytes)

    def read(self, key: str, buffer: Any, nbytes: Optional[int] = None) -> IOFuture:
        """Read ``key``'s bytes into ``buffer`` (``nbytes`` must be what was written); checked
        against the checksum taken at the write; the key keeps its bytes."""
        return self._data_request("r", key, buffer, nbytes)

    def discard(self, key: str) -> IOFuture:
        """Free ``key``'s bytes (a no-op for an unknown key)."""
        return self._submit(_Req("d", key))

    def flush(self, drop_cache: bool = True) -> IOFuture:
        """After every earlier request: ``fdatasync`` the file (TensorNVMe never does) and,
        with ``drop_cache``, drop its pages from the page cache (it has no ``O_DIRECT``)."""
        return self._submit(_Req("f" if drop_cache else "s"))

    def reset(self) -> IOFuture:
        """Forget every key at once: TensorNVMe's file is removed (the next write creates
        a fresh one)."""
        return self._submit(_Req("x"))

    def __contains__(self, key: str) -> bool:
        return key in self._sums

    # ------------------------------------------------------------------ worker
    def _run(self) -> None:
        stop = False
        pending: List[_Req] = []
        while not stop:
            if not pending:
                item = self._q.get()
                if item is None:
                    break
                pending.append(item)
            while True:
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                pending.append(item)
            batch, pending = self._cut_batch(pending)
            try:
                self._run_batch(batch)
            except BaseException as e:  # noqa: BLE001 - never leave a future unresolved
                for r in batch:
                    if not r.fut.done():
                        r.fut.set_exception(self._error(errno.EIO, r, f"internal error: {e!r}"))
        for r in pending:
            if not r.fut.done():
                r.fut.set_exception(StateStoreClosedError(f"I/O engine {self.name} is closed"))

    def _cut_batch(self, pending: List[_Req]) -> Tuple[List[_Req], List[_Req]]:
        """The longest prefix of ``pending`` with each key once, at most ``queue_depth``
        TensorNVMe requests in flight and the scratch budget for freeing; a flush or reset
        runs alone."""
        if pending[0].op in "fsx":
            return pending[:1], pending[1:]
        keys, n, scratch, i = set(), 0, 0, 0
        for r in pending:
            if r.op in "fsx" or r.key in keys:
                break
            cost = 1
            old = self._sums.get(r.key)
            if r.op in "wd" and old is not None:
                cost += 1 if r.op == "w" else 0
                if i and scratch + old[0] > _SCRATCH_BYTES:
                    break
                scratch += old[0]
            if i and n + cost > self.queue_depth:
                break
            keys.add(r.key)
            n += cost
            i += 1
        return pending[:i], pending[i:]

    def _error(self, err: int, r: _Req, cause: str) -> StateStoreIOError:
        what = {"w": "write of", "r": "read of", "d": "discard of"}.get(r.op, "flush of")
        key = f" block {r.key!r} ({r.nbytes} bytes)" if r.key is not None else ""
        with self._lock:
            self._stats["errors"] += 1
        return StateStoreIOError(err, f"tensornvme {what}{key} in '{self.path}' failed: {cause}",
                                 self.path)

    def _take_fault(self, op: str) -> Optional[Tuple[str, int]]:
        with self._lock:
            for f in self._faults:
                fop, skip, count, kind, err = f
                if fop not in ("any", op) or count <= 0:
                    continue
                if skip > 0:
                    f[1] -= 1
                    return None
                f[2] -= 1
                return kind, err
        return None

    def _scratch_view(self, offset: int, nbytes: int) -> torch.Tensor:
        need = offset + nbytes
        if self._scratch.numel() < need:
            self._scratch = torch.empty(max(need, min(_SCRATCH_BYTES, 2 * need)), dtype=torch.uint8)
        return torch.from_numpy(self._scratch[offset:need].numpy())

    def _run_batch(self, batch: List[_Req]) -> None:
        op = batch[0].op
        if op in "fsx":
            self._control(batch[0])
            return
        if self._off is None and not self._open_for(batch):
            return
        off = self._off
        started, hold = self._start_batch(batch, off)   # hold: alive until synchronized
        # Its binding's sync_read_events() waits for *write* events: wait for everything.
        failed = self._synchronize(started)
        if failed:
            return
        put_back = self._complete(started, off)
        if put_back and self._synchronize(put_back):
            return
        for r in put_back:
            self._sums[r.key] = (r.nbytes, r.digest)
            self._count("bytes_read", r.nbytes, put_back=1)
            r.fut.set_result(r.nbytes)
        self._dirty += sum(r.nbytes for r in started if r.op == "w") + \
            sum(r.nbytes for r in put_back)
        if self._dirty >= self.cache_bytes:
            self._write_back()

    def _open_for(self, batch: List[_Req]) -> bool:
        """Open TensorNVMe for ``batch``; False when the batch is answered without it."""
        if all(r.op != "w" for r in batch):     # nothing was ever written: no key exists
            for r in batch:
                if r.op == "d":
                    r.fut.set_result(0)
                else:
                    r.fut.set_exception(self._error(errno.ENOENT, r, "no such key (never "
                                                    "written, or lost to an earlier failure)"))
            return False
        try:
            self._open()
        except StateStoreIOError as e:
            for r in batch:
                r.fut.set_exception(e)
            return False
        return True

    def _start_batch(self, batch: List[_Req], off) -> Tuple[List[_Req], List[torch.Tensor]]:
        """Submit each request; those refused are answered. Returns the started requests and
        the scratch views TensorNVMe reads into (kept until synchronized)."""
        started: List[_Req] = []
        hold: List[torch.Tensor] = []
        room: List[Any] = [0, None]         # scratch bytes used, free bytes on the filesystem
        for r in batch:
            try:
                if r.op == "r":
                    self._start_read(r, off)
                else:
                    self._start_change(r, off, hold, room)
                started.append(r)
            except StateStoreIOError as e:
                # No traceback: its frames would keep TensorNVMe's object alive past close().
                r.fut.set_exception(e.with_traceback(None))
            except Exception as e:  # noqa: BLE001 - tensornvme raises RuntimeError
                r.fut.set_exception(self._error(errno.EIO, r, str(e)))
        return started, hold

    def _start_read(self, r: _Req, off) -> None:
        old = self._sums.get(r.key)
        if old is None:
            raise self._error(errno.ENOENT, r, "no such key (never written, or lost "
                              "to an earlier failure)")
        if old[0] != r.nbytes:
            raise self._error(errno.EINVAL, r, f"the key holds {old[0]} bytes")
        r.fault = self._take_fault("read")
        if r.fault is not None and r.fault[0] == "error":
            # As a request refused before it reached the disk: the bytes stay.
            raise self._error(r.fault[1], r, os.strerror(r.fault[1]))
        r.tensor = _exact_tensor(r.keep, r.ptr, r.nbytes)
        r.digest = old[1]
        off.async_read(r.tensor, r.key, None)
        self._sums.pop(r.key)       # TensorNVMe forgot it; put back once verified

    def _start_change(self, r: _Req, off, hold: List[torch.Tensor], room: List[Any]) -> None:
        """Submit a write or a discard: the key's old bytes are freed first."""
        old = self._sums.get(r.key)
        if r.op == "w":
            r.fault = self._take_fault("write")
            if r.fault is not None and r.fault[0] == "error":
                raise self._error(r.fault[1], r, os.strerror(r.fault[1]))
            if room[1] is None:
                st = os.fstatvfs(self._fd)
                room[1] = st.f_bavail * st.f_frsize
            if r.nbytes > room[1]:
                raise self._error(errno.ENOSPC, r, f"{os.strerror(errno.ENOSPC)} "
                                  f"({room[1]} bytes free on its filesystem)")
            room[1] -= r.nbytes
        if old is not None:             # free the old bytes first (a rewrite leaks them)
            tmp = self._scratch_view(room[0], old[0])
            room[0] += old[0]
            hold.append(tmp)
            off.async_read(tmp, r.key, None)
            self._sums.pop(r.key)
            r.freed = True
        if r.op == "d":
            return
        r.tensor = _exact_tensor(r.keep, r.ptr, r.nbytes)
        r.digest = _digest(r.tensor)
        src = r.tensor
        if r.fault is not None:        # "short": half the bytes land, unreported
            src = r.tensor.clone()
            src[r.nbytes // 2:] = 0
            r.keep = (r.keep, src)
        off.async_write(src, r.key, None)

    def _complete(self, started: List[_Req], off) -> List[_Req]:
        """Answer the synchronized writes and discards, verify the reads; returns the reads
        whose bytes were written back under their key (reading freed it)."""
        put_back: List[_Req] = []
        for r in started:
            if r.op == "w":
                self._sums[r.key] = (r.nbytes, r.digest)
                self._count("bytes_written", r.nbytes, freed=r.freed)
                r.fut.set_result(r.nbytes)
            elif r.op == "d":
                self._count("freed", int(r.freed))
                r.fut.set_result(0)
            else:
                if r.fault is not None:         # "short": half the bytes arrive, unreported
                    r.tensor[r.nbytes // 2:] = 0
                if _digest(r.tensor) != r.digest:
                    with self._lock:
                        self._stats["checksum_errors"] += 1
                    r.fut.set_exception(self._error(
                        errno.EIO, r, "the bytes read back differ from those written (xxh3-64 "
                        "mismatch): a short or failed transfer that tensornvme does not report; "
                        "the block is lost"))
                    continue
                # Reading freed the key: write the same bytes back under it.
                try:
                    off.async_write(r.tensor, r.key, None)
                    put_back.append(r)
                except Exception as e:  # noqa: BLE001
                    r.fut.set_exception(self._error(errno.EIO, r, f"putting the block back "
                                                    f"failed: {e}; the block is lost"))
        return put_back

    def _write_back(self) -> None:
        """Bound the page cache's share of the file: write it back and drop it (an error
        here surfaces at the next flush, whose fdatasync reports it)."""
        self._dirty = 0
        try:
            os.fdatasync(self._fd)
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            return
        with self._lock:
            self._stats["cache_drops"] += 1

    def _count(self, what: str, n: int, freed: bool = False, put_back: int = 0) -> None:
        with self._lock:
            self._stats["requests"] += 1
            self._stats[what] += n
            self._stats["freed"] += int(freed)
            self._stats["put_back"] += put_back

    def _synchronize(self, started: List[_Req]) -> bool:
        """``synchronize()``; on failure every started request fails (True)."""
        try:
            self._off.synchronize()
        except Exception as e:  # noqa: BLE001
            for r in started:
                self._sums.pop(r.key, None)
                if not r.fut.done():
                    r.fut.set_exception(self._error(errno.EIO, r, f"synchronize failed: {e}"))
            return True
        return False

    def _control(self, r: _Req) -> None:
        try:
            if self._off is None:
                pass                        # no file: nothing to sync, drop or reset
            elif r.op == "x":
                self._release()
            else:
                os.fdatasync(self._fd)
                with self._lock:
                    self._stats["fsyncs"] += 1
                if r.op == "f":
                    os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    self._dirty = 0
            r.fut.set_result(0)
        except StateStoreIOError as e:
            r.fut.set_exception(e)
        except OSError as e:
            r.fut.set_exception(self._error(e.errno or errno.EIO, r, e.strerror or str(e)))

    # ------------------------------------------------------------------ lifetime, stats
    def close(self) -> None:
        """Finish every request, then release TensorNVMe (which removes its file)."""
        if self._closed:
            return
        self._closed = True
        self._q.put(None)
        self._worker.join()
        self._release()

    def _release(self) -> None:
        """Drop TensorNVMe's Offloader and its file (every key is forgotten)."""
        off, self._off = self._off, None
        if off is not None:
            off.synchronize()
            del off                     # its destructor removes the file
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            os.unlink(self.path)        # in case something kept its Offloader alive
        except FileNotFoundError:
            pass
        self._sums.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "TensorNVMeEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def fileno(self) -> int:
        """Our own descriptor of TensorNVMe's file (for ``fstat``); -1 while it has none."""
        return self._fd

    def stats(self) -> dict:
        with self._lock:
            s = dict(self._stats)
        s.update(engine=self.name, backend=self.backend, queue_depth=self.queue_depth,
                 keys=len(self._sums), key_bytes=sum(n for n, _ in self._sums.values()))
        return s

    def __repr__(self) -> str:
        return f"<TensorNVMeEngine {self.backend} {self.path}>"

    # ------------------------------------------------------------------ tests only
    def _inject_fault_for_testing(self, *, op: str = "any", skip: int = 0, count: int = 1,
                                  kind: str = "error", err: int = errno.EIO) -> None:
        """TESTS ONLY. After ``skip`` matching block requests, the next ``count`` fail:
        ``kind="error"``: refused with ``err`` before reaching TensorNVMe (the key keeps its
        bytes); ``kind="short"``: only half the bytes are transferred and TensorNVMe reports
        nothing, which the checksum catches (a read raises EIO at once; a write at the
        block's next read). ``op``: ``"read"``, ``"write"`` or ``"any"``."""
        if op not in ("any", "read", "write"):
            raise StateStoreValueError(f"op must be one of ['any', 'read', 'write'], got {op!r}")
        if kind not in ("error", "short"):
            raise StateStoreValueError(f"kind must be one of ['error', 'short'], got {kind!r}")
        with self._lock:
            self._faults.append([op, int(skip), int(count), kind, int(err)])

    def _clear_faults_for_testing(self) -> None:
        with self._lock:
            self._faults.clear()

"""Adapter exposing TensorNVMe's ``Offloader`` as an :class:`~statestore.io.IOEngine`.

TensorNVMe is never a dependency: this module imports it lazily and reports why it cannot be
used. Its model differs from ours: it keeps every tensor in ONE anonymous file of its own,
keyed by a string, at offsets its space manager chooses. The adapter therefore keys each request
by ``"<path>@<offset>"`` and is a *keyed* engine (``writes_in_place = False``): bytes written
through it can be read back only through the same engine instance, at the same (file, offset,
size); the named file itself is not written.

All TensorNVMe calls run on one worker thread (the library is not thread-safe): the worker takes
every queued request, submits them asynchronously, waits with ``synchronize()`` (its
``sync_read_events`` binding calls the write-events function, so it is never used) and resolves
the futures. TensorNVMe does not check read/write results; a missing key is checked here.
"""
from __future__ import annotations

import errno
import os
import queue
import tempfile
import threading
import uuid

import torch

from statestore.errors import StateStoreIOError, StateStoreValueError

from .engine import IOEngine, IOFuture, _as_bytes

__all__ = ["TensorNVMeEngine", "unavailable_reason"]


def unavailable_reason() -> str | None:
    """``None`` when ``tensornvme`` imports and offers a backend, else why not."""
    try:
        from tensornvme._C import get_backends  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError or a broken build
        return f"tensornvme is not installed ({type(e).__name__}: {e}); see docs/nvme.md"
    try:
        backends = get_backends()
    except Exception as e:  # noqa: BLE001
        return f"tensornvme.get_backends() failed: {e}"
    if not backends:
        return "tensornvme was built without io_uring or libaio"
    return None


class TensorNVMeEngine(IOEngine):
    name = "tensornvme"
    writes_in_place = False

    def __init__(self, *, directory: str | None = None, queue_depth: int = 32,
                 backend: str | None = None) -> None:
        super().__init__()
        reason = unavailable_reason()
        if reason is not None:
            raise StateStoreIOError(errno.ENOSYS, f"engine 'tensornvme' unavailable: {reason}")
        from tensornvme._C import Offloader, get_backends

        backends = get_backends()
        if backend is None:
            backend = "uring" if "uring" in backends else sorted(backends)[0]
        if backend not in backends:
            raise StateStoreValueError(f"backend must be one of {sorted(backends)}, got {backend!r}")
        directory = directory or tempfile.gettempdir()
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"tensornvme-{uuid.uuid4().hex}.bin")
        self.backend = backend
        self._off = Offloader(self.path, queue_depth, backend)
        self._sizes: dict[str, int] = {}
        self._q: queue.Queue = queue.Queue()
        self._stats = {"requests": 0, "bytes_read": 0, "bytes_written": 0}
        self._worker = threading.Thread(target=self._run, name="statestore-tensornvme", daemon=True)
        self._worker.start()

    def _submit(self, op, file, ptr, nbytes, offset, keep, sync) -> IOFuture:
        fut = IOFuture()
        fut.set_running_or_notify_cancel()
        self._q.put((op, file, ptr, nbytes, offset, keep, fut))
        return fut

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            batch = [item]
            while True:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._q.put(None)
                    break
                batch.append(nxt)
            ok = []
            for op, file, ptr, nbytes, offset, keep, fut in batch:
                path = file.path
                key = f"{path}@{offset}"
                t = torch.from_numpy(_as_bytes(keep, ptr, nbytes))
                try:
                    if op == 1:
                        self._off.async_write(t, key, None)
                        self._sizes[key] = nbytes
                    elif key not in self._sizes:
                        # Never written through this engine: the bytes are the named file's.
                        self._read_file(file, t, offset)
                        fut.set_result(nbytes)
                        continue
                    else:
                        if self._sizes[key] != nbytes:
                            raise StateStoreIOError(
                                errno.EINVAL, f"read of {nbytes} bytes at offset {offset} in "
                                f"'{path}': tensornvme holds {self._sizes[key]} bytes there "
                                "(a keyed engine reads back exactly what was written)", path)
                        self._off.async_read(t, key, None)
                    ok.append((op, nbytes, fut, t))
                except StateStoreIOError as e:
                    fut.set_exception(e)
                except Exception as e:  # noqa: BLE001 - tensornvme raises RuntimeError
                    fut.set_exception(StateStoreIOError(errno.EIO, f"tensornvme failed on '{path}' "
                                                        f"at offset {offset}: {e}", path))
            try:
                self._off.synchronize()
            except Exception as e:  # noqa: BLE001
                for _, _, fut, _ in ok:
                    fut.set_exception(StateStoreIOError(errno.EIO, f"tensornvme synchronize failed: {e}",
                                                        self.path))
                continue
            for op, nbytes, fut, _t in ok:
                self._stats["requests"] += 1
                self._stats["bytes_read" if op == 0 else "bytes_written"] += nbytes
                fut.set_result(nbytes)

    @staticmethod
    def _read_file(file, t: torch.Tensor, offset: int) -> None:
        mv = t.numpy()
        done = 0
        try:
            while done < len(mv):
                n = os.preadv(file.fd, [mv[done:]], offset + done)
                if n == 0:
                    raise StateStoreIOError(errno.ENODATA, f"short read of '{file.path}' at offset "
                                            f"{offset + done} (end of file)", file.path)
                done += n
        except OSError as e:
            if isinstance(e, StateStoreIOError):
                raise
            raise StateStoreIOError(e.errno, f"read of '{file.path}' at offset {offset} failed: "
                                    f"{e.strerror}", file.path) from e

    def _close(self) -> None:
        self._q.put(None)
        self._worker.join()
        del self._off
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def stats(self) -> dict:
        return dict(self._stats, engine=self.name, backend=self.backend)

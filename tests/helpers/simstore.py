"""``SimDiskStore``: a TEST DOUBLE of a non-resident (disk-like) store.

It is not part of statestore and never ships: it exists so that the pipeline's non-resident
path (ring buffer, read-ahead, write-behind, pending-write ordering, background errors, the RAM
budget) is exercised on any machine, without NVMe, O_DIRECT or io_uring.

Each state's bytes live in a private ``bytearray`` the pipeline cannot address (so
``resident = False``: every access goes through ``_submit_read`` / ``_submit_write``). Both
complete on a small ``ThreadPoolExecutor``, optionally after a delay (``read_delay`` /
``write_delay``, seconds), so completions arrive out of order and late, as real asynchronous
I/O does. Failures are injected with :meth:`fail_writes` / :meth:`fail_reads`.

It also records what the pipeline asked of it, for tests to check:
``io_log`` (``("read"|"write", key, start, stop)`` in submission order), ``buffer_ranges``
(the host buffers the ring was carved from) and ``out_of_budget`` (submissions whose tensor
was not inside one of those buffers: must stay empty).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from statestore import StateKey, StateStore
from statestore._types import Slice, StateSpec

__all__ = ["SimDiskStore"]


class SimDiskStore(StateStore):
    """A non-resident store keeping each state in a ``bytearray``; I/O on worker threads.

    Args:
        budget_bytes: the pipeline's RAM budget (as every store).
        read_delay, write_delay: seconds each read / write sleeps on its worker thread.
        workers: worker threads (>= 2 so completions can be reordered).
    """

    resident = False
    alignment = 4096

    def __init__(self, *, budget_bytes: Optional[int] = None, read_delay: float = 0.0,
                 write_delay: float = 0.0, workers: int = 3):
        super().__init__(budget_bytes=budget_bytes)
        self.read_delay = read_delay
        self.write_delay = write_delay
        self._data: Dict[StateKey, bytearray] = {}
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="simdisk")
        self._lock = threading.Lock()
        self._fail_write: Optional[Callable[[Slice], bool]] = None
        self._fail_read: Optional[Callable[[Slice], bool]] = None
        self.io_log: List[Tuple[str, StateKey, int, int]] = []
        self.buffer_ranges: List[Tuple[int, int]] = []
        self.out_of_budget: List[Tuple[str, Slice]] = []
        self.flushes = 0
        self.closed_backend = False

    # -- failure injection -------------------------------------------------------------------
    def fail_writes(self, pred: Optional[Callable[[Slice], bool]] = None, *, key=None,
                    once: bool = True) -> None:
        """Make writes fail with ``OSError(EIO)``: those of ``key`` (a StateKey), or those
        matching ``pred``; ``once``: only the first matching write fails."""
        self._fail_write = self._make_pred(pred, key, once)

    def fail_reads(self, pred: Optional[Callable[[Slice], bool]] = None, *, key=None,
                   once: bool = True) -> None:
        """As :meth:`fail_writes`, for reads."""
        self._fail_read = self._make_pred(pred, key, once)

    @staticmethod
    def _make_pred(pred, key, once):
        if pred is None:
            pred = (lambda s: True) if key is None else (lambda s: s.key == key)
        fired = [False]

        def check(s: Slice) -> bool:
            if once and fired[0]:
                return False
            if pred(s):
                fired[0] = True
                return True
            return False
        return check

    # -- backend primitives ------------------------------------------------------------------
    def _allocate(self, entries: Sequence[Tuple[StateKey, StateSpec]]) -> None:
        for k, spec in entries:
            self._data[k] = bytearray(spec.nbytes)

    def _free(self, keys: Sequence[StateKey]) -> None:
        for k in keys:
            del self._data[k]

    def _alloc_host_buffer(self, nbytes: int) -> torch.Tensor:
        buf = super()._alloc_host_buffer(nbytes)
        self.buffer_ranges.append((buf.data_ptr(), buf.data_ptr() + nbytes))
        return buf

    def _inside_budget(self, t: torch.Tensor) -> bool:
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        return any(a <= lo and hi <= b for a, b in self.buffer_ranges)

    def _bounds(self, s: Slice) -> Tuple[int, int]:
        item = self._specs[s.key].itemsize
        return s.start * item, s.stop * item

    def _submit_read(self, s: Slice, out: torch.Tensor):
        self.io_log.append(("read", s.key, s.start, s.stop))
        if not self._inside_budget(out):
            self.out_of_budget.append(("read", s))
        data = self._data[s.key]
        a, b = self._bounds(s)
        fail = self._fail_read is not None and self._fail_read(s)
        dst = out.view(torch.uint8)

        def run() -> int:
            if self.read_delay:
                time.sleep(self.read_delay)
            if fail:
                raise OSError(5, f"simulated read error on {s.key}")
            with self._lock:
                chunk = bytes(data[a:b])
            if b > a:
                dst[: b - a].copy_(torch.frombuffer(bytearray(chunk), dtype=torch.uint8))
            return b - a
        return self._pool.submit(run)

    def _submit_write(self, s: Slice, src: torch.Tensor, *, optimizer_pass: bool = False):
        self.io_log.append(("write", s.key, s.start, s.stop))
        if not self._inside_budget(src):
            self.out_of_budget.append(("write", s))
        data = self._data[s.key]
        a, b = self._bounds(s)
        fail = self._fail_write is not None and self._fail_write(s)
        srcb = src.view(torch.uint8)

        def run() -> int:
            if self.write_delay:
                time.sleep(self.write_delay)
            if fail:
                raise OSError(5, f"simulated write error on {s.key}")
            payload = srcb[: b - a].numpy().tobytes() if b > a else b""
            with self._lock:
                data[a:b] = payload
            return b - a
        return self._pool.submit(run)

    def _flush(self) -> None:
        self.flushes += 1

    def _close(self) -> None:
        self._pool.shutdown(wait=True)
        self._data.clear()
        self.closed_backend = True

    def _backend_stats(self):
        return {"sim_bytes": sum(len(d) for d in self._data.values())}

    # -- test helper ---------------------------------------------------------------------------
    def raw(self, key) -> bytes:
        """The bytes the 'disk' holds now for ``key`` (no pipeline, no waiting)."""
        k = key if isinstance(key, StateKey) else StateKey.parse(key)
        with self._lock:
            return bytes(self._data[k])

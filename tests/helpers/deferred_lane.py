"""A lane for :mod:`statestore.optim._staging` that runs on the CPU and defers every copy.

The real lane (``CudaLane``) queues copies on a side CUDA stream: each reads its source and
writes its destination at some moment between the call and the completion of the event
recorded after it. This one queues them in a list and writes the destinations only when an
event is waited on (``wait_host``: every copy up to that event) or the current stream is made
to wait for the side stream (``join``: the copies into tensors other than the staging buffers,
i.e. the uploads the host reads next as "device" memory; copies into staging buffers stay
queued until a wait, since the host reads those only after one), the latest moment the real
one may. The source is read at the call
(``read="early"``, the default: a copy that ran at once, so a source changed afterwards must
be copied again) or with the write (``read="late"``: a source overwritten before the copy ran is
what gets copied). Code that reads a staging buffer without waiting for its copy, uses a copy
of a gradient that changed since, or writes a buffer before its upload has run, computes with
the wrong values and the comparison in the test fails. Staging memory starts as NaN bytes
(0xFF), so a buffer read before any copy shows up too.

``lax=True`` makes ``wait_host`` a no-op (copies then run only at ``join``): a lane with a
missing wait, to show the tests catch one.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor

from statestore.optim._staging import StagingPath


class DeferredLane:
    def __init__(self, device: torch.device, lax: bool = False, read: str = "early"):
        assert read in ("early", "late")
        self.device = device
        self.lax = lax
        self.read = read
        self.queue: List[Tuple[int, torch.Tensor, torch.Tensor]] = []
        self.seq = 0
        self.copies = 0          # copies performed
        self.queued = 0          # copies queued
        self.allocated = 0       # bytes handed out by alloc
        self._staging: set = set()   # data pointers of the buffers handed out by alloc
        self.closed = False

    def alloc(self, nbytes: int):
        self.allocated += max(int(nbytes), 1)
        buf = torch.full((max(int(nbytes), 1),), 0xFF, dtype=torch.uint8)
        self._staging.add(buf.untyped_storage().data_ptr())
        return buf, True

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> int:
        assert dst.shape == src.shape and dst.dtype == src.dtype, (dst.shape, src.shape)
        self.seq += 1
        self.queued += 1
        self.queue.append((self.seq, dst, src.clone() if self.read == "early" else src))
        return self.seq

    def _run(self, upto: int) -> None:
        while self.queue and self.queue[0][0] <= upto:
            _, dst, src = self.queue.pop(0)
            dst.copy_(src)
            self.copies += 1

    def wait_host(self, event) -> None:
        if event is not None and not self.lax:
            self._run(event)

    def join(self) -> None:
        keep = []
        for item in self.queue:
            _, dst, src = item
            if dst.untyped_storage().data_ptr() in self._staging:
                keep.append(item)
            else:
                dst.copy_(src)
                self.copies += 1
        self.queue = keep

    def close(self) -> None:
        self._run(self.seq)
        self.closed = True


def install(opt, lane_factory, select: Optional[Callable[[Tensor], bool]] = None) -> StagingPath:
    """Replace ``opt``'s path by one with ``lane_factory`` (and ``select``;
    default: every contiguous parameter whose store hands out host tensors), hooks included.
    CPU parameters then take the same path as CUDA ones. Reads the optimizer's public
    ``param_groups`` and ``state_store`` (a parameter's default store is on its device)."""
    old = getattr(opt, "_staging", None)
    if old is not None:
        old.close()
    store = opt.state_store

    if select is None:
        def select(p: Tensor) -> bool:
            where = store.device if store is not None else p.device
            return where.type == "cpu" and p.is_contiguous()
    path = StagingPath(select, lane_factory)
    opt._staging = path     # a test hook: the optimizer's own attribute, set from outside
    path.watch([p for g in opt.param_groups for p in g["params"]], opt)
    return path

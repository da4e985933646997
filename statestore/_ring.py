"""The ring of host buffers a streaming store's pipelines carve their units from: one aligned
buffer of at most ``budget_bytes``, allocated and freed in FIFO order (the RAM bound).

Allocation and release run with signals deferred (:mod:`statestore._signals`): a Ctrl-C never
lands between a region's record and the head that follows it. Each region records its owner
(the pipeline, weakly) and the I/O using its bytes, so that a region its owner abandoned (an
interrupt outside any clean-up, an iteration dropped without ``with``) can be taken back once
that I/O is done (:meth:`InFlightWrites.reclaim_abandoned`)."""
from __future__ import annotations

import weakref
from collections import deque
from typing import Deque, NamedTuple, Optional

import torch

from ._signals import deferred_signals
from .errors import BudgetError, StateStoreValueError

__all__ = ["RingArena", "RingRegion", "Allocation", "aligned_buffer", "round_up"]


def round_up(n: int, align: int) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return (n + align - 1) // align * align


def aligned_buffer(nbytes: int, align: int) -> torch.Tensor:
    """``nbytes`` of pageable host memory (1-D uint8) starting at a multiple of ``align``."""
    raw = torch.empty(nbytes + align, dtype=torch.uint8)
    off = (-raw.data_ptr()) % align
    return raw[off:off + nbytes]


class RingRegion:
    """Bytes ``[start, end)`` of a ring, live until :meth:`RingArena.release` marks them free.

    Attributes:
        owner: a weak reference to what allocated it (a pipeline), or None.
        ios: the reads or writes in flight on its bytes (``(slice, future)`` pairs).
    """

    __slots__ = ("start", "end", "released", "owner", "ios")

    def __init__(self, start: int, end: int, owner=None):
        self.start, self.end, self.released = start, end, False
        self.owner = owner
        self.ios: list = []

    def __repr__(self) -> str:
        return f"RingRegion({self.start}, {self.end}{', released' if self.released else ''})"


class Allocation(NamedTuple):
    """What :meth:`RingArena.try_alloc` hands out: where the bytes start, and the region to
    release once they are no longer used."""

    offset: int
    region: RingRegion


class RingArena:
    """A ring of bytes carved from one aligned host buffer, allocated and freed in FIFO order.

    Regions are released out of order (writes complete in any order) but the space is reused
    only once every older region is released, which keeps allocation O(1) and the footprint
    exactly ``capacity`` bytes.

    Args:
        buffer: a 1-D uint8 tensor, the ring's bytes.
        align: every region starts at a multiple of it (and is a multiple of it long).
        budget: the store's ``budget_bytes`` (the ring may be smaller while the states are);
            default ``capacity``.

    Raises:
        StateStoreValueError: ``buffer`` is not a 1-D uint8 tensor.
    """

    def __init__(self, buffer: torch.Tensor, align: int, budget: Optional[int] = None):
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise StateStoreValueError("arena buffer must be a 1-D uint8 tensor")
        self.buffer = buffer
        self.capacity = buffer.numel()
        self.align = align
        self.budget = budget if budget is not None else self.capacity
        self._head = 0                                  # where the next region starts
        self._regions: Deque[RingRegion] = deque()      # allocation order
        #: tensor views of pipeline units at their offsets, kept with the buffer they view
        #: while the unit lives (``statestore/_unit_cache.py``): unit -> [(offset, views)]
        self.views = weakref.WeakKeyDictionary()
        self._kept: Optional[RingRegion] = None         # see keep()

    @property
    def used(self) -> int:
        """Bytes held by live regions."""
        return sum(r.end - r.start for r in self._regions)

    def try_alloc(self, nbytes: int, owner=None, at_start: bool = False) -> Optional[Allocation]:
        """``nbytes`` (rounded up to ``align``, at least one block) of the ring, for ``owner``
        (a weak reference, recorded in the region). ``at_start``: take the ring's start
        rather than the bytes after the live ones wherever both are free (the caller has
        views at the start: a unit alternating between two places keeps its views).

        Returns:
            An :class:`Allocation` ``(offset, region)``, or None when the ring has no room now.

        Raises:
            BudgetError: ``nbytes`` exceeds the budget, or the ring (which could not grow).
        """
        nbytes = round_up(max(nbytes, 1), self.align)
        if nbytes > self.budget:
            raise BudgetError(f"a pipeline unit of {nbytes} bytes exceeds the RAM budget of "
                              f"{self.budget} bytes; raise budget_bytes or use smaller units")
        if nbytes > self.capacity:
            raise BudgetError(f"a pipeline unit of {nbytes} bytes exceeds the {self.capacity}-byte "
                              f"ring of host buffers, sized for the states that existed when it "
                              f"was allocated (budget_bytes is {self.budget}); it could not grow "
                              f"because another pipeline still holds buffers in it: finish or "
                              f"close that pipeline first")
        with deferred_signals():
            return self._alloc(nbytes, owner, at_start)

    def _alloc(self, nbytes: int, owner, at_start: bool) -> Optional[Allocation]:
        self._reclaim()
        kept = self._kept
        if not self._regions:
            start = 0
            if kept is not None and kept.start < nbytes and kept.end + nbytes <= self.capacity:
                start = kept.end            # after the watched bytes rather than over them
        else:
            tail, head = self._regions[0].start, self._head
            if head > tail:                 # live bytes in [tail, head)
                if head + nbytes <= self.capacity and not (at_start and nbytes <= tail):
                    start = head
                elif nbytes <= tail:        # wrap; [head, capacity) stays unused this lap
                    start = 0
                else:
                    return None
            elif head + nbytes <= tail:     # wrapped: live in [tail, cap) and [0, head)
                start = head
            else:
                return None
        if kept is not None and start < kept.end and kept.start < start + nbytes:
            self._kept = None               # its bytes are about to be overwritten
        region = RingRegion(start, start + nbytes, owner)
        self._regions.append(region)
        self._head = start + nbytes
        return Allocation(start, region)

    def release(self, region: RingRegion) -> None:
        """Marks a region free; its space is reused once all older regions are free too."""
        with deferred_signals():
            region.released = True
            region.ios = []
            self._reclaim()

    def keep(self, region: Optional[RingRegion]) -> None:
        """Watch ``region`` (one at a time; None: none): once released, :meth:`intact` says
        whether its bytes are still as its owner left them, no later allocation having
        reached them (a read served from a completed write's bytes, ``InFlightWrites``)."""
        self._kept = region

    def intact(self, region: RingRegion) -> bool:
        """Whether ``region`` is the one :meth:`keep` watches, released, and no allocation
        since has overlapped its bytes."""
        return region is self._kept and region.released

    def live(self) -> list:
        """The regions not released yet, oldest first."""
        return [r for r in self._regions if not r.released]

    def _reclaim(self) -> None:
        while self._regions and self._regions[0].released:
            self._regions.popleft()

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` of the ring's buffer from ``offset``."""
        return self.buffer[offset:offset + nbytes]

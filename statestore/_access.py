"""How callers visit a store's states, as part of :class:`~statestore.StateStore`: the
read / compute / write :meth:`~PipelineAccess.pipeline`, :meth:`~PipelineAccess.stream` of
whole states, :meth:`~PipelineAccess.prefetch` between steps, and the chunk and unit sizes
callers cut states by. The pipelines' in-flight state is ``store.in_flight``
(:class:`~statestore._inflight.InFlightWrites`)."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from ._inflight import InFlightWrites
from ._signals import deferred_signals
from ._stream import StateStream, chunk_ranges, group_units, plan_slices
from ._types import Slice, StateSpec
from .pipeline import Pipeline, Prefetch, StatePipeline, UnitPlan, check_mode, unit_lists

__all__ = ["CHUNK_BYTES", "PipelineAccess"]

#: Largest chunk of a ``get``/``put``/checkpoint load through a streaming store's pipeline.
CHUNK_BYTES = 16 << 20


class PipelineAccess:
    """Part of :class:`~statestore.StateStore` (which provides ``spec``, ``resident``,
    ``budget_bytes``, ``alignment``, ``transfer_alignment``, the open/file checks, the
    prefetch slot and ``in_flight``)."""

    # Hooks of a streaming backend that moves several slices of a unit by one request
    # (NVMeStore's packed small states; statestore/backends/_nvme_packed.py).
    def _unit_plan(self, slices: Sequence[Slice]) -> Optional[UnitPlan]:
        """How a pipeline lays a unit out in the ring: None, each slice on its own; or a
        :class:`~statestore.pipeline.UnitPlan` whose extents one request moves each
        (``_start_extent``, ``_write_extent``: NVMeStore's packed small states)."""
        return None

    def _ring_bytes(self, spec: StateSpec) -> int:
        """Ring bytes a state takes (the ring is never larger than all states' sum)."""
        return -(-spec.nbytes // self.alignment) * self.alignment

    def _start_extent(self, extent, buf: torch.Tensor, slices: List[Slice], read: bool):
        raise NotImplementedError

    def _write_extent(self, extent, buf: torch.Tensor, slices: List[Slice],
                      tensors: List[torch.Tensor], optimizer_pass: bool):
        raise NotImplementedError       # -> (the write's future, keys of the states rewritten)

    def _chunks(self, spec: StateSpec, limit: Optional[int] = None) -> List[Tuple[int, int]]:
        """Element ranges of at most ``limit`` bytes, cut at :meth:`cut_alignment`, that
        :meth:`stream` moves ``spec``'s state in. Default: half the budget, and at most
        ``CHUNK_BYTES`` on streaming stores, so that copying one chunk overlaps the transfer
        of the previous (puts into an NVMeStore were faster with 16 MiB chunks than with whole
        64 MiB states: benchmarks/RESULTS.md)."""
        limit = self._chunk_limit(limit)
        return chunk_ranges(spec, limit, self.cut_alignment(limit))

    def _chunk_limit(self, limit: Optional[int] = None) -> int:
        """The most bytes of a :meth:`stream` chunk, and of a unit of consecutive small
        chunks: ``limit``, else :meth:`_chunks`' default."""
        if limit is not None:
            return limit
        return self.budget_bytes // 2 if self.resident else min(self.budget_bytes // 2,
                                                                 CHUNK_BYTES)

    def pipeline(self, units: Sequence[Sequence[Slice]], mode: str = "rw",
                 wait: bool = True) -> StatePipeline:
        """The read / compute / write pipeline over ``units`` (see :mod:`statestore.pipeline`).

        Args:
            units: a sequence of units, each a list of :class:`Slice` visited together.
            mode: ``"rw"`` read, hand out, write back; ``"r"`` read only; ``"w"`` hand out
                uninitialized buffers (streaming stores) or the live views (resident stores)
                and write back.
            wait: False leaves the last writes pending in the background (a later read of
                the same state, :meth:`sync`, checkpoints and :meth:`close` wait for them).

        Returns:
            A :class:`~statestore.pipeline.StatePipeline`: iterate it (inside ``with``) for
            each unit's list of flat tensors. A :meth:`prefetch` of the same units and mode
            is handed out with its reads already started.

        Raises:
            StateStoreValueError: a bad mode or unit (a slice out of range, misaligned).
            StateKeyError: a slice names no state of this store.
            BudgetError: a unit exceeds ``budget_bytes``.
            StateStoreIOError: a state file was damaged, or a background write failed.
            StateStoreClosedError: the store is closed.
        """
        self._check_open()
        self._check_files()
        pre = self._prefetched
        if pre is not None:
            if pre.matches(mode, unit_lists(units)):
                self._prefetched = None
                pre.pipeline.wait = wait    # the reads started early: hand that pipeline out
                return pre.pipeline
            self.cancel_prefetch()
        return Pipeline(self, units, mode=mode, wait=wait)

    def stream(self, keys, mode: str = "r", *, chunk_bytes: Optional[int] = None,
               wait: bool = True) -> StateStream:
        """Whole states, chunk by chunk, through one pipeline: the way to move states in or
        out without holding them in RAM (``get``/``put``, checkpoints, ``state_dict()``).
        Each state is cut into ranges of at most ``chunk_bytes`` at :meth:`cut_alignment`; a
        streaming store reads ahead across states within its budget and writes behind::

            with store.stream(keys, "r") as chunks:
                for sl, t in chunks:            # Chunk(slice, tensor)
                    out[sl.key].view(-1)[sl.start:sl.stop].copy_(t)

        Args:
            keys: a :class:`StateKey` or ``"param/state"`` string, or an iterable of keys
                (as :meth:`delete`); each state is streamed whole, in order.
            mode: ``"r"`` (read: the tensors hold the stored values; do not modify them),
                ``"w"`` (write: fill each tensor, written back when the iteration moves on)
                or ``"rw"`` (read, modify in place, write back).
            chunk_bytes: the largest chunk in bytes; default half the budget, and at most
                ``CHUNK_BYTES`` (16 MiB) on streaming stores. A state of zero elements comes
                as one empty chunk.
            wait: as for :meth:`pipeline`: False leaves the last writes in flight.

        Returns:
            A :class:`~statestore._stream.StateStream` of :class:`~statestore._stream.Chunk`
            ``(slice, tensor)`` pairs, ``tensor`` flat on :attr:`device`; a context manager
            (an exception inside drops the chunk in hand, not written back).

        Raises:
            StateKeyError: a key names no state.
            StateStoreValueError: a bad key, mode or ``chunk_bytes``.
            StateStoreIOError, BudgetError, StateStoreClosedError: as :meth:`pipeline`.
        """
        self._check_open()
        check_mode(mode)
        slices = plan_slices(keys, chunk_bytes, lambda k, lim: self._chunks(self.spec(k), lim))
        limit = self._chunk_limit(chunk_bytes)
        align = max(self.alignment, 1)
        units = group_units(slices, lambda s: -(-s.numel * self.spec(s.key).itemsize // align)
                            * align, limit)
        pipe = None
        try:
            pipe = self.pipeline(units, mode=mode, wait=wait)
            with deferred_signals():        # until the caller holds it, nobody else would
                return StateStream(pipe, slices)        # ... cancel it: here
        except BaseException:
            if pipe is not None:
                pipe.cancel()
            raise

    def prefetch(self, units: Sequence[Sequence[Slice]], mode: str = "rw") -> None:
        """Start reading ``units`` now, for a :meth:`pipeline` that will ask for exactly these
        units (and mode) later, typically an optimizer's next step: the reads then overlap
        whatever runs in between (forward and backward). Reads start as far as the RAM budget
        allows without waiting; :meth:`pump` starts more as write-behind frees buffers. Any
        other use of the store (another pipeline, put, create, delete, load, close) cancels
        the prefetch first, so it never hands out stale values. A no-op on resident stores.

        Raises:
            as :meth:`pipeline`.
        """
        self._check_open()
        self.cancel_prefetch()
        if self.resident:
            return
        units = unit_lists(units)
        self._prefetched = Prefetch(mode, units, Pipeline(self, units, mode=mode, wait=False,
                                                          prefetch=True))

    def pump(self) -> None:
        """Never blocks: retire finished background writes and start more prefetch reads in
        the RAM they free. Optimizers call it from gradient hooks during backward."""
        if self._prefetched is None or self._closed:
            return
        self._prefetched.pipeline.pump()

    def cancel_prefetch(self) -> None:
        """Drop a :meth:`prefetch` not yet used (reads in flight are drained), and end the
        pipelines lent across calls (:meth:`~statestore.pipeline.StatePipeline.lend`): what
        every call that changes the store's states, or needs its ring, does first."""
        p, self._prefetched = self._prefetched, None
        if p is not None:
            p.pipeline.cancel()
        self._in_flight.reclaim_lent()

    def cut_alignment(self, max_bytes: Optional[int]) -> int:
        """Bytes at whose multiples to cut a state into slices of at most ``max_bytes``:
        :attr:`transfer_alignment`, halved while larger than ``max_bytes`` (small budgets),
        never below :attr:`alignment`."""
        a = max(self.transfer_alignment, self.alignment)
        while max_bytes is not None and a > self.alignment and a > max_bytes and a % 2 == 0:
            a //= 2
        return a

    @property
    def unit_bytes(self) -> Optional[int]:
        """Suggested upper size of a pipeline unit: None (no limit) for resident stores, a
        quarter of the budget for others, so read-ahead, compute and write-behind overlap."""
        return None if self.resident else max(self.alignment, self.budget_bytes // 4)

    @property
    def in_flight(self) -> InFlightWrites:
        """The store's write-behind (:class:`~statestore._inflight.InFlightWrites`): the ring
        its pipelines carve buffers from, their writes in flight, and the states whose last
        write failed. Pipelines and backends use it; callers use :meth:`sync`."""
        return self._in_flight

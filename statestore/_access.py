"""``PipelineAccess``: the object each :class:`~statestore.StateStore` holds for the way
callers visit its states: a pipeline (handing out a prefetched one when it matches), whole
states streamed chunk by chunk, the one prefetch kept between calls, and the chunk sizes
``stream`` cuts states by. It talks to its store through the store's public names
(``spec``, ``resident``, ``budget_bytes``, ``alignment``, ``cut_alignment``, ``closed``,
``in_flight``) and owns the prefetch; the store's ``pipeline``, ``stream``, ``prefetch``,
``pump`` and ``cancel_prefetch`` check the store and call it. What a backend's pipeline does
differently is given at construction (``make_pipeline``, ``before_write``), so every
pipeline, a checkpoint's included, is made here without going back through the store."""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

from ._ring import round_up
from ._signals import deferred_signals
from ._stream import StateStream, chunk_ranges, plan_slices
from ._types import Slice, StateSpec
from .pipeline import Pipeline, Prefetch, StatePipeline, check_mode, pack_runs, unit_lists

__all__ = ["CHUNK_BYTES", "PipelineAccess"]

#: Largest chunk of a ``get``/``put``/checkpoint load through a streaming store's pipeline.
CHUNK_BYTES = 16 << 20


class PipelineAccess:
    """How callers visit ``store``'s states (module docstring).

    Args:
        store: the store it serves (its public names only).
        sized_by: the store whose budget sets the default chunk size of :meth:`stream`
            (called when needed; default ``store``): a ``TieredStore`` cuts by its smallest
            disk tier, so every tier's pipeline takes the chunks.
        make_pipeline: ``(units, mode, wait) -> StatePipeline``, the store's own kind of
            pipeline (``TieredStore``: one over its tiers' pipelines); default a
            :class:`~statestore.pipeline.Pipeline` over ``store``.
        before_write: called before a pipeline that writes (mode ``"rw"`` or ``"w"``) is
            handed out (``NVMeStore``: reserve what copy-on-write needs), else None.
    """

    def __init__(self, store, sized_by: Optional[Callable[[], object]] = None, *,
                 make_pipeline: Optional[Callable[..., Any]] = None,
                 before_write: Optional[Callable[[], None]] = None):
        self.store = store
        self._sized_by = sized_by or (lambda: store)
        self._make = make_pipeline or (lambda units, mode, wait:
                                       Pipeline(store, units, mode=mode, wait=wait))
        self._before_write = before_write
        self._prefetched: Optional[Prefetch] = None     # started by prefetch()

    @property
    def pending(self) -> Optional[Prefetch]:
        """The :meth:`prefetch` not yet handed out (``Prefetch(mode, units, pipeline)``)."""
        return self._prefetched

    def pipeline(self, units: Sequence[Sequence[Slice]], mode: str, wait: bool) -> StatePipeline:
        """``store.pipeline(units, mode, wait)``, after the store checked itself: a
        :class:`~statestore.pipeline.Pipeline` over ``units`` (see :mod:`statestore.pipeline`),
        or the pipeline of a :meth:`prefetch` of the same units and mode, handed out with its
        reads already started (any other prefetch is cancelled).

        Args:
            units: a sequence of units, each a list of :class:`Slice` visited together.
            mode: ``"rw"`` read, hand out, write back; ``"r"`` read only; ``"w"`` hand out
                uninitialized buffers (streaming stores) or the live views (resident stores)
                and write back.
            wait: False leaves the last writes pending in the background (a later read of
                the same state, ``sync()``, checkpoints and ``close()`` wait for them).

        Returns:
            A :class:`~statestore.pipeline.StatePipeline`: iterate it (inside ``with``) for
            each unit's list of flat tensors.

        Raises:
            StateStoreValueError: a bad mode or unit (a slice out of range, misaligned).
            StateKeyError: a slice names no state of this store.
            BudgetError: a unit exceeds ``budget_bytes``.
            StateStoreIOError: a state file was damaged, or a background write failed.
            StateStoreClosedError: the store is closed.
        """
        if mode != "r" and self._before_write is not None:
            self._before_write()
        pre = self._prefetched
        if pre is not None:
            # never a closed one: iterating it yields no unit, and a step would end as if
            # made, its counts advanced and nothing updated (the 15-minute soak's fourth run)
            if pre.matches(mode, unit_lists(units)) and not pre.pipeline.closed:
                try:    # a Ctrl-C between the two must not leave it held by no one
                    with deferred_signals():
                        self._prefetched = None
                        pre.pipeline.wait = wait    # the reads started early: hand it out
                except BaseException:
                    pre.pipeline.cancel()           # its ring buffers go back
                    raise
                return pre.pipeline
            self.cancel_prefetch()
        return self._make(units, mode, wait)

    def stream(self, keys, mode: str, chunk_bytes: Optional[int], wait: bool) -> StateStream:
        """``store.stream(keys, mode, chunk_bytes=..., wait=...)``: whole states, chunk by
        chunk, through one :meth:`pipeline` (a backend's own kind included; units of consecutive
        chunks of at most :meth:`chunk_limit` bytes): the way to move states in or out
        without holding them in RAM (``get``/``put``, checkpoints, ``state_dict()``); a
        streaming store reads ahead across states within its budget::

            with store.stream(keys, "r") as chunks:
                for sl, t in chunks:            # Chunk(slice, tensor)
                    out[sl.key].view(-1)[sl.start:sl.stop].copy_(t)

        Args:
            keys: a :class:`StateKey` or ``"param/state"`` string, or an iterable of keys
                (as ``store.delete``); each state is streamed whole, in order.
            mode: ``"r"`` (read: the tensors hold the stored values; do not modify them),
                ``"w"`` (write: fill each tensor, written back when the iteration moves on)
                or ``"rw"`` (read, modify in place, write back).
            chunk_bytes: the largest chunk in bytes (cut at the store's ``cut_alignment``);
                default half the budget, and at most ``CHUNK_BYTES`` (16 MiB) on streaming
                stores. A state of zero elements comes as one empty chunk.
            wait: as for :meth:`pipeline`: False leaves the last writes in flight.

        Returns:
            A :class:`~statestore._stream.StateStream` of :class:`~statestore._stream.Chunk`
            ``(slice, tensor)`` pairs, ``tensor`` flat on the store's ``device``; a context
            manager (an exception inside drops the chunk in hand, not written back).

        Raises:
            StateKeyError: a key names no state.
            StateStoreValueError: a bad key, mode or ``chunk_bytes``.
            StateStoreIOError, BudgetError, StateStoreClosedError: as :meth:`pipeline`.
        """
        check_mode(mode)
        store = self.store
        slices = plan_slices(keys, chunk_bytes, lambda k, lim: self.chunks(store.spec(k), lim))
        align = max(store.alignment, 1)
        # small states move many to a unit (one request for a packed run of them)
        units = pack_runs(((s, round_up(s.numel * store.spec(s.key).itemsize, align))
                           for s in slices), self.chunk_limit(chunk_bytes))
        pipe = None
        try:
            pipe = self.pipeline(units, mode, wait)
            with deferred_signals():        # until the caller holds it, nobody else would
                return StateStream(pipe, slices)        # ... cancel it: here
        except BaseException:
            if pipe is not None:
                pipe.cancel()
            raise

    def prefetch(self, units: Sequence[Sequence[Slice]], mode: str) -> None:
        """Start the reads of a later :meth:`pipeline` over ``units`` now (streaming stores;
        the previous prefetch is cancelled)."""
        self.cancel_prefetch()
        if self.store.resident:
            return
        units = unit_lists(units)
        # signals deferred: a Ctrl-C between the pipeline's start (its reads take ring
        # buffers) and its keeping here left them held by a pipeline no one could reach
        with deferred_signals():
            self._prefetched = Prefetch(mode, units, Pipeline(self.store, units, mode=mode,
                                                              wait=False, prefetch=True))

    def pump(self) -> None:
        """Advance the prefetch without blocking (nothing once the store is closed)."""
        if self._prefetched is not None and not self.store.closed:
            self._prefetched.pipeline.pump()

    def cancel_prefetch(self) -> None:
        """Drop the prefetch (its reads in flight are drained) and end the pipelines lent
        across calls (the store's ``in_flight``). Signals are deferred: a Ctrl-C between
        taking the prefetch and cancelling it left its ring buffers held by a pipeline no
        one could reach (every later pipeline of the store then failed with BudgetError)."""
        with deferred_signals():
            p, self._prefetched = self._prefetched, None
            if p is not None:
                p.pipeline.cancel()
        self.store.in_flight.reclaim_lent()

    def chunk_limit(self, limit: Optional[int] = None) -> int:
        """The most bytes of a :meth:`stream` chunk, and of a unit of consecutive small
        chunks: ``limit``, else half the budget of the store it is sized by, and at most
        ``CHUNK_BYTES`` on streaming stores, so that copying one chunk overlaps the transfer
        of the previous (puts into an NVMeStore were faster with 16 MiB chunks than with
        whole 64 MiB states: benchmarks/RESULTS.md)."""
        if limit is not None:
            return limit
        by = self._sized_by()
        return by.budget_bytes // 2 if by.resident else min(by.budget_bytes // 2, CHUNK_BYTES)

    def chunks(self, spec: StateSpec, limit: Optional[int] = None) -> List[Tuple[int, int]]:
        """Element ranges of at most :meth:`chunk_limit` bytes that :meth:`stream` moves a
        state of ``spec`` in, cut at ``cut_alignment`` (of the store it is sized by when no
        ``limit`` is given)."""
        by = self.store if limit is not None else self._sized_by()
        limit = self.chunk_limit(limit)
        return chunk_ranges(spec, limit, by.cut_alignment(limit))

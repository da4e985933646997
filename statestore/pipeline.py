"""The read / compute / write pipeline: the one way optimizers (and checkpoints) visit states.

The caller names, up front, the *units* it will visit: each unit is a list of
:class:`~statestore.Slice` (for Adam: the same element range of ``exp_avg``, ``exp_avg_sq``
and, where present, the fp32 master). Iterating the pipeline yields each unit's tensors in
order, as flat 1-D tensors the caller may read and modify in place.

* **Resident stores** (states in addressable memory: device, pinned or pageable RAM, mmap'd
  files) hand out views of the live tensors: no copy, nothing to write back.
* **Non-resident stores** (NVMe) read units ahead into a ring of aligned host buffers of
  ``budget_bytes`` (the RAM bound), and, when the caller moves to the next unit, write the
  finished one back in the background. A read of a state waits for any pending write of that
  same state, so nothing is lost or reordered; where the last write moved that very unit, the
  read copies its ring bytes instead (``InFlightWrites.forward``, docs/nvme.md), and the unit
  is handed back only after that write completed. The writes in flight, the ring and the states
  whose last write failed live in the store's :class:`~statestore._inflight.InFlightWrites`
  (``store.in_flight``), shared by its pipelines: writes still pending when a pipeline ends
  are waited for by :meth:`StateStore.sync` (called by ``save_checkpoint``, ``state_dict``,
  ``get`` and ``close``).

Errors raised by background I/O surface at the caller's next call into the pipeline or store,
as :class:`~statestore.errors.StateStoreIOError` naming the state and the file.

Every call into a pipeline runs with signals deferred (:mod:`statestore._signals`): a Ctrl-C
lands between calls, never half-way through the bookkeeping of buffers and I/O in flight (a
caller's ``with`` then cancels the pipeline, which gives everything back). Buffers a pipeline
still holds when its owner abandons it (dropped without ``close()``) are taken back once their
I/O is done, when another pipeline needs them (:meth:`InFlightWrites.reclaim_abandoned`).

Order of calls::

    with store.pipeline(units, mode="rw") as pipe:   # 0) reads start at once
        for tensors in pipe:                         # 1) wait for unit i, submit more reads
            compute(tensors)                         # 2) caller updates in place
                                                     # 3) next(): unit i written back
    # 4) exit: remaining writes submitted (and waited for when wait=True)

A caller that must never wait (an optimizer updating parameters from gradient hooks, during
backward) polls instead: ``pipe.ready()`` starts what reads it can without waiting and says
whether the next unit has arrived, ``pipe.take()`` hands it out only then (else None), and
``pipe.commit()`` starts the current unit's write-back at once.
"""
from __future__ import annotations

import functools
import weakref
from abc import ABC, abstractmethod
from typing import Iterator, List, NamedTuple, Optional, Sequence

import torch

from ._inflight import ExtentIO, InFlightWrites, SliceIO
from ._ring import RingArena, RingRegion
from ._signals import deferred_signals
from ._unit_cache import check_slice, compile_units
from ._unit_plans import pack_runs, plan_units      # re-exported: unit planning
from ._trace import begin as _begin_span, end as _end_span, span as _span
from ._types import Slice
from .errors import BudgetError, StateStoreClosedError, StateStoreValueError

__all__ = ["StatePipeline", "Pipeline", "Prefetch", "RingArena", "Extent", "UnitPlan",
           "check_mode", "check_slice", "pack_runs", "plan_units", "unit_lists"]

_MODES = ("r", "rw", "w")


def check_mode(mode: str) -> None:
    """Raise :class:`StateStoreValueError` unless ``mode`` is ``"r"``, ``"rw"`` or ``"w"``."""
    if mode not in _MODES:
        raise StateStoreValueError(f"pipeline mode must be one of {_MODES}, got {mode!r}")


def unit_lists(units) -> List[List[Slice]]:
    """``units`` as a list of lists of Slice (each slice is checked by the store later);
    :class:`StateStoreValueError` when it is not a sequence of sequences."""
    def problem() -> str:       # formatted only when raised: repr of every unit costs
        return f"pipeline units must be a sequence of lists of Slice, got {units!r}"[:300]
    if isinstance(units, (str, bytes, Slice)):
        raise StateStoreValueError(problem())
    try:
        out = [u for u in units]
    except TypeError:
        raise StateStoreValueError(problem()) from None
    for i, u in enumerate(out):
        if isinstance(u, (str, bytes, Slice)):
            raise StateStoreValueError(f"pipeline unit {i} must be a list of Slice, got {u!r}")
        try:
            out[i] = list(u)
        except TypeError:
            raise StateStoreValueError(f"pipeline unit {i} must be a list of Slice, "
                                       f"got {u!r}") from None
    return out


class StatePipeline(ABC):
    """What every store's ``pipeline()`` returns (:class:`Pipeline`, and the tiered store's
    pipeline over its tiers' pipelines): an iterator over units, a context manager, and a
    non-blocking polling interface; see the module docstring.

    Leaving the ``with`` block normally is :meth:`close`; leaving it by an exception is
    :meth:`cancel` (the unit in hand is not written back).
    """

    def __iter__(self) -> Iterator[List[torch.Tensor]]:
        return self

    @abstractmethod
    def __next__(self) -> List[torch.Tensor]:
        """The next unit's tensors (waiting for its reads); StopIteration after the last.
        The previous unit is handed back first (modes "rw" and "w": written back).
        ``StateStoreClosedError`` once the pipeline was closed or cancelled before its last
        unit: a caller never mistakes a cut-short pass for a whole one."""

    @abstractmethod
    def ready(self) -> bool:
        """Never blocks: whether the next unit can be handed out without waiting for I/O
        (starting the reads that need no waiting). True at the end."""

    @abstractmethod
    def take(self) -> Optional[List[torch.Tensor]]:
        """The next unit when :meth:`ready`, else None (also at the end); never waits."""

    @abstractmethod
    def wait_next(self) -> Optional[List[torch.Tensor]]:
        """The next unit, waiting for its reads only (further reads start without waiting
        for buffers); None at the end."""

    @abstractmethod
    def commit(self) -> None:
        """Hand the current unit back now (modes "rw" and "w": its write-back starts); its
        tensors must not be used afterwards."""

    @abstractmethod
    def close(self) -> None:
        """Hand back the current unit, release unread buffers and (``wait=True``) wait for
        every write; raises the first background error."""

    @abstractmethod
    def cancel(self) -> None:
        """Give up: the unit in hand is not written back (the store keeps its previous
        values), reads in flight are drained, every buffer goes back; never raises."""

    def lend(self, give_back) -> None:
        """Keep this pipeline open across calls (an optimizer's pass during backward): before
        another pipeline of the store needs the ring, or the store's states change,
        ``give_back()`` is called and must end it (:meth:`cancel` or :meth:`close`) and
        return True, or return False while its owner is using it. A no-op where the
        pipeline holds no ring buffers (resident stores)."""

    def __enter__(self) -> "StatePipeline":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.cancel()


class Extent:
    """A run of a file that one request moves for several slices of a unit (small states
    packed into shared 4 KiB blocks: ``statestore/backends/_nvme_packed.py``): ``nbytes``
    from ``ring_offset`` of the unit's buffer; ``members``: the indices of the unit's slices
    inside it. ``where`` is the store's own (file and offset); ``whole``: the store found
    every state of its blocks among the members, each whole (a write then needs no
    read-modify-write and rewrites only them)."""

    __slots__ = ("ring_offset", "nbytes", "members", "where", "whole", "slices", "runs")

    def __init__(self, ring_offset: int, nbytes: int, members: List[int], where,
                 whole: bool = False):
        self.ring_offset, self.nbytes, self.members, self.where = \
            ring_offset, nbytes, members, where
        self.whole = whole
        self.slices: Optional[List[Slice]] = None      # its members' slices, when kept
        self.runs = None            # the store's own: its blocks' current files, when kept


def _members(e: Extent, slices: List[Slice]) -> List[Slice]:
    return e.slices if e.slices is not None else [slices[i] for i in e.members]


class UnitPlan(NamedTuple):
    """How a streaming store lays a unit out in the ring (``store.extents.unit_plan``):
    ``nbytes`` in all, each slice's data at ``offsets[i]``; the slices of ``extents`` move by
    extent (``store.extents.start_extent``/``write_extent``), the ``loose`` ones one by one
    (``_submit_read``/``_submit_write``)."""

    nbytes: int
    offsets: List[int]
    extents: List[Extent]
    loose: List[int]


class _Unit:
    __slots__ = ("slices", "region", "tensors", "reads", "span", "plan", "compiled", "forwarded")

    def __init__(self, slices, compiled=None):
        self.slices: List[Slice] = slices
        self.region: Optional[RingRegion] = None
        self.tensors: List[torch.Tensor] = []
        self.reads: List[SliceIO] = []     # its reads in flight
        self.forwarded = False             # its bytes came from a pending write (_try_submit)
        self.span = None                   # its "statestore::compute" span (profiling only)
        self.compiled = compiled           # streaming stores: _unit_cache.CompiledUnit
        self.plan: Optional[UnitPlan] = compiled.plan if compiled is not None else None


class Pipeline(StatePipeline):
    """Iterates units of state slices with read-ahead and write-behind; see the module doc.

    Built by :meth:`StateStore.pipeline` (and :meth:`StateStore.prefetch`); not constructed
    directly. Its in-flight writes live in the store's :class:`~statestore._inflight.InFlightWrites`
    (``store.in_flight``), shared with the store's other pipelines.

    Attributes:
        wait: whether :meth:`close` waits for the writes (else they stay in flight; a later
            read of their states, ``sync()``, checkpoints and ``close()`` wait for them).
    """

    def __init__(self, store, units: Sequence[Sequence[Slice]], mode: str = "rw",
                 wait: bool = True, prefetch: bool = False):
        check_mode(mode)
        self._store = store
        self._mode = mode
        self.wait = wait
        self._resident = store.resident
        if self._resident:
            self._units: List[_Unit] = []
            for sl in unit_lists(units):
                for s in sl:
                    check_slice(store, s)
                self._units.append(_Unit(sl))
        else:       # checked and laid out once per store layout (_unit_cache.py)
            self._units = [_Unit(c.slices, c) for c in compile_units(store, unit_lists(units))]
        self._next_submit = 0
        self._next_yield = 0
        self._current: Optional[_Unit] = None
        self._closed = False
        self._writes: InFlightWrites = store.in_flight
        self._ref = weakref.ref(self)
        self._claimed = False   # its owner used it (see _claim)
        if not self._resident:
            need = max((u.compiled.nbytes for u in self._units), default=0)
            try:
                with deferred_signals():    # a Ctrl-C meanwhile is raised as it ends: below
                    self._arena: RingArena = self._writes.arena(need)
                    self._fill(block=not prefetch)
                    # until its owner uses it, another pipeline of the store may take its
                    # buffers back: a Ctrl-C between this constructor and the caller's
                    # `with` (at __enter__'s first line) leaves it held by no one but the
                    # exception's traceback, which a handler using the store still has
                    self._writes.lend(self, functools.partial(_give_back_unclaimed, self._ref))
            except BaseException:
                with deferred_signals():
                    self._closed = True
                    if hasattr(self, "_arena"):
                        self._drop_unconsumed(swallow=True)     # nobody else could
                raise

    @property
    def closed(self) -> bool:
        """Whether the pipeline was closed or cancelled (its buffers are no longer used)."""
        return self._closed

    def __enter__(self) -> "Pipeline":
        self._claim()
        return self

    def _claim(self) -> None:
        """Its owner uses it: another pipeline no longer takes its buffers back (they stay
        until it is closed or cancelled, or lent again by the owner)."""
        if not self._claimed:
            with deferred_signals():
                self._claimed = True
                if not self._resident and not self._closed:
                    self._writes.returned(self)

    # -- iteration ---------------------------------------------------------------------------
    def __next__(self) -> List[torch.Tensor]:
        with deferred_signals():
            return self._next(block=True)

    def ready(self) -> bool:
        """Never blocks: retires finished background writes, starts the reads that need no
        waiting, and tells whether the next unit's reads are done, so that :meth:`take` (or
        ``next()``) hands it out without waiting for I/O. True at the end and on resident
        stores."""
        self._claim()
        if self._closed or self._resident or self._next_yield >= len(self._units):
            return True
        with deferred_signals():
            self._writes.poll()
            self._fill(block=False)
            if self._next_submit <= self._next_yield:
                return False
            return all(f.done() for _, f in self._units[self._next_yield].reads)

    def take(self) -> Optional[List[torch.Tensor]]:
        """``next()`` without waiting: the next unit's tensors when :meth:`ready`, else None
        (also at the end). Used from gradient hooks, where a wait would stall backward; the
        reads it starts for later units are only those that need no waiting either."""
        with deferred_signals():
            if self._closed or self._next_yield >= len(self._units) or not self.ready():
                return None
            return self._next(block=False)

    def wait_next(self) -> Optional[List[torch.Tensor]]:
        """``next()`` that waits for the next unit's reads only and then starts further reads
        without waiting for buffers (``next()`` fills the ring, waiting for write-backs): for
        a gradient hook that must not go on before its unit is updated (``release_grads``)
        yet should hold backward no longer than that. None at the end."""
        with deferred_signals():
            if self._closed or self._next_yield >= len(self._units):
                return None
            return self._next(block=False)

    def commit(self) -> None:
        """Hand the current unit back now instead of at the next ``next()``: in modes "rw"
        and "w" its write-back starts. Its tensors must not be used afterwards."""
        with deferred_signals():
            if not self._closed:
                self._finish_current()

    def lend(self, give_back) -> None:
        self._claim()
        if not self._resident and not self._closed:
            self._writes.lend(self, give_back)

    def pump(self) -> None:
        """Never blocks: retire finished background writes and start the reads of further
        units that fit the ring now (a prefetch between an optimizer's steps)."""
        if self._closed or self._resident:
            return
        with deferred_signals():
            self._writes.poll()
            self._fill(block=False)

    def _next(self, block: bool) -> List[torch.Tensor]:
        self._claim()
        if self._closed:
            left = len(self._units) - self._next_yield
            if left > 0:    # never an early end: a step would take it for a whole one
                raise StateStoreClosedError(
                    f"this pipeline was closed or cancelled with {left} of its "
                    f"{len(self._units)} units not handed out; open a new one")
            raise StopIteration
        self._writes.raise_error()
        self._finish_current()
        if self._next_yield >= len(self._units):
            self.close()
            raise StopIteration
        unit = self._units[self._next_yield]
        self._next_yield += 1
        if self._resident:
            unit.tensors = [self._store._view(s.key).view(-1)[s.start:s.stop] for s in unit.slices]
            self._current = unit
        else:
            with _span("statestore::read_wait"):
                self._await_reads(unit)
            self._current = unit    # before _fill: if it raises, cancel releases this unit
            self._fill(block=block)
        unit.span = _begin_span("statestore::compute")
        return unit.tensors

    def _await_reads(self, unit: _Unit) -> None:
        while self._next_submit < self._next_yield:
            self._submit_blocking()
        try:
            for s, fut in unit.reads:
                self._writes.outcome(fut, s.key, "read")
        except BaseException:
            self._release_unit(unit)
            raise
        unit.reads = []

    def close(self) -> None:
        """Write back the current unit, release unread buffers, and (``wait=True``) wait for
        every write; raises the first background error."""
        if self._closed:
            return
        with deferred_signals():
            self._finish_current()
            self._closed = True
            if not self._resident:
                self._writes.returned(self)
                self._drop_unconsumed()
        if not self._resident:
            if self.wait:
                with _span("statestore::write_wait"):
                    self._store.sync()
            else:
                self._writes.raise_error()

    def cancel(self) -> None:
        """The caller failed mid-unit (or a prefetch is dropped): its unit is not written
        back (its data may be half updated, and the store keeps the previous values); reads
        in flight are drained and every buffer goes back to the ring."""
        with deferred_signals():
            unit, self._current = self._current, None
            self._closed = True
            if unit is not None:
                _end_span(unit.span)
                unit.span = None
            if not self._resident:
                self._writes.returned(self)
                if unit is not None:
                    self._release_unit(unit)
                self._drop_unconsumed(swallow=True)

    # -- internals ---------------------------------------------------------------------------
    def _finish_current(self) -> None:
        unit, self._current = self._current, None
        if unit is not None:
            _end_span(unit.span)
            unit.span = None
        if unit is None or self._resident:
            return
        if self._mode in ("rw", "w"):
            futs: List[SliceIO] = []
            try:
                if unit.forwarded:      # the write it was served from lands first
                    self._writes.wait_for_unit(unit.compiled, raise_errors=False)
                optimizer_pass = self._mode == "rw"
                submit = self._store._submit_write
                plan = unit.plan
                with _span("statestore::write_submit"):
                    if plan is None:
                        for s, t in zip(unit.slices, unit.tensors):
                            futs.append(SliceIO(s, submit(s, t, optimizer_pass=optimizer_pass)))
                    else:
                        for i in plan.loose:
                            s = unit.slices[i]
                            futs.append(SliceIO(s, submit(s, unit.tensors[i],
                                                          optimizer_pass=optimizer_pass)))
                        for e in plan.extents:
                            fut, covered = self._store.extents.write_extent(
                                e, self._arena.view(unit.region.start + e.ring_offset, e.nbytes),
                                _members(e, unit.slices),
                                list(map(unit.tensors.__getitem__, e.members)), optimizer_pass)
                            futs.append(ExtentIO(tuple(covered), fut))
            except BaseException as e:
                # The unit's new values are not (all) written: they are lost, so its states
                # are stale until rewritten; reading them raises (InFlightWrites.check_damaged).
                self._writes.mark_damaged([s.key for s in unit.slices], e)
                unit.reads = futs          # drained by _release_unit before the buffer is reused
                self._release_unit(unit)
                raise
            self._writes.add(unit.region, futs, unit.compiled)
        else:
            if unit.forwarded:          # its error is raised as the pipeline ends, at the latest
                try:
                    self._writes.wait_for_unit(unit.compiled, raise_errors=False)
                except BaseException:
                    self._release_unit(unit)
                    raise
            self._arena.release(unit.region)
        unit.tensors = []

    def _drop_unconsumed(self, swallow: bool = False) -> None:
        # Every unit's buffer goes back to the ring, even when a read failed; then the first
        # failure is raised (unless ``swallow``).
        first = None
        for unit in self._units[self._next_yield:self._next_submit]:
            for s, fut in unit.reads:
                try:
                    fut.result()
                except BaseException as e:
                    first = first or e
            unit.reads = []
            self._arena.release(unit.region)
            unit.region = None
        self._next_submit = self._next_yield
        if first is not None and not swallow:
            raise first

    def _release_unit(self, unit: _Unit) -> None:
        """After an error on ``unit``: drain its other reads and give its buffer back."""
        for _, fut in unit.reads:
            try:
                fut.result()
            except BaseException:
                pass
        unit.reads = []
        unit.tensors = []
        if unit.region is not None:
            self._arena.release(unit.region)
            unit.region = None

    def _try_submit(self, block: bool = True) -> bool:
        unit = self._units[self._next_submit]
        c = unit.compiled
        writes = self._writes
        if not block:       # its last write still in flight: try again later
            if c.whole and writes.busy_states(c.keys):
                return False
            if not c.whole and any(writes.busy(s.key, s.start, s.stop) for s in unit.slices):
                return False
        # a unit served from its own last write alternates between the ring's start and the
        # place after it: back to the start when its views are there
        at_start = writes.wrote_last(c) and c.viewed_at_start(self._arena)
        got = self._arena.try_alloc(c.nbytes, self._ref, at_start)
        if got is None:
            return False
        unit.region = got.region
        unit.region.ios = unit.reads = []
        unit.tensors = c.views(self._arena, got.offset)
        span = _begin_span("statestore::read_submit") if self._mode != "w" else None
        reading = self._mode in ("r", "rw")
        plan = unit.plan
        try:
            # A read copies the last write's ring bytes when it moved this very unit, or
            # waits for the pending writes of its states and reads the disk; a write (mode
            # "w") waits: two writes of one slice in flight at once may land in either order.
            served = writes.forward(c, self._arena, got.offset, block) if reading else None
            if served is not None:
                unit.forwarded = served     # True: its write-back waits for the source
                _end_span(span)
                self._next_submit += 1
                return True
            writes.wait_for_unit(c)
            if reading:
                writes.check_damaged_states(c.keys)
                for i in (range(len(unit.slices)) if plan is None else plan.loose):
                    s = unit.slices[i]
                    unit.reads.append(SliceIO(s, self._store._submit_read(s, unit.tensors[i])))
            if plan is not None:
                for e in plan.extents:
                    # an extent is read whole (or, mode "w", zero-filled: it is written whole)
                    fut = self._store.extents.start_extent(
                        e, self._arena.view(unit.region.start + e.ring_offset, e.nbytes),
                        _members(e, unit.slices), reading)
                    unit.reads.append(SliceIO(unit.slices[e.members[0]], fut))
        except BaseException:
            _end_span(span)
            self._release_unit(unit)
            raise
        _end_span(span)
        self._next_submit += 1
        return True

    def _fill(self, block: bool = True) -> None:
        """Submit reads of the next units while the ring has room (``block=False``: and
        their states have no write in flight, so it never waits)."""
        while self._next_submit < len(self._units) and self._try_submit(block):
            pass

    def _submit_blocking(self) -> None:
        while not self._try_submit():
            with _span("statestore::write_wait"):
                waited = self._writes.wait_oldest()
            if not (waited or self._writes.reclaim_abandoned()
                    or self._writes.cancel_unwound(self)):
                held = sum(r.end - r.start for r in self._arena.live()
                           if r.owner is not self._ref)
                raise BudgetError(
                    f"no room in the RAM budget of {self._arena.budget} bytes for the next "
                    f"unit: other pipelines of this store still open hold {held} bytes of its "
                    f"ring (close or cancel them: iterate a pipeline inside 'with')")


def _give_back_unclaimed(ref) -> bool:
    """A pipeline's buffers asked back before its owner used it (``InFlightWrites.lend``):
    cancelled, and True; False once claimed (its owner has it)."""
    pipe = ref()
    if pipe is None or pipe.closed:
        return True
    if pipe._claimed:
        return False
    pipe.cancel()
    return True


class Prefetch(NamedTuple):
    """A pipeline started early by :meth:`StateStore.prefetch`, handed out by the next
    :meth:`StateStore.pipeline` asking for the same ``mode`` and ``units``."""

    mode: str
    units: List[List[Slice]]
    pipeline: Pipeline

    def matches(self, mode: str, units: List[List[Slice]]) -> bool:
        return self.mode == mode and self.units == units

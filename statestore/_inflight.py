"""The write-behind of a streaming store: the ring its pipelines carve buffers from, the
writes still in flight (each holding a ring region until it completes), the first background
error not yet raised, and the states whose last write failed.

One :class:`InFlightWrites` belongs to each store (``store.in_flight``); every pipeline of
that store, and the store itself (``sync``, ``put``, ``delete``), go through it, so the order
"a read or write of a state waits for the pending writes of its blocks" holds across
pipelines, and an error of a write started by one call surfaces at the next call that depends
on it. A read of a unit whose states' last write moved that very unit copies the write's ring
bytes instead of waiting for it and reading the disk (:meth:`InFlightWrites.forward`).
Not thread-safe, as stores are not. Its bookkeeping runs with signals deferred
(:mod:`statestore._signals`): a Ctrl-C never lands between taking a finished write off the
list and recording its outcome and freeing its buffer.
"""
from __future__ import annotations

import errno
import os
import sys
from collections import deque
from itertools import repeat
import weakref
from typing import (Callable, Deque, Dict, Iterable, List, NamedTuple, Optional,
                    Sequence, Tuple)

import torch

from ._ring import RingArena, RingRegion
from ._signals import deferred_signals
from ._types import Slice, StateKey, StateSpec
from ._unit_cache import UnitCache
from .errors import StateStoreError, StateStoreIOError

__all__ = ["InFlightWrites", "SliceIO", "ExtentIO"]


class SliceIO(NamedTuple):
    """One read or write in flight: the slice it moves and the backend's Future-like handle."""

    slice: Slice
    future: object


class ExtentIO(NamedTuple):
    """One write that moves several whole states at once (an extent of small states packed
    in shared blocks): their keys and the backend's Future-like handle."""

    keys: Tuple[StateKey, ...]
    future: object


def _keys_of(w) -> Tuple[StateKey, ...]:
    return w.keys if isinstance(w, ExtentIO) else (w.slice.key,)


class _Batch:
    """The writes of one pipeline unit and the ring region holding their bytes; ``unit``: the
    compiled unit (``_unit_cache.CompiledUnit``) laid out in that region, or None."""

    __slots__ = ("region", "writes", "seq", "unit")

    def __init__(self, region: Optional[RingRegion], writes: List[SliceIO], seq: int = 0,
                 unit=None):
        self.region, self.writes, self.seq, self.unit = region, writes, seq, unit

    def done(self) -> bool:
        return all(w.future.done() for w in self.writes)


class InFlightWrites:
    """A store's ring of host buffers, its writes in flight and their outcomes.

    Args:
        spec: the store's ``spec(key)`` (item sizes, for the disk blocks a write touches).
        alignment: the store's ``alignment`` (ring offsets and disk blocks).
        budget_bytes: the most bytes the ring may take.
        alloc_buffer: ``alloc_buffer(nbytes)`` returns a 1-D uint8 host buffer aligned to
            ``alignment`` (the store's page-locked allocator).
        state_bytes: ``state_bytes()`` returns the bytes of the store's states, each rounded
            up to ``alignment`` (the ring stays smaller than the budget while they are).
    """

    def __init__(self, *, spec: Callable[[StateKey], StateSpec], alignment: int,
                 budget_bytes: int, alloc_buffer: Callable[[int], torch.Tensor],
                 state_bytes: Callable[[], int]):
        self._spec = spec
        self.alignment = alignment
        self.budget_bytes = budget_bytes
        self._alloc_buffer = alloc_buffer
        self._state_bytes = state_bytes
        self._ring: Optional[RingArena] = None
        #: pipelines kept open across calls by their owner (:meth:`lend`), with the callable
        #: that ends them on demand
        self._lent: Dict[int, Tuple[Callable[[], object], Callable[[], bool]]] = {}
        self._pending: Deque[_Batch] = deque()
        # The pending writes of each state (in the order of _pending), so that a read or
        # write of a state finds the writes it must wait for without scanning every write in
        # flight: a step over 100k small states had tens of thousands in flight per unit.
        self._by_key: Dict[StateKey, Deque[SliceIO]] = {}
        self._batch_of: Dict[int, _Batch] = {}        # id(SliceIO) -> its batch
        # The writes that move whole states (ExtentIO: small states packed in shared blocks,
        # thousands a unit) are indexed by their batch's number only: each state -> the
        # number of the last batch that wrote it. Batches retire in order, so a number
        # below the oldest pending one means "no longer in flight", and recording or
        # retiring a batch of thousands of states is one C-level dict operation.
        self._last_batch: Dict[StateKey, int] = {}
        self._seq = 0
        #: the last batch added, while no sync() came since (:meth:`forward`)
        self._newest: Optional[_Batch] = None
        self._error: Optional[BaseException] = None
        #: states whose last write failed, with its error: their stored bytes are stale, so
        #: reading them raises until put(), delete() or load_checkpoint() replaces them.
        self._damaged: Dict[StateKey, BaseException] = {}
        #: bytes moved so far by completed reads and writes (``stats()``)
        self.bytes_read = 0
        self.bytes_written = 0
        #: whether a read may be served from the last write's ring bytes (:meth:`forward`;
        #: ``STATESTORE_FORWARD=0`` in the environment turns it off, for comparisons)
        self.forwarding = os.environ.get("STATESTORE_FORWARD", "1") != "0"
        #: bytes of reads served so (not in ``bytes_read``: they read no disk)
        self.bytes_forwarded = 0
        #: the store's pipeline units checked and laid out (``statestore/_unit_cache.py``)
        self.units = UnitCache()

    # ------------------------------------------------------------------ the ring
    @property
    def ring(self) -> Optional[RingArena]:
        """The ring, once a pipeline has needed one (None before, and after :meth:`close`)."""
        return self._ring

    def arena(self, need: int = 0) -> RingArena:
        """The pipelines' ring: ``budget_bytes``, or less while the states are smaller. It
        grows, up to the budget, when more states exist or a pipeline needs a unit of
        ``need`` bytes that it cannot hold: pending background writes (which hold ring
        buffers) are waited for first, so that a ring sized when few states existed (a
        ``load_state_dict`` creating states one parameter at a time) never refuses a unit
        that fits the budget.

        Args:
            need: bytes of the largest unit of the pipeline asking.

        Returns:
            The ring (the same object until it grows).
        """
        self.reclaim_lent()         # a new pipeline: lent ones give their buffers back first
        want = min(self.budget_bytes, max(self._state_bytes() + (1 << 20) + 4 * self.alignment,
                                          need))
        ring = self._ring
        if ring is not None and ring.capacity < want and ring.used:
            self.poll()
            if ring.capacity < max(need, 1) <= self.budget_bytes:
                # This pipeline cannot run in the ring as it is: wait for the writes that
                # hold its buffers (their errors surface at the next call, as usual).
                while self.wait_oldest():
                    pass
            if ring.used:
                self.reclaim_abandoned()
        if ring is None or (ring.capacity < want and not self._pending and ring.used == 0):
            self._ring = None           # release the old buffer before allocating the new
            self._ring = RingArena(self._alloc_buffer(want), self.alignment,
                                   budget=self.budget_bytes)
        return self._ring

    # ------------------------------------------------------------------ lent pipelines
    def lend(self, pipeline, give_back: Callable[[], bool]) -> None:
        """``pipeline`` stays open across calls (an optimizer's step made during backward
        holds its read-ahead between gradient hooks): before another pipeline of the store
        takes the ring, or the store's states change, :meth:`reclaim_lent` calls
        ``give_back()``, which ends it (True) or declines, its owner being busy with it
        (False: asked again next time). Without this, such a pipeline abandoned by its
        owner (a backward that raised) would hold ring buffers for good."""
        self._lent[id(pipeline)] = (weakref.ref(pipeline), give_back)

    def returned(self, pipeline) -> None:
        """``pipeline`` ended (closed or cancelled): no longer lent."""
        self._lent.pop(id(pipeline), None)

    def reclaim_lent(self) -> None:
        """Ask every lent pipeline's owner to end it (see :meth:`lend`)."""
        if not self._lent:
            return
        for key, (ref, give_back) in list(self._lent.items()):
            if ref() is None:
                self._lent.pop(key, None)
            elif give_back():
                self._lent.pop(key, None)

    def close(self) -> None:
        """Let the ring's buffer go (the store is closed; every write was waited for)."""
        self._ring = None
        self.units.clear()

    # ------------------------------------------------------------------ I/O outcomes
    def outcome(self, fut, key: StateKey, op: str) -> int:
        """Wait for one read or write and count its bytes.

        Args:
            fut: the Future-like handle a backend returned.
            key: the state it moves (named in the error).
            op: ``"read"`` or ``"write"``.

        Returns:
            What the future returned (the bytes moved, where the backend says).

        Raises:
            StateStoreIOError: the I/O failed (a ``StateStoreError`` is raised as it is).
        """
        try:
            n = fut.result()
        except StateStoreError:
            raise
        except OSError as e:
            raise StateStoreIOError(e.errno, f"{op} of state {key} failed: {e}") from e
        except Exception as e:
            raise StateStoreIOError(f"{op} of state {key} failed: {e}") from e
        if isinstance(n, int):
            if op == "read":
                self.bytes_read += n
            else:
                self.bytes_written += n
        return n

    # ------------------------------------------------------------------ pending writes
    def add(self, region: Optional[RingRegion], writes: List[SliceIO], unit=None) -> None:
        """Record the writes of one unit; ``region`` (its ring bytes) is released once every
        one of them has completed. ``unit``: the compiled unit laid out in ``region`` whose
        every slice these writes move from it (a later read of the same unit may then be
        served from ``region``: :meth:`forward`)."""
        with deferred_signals():
            if region is not None:
                region.ios = writes
            self._seq += 1
            batch = _Batch(region, writes, self._seq, unit)
            self._pending.append(batch)
            self._newest = batch
            for w in writes:
                if isinstance(w, ExtentIO):
                    self._last_batch.update(dict.fromkeys(w.keys, self._seq))
                else:
                    self._by_key.setdefault(w.slice.key, deque()).append(w)
                self._batch_of[id(w)] = batch
            self.poll()

    def __bool__(self) -> bool:
        """Whether any write is still recorded as in flight."""
        return bool(self._pending)

    def poll(self) -> None:
        """Never blocks: retire the oldest units whose writes have all completed."""
        if not (self._pending and self._pending[0].done()):
            return
        with deferred_signals():
            while self._pending and self._pending[0].done():
                self._complete(self._pending.popleft())

    def wait_oldest(self) -> bool:
        """Wait for the oldest unit's writes (False when none is in flight). A failure is
        recorded (the state is damaged, the error raised by :meth:`raise_error`)."""
        if not self._pending:
            return False
        with deferred_signals():
            self._complete(self._pending.popleft())
        return True

    def drain(self) -> None:
        """Wait for every write in flight, then raise the first error not yet raised. Reads
        are served from the disk again from now on (not from the last write's ring bytes)."""
        while self.wait_oldest():
            pass
        self._newest = None
        self.raise_error()

    def _complete(self, batch: _Batch) -> None:
        for w in batch.writes:
            self._batch_of.pop(id(w), None)
            if isinstance(w, ExtentIO):     # _last_batch: numbers below the oldest pending
                continue
            k = w.slice.key
            q = self._by_key.get(k)
            if q is None:
                continue
            if q and q[0] is w:         # batches retire in order: the usual case
                q.popleft()
            else:
                try:
                    q.remove(w)
                except ValueError:
                    pass
            if not q:
                del self._by_key[k]
        if len(self._pending) == 0:
            self._last_batch.clear()    # nothing in flight: every number is retired
        ok = None
        try:
            for w in batch.writes:
                keys = _keys_of(w)
                try:
                    self.outcome(w.future, keys[0], "write")
                except StateStoreError as e:
                    ok = False
                    for k in keys:
                        self._damaged.setdefault(k, e)
                    if self._error is None:
                        self._error = e
            ok = ok is None
        finally:
            if batch.region is not None and self._ring is not None:
                self._ring.release(batch.region)
                if batch is self._newest and self.forwarding:   # may serve the next read
                    self._ring.keep(batch.region if ok and batch.unit is not None else None)

    def _overlaps(self, w, key: StateKey, start: int, stop: Optional[int]) -> bool:
        """Whether pending-write slice ``s`` touches a disk block of ``key``'s elements
        ``[start, stop)`` (``stop=None``: the whole state). Blocks, not elements: a write that
        ends inside a block merges that block, so two slices sharing one are ordered.
        An :class:`ExtentIO` holds its states whole."""
        if isinstance(w, ExtentIO):
            return key in w.keys
        s = w.slice
        if s.key != key:
            return False
        if stop is None:
            return True
        size, align = self._spec(key).itemsize, self.alignment
        return s.start * size // align < -(-stop * size // align) \
            and start * size // align < -(-s.stop * size // align)

    def busy(self, key: StateKey, start: int = 0, stop: Optional[int] = None) -> bool:
        """True when a write of ``key`` (of a block holding one of its elements
        ``[start, stop)``, when given) is still in flight; never blocks."""
        self.poll()
        return self._last_batch.get(key, 0) >= self._oldest() or \
            any(self._overlaps(w, key, start, stop) for w in self._by_key.get(key, ()))

    def _oldest(self) -> int:
        """The number of the oldest batch in flight (above every batch number when none)."""
        return self._pending[0].seq if self._pending else self._seq + 1

    def busy_states(self, keys: Sequence[StateKey]) -> bool:
        """:meth:`busy` of whole states ``keys`` at once (a unit of them): True when a write
        of any of them is still in flight; never blocks."""
        self.poll()
        if not self._pending:
            return False
        return self._last_seq(keys) >= self._oldest()

    def _last_seq(self, keys: Sequence[StateKey]) -> int:
        """The number of the last batch holding a write of any of ``keys`` (0: none)."""
        last = max(map(self._last_batch.get, keys, repeat(0, len(keys))), default=0) \
            if self._last_batch else 0
        if self._by_key and not self._by_key.keys().isdisjoint(keys):
            for k in self._by_key.keys() & set(keys):
                last = max(last, self._batch_of[id(self._by_key[k][-1])].seq)
        return last

    def wait_for_states(self, keys: Sequence[StateKey]) -> None:
        """:meth:`wait_for` of whole states ``keys`` at once: wait for every pending write
        of any of them (in C-level dict operations, not a call per state).

        Raises:
            StateStoreIOError: a background write failed (the first error not yet raised).
        """
        if self._pending:
            last = self._last_seq(keys)
            while self._pending and self._pending[0].seq <= last:
                self.wait_oldest()
        self.raise_error()

    def _last_write(self, key: StateKey, start: int = 0, stop: Optional[int] = None) -> int:
        """The number of the last batch writing a block of ``key``'s elements ``[start,
        stop)`` (0: none; below the oldest pending one: no longer in flight)."""
        last = self._last_batch.get(key, 0)
        for w in self._by_key.get(key, ()):
            if self._overlaps(w, key, start, stop):
                last = max(last, self._batch_of[id(w)].seq)
        return last

    def wait_for(self, key: StateKey, start: int = 0, stop: Optional[int] = None) -> None:
        """Wait for the writes of ``key`` (only those of blocks holding its elements
        ``[start, stop)``, when given): later slices of a large state are read while earlier
        ones are still being written.

        Raises:
            StateStoreIOError: a background write failed (the first error not yet raised).
        """
        last = self._last_write(key, start, stop)
        if last:
            while self._pending and self._pending[0].seq <= last:
                self.wait_oldest()
        self.raise_error()

    def wrote_last(self, unit) -> bool:
        """Whether the store's last write (since the last sync) moved compiled unit ``unit``,
        forwarding being on: a read of ``unit`` may then be served from it (:meth:`forward`),
        and its buffer is best placed where the unit's views already are."""
        newest = self._newest
        return newest is not None and newest.unit is unit and self.forwarding

    def _unit_last_seq(self, unit) -> int:
        """The number of the last batch writing a block of compiled unit ``unit``'s states
        (of the blocks its slices touch; 0: none)."""
        if unit.whole:
            return self._last_seq(unit.keys)
        return max((self._last_write(s.key, s.start, s.stop) for s in unit.slices), default=0)

    def _source(self, unit, arena: RingArena) -> Optional[_Batch]:
        """The batch whose ring bytes a read of ``unit`` may copy (:meth:`forward`), or None."""
        newest = self._newest
        if newest is None or not self.forwarding or arena is not self._ring:
            return None
        pending = self._pending
        if not pending or newest.seq < pending[0].seq:
            # every write completed: the last one's bytes, while the ring has not reused them
            ok = newest.unit is unit and newest.region is not None and arena.intact(newest.region)
            return newest if ok else None
        # the unit's own pending write (pointer tests: most reads have none), if it is the
        # newest write of the unit's states
        mine = next((b for b in reversed(pending) if b.unit is unit), None)
        if mine is None or mine.region is None:
            return None
        return mine if self._unit_last_seq(unit) == mine.seq else None

    def forward(self, unit, arena: RingArena, offset: int, may_wait: bool) -> Optional[bool]:
        """Serve a read of ``unit`` (a ``_unit_cache.CompiledUnit``) into its buffer at
        ``offset`` of ``arena`` by copying the ring bytes of the last write of its states
        instead of reading the disk (read-after-write forwarding, docs/nvme.md), when that
        write moved this very unit (the same slices at the same offsets, each written whole
        from the ring), so its bytes are those the disk holds or will hold:

        * the newest pending write of the unit's states (of their blocks), only where the
          caller ``may_wait``: it must wait for that write (:meth:`wait_for_unit`) before it
          writes the unit back or returns its buffer, so a later write never overtakes it,
          and the write's error surfaces at the latest as the caller's pipeline ends;
        * or, every write having completed without error, the store's last write, while no
          sync() came since and the ring has not reused its bytes (``RingArena.keep``).

        Finished writes are retired first (their errors raised). Off when :attr:`forwarding`
        is False (``STATESTORE_FORWARD=0``).

        Returns:
            None: not served (the caller waits for the writes and reads the disk); True:
            served from a pending write (wait for it as above); False: from a completed one.

        Raises:
            StateStoreIOError: a background write failed, or a state of ``unit`` is damaged.
        """
        self.raise_error()
        src = self._source(unit, arena)
        if src is None:
            return None
        pending = bool(self._pending) and src.seq >= self._pending[0].seq
        if pending and not may_wait:
            return None
        self.check_damaged_states(unit.keys)
        arena.view(offset, unit.nbytes).copy_(arena.view(src.region.start, unit.nbytes))
        self.bytes_forwarded += unit.nbytes
        return pending

    def wait_for_unit(self, unit, raise_errors: bool = True) -> None:
        """Wait for the pending writes of compiled unit ``unit``'s states (of the blocks its
        slices touch, as :meth:`wait_for_states` and :meth:`wait_for` do).

        Args:
            raise_errors: raise the first background error not yet raised; False leaves it
                to the next call that does (a unit served from a write it just waited for
                is still written back, and the write's error raised as its pipeline ends).

        Raises:
            StateStoreIOError: a background write failed (the first error not yet raised).
        """
        if raise_errors:
            if unit.whole:
                self.wait_for_states(unit.keys)
            else:
                for s in unit.slices:
                    self.wait_for(s.key, s.start, s.stop)
            return
        if not self._pending:
            return
        last = self._unit_last_seq(unit)
        while self._pending and self._pending[0].seq <= last:
            self.wait_oldest()

    def raise_error(self) -> None:
        """Raise the first background write error not yet raised (retiring finished writes
        first)."""
        self.poll()
        err, self._error = self._error, None
        if err is not None:
            raise err

    def reclaim_abandoned(self) -> bool:
        """Take back the ring regions whose pipeline is gone or closed and that no write in
        flight holds (an owner interrupted outside its clean-up, or dropped without
        ``close()``): their reads are waited for first. Returns whether any was freed."""
        ring = self._ring
        if ring is None:
            return False
        freed = False
        with deferred_signals():
            held = {id(b.region) for b in self._pending}
            for r in ring.live():
                owner = r.owner() if r.owner is not None else None
                if id(r) in held or (owner is not None and not owner.closed):
                    continue
                for io in list(r.ios):
                    try:
                        io[1].result()
                    except BaseException:
                        pass
                ring.release(r)
                freed = True
        return freed

    def cancel_unwound(self, asking) -> bool:
        """Cancel the pipelines holding ring buffers (other than ``asking``) that the
        exception being handled unwound past without their ``with`` ending them: a frame of
        its traceback (or of one it was raised during) holds them, and no frame still
        running does (a Ctrl-C at the first line of ``__exit__``, before any of its code, so
        the pipeline is left open, reachable from the traceback only). Returns whether any
        was."""
        ring, exc = self._ring, sys.exc_info()[1]
        if ring is None or exc is None:
            return False
        open_ = {}
        for r in ring.live():
            owner = r.owner() if r.owner is not None else None
            if owner is not None and owner is not asking and not owner.closed:
                open_[id(owner)] = owner
        running = set()
        f = sys._getframe()
        while f is not None:
            running.add(id(f))
            f = f.f_back
        found, seen = {}, set()
        while exc is not None and id(exc) not in seen and len(found) < len(open_):
            seen.add(id(exc))
            tb = exc.__traceback__
            while tb is not None:
                if id(tb.tb_frame) not in running:
                    for v in tb.tb_frame.f_locals.values():
                        if open_.get(id(v)) is v:
                            found[id(v)] = v
                tb = tb.tb_next
            exc = exc.__context__
        for pipe in found.values():
            pipe.cancel()
        return bool(found)

    def forget(self) -> None:
        """Drop every record of writes in flight without waiting (their futures must never
        complete into the ring again: tests of ordering only)."""
        self._pending.clear()
        self._newest = None
        self._by_key.clear()
        self._batch_of.clear()
        self._last_batch.clear()

    # ------------------------------------------------------------------ damaged states
    def mark_damaged(self, keys: Iterable[StateKey], err: BaseException) -> None:
        """Record that the last write of ``keys`` failed with ``err``."""
        for k in keys:
            self._damaged.setdefault(k, err)

    def repaired(self, key: StateKey) -> None:
        """``key`` gets a whole new value (put, delete, a load): no longer stale."""
        self._damaged.pop(key, None)

    def is_damaged(self, key: StateKey) -> bool:
        """Whether ``key``'s last write failed."""
        return key in self._damaged

    def check_damaged_states(self, keys: Sequence[StateKey]) -> None:
        """:meth:`check_damaged` of ``keys`` at once (one C-level test while none is)."""
        if self._damaged and not self._damaged.keys().isdisjoint(keys):
            for k in keys:
                self.check_damaged(k)

    def check_damaged(self, key: StateKey) -> None:
        """Refuse a state whose last write failed: its stored value is stale, and handing it
        out would let training or a checkpoint go on silently with lost updates.

        Raises:
            StateStoreIOError: ``key``'s last write failed (naming that write's error).
        """
        err = self._damaged.get(key)
        if err is not None:
            raise StateStoreIOError(
                getattr(err, "errno", None) or errno.EIO,
                f"state {key} lost an update: its last write failed ({err}); its stored value "
                "is stale until put(), delete() or load_checkpoint() replaces it",
                getattr(err, "filename", None))

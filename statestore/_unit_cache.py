"""A streaming store's pipeline units, checked and laid out once and reused while the store's
layout is unchanged: what made a step over many small states cost tens of microseconds a
state in Python (issue 44).

Building a :class:`~statestore.pipeline.Pipeline` checks every slice
(:func:`~statestore.pipeline.check_slice`) and asks the store how each unit lies in the ring
(``store.extents.unit_plan``); starting a unit's reads makes a tensor view per slice. All of it
depends only on the units and on where the states lie in their files, so a store that counts
the changes of that (``layout_version``: NVMeStore's, bumped by every state created, removed
or loaded) keeps the result in a :class:`UnitCache` (its ``in_flight.units``), and a pipeline
over the same units (the same :class:`~statestore.Slice` objects, or equal ones) at the same
version skips all of it: a unit is then a few calls whatever its number of states. The views
of a unit at its last ring offsets are kept by the ring itself (``RingArena.views``), so they
go with its buffer and never hold a replaced one, within a share of the budget
(:data:`RING_BYTES_PER_VIEW`).

Stores without ``layout_version`` check and lay out every pipeline's units, as before.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ._ring import RingArena, round_up
from ._types import Slice, StateKey
from .errors import StateStoreValueError

__all__ = ["CompiledUnit", "UnitCache", "check_slice", "compile_units"]

#: ring bytes per view a ring may keep for its units: a view (a tensor object) takes about 300
#: bytes, so the views kept cost at most about 15% of the store's ``budget_bytes``
RING_BYTES_PER_VIEW = 2048
#: offsets of the ring a unit keeps its views at (it lands at a few in turn)
VIEW_SLOTS = 2
#: most sets of units a store keeps (the optimizer's step, a prefetch, a checkpoint's stream)
MAX_CACHED_SETS = 4


def check_slice(store, s: Slice) -> None:
    """Raise :class:`StateStoreValueError` (or :class:`StateKeyError`) unless ``s`` is a
    :class:`Slice` of a state of ``store``, inside it, starting at a multiple of the store's
    ``alignment`` bytes where the store streams."""
    if not isinstance(s, Slice):
        raise StateStoreValueError(f"pipeline units hold Slice objects, got {s!r}")
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (s.start, s.stop)):
        raise StateStoreValueError(f"slice of {s.key}: start and stop must be ints, got "
                                   f"{s.start!r}, {s.stop!r}")
    spec = store.spec(s.key)
    if not (0 <= s.start <= s.stop <= spec.numel):
        raise StateStoreValueError(f"slice [{s.start}, {s.stop}) out of range for state "
                                   f"{s.key} of {spec.numel} elements")
    if not store.resident and (s.start * spec.itemsize) % store.alignment:
        raise StateStoreValueError(f"slice of {s.key} starts at element {s.start}, not a "
                                   f"multiple of {store.alignment} bytes")


class CompiledUnit:
    """One unit, checked and laid out: its ``slices``, the store's ``plan`` (a
    :class:`~statestore.pipeline.UnitPlan`, or None: one request per slice), ``nbytes`` of
    ring it takes, its states' ``keys``, ``whole`` (every slice a whole state of at least one
    element: its reads and writes wait for, and mark, whole states) and where each slice's
    data lies in the unit's buffer (``layout``: ``(dtype, byte offset, elements)``)."""

    __slots__ = ("slices", "plan", "nbytes", "keys", "whole", "layout", "__weakref__")

    def __init__(self, store, slices: List[Slice]):
        for s in slices:
            check_slice(store, s)
        self.slices = slices
        layout = store.extents
        self.plan = layout.unit_plan(slices) if layout is not None else None
        spec = store.spec
        specs = [spec(s.key) for s in slices]
        self.keys: Tuple[StateKey, ...] = tuple(s.key for s in slices)
        self.whole = all(s.start == 0 and s.stop == sp.numel > 0 for s, sp in zip(slices, specs))
        if self.plan is None:
            sizes = [round_up(s.numel * sp.itemsize, store.alignment)
                     for s, sp in zip(slices, specs)]
            offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            self.nbytes = sum(sizes)
        else:
            offsets, self.nbytes = self.plan.offsets, self.plan.nbytes
        self.layout = [(sp.dtype, off, s.numel) for s, sp, off in zip(slices, specs, offsets)]

    def views(self, arena: RingArena, start: int) -> List[torch.Tensor]:
        """Each slice's tensor in the unit's buffer at ``start`` of ``arena`` (a new list).
        The arena keeps the views of a unit at its last :data:`VIEW_SLOTS` offsets, for the
        next time it lands there, while the unit is alive and up to its share of the budget
        (:data:`RING_BYTES_PER_VIEW`); past that they are made each time."""
        slots = arena.views.get(self)
        if slots is not None:
            for at, got in slots:
                if at == start:
                    return list(got)
        got = self._make_views(arena, start)
        if slots is not None and len(slots) >= VIEW_SLOTS:
            slots.pop(0)
            slots.append((start, got))
        elif _room(arena, len(got)):
            arena.views.setdefault(self, []).append((start, got))
        return list(got)

    def viewed_at_start(self, arena: RingArena) -> bool:
        """Whether ``arena`` keeps this unit's views at its start (offset 0): a unit that
        alternates between the start and the place after it (a read served from its own
        pending write, ``InFlightWrites.forward``) then keeps its views at both."""
        return any(at == 0 for at, _ in arena.views.get(self, ()))

    def _make_views(self, arena: RingArena, start: int) -> List[torch.Tensor]:
        out: List[torch.Tensor] = []
        if self.plan is None:
            for dtype, off, n in self.layout:
                raw = arena.view(start + off, n * dtype.itemsize)
                out.append(raw.view(dtype))
            return out
        typed: Dict[torch.dtype, torch.Tensor] = {}   # one view per dtype, then a slice of it
        for dtype, off, n in self.layout:
            whole = typed.get(dtype)
            if whole is None:
                whole = typed[dtype] = arena.view(start, self.nbytes).view(dtype)
            first = off // dtype.itemsize
            out.append(whole[first:first + n])
        return out


def _room(arena: RingArena, n: int) -> bool:
    """Whether ``arena`` may keep ``n`` more views (counting only live units' views)."""
    cap = arena.budget // RING_BYTES_PER_VIEW
    kept = sum(len(v) for slots in arena.views.values() for _, v in slots)
    return kept + n <= cap


def compile_units(store, units: List[List[Slice]]) -> List[CompiledUnit]:
    """``units`` (lists of Slice, as :func:`~statestore.pipeline.unit_lists` gives them)
    checked and laid out for ``store``, from its cache (``store.in_flight.units``) when the
    store has a ``layout_version`` and the same units were compiled at that version.

    Raises:
        StateStoreValueError, StateKeyError: a slice out of range, misaligned, or of no state.
    """
    version = getattr(store, "layout_version", None)
    cache: Optional[UnitCache] = getattr(store.in_flight, "units", None)
    if version is None or cache is None:
        return [CompiledUnit(store, u) for u in units]
    got = cache.find(units, version)
    if got is None:
        got = [CompiledUnit(store, u) for u in units]
        cache.keep(units, version, got)
    return got


class UnitCache:
    """The compiled units of a store's latest pipelines (a few sets, newest first), each
    valid at the ``layout_version`` it was compiled at. Matching a set compares its slices
    with ``==``: the same Slice objects (an optimizer's step plan hands the same ones every
    step) compare by identity, in C."""

    def __init__(self):
        self._sets: List[Tuple[int, List[List[Slice]], List[CompiledUnit]]] = []

    def find(self, units: Sequence[List[Slice]], version: int) -> Optional[List[CompiledUnit]]:
        """The compiled form of ``units`` at ``version``, or None."""
        for i, (v, us, compiled) in enumerate(self._sets):
            if v == version and len(us) == len(units) and us == units:
                if i:
                    self._sets.insert(0, self._sets.pop(i))
                return compiled
        return None

    def keep(self, units: Sequence[List[Slice]], version: int,
             compiled: List[CompiledUnit]) -> None:
        """Remember ``compiled`` for ``units`` (copied: a caller may change its lists)."""
        self._sets = [s for s in self._sets if s[0] == version][:MAX_CACHED_SETS - 1]
        self._sets.insert(0, (version, [list(u) for u in units], compiled))

    def clear(self) -> None:
        """Forget every set (the store closes)."""
        self._sets = []

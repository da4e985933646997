"""How pipeline units are packed: :func:`pack_runs` (items cut into runs of bounded weight,
every planner's packing) and :func:`plan_units` (groups of same-sized states split and packed
into units). Re-exported by :mod:`statestore.pipeline`, where the units are used."""
from __future__ import annotations

from typing import Iterable, List, Optional, Sequence, Tuple, TypeVar

from ._ring import round_up as _round_up
from ._types import StateKey

T = TypeVar("T")

__all__ = ["pack_runs", "plan_units"]


def pack_runs(weighted: Iterable[Tuple[T, int]], limit: Optional[int]) -> List[List[T]]:
    """The items of ``weighted`` (``(item, weight)`` pairs) in order, cut into runs whose
    weights add up to at most ``limit`` (None: one run); an item heavier than ``limit`` makes
    a run of its own. How every planner packs pipeline units (states, slices, parameters)."""
    runs: List[List[T]] = []
    cur: List[T] = []
    total = 0
    for item, w in weighted:
        if cur and limit is not None and total + w > limit:
            runs.append(cur)
            cur, total = [], 0
        cur.append(item)
        total += w
    if cur:
        runs.append(cur)
    return runs


def plan_units(groups: Sequence[Sequence[StateKey]], numels: Sequence[int], itemsize: int,
               max_unit_bytes: Optional[int], align_elems: int = 1, slice_round: int = 1
               ) -> List[List[Tuple[int, int, int]]]:
    """Split and pack groups of same-sized states into pipeline units.

    ``groups[i]`` lists the states visited together (all ``numels[i]`` elements of
    ``itemsize`` bytes). Returns units, each a list of ``(group index, start, stop)``: a large
    group is cut into ranges of at most ``max_unit_bytes`` (cut points multiples of
    ``align_elems``), small groups are packed together up to the same size.
    ``max_unit_bytes=None`` packs everything into one unit. Each slice's bytes count
    rounded up to ``slice_round`` (the ring's alignment), as the pipeline allocates them.
    """
    if max_unit_bytes is None:
        return [[(i, 0, n) for i, n in enumerate(numels)]] if numels else []

    def pieces():
        for i, n in enumerate(numels):
            per_elem = itemsize * max(len(groups[i]), 1)
            cap = max(align_elems, (max_unit_bytes // per_elem) // align_elems * align_elems)
            start = 0
            while start < n or (n == 0 and start == 0):
                stop = min(n, start + cap)
                yield ((i, start, stop),
                       len(groups[i]) * _round_up(max((stop - start) * itemsize, 1), slice_round))
                if n == 0:
                    break
                start = stop
    return pack_runs(pieces(), max_unit_bytes)

"""Whole states moved chunk by chunk through one pipeline: what :meth:`StateStore.stream`
returns, and the one way ``get``/``put``, checkpoints, ``state_dict()`` and fp32 master
export read or write whole states without holding them in RAM."""
from __future__ import annotations

from typing import Callable, Iterator, List, NamedTuple, Optional, Tuple

import torch

from ._types import Slice, StateKey, StateSpec, as_key
from .errors import StateStoreValueError
from .pipeline import StatePipeline

__all__ = ["Chunk", "StateStream", "chunk_ranges", "plan_slices"]


def chunk_ranges(spec: StateSpec, limit: int, cut_bytes: int) -> List[Tuple[int, int]]:
    """Element ranges ``(start, stop)`` covering a state of ``spec`` in chunks of at most
    ``limit`` bytes (at least one cut unit), cut at multiples of ``cut_bytes``; one empty
    range for an empty state."""
    if spec.numel == 0:
        return [(0, 0)]
    align = max(1, cut_bytes // max(spec.itemsize, 1))
    step = max(align, (limit // max(spec.itemsize, 1)) // align * align)
    return [(a, min(a + step, spec.numel)) for a in range(0, spec.numel, step)]


def plan_slices(keys, chunk_bytes: Optional[int],
                ranges: Callable[[StateKey, Optional[int]], List[Tuple[int, int]]]) -> List[Slice]:
    """The slices :meth:`StateStore.stream` moves ``keys`` (a key or an iterable of them)
    in: each state whole, in the element ranges ``ranges(key, chunk_bytes)`` (the store's
    chunking; ``chunk_bytes`` None: its default).

    Raises:
        StateStoreValueError: a bad key or ``chunk_bytes``. StateKeyError: no such state.
    """
    if chunk_bytes is not None and (isinstance(chunk_bytes, bool)
                                    or not isinstance(chunk_bytes, int) or chunk_bytes <= 0):
        raise StateStoreValueError(f"stream: chunk_bytes must be a positive int or None, "
                                   f"got {chunk_bytes!r}")
    if isinstance(keys, (str, StateKey)):
        keys = [keys]
    slices: List[Slice] = []
    for key in keys:
        k = as_key(key)
        slices += [Slice(k, a, b) for a, b in ranges(k, chunk_bytes)]
    return slices


class Chunk(NamedTuple):
    """One chunk of a stream: ``slice`` (the state and element range) and ``tensor``, its
    elements as a flat 1-D tensor on the store's ``device`` (``len == slice.numel``)."""

    slice: Slice
    tensor: torch.Tensor


class StateStream:
    """Iterates :class:`Chunk` s of whole states, in the order of the keys and, within a
    state, of its elements; built by :meth:`StateStore.stream`.

    Mode ``"r"``: each tensor holds the chunk's stored values (a streaming store's ring
    buffer, or a live view on resident stores: do not modify it). Mode ``"w"``: each tensor is
    the place to fill (on streaming stores an uninitialized buffer, written back when the
    iteration moves on; on resident stores the live view). Mode ``"rw"``: read, modified in
    place, written back.

    Chunks come a pipeline unit at a time (consecutive small chunks share one: see
    :func:`~statestore.pipeline.pack_runs`); a unit is written back when the iteration moves past its last
    chunk. Use it as a context manager: leaving the block by an exception drops the unit in
    hand (not written back) and every buffer goes back; iterating to the end, or
    :meth:`close`, hands the last unit back and (``wait=True``) waits for the writes.
    """

    __slots__ = ("pipeline", "slices")

    def __init__(self, pipeline: StatePipeline, slices: List[Slice]):
        self.pipeline = pipeline
        #: every chunk's slice, in the order they come
        self.slices = slices

    def __iter__(self) -> Iterator[Chunk]:
        slices = iter(self.slices)
        for tensors in self.pipeline:
            for t in tensors:
                yield Chunk(next(slices), t)

    def __len__(self) -> int:
        return len(self.slices)

    def close(self) -> None:
        """Hand back the chunk in hand and (``wait=True``) wait for every write; raises the
        first background error."""
        self.pipeline.close()

    def __enter__(self) -> "StateStream":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.pipeline.__exit__(exc_type, exc, tb)

"""Regions: the part of a tensor one rank holds.

A :class:`Region` is a box of a tensor of ``global_shape``: elements ``[offsets, offsets +
shape)`` in every dimension, kept row-major (C order) on its own, as a DTensor's local shard is.
FSDP2 (``fully_shard``) shards a parameter along one dimension of a 1-D mesh, so the local
tensor of rank ``r`` is :func:`chunk_region` of the parameter; on a 2-D mesh (HSDP, FSDP x
tensor parallel) it is a box cut along one or two dimensions, held by one rank or, along
``Replicate()`` mesh dimensions, by several (replicas). A parameter's optimizer states are
the same region of states of the parameter's global shape. Stores record the regions their
states hold (:meth:`statestore.StateStore.record_regions`); checkpoints record each tensor's
region in their manifest (``docs/checkpoint-format.md``); a load copies any region out of
the regions saved (:func:`runs`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Tuple

__all__ = ["Region", "chunk_region", "runs"]


def _ints(xs: Sequence[int]) -> Tuple[int, ...]:
    return tuple(int(x) for x in xs)


@dataclass(frozen=True)
class Region:
    """Elements ``[offsets, offsets + shape)`` of a tensor of ``global_shape``.

    Attributes:
        global_shape: the whole tensor's shape.
        offsets: where the region starts, per dimension.
        shape: the region's extent, per dimension (the local tensor's shape).
    """

    global_shape: Tuple[int, ...]
    offsets: Tuple[int, ...]
    shape: Tuple[int, ...]

    @classmethod
    def whole(cls, shape: Sequence[int]) -> "Region":
        """The whole tensor of ``shape``."""
        shape = _ints(shape)
        return cls(shape, (0,) * len(shape), shape)

    @classmethod
    def of(cls, global_shape: Sequence[int], offsets: Sequence[int],
           shape: Sequence[int]) -> "Region":
        """A region from any sequences of ints (torch.Size, lists)."""
        return cls(_ints(global_shape), _ints(offsets), _ints(shape))

    @property
    def is_whole(self) -> bool:
        return self.shape == self.global_shape and not any(self.offsets)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def problem(self) -> Optional[str]:
        """What makes this not a region of its tensor (None when nothing does): lengths that
        differ, a negative number, or a box that ends past the tensor."""
        n = len(self.global_shape)
        if len(self.offsets) != n or len(self.shape) != n:
            return (f"global shape {list(self.global_shape)}, offsets {list(self.offsets)} "
                    f"and shape {list(self.shape)} must have one entry per dimension")
        for g, o, s in zip(self.global_shape, self.offsets, self.shape):
            if g < 0 or o < 0 or s < 0 or o + s > g:
                return (f"offsets {list(self.offsets)} + shape {list(self.shape)} do not fit "
                        f"in global shape {list(self.global_shape)}")
        return None

    def split_dim(self) -> Optional[int]:
        """The one dimension along which this region is part of its tensor (None: the whole
        tensor, or an empty region); -1 when it is cut along several."""
        if self.numel == 0:
            return None
        cut = [d for d, (g, s) in enumerate(zip(self.global_shape, self.shape)) if s != g]
        if not cut:
            return None
        return cut[0] if len(cut) == 1 else -1

    def intersect(self, other: "Region") -> Optional["Region"]:
        """The elements both regions hold (None when none), a region of the same tensor."""
        offs, shape = [], []
        for a, sa, b, sb in zip(self.offsets, self.shape, other.offsets, other.shape):
            lo, hi = max(a, b), min(a + sa, b + sb)
            if hi <= lo:
                return None
            offs.append(lo)
            shape.append(hi - lo)
        return Region(self.global_shape, tuple(offs), tuple(shape))

    def describe(self) -> str:
        """``[a:b, :, ...]`` of the global shape, for messages."""
        if self.is_whole:
            return f"whole {list(self.global_shape)}"
        dims = [":" if (o == 0 and s == g) else f"{o}:{o + s}"
                for g, o, s in zip(self.global_shape, self.offsets, self.shape)]
        return f"[{', '.join(dims)}] of {list(self.global_shape)}"


def chunk_region(global_shape: Sequence[int], dim: int, rank: int, world: int) -> Region:
    """The region rank ``rank`` of ``world`` holds of a tensor sharded along ``dim`` as a
    DTensor ``Shard(dim)`` placement on a 1-D mesh (FSDP2): chunks of ``ceil(n / world)``,
    the last ones shorter or empty (an empty chunk starts at ``n``)."""
    global_shape = _ints(global_shape)
    n = global_shape[dim]
    size = -(-n // world) if world else n
    start = min(rank * size, n)
    stop = min(start + size, n)
    offs = [0] * len(global_shape)
    offs[dim] = start
    shape = list(global_shape)
    shape[dim] = stop - start
    return Region(global_shape, tuple(offs), tuple(shape))


def _strides(shape: Sequence[int]) -> Tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


def runs(src: Region, dst: Region) -> Iterator[Tuple[int, int, int]]:
    """The elements ``src`` and ``dst`` share as runs contiguous in both, in increasing order
    (the same order in both, row-major): ``(element offset in src, element offset in dst,
    length)``. Nothing when they share nothing."""
    common = src.intersect(dst)
    if common is None:
        return
    nd = len(common.shape)
    if nd == 0:
        yield 0, 0, 1
        return
    # The runs are contiguous over the trailing dimensions both boxes hold whole.
    k = nd - 1
    while k > 0 and common.shape[k] == src.shape[k] == dst.shape[k]:
        k -= 1
    length = math.prod(common.shape[k:])
    ss, ds = _strides(src.shape), _strides(dst.shape)
    base_s = sum((c - o) * st for c, o, st in zip(common.offsets, src.offsets, ss))
    base_d = sum((c - o) * st for c, o, st in zip(common.offsets, dst.offsets, ds))
    outer = common.shape[:k]
    for i in range(math.prod(outer)):
        # index i over the outer dimensions, row-major
        s_off, d_off = base_s, base_d
        rem = i
        for j in range(k - 1, -1, -1):
            idx = rem % outer[j]
            rem //= outer[j]
            s_off += idx * ss[j]
            d_off += idx * ds[j]
        yield s_off, d_off, length

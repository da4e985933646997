"""Sharding optimizer states over a ``torch.distributed`` process group.

Parameters are assigned whole to ranks by :func:`partition`: a deterministic greedy balance
by element count that depends only on the parameters' sizes (in optimizer order) and the
world size. The optimizer, the distributed checkpoint save and the resharding load all call
it, so a rank knows which states it owns from the checkpoint's manifest alone, before any
optimizer exists, at any world size.
"""
from __future__ import annotations

import heapq
from typing import List, Sequence

from .errors import StateStoreError, StateStoreValueError

__all__ = ["partition", "group_info"]


def partition(numels: Sequence[int], world_size: int) -> List[int]:
    """Owner rank of each parameter: largest first, each to the least loaded rank (ties to
    the lower rank). Deterministic; balanced to within the largest parameter."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise StateStoreValueError(f"world_size must be a positive int, got {world_size!r}")
    owners = [0] * len(numels)
    heap = [(0, r) for r in range(world_size)]
    order = sorted(range(len(numels)), key=lambda i: (-int(numels[i]), i))
    for i in order:
        load, r = heapq.heappop(heap)
        owners[i] = r
        heapq.heappush(heap, (load + int(numels[i]), r))
    return owners


def group_info(process_group):
    """``(rank, world_size)`` in ``process_group``; a clear error when torch.distributed is
    not initialized."""
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise StateStoreError("process_group given but torch.distributed is not initialized "
                              "(call torch.distributed.init_process_group first)")
    return dist.get_rank(process_group), dist.get_world_size(process_group)

"""Sharding optimizer states over a ``torch.distributed`` process group.

Parameters are assigned whole to ranks by :func:`partition`: a deterministic greedy balance
by element count that depends only on the parameters' sizes (in optimizer order) and the
world size. The optimizer, the distributed checkpoint save and the resharding load all call
it, so a rank knows which states it owns from the checkpoint's manifest alone, before any
optimizer exists, at any world size.
"""
from __future__ import annotations

import heapq
from typing import Dict, List, Sequence

from .errors import StateStoreError, StateStoreValueError

__all__ = ["partition", "group_info", "resolve_load_group", "owners_from_metadata"]


def partition(numels: Sequence[int], world_size: int) -> List[int]:
    """Owner rank of each parameter: largest first, each to the least loaded rank (ties to
    the lower rank). Deterministic; balanced to within the largest parameter."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise StateStoreValueError(f"world_size must be a positive int, got {world_size!r}")
    try:
        numels = list(numels)
    except TypeError:
        raise StateStoreValueError(f"numels must be a sequence of element counts, got "
                                   f"{numels!r}"[:200]) from None
    for i, n in enumerate(numels):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise StateStoreValueError(f"numels[{i}] must be a non-negative int, got {n!r}")
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


# ---------------------------------------------------------------------------------- groups
def resolve_load_group(process_group):
    """The group a checkpoint load shards over: ``"auto"`` is the default group when
    torch.distributed is initialized with more than one rank, else None (load everything)."""
    if process_group is None:
        return None
    if isinstance(process_group, str):
        if process_group != "auto":
            raise StateStoreValueError(f"process_group must be a ProcessGroup, None or "
                                       f"'auto', got {process_group!r}")
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        return dist.group.WORLD
    group_info(process_group)
    return process_group


def owners_from_metadata(metadata: dict, numel_of_rows: Dict[str, int],
                         world_size: int) -> Dict[str, int]:
    """Owner rank of each parameter of a checkpoint at ``world_size``, computed exactly as a
    sharded optimizer over the same parameters computes it (:func:`partition` over the
    parameters' element counts in optimizer order). The order and sizes come from the
    optimizer metadata's ``params`` table; parameters missing from it (a checkpoint saved
    without an optimizer) follow in manifest order with the size of their states,
    ``numel_of_rows`` (parameter name -> element count, in manifest order)."""
    order: List[str] = []
    numels: List[int] = []
    table = metadata.get("params") if isinstance(metadata, dict) else None
    seen = set()
    if isinstance(table, dict):
        for name, info in table.items():
            shape = info.get("shape") if isinstance(info, dict) else None
            if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
                continue
            n = 1
            for d in shape:
                n *= d
            order.append(str(name))
            numels.append(n)
            seen.add(str(name))
    for name in numel_of_rows:
        if name not in seen:
            order.append(name)
            numels.append(numel_of_rows.get(name, 0))
            seen.add(name)
    return dict(zip(order, partition(numels, world_size)))


class Collective:
    """The few object collectives a sharded checkpoint save needs, over one group."""

    def __init__(self, process_group):
        import torch.distributed as dist
        self.dist = dist
        self.group = process_group
        self.rank, self.world = group_info(process_group)

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank."""
        box = [obj]
        self.dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def all_gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order, on every rank."""
        out = [None] * self.world
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

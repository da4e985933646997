"""The distributed side of a sharded optimizer (``process_group=pg``): which rank keeps each
parameter's states (:func:`statestore.distributed.partition`), the gradient all-reduce before
a step and the parameter broadcast after it (``docs/distributed.md``)."""
from __future__ import annotations

from typing import Dict, List, Sequence

from torch import Tensor

from ..distributed import group_info, partition

__all__ = ["Sharding"]


class Sharding:
    """This rank's share of the optimizer states over ``process_group``.

    Args:
        process_group: a ``torch.distributed`` group (``dist.group.WORLD`` included).
        params: every parameter of the optimizer, in group order (the partition's order).
    """

    def __init__(self, process_group, params: Sequence[Tensor]):
        self.group = process_group
        self.rank, self.world = group_info(process_group)
        owners = partition([p.numel() for p in params], self.world)
        self.owner: Dict[Tensor, int] = dict(zip(params, owners))

    def owns(self, p: Tensor) -> bool:
        """Whether this rank keeps ``p``'s states."""
        return self.owner[p] == self.rank

    def allreduce_grads(self, params: Sequence[Tensor], grads: Dict[Tensor, Tensor]) -> None:
        """Average gradients over the group (all-reduce, as DDP does): afterwards every
        rank's ``p.grad`` holds the group mean. ``grads``: each parameter's gradient (made
        contiguous, possibly a copy of ``p.grad``, which is then replaced by it)."""
        import torch.distributed as dist
        handles = []
        for p in params:
            g = grads.get(p)
            if g is None:
                continue
            if g is not p.grad:          # made contiguous: reduce the copy, then store it back
                p.grad = g
            handles.append(dist.all_reduce(g, op=dist.ReduceOp.SUM, group=self.group,
                                           async_op=True))
        for h in handles:
            h.wait()
        for g in grads.values():
            g.div_(self.world)

    def broadcast_params(self, params: List[Tensor]) -> None:
        """Each owner sends its updated parameters to every rank (the all-gather step)."""
        import torch.distributed as dist
        handles = []
        for p in params:
            src = dist.get_global_rank(self.group, self.owner[p]) \
                if self.group is not dist.group.WORLD else self.owner[p]
            handles.append(dist.broadcast(p.detach(), src=src, group=self.group,
                                          async_op=True))
        for h in handles:
            h.wait()

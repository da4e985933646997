"""Updates that need the whole tensor (Muon's Newton-Schulz orthogonalization, Adafactor's
norms) over DTensor parameters sharded across ranks (FSDP2, HSDP, FSDP x TP):
:class:`WholeUpdates`, used by :class:`~statestore.optim.StoreOptimizer`
(``docs/distributed.md``, "Optimizers whose update needs the whole tensor").

Each rank keeps the states of its shard in its own store, as for an element-wise class. To
update a parameter, every rank all-gathers, over the parameter's mesh, the parameter, its
gradient and each of its states into whole tensors (``DTensor.full_tensor()``: uneven,
empty, 2-D and strided shards included), runs the class's own ``step()`` on them, exactly as
the class does on the unsharded parameter, and keeps its region of the results: the updated
parameter shard and the states' shards. One parameter at a time, in the optimizer's order
(the same on every rank: every rank steps every parameter, its shard empty or not), so a
rank holds at most one whole parameter, gradient and state set beyond its shards.

States shaped like the parameter (Muon's ``momentum_buffer``) are kept as the rank's shard;
the others (Adafactor's row and column variances) are kept whole by every rank: the class
computes them from the gathered tensors, identically on every rank, and a checkpoint holds
them once.
"""
from __future__ import annotations

from typing import Dict

import torch
from torch import Tensor

from .._regions import Region
from ._dtensor import contiguous_strides, local, region_of, sharded_over_ranks

__all__ = ["WholeUpdates"]


class WholeUpdates:
    """The sharded parameters of one optimizer, if its class updates whole tensors.

    Args:
        active: whether the class's update needs the whole tensor (not element-wise): then
            every DTensor parameter sharded over several ranks
            (:func:`~statestore.optim._dtensor.sharded_over_ranks`), those of groups added
            later included, is updated gathered.

    Every method that gathers is a collective over the parameter's mesh: every rank calls
    it, for the same parameters in the same order.
    """

    def __init__(self, active: bool):
        self.active = active

    def covers(self, p: Tensor) -> bool:
        """Whether ``p`` is updated whole (gathered) rather than on its shard."""
        return self.active and sharded_over_ranks(p)

    def gather(self, p: Tensor, t: Tensor) -> Tensor:
        """The whole tensor of which ``t`` (shaped like ``p``'s local shard) is this rank's
        shard: an all-gather over ``p``'s mesh."""
        from torch.distributed.tensor import DTensor
        shard = t.detach().reshape(local(p).shape)
        d = DTensor.from_local(shard, p.device_mesh, p.placements, run_check=False,
                               shape=p.shape, stride=contiguous_strides(p.shape))
        return d.full_tensor()

    def proxy(self, p: Tensor, grad: Tensor) -> Tensor:
        """The whole parameter the class updates in place of ``p``: its shards gathered, with
        the gathered gradient (``grad``: the local part of ``p``'s gradient)."""
        w = self.gather(p, local(p))
        w.grad = self.gather(p, grad)
        return w

    def gather_states(self, p: Tensor, state: Dict[str, Tensor]) -> Dict[str, Tensor]:
        """``state`` with each tensor shaped like ``p``'s shard gathered whole; the others
        (Adafactor's row and column variances, scalars) are whole on every rank already."""
        shard = tuple(local(p).shape)
        return {name: self.gather(p, t) if tuple(t.shape) == shard else t
                for name, t in state.items()}

    def mine(self, p: Tensor, whole: Tensor) -> Tensor:
        """This rank's region of ``whole`` (a tensor of ``p``'s global shape): always a new
        view, never ``whole`` itself (a state the class updated in place is then still told
        apart from the tensor given, and copied into the store's)."""
        r = region_of(p) or Region.whole(p.shape)
        return whole[tuple(slice(o, o + n) for o, n in zip(r.offsets, r.shape))]

    def finish(self, p: Tensor, proxy: Tensor, after: Dict[str, object]) -> Dict[str, object]:
        """After the class's step on ``proxy``: this rank's region of the updated parameter
        copied into ``p``'s shard; ``after`` (the class's states for ``proxy``) with each
        tensor state cut to this rank's region (other entries, ``"step"``, as they are)."""
        with torch.no_grad():
            local(p).copy_(self.mine(p, proxy))
        return {k: self.mine(p, v) if isinstance(v, Tensor) and tuple(v.shape) == tuple(p.shape)
                else v for k, v in after.items()}

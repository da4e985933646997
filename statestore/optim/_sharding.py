"""The distributed side of a sharded optimizer (``process_group=pg``): which rank keeps each
parameter's states (:func:`statestore.distributed.partition`), the gradient all-reduce before
a step and the parameter broadcast after it, and what keeps one rank's share of the states
from passing for the whole (``docs/distributed.md``, "state_dict() of a sharded optimizer")."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from torch import Tensor

from ..distributed import group_info, partition
from ..errors import StateStoreError
from ._torch_format import export_state_dict

__all__ = ["Sharding", "SHARD_KEY", "check_not_partial", "refuse_partial", "shard_state_dict"]

#: Top-level key of a state dict that holds one rank's shard (``shard_state_dict()``):
#: ``{"world_size": W, "owners": [owner rank of each parameter, torch's numbering]}``. The
#: same on every rank, so ``torch.distributed.checkpoint`` (which keeps one copy of a key every
#: rank saves) merges the ranks' dicts into a whole one that still carries the right value.
SHARD_KEY = "statestore_shard"

_WHAT_INSTEAD = (
    "save with store.save_checkpoint(path) on every rank (a collective that writes one "
    "checkpoint; statestore's integrations StateStoreTrainer, "
    "statestore.integrations.accelerate.prepare and lightning's StateStoreCheckpoint do "
    "this), or, for torch.distributed.checkpoint, save StateStoreStateful(opt) or "
    "opt.shard_state_dict() on every rank")


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

    def refuse_partial(self, what: str) -> None:
        """Raise unless this rank keeps every parameter's states (a group of one rank):
        ``what`` (e.g. ``"state_dict()"``) would otherwise return this rank's shard only, and
        a framework that saves it from one rank (HF Trainer's ``optimizer.pt``, accelerate's
        ``optimizer.bin``, Lightning's ``.ckpt``) resumes silently wrong.

        Raises:
            StateStoreError: naming the shard and what to call instead.
        """
        if self.world == 1:
            return
        mine = sum(1 for r in self.owner.values() if r == self.rank)
        raise StateStoreError(
            f"{what} of a sharded optimizer (process_group of {self.world} ranks): rank "
            f"{self.rank} keeps the states of {mine} of the {len(self.owner)} parameters "
            f"only, and a partial state dict would resume silently wrong; {_WHAT_INSTEAD}")

    def shard_marker(self, params: Sequence[Tensor]) -> Dict[str, Any]:
        """The :data:`SHARD_KEY` entry of this rank's shard (``params``: torch's order)."""
        return {"world_size": self.world, "owners": [self.owner[p] for p in params]}

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


def refuse_partial(sharding: Optional[Sharding], what: str) -> None:
    """:meth:`Sharding.refuse_partial` where the optimizer is sharded, else nothing."""
    if sharding is not None:
        sharding.refuse_partial(what)


def shard_state_dict(sharding: Optional[Sharding], param_groups: List[dict], table,
                     layout) -> Dict[str, Any]:
    """``shard_state_dict()`` of an optimizer: torch's format holding the parameters whose
    states this rank keeps, marked with :data:`SHARD_KEY` where the optimizer is sharded, so
    that ``load_state_dict`` refuses it wherever other ranks' states are needed
    (:func:`check_not_partial`). For ``torch.distributed.checkpoint``: every rank saves its
    own shard, and ``dcp.load`` merges them into the whole dict. Without a process group it
    is ``state_dict()``."""
    out = export_state_dict(param_groups, table, layout)
    if sharding is not None:
        out[SHARD_KEY] = sharding.shard_marker(table.params)
    return out


def check_not_partial(state_dict: Any, sharding: Optional[Sharding], table) -> None:
    """Refuse a state dict that holds some ranks' shards only (``shard_state_dict()`` of one
    rank, :data:`SHARD_KEY`) where its loader needs more: an optimizer that is not sharded
    the same way needs every rank's shard, a sharded one its own rank's. A dict without the
    key, or merged from every rank's shard (``torch.distributed.checkpoint``), passes.

    Args:
        state_dict: what ``load_state_dict`` was given.
        sharding: the loading optimizer's, or None.
        table: the loading optimizer's ``ParamTable`` (state dicts may be keyed by name).

    Raises:
        StateStoreError: naming the ranks present and what to load instead.
    """
    mark = state_dict.get(SHARD_KEY) if isinstance(state_dict, dict) else None
    if mark is None:
        return
    owners, world = (mark.get("owners"), mark.get("world_size")) if isinstance(mark, dict) \
        else (None, None)
    if not isinstance(owners, list) or not isinstance(world, int) \
            or not all(isinstance(r, int) for r in owners):
        raise StateStoreError(f"state dict entry {SHARD_KEY!r} is malformed (expected "
                              f"{{'world_size': int, 'owners': [int, ...]}})")
    states = state_dict.get("state")
    index_of = {table.keys[p]: i for i, p in enumerate(table.params)}
    present = set()
    for k in (states if isinstance(states, dict) else ()):
        i = k if isinstance(k, int) else index_of.get(str(k))
        if isinstance(i, int) and 0 <= i < len(owners):
            present.add(owners[i])
    if not present:
        return                          # no states at all: nothing partial to load
    holding = set(owners)
    same = sharding is not None and sharding.world == world and len(owners) == len(
        sharding.owner) and list(sharding.owner.values()) == owners
    if same:
        if sharding.rank in present or sharding.rank not in holding:
            return
        need = f"rank {sharding.rank}'s"
    elif present >= holding:
        return
    else:
        need = "every rank's"
    raise StateStoreError(
        f"load_state_dict: this state dict holds the optimizer states of rank(s) "
        f"{sorted(present)} of a sharded optimizer over {world} ranks only (it came from "
        f"shard_state_dict() on one rank), and this optimizer needs {need}; loading it would "
        f"resume the other parameters from zero moments silently. Load a statestore "
        f"checkpoint (store.load_checkpoint on every rank), or each rank's own shard into "
        f"that rank's sharded optimizer, or the dict torch.distributed.checkpoint merges from "
        f"every rank's shard")

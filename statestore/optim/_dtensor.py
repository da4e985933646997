"""DTensor parameters (FSDP2's ``fully_shard``, or any DTensor on a 1-D mesh): the local
tensor an update runs on, the region of its parameter it is, and the DTensor views of its
states that ``optimizer.state`` and ``state_dict()`` give (``docs/distributed.md``, "FSDP2").

An optimizer keeps the user's parameters (DTensors) in its groups, as torch's do, so that
``torch.distributed.checkpoint`` maps them to their names. Everything that touches data goes
through :func:`local`: the update runs on each rank's local shard with statestore's kernels,
no DTensor dispatch in the step; the states are the shard's, in the rank's store, keyed by the
parameter's name, of the shard's shape. :class:`DTensorParams` checks the placements once and
gives the regions (:class:`statestore._regions.Region`) the store records and the process
group its checkpoints are collective over; :func:`as_param_layout` wraps a local state as a
DTensor of the parameter's mesh and placements, and :func:`local_state` takes the local part
of a state given in torch's format (a DTensor of any placements, or a whole tensor).

Supported: meshes of any number of dimensions whose placements are ``Shard(d)`` (any ``d``,
uneven and empty shards included), ``Replicate()``, or FSDP2's ``_StridedShard`` where the
local shard is a box of the parameter (FSDP over tensor parallelism sharding one dimension
twice): 1-D FSDP2, HSDP (``Replicate()`` x ``Shard(d)``) and FSDP x TP (``Shard`` x ``Shard``).
Ranks whose coordinates differ only along ``Replicate()`` dimensions hold the same region (a
replica): they step it identically from identical gradients, and a checkpoint writes it once.
Refused, naming the parameter and its placements: ``Partial``, and strided shards whose
local tensor is not one box of the parameter.
"""
from __future__ import annotations

import functools
import itertools
import sys
import weakref
from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor

from .._regions import Region
from ..errors import StateStoreError, StateStoreValueError

__all__ = ["contiguous_strides", "is_dtensor", "local", "local_shape", "local_grad", "DTensorParams", "as_param_layout",
           "local_state", "region_of", "sharded_over_ranks", "any_rank"]


def _dtensor_type():
    """torch's DTensor class, or None while ``torch.distributed.tensor`` is not imported (no
    DTensor can exist then, and importing it costs a fraction of a second)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def is_dtensor(t) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def local(p: Tensor) -> Tensor:
    """The tensor an update of ``p`` runs on: a DTensor's local shard (sharing its storage),
    else ``p`` itself."""
    if is_dtensor(p):
        with torch.no_grad():
            return p.to_local()
    return p


def local_shape(p: Tensor) -> tuple:
    """The shape of :func:`local` ``(p)``: what a state "shaped like the parameter" has in
    the store."""
    return tuple(local(p).shape)


def _is_shard(pl) -> bool:
    """``Shard(d)`` or ``_StridedShard(d, ...)`` (not a subclass of ``Shard`` in every torch
    release)."""
    from torch.distributed.tensor import Shard
    return isinstance(pl, Shard) or type(pl).__name__ == "_StridedShard"


def sharded_over_ranks(p: Tensor) -> bool:
    """Whether ``p`` is a DTensor cut over several ranks (a shard placement on a mesh
    dimension of more than one rank): each rank then updates a part of it. The same answer
    on every rank (an empty or whole local shard included), so that a refusal based on it
    happens on all of them."""
    if not is_dtensor(p):
        return False
    mesh = p.device_mesh
    return any(_is_shard(pl) and mesh.size(i) > 1 for i, pl in enumerate(p.placements))


def local_grad(p: Tensor, g: Tensor) -> Tensor:
    """The local part of ``p``'s gradient ``g``: a DTensor gradient is brought to ``p``'s
    placements first if it has others (e.g. ``Partial`` after a tensor-parallel backward; a
    collective, outside the hot path)."""
    if not is_dtensor(g):
        return g
    if is_dtensor(p) and tuple(g.placements) != tuple(p.placements):
        g = g.redistribute(p.device_mesh, p.placements)
    with torch.no_grad():
        return g.to_local()


def region_of(p: Tensor) -> Optional[Region]:
    """The region of ``p``'s global tensor its local shard holds (None: the whole tensor,
    or not a DTensor): the box torch's ``compute_local_shape_and_global_offset`` gives at
    this rank's mesh coordinate (on a 1-D mesh, ``Shard(d)`` is
    :func:`statestore._regions.chunk_region`), checked against the local tensor's shape."""
    if not is_dtensor(p):
        return None
    if not any(_is_shard(pl) for pl in p.placements):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offsets = compute_local_shape_and_global_offset(p.shape, p.device_mesh,
                                                           p.placements)
    r = Region.of(p.shape, offsets, shape)
    if tuple(local(p).shape) != r.shape or r.problem() is not None:
        raise StateStoreError(f"DTensor parameter of shape {tuple(p.shape)} placed "
                              f"{tuple(p.placements)}: its local shard has shape "
                              f"{tuple(local(p).shape)}, not the {r.shape} at offsets "
                              f"{r.offsets} torch computes for this rank")
    return None if r.is_whole else r


@functools.lru_cache(maxsize=256)
def _boxes_tile(global_shape: tuple, mesh_shape: tuple, placements: tuple) -> bool:
    """Whether, at every mesh coordinate, the local shard of a DTensor of ``global_shape``
    placed ``placements`` is the box torch reports (first offset and local shape per
    dimension). Per tensor dimension, the index sets of the coordinates partition the
    dimension; their boxes ``[first, first + size)`` then partition it too exactly when
    every set is contiguous (sorted by first index, each box must start where the previous
    ended), so it suffices to check that the distinct non-empty boxes tile the dimension.
    Only the mesh dimensions that shard some tensor dimension are walked."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    cut = [i for i, pl in enumerate(placements) if _is_shard(pl)]
    spans = [set() for _ in global_shape]
    for coords in itertools.product(*(range(mesh_shape[i]) for i in cut)):
        coord = [0] * len(mesh_shape)
        for i, c in zip(cut, coords):
            coord[i] = c
        shape, offs = _compute_local_shape_and_global_offset(global_shape, mesh_shape, coord,
                                                              placements)
        for d, (o, n) in enumerate(zip(offs, shape)):
            if n:
                spans[d].add((int(o), int(n)))
    for d, n in enumerate(global_shape):
        at = 0
        for o, k in sorted(spans[d]):
            if o != at:
                return False
            at = o + k
        if n and at != n:
            return False
    return True


def _placement_problem(p: Tensor) -> Optional[str]:
    from torch.distributed.tensor import Replicate, Shard
    mesh = p.device_mesh
    where = (f"a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)} with placements "
             f"{tuple(p.placements)}")
    for pl in p.placements:
        if type(pl) not in (Shard, Replicate) and not _is_shard(pl):
            return (f"a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)} with placement "
                    f"{pl!r} (placements {tuple(p.placements)})")
    if any(type(pl).__name__ == "_StridedShard" for pl in p.placements):
        try:
            ok = _boxes_tile(tuple(p.shape), tuple(mesh.shape), tuple(p.placements))
        except Exception:           # a torch whose helpers differ: not a box we can prove
            ok = False
        if not ok:
            return f"{where}, whose local shards are not boxes of the parameter"
    return None


#: the group over every rank of each multi-dimensional mesh not holding every rank
_FLAT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _mesh_group(mesh):
    """The process group over every rank of ``mesh``: its own group on a 1-D mesh, the
    default group when the mesh holds every rank, else the group of the mesh flattened
    (torch's ``DeviceMesh._flatten``, made once per mesh: a collective of the mesh's ranks,
    at the optimizer's construction)."""
    if mesh.ndim == 1:
        return mesh.get_group()
    import torch.distributed as dist
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    group = _FLAT.get(mesh)
    if group is None:
        try:
            group = _FLAT[mesh] = mesh._flatten().get_group()
        except Exception as e:
            raise StateStoreValueError(
                f"a {mesh.ndim}-D mesh of {mesh.size()} of the {dist.get_world_size()} "
                f"ranks: its ranks' process group could not be made ({e}); build the mesh "
                f"over every rank") from e
    return group


_UNSET = object()


class DTensorParams:
    """The DTensor parameters of one optimizer, checked.

    Args:
        params: every parameter of the optimizer.
        keys: each parameter's key.
        process_group: the optimizer's ``process_group`` (data-parallel sharding of whole
            parameters), refused with DTensor parameters.
        group: for ``add_param_group``: the group the optimizer's stores save over, which
            the parameters must keep.

    Attributes:
        group: the group the optimizer's stores save collectively over: ``process_group``,
            else the process group of the parameters' mesh when one of them is sharded over
            more than one rank, else None.

    Raises:
        StateStoreValueError: a DTensor parameter with a placement other than
            ``Shard(d)``/``Replicate()`` (or a strided shard that is not a box); DTensor
            parameters on meshes of different process groups; DTensor parameters with a
            ``process_group``; parameters added on another mesh than ``group``.
    """

    def __init__(self, params: Sequence[Tensor], keys: Dict[Tensor, str], process_group=None,
                 group=_UNSET):
        self.params: List[Tensor] = [p for p in params if is_dtensor(p)]
        self.keys = keys
        self.group = process_group
        if self.params and process_group is not None:
            raise StateStoreValueError(
                f"process_group shards whole parameters over a group (data parallel), and "
                f"parameter {keys[self.params[0]]!r} is a DTensor, already sharded (FSDP2): "
                f"leave process_group out (the store's checkpoints are collective over the "
                f"parameters' mesh)")
        groups = []
        for p in self.params:
            problem = _placement_problem(p)
            if problem is not None:
                raise StateStoreValueError(
                    f"parameter {keys[p]!r} is a DTensor on {problem}: statestore optimizers "
                    f"take DTensor parameters sharded (Shard(d), or FSDP x TP's strided shards "
                    f"of one box) or replicated (Replicate()) over each mesh dimension, as "
                    f"fully_shard (1-D, HSDP) and parallelize_module make them; Partial "
                    f"placements, and strided shards whose local tensor is not one box of the "
                    f"parameter, are not supported")
            groups.append(_mesh_group(p.device_mesh))
        if any(g is not groups[0] for g in groups):
            raise StateStoreValueError(
                "the optimizer's DTensor parameters are on meshes of different process groups; "
                "give each mesh's parameters their own optimizer (each store saves over one "
                "group)")
        if self.params and max(p.device_mesh.size() for p in self.params) > 1:
            self.group = groups[0]
        if group is not _UNSET and self.group is not group:
            raise StateStoreValueError(
                "add_param_group: the new parameters would make the optimizer's checkpoints "
                "collective over another process group than its stores save over; build the "
                "optimizer with every DTensor parameter of one mesh from the start")

    def __bool__(self) -> bool:
        return bool(self.params)

    def regions(self, among: Optional[Sequence[Tensor]] = None) -> Dict[str, Region]:
        """``{key: region}`` of the parameters (of ``among``) whose shard is not the whole
        tensor."""
        out = {}
        for p in self.params if among is None else [p for p in among if is_dtensor(p)]:
            r = region_of(p)
            if r is not None:
                out[self.keys[p]] = r
        return out

    def all_finite(self, grads: List[Tensor]) -> bool:
        """Whether ``grads`` (this rank's local gradients) and every other rank's of the
        parameters' mesh are finite (so that ``skip_nonfinite`` skips a step on every rank
        or on none)."""
        from ..kernels import grads_finite
        finite = grads_finite(grads)
        if not self.params or self.group is None:
            return finite
        import torch.distributed as dist
        flag = torch.tensor([1 if finite else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())


def any_rank(params: Sequence[Tensor], flags: Sequence[bool]) -> List[bool]:
    """Each of ``flags`` or-ed over every rank of the mesh of the first DTensor parameter of
    ``params`` sharded over several ranks (one all-reduce, on that parameter's device: every
    rank must call it); ``flags`` as they are when there is none."""
    p = next((q for q in params if sharded_over_ranks(q)), None)
    if p is None or not flags:
        return list(flags)
    import torch.distributed as dist
    t = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32, device=local(p).device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_mesh_group(p.device_mesh))
    return [bool(v) for v in t.tolist()]


def as_param_layout(p: Tensor, t: Tensor) -> Tensor:
    """A state ``t`` of ``p``'s local shard as torch's optimizers keep states of DTensor
    parameters: a DTensor of ``p``'s mesh, placements and global shape (sharing ``t``'s
    storage); ``t`` itself when ``p`` is not a DTensor, or when ``t`` is not shaped like the
    local shard (a per-parameter scalar such as NAdam's ``mu_product``, which torch's
    optimizers keep as a plain tensor for DTensor parameters too)."""
    if not is_dtensor(p) or tuple(t.shape) != tuple(local(p).shape):
        return t
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=contiguous_strides(p.shape))


def contiguous_strides(shape) -> tuple:
    """The strides of a contiguous tensor of ``shape``."""
    out, acc = [], 1
    for s in reversed(tuple(shape)):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


def local_state(p: Tensor, key: str, name: str, t: Tensor) -> Tensor:
    """The part of state ``name`` (given in torch's format: a DTensor, or a tensor of the
    whole parameter's shape) that ``p``'s local shard keeps.

    Raises:
        StateStoreValueError: a DTensor state on another mesh than ``p``'s.
    """
    if not is_dtensor(p):
        if is_dtensor(t):
            return t.full_tensor()
        return t
    if not is_dtensor(t) and tuple(t.shape) != tuple(p.shape):
        return t            # not shaped like the parameter: a per-parameter scalar, kept whole
    if is_dtensor(t):
        if t.device_mesh != p.device_mesh:
            raise StateStoreValueError(f"state {name!r} of parameter {key!r} is a DTensor on "
                                       f"mesh {t.device_mesh}, the parameter's is "
                                       f"{p.device_mesh}")
        if tuple(t.placements) != tuple(p.placements):
            t = t.redistribute(p.device_mesh, p.placements)
        with torch.no_grad():
            return t.to_local()
    r = region_of(p)
    if r is None:
        return t
    return t[tuple(slice(o, o + n) for o, n in zip(r.offsets, r.shape))]


def check_no_dtensor(params: Sequence[Tensor], keys: Dict[Tensor, str], what: str) -> None:
    """Refuse ``what`` (an argument combination) for DTensor parameters."""
    for p in params:
        if is_dtensor(p):
            raise StateStoreError(f"{what} with DTensor parameters (parameter {keys[p]!r}): "
                                  f"FSDP2 already shards them")

"""A :class:`~statestore.optim.StoreOptimizer` step over states in RAM, remembered between
steps: :class:`ResidentPlan`.

On a resident store (``DeviceStore``, ``PinnedCPUStore``) a step's own work is a few tensor
operations a parameter; the general step around it (collecting and checking the gradients,
creating missing states, planning units, handing each state out through the store's
pipeline, one class call per unit with a state dict per parameter) cost several times that in
Python. When every parameter of an element-wise class is small, plain, fp32/fp64, on the CPU
and kept in such a store, the step is the same every time: parameters of one group, store,
dtype, state names and step count are updated by one call of the class over their concatenation
(:meth:`StoreOptimizer._update_joined`, the same bits as the general step), their states
handed as one view of the store's memory where they lie back to back (the store creates a
call's states name by name, so they do), else concatenated and copied back; a per-parameter
scalar state (NAdam's ``mu_product``) joins while every parameter holds the same value.

The plan is built after a general step and used while nothing it depends on changed; each
step checks, before changing anything: the groups and their parameters (identity, order),
the structure of each group's hyperparameters (:func:`~statestore.optim._torch_layout.
group_structure`; values such as ``lr`` are read at each step), every parameter has a
gradient of its dtype and shape, the parameters' data is where it was, the stores are open
and their layout is the one planned (``layout_version``: no state created, deleted or
loaded since), the step counts are the plan's. Anything else, and loads,
``load_state_dict`` and ``add_param_group`` (which drop the plan), takes the general step,
after which the plan is built anew. Only ``DeviceStore`` and ``PinnedCPUStore`` qualify:
their states are fixed tensors from creation to deletion, which the plan holds (a state
deleted and created again directly on the store between two steps changes the layout
version: the general step runs).
"""
from __future__ import annotations

from operator import attrgetter, is_
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._types import StateKey
from ..backends import DeviceStore, PinnedCPUStore
from ..offload._seam import is_offloaded
from ..store import StateStore
from ._dtensor import local

__all__ = ["ResidentPlan", "Batch", "Scalars", "joined_view", "state_kinds"]

_shape, _dtype, _device, _layout = (attrgetter(a) for a in ("shape", "dtype", "device", "layout"))


def joined_view(ts: List[Tensor]) -> Optional[Tensor]:
    """One 1-D view over contiguous tensors ``ts`` that lie back to back in one storage, in
    order; None otherwise."""
    first = ts[0]
    if not all(t.is_contiguous() and t.dtype == first.dtype for t in ts):
        return None
    size = first.element_size()
    ptr, total = first.data_ptr(), 0
    for t in ts:
        if t.data_ptr() != ptr + total * size:
            return None
        total += t.numel()
    try:            # within the first tensor's storage, or refused: the memory is that storage's
        return first.as_strided((total,), (1,))
    except RuntimeError:
        return None


def state_kinds(layout, p: Tensor, names, dev: torch.device) -> Optional[Tuple[str, ...]]:
    """How a joined update takes each state of parameter ``p`` (a plain CPU tensor of one or
    more dimensions) kept in a store on ``dev``: ``"e"`` shaped like the parameter and kept
    on its device, ``"s"`` a per-parameter scalar (shape ``()``, kept where the store is: NAdam's
    ``mu_product``, ASGD's ``eta`` and ``mu``); None when a state is neither (the parameter
    is then updated alone)."""
    if p.dim() == 0:            # its states and its scalars look alike
        return None
    if p.device.type != "cpu":
        # ATen's CPU loops give an element the same bits wherever it lies in the tensor (what
        # cutting fp32 parameters into units relies on too); GPU kernels are not checked here
        return None
    kinds = []
    for name in names:
        shape = tuple(layout.spec(name, p)[0])
        on_param = layout.on_param_device(name, p)
        if shape == tuple(p.shape) and on_param and p.device == dev:
            kinds.append("e")
        elif shape == () and (p.device if on_param else torch.device("cpu")) == dev:
            kinds.append("s")
        else:
            return None
    return tuple(kinds)


class Scalars:
    """A per-parameter scalar state in a joined update: each parameter's tensor (``ts``,
    one element each) and the shape the class keeps (``()``). Joined only while every
    parameter holds the same value (:meth:`common`); the class's result is put back into
    each (:meth:`put`)."""

    __slots__ = ("ts",)

    def __init__(self, ts: List[Tensor]):
        self.ts = ts

    def common(self) -> Optional[Tensor]:
        """Their one value (a tensor of its own, shape ``()``), or None when they differ (or
        one is NaN)."""
        flat = torch._C._nn.flatten_dense_tensors(self.ts)
        if not bool((flat == flat[0]).all()):
            return None
        return flat[0].clone()

    def put(self, value: Tensor) -> None:
        v = value.reshape(1)
        torch._foreach_copy_(self.ts, [v] * len(self.ts))


class Batch:
    """Parameters of one group, store, dtype, state names and kinds and step count, updated
    by one call of the class: ``params``, their ``keys``, ``group`` (the group's index),
    ``names`` of their states and their ``kinds`` (:func:`state_kinds`), ``count`` (their
    step count), ``lines`` (each parameter's memory, 1-D) and ``sizes``, ``states`` (per
    name: one view over every parameter's state where they lie back to back, else the list
    of them; :class:`Scalars` for a scalar)."""

    __slots__ = ("params", "keys", "group", "names", "kinds", "count", "store", "dtype",
                 "shapes", "lines", "ptrs", "sizes", "states")

    def __init__(self, group: int, store: StateStore, names: Tuple[str, ...],
                 kinds: Tuple[str, ...], count: int, dtype: torch.dtype):
        self.group, self.store, self.names, self.kinds, self.count, self.dtype = \
            group, store, names, kinds, count, dtype
        self.params: List[Tensor] = []
        self.keys: List[str] = []
        self.shapes: List[torch.Size] = []

    def _finish(self) -> bool:
        """Take the parameters' memory and the states; False where a parameter is not
        contiguous."""
        if not all(p.is_contiguous() for p in self.params):
            return False
        self.lines = [p.detach().view(-1) for p in self.params]
        self.ptrs = [p.data_ptr() for p in self.params]
        self.sizes = [p.numel() for p in self.params]
        self.states = []
        for name, kind in zip(self.names, self.kinds):
            ts = [self.store.get(StateKey(k, name)).view(-1) for k in self.keys]
            view = joined_view(ts) if kind == "e" else None
            self.states.append(Scalars(ts) if kind == "s" else ts if view is None else view)
        return True


class ResidentPlan:
    """See the module docstring. :meth:`build` after a general step (None where it does not
    apply); per step, :meth:`grads` (None: the plan does not apply now) then each of
    :attr:`batches` updated and its count advanced."""

    __slots__ = ("groups", "ids", "structures", "stores", "lens", "batches", "keys", "idle")

    @classmethod
    def build(cls, param_groups: Sequence[dict], keys: Dict[Tensor, str],
              stores: Dict[Tensor, StateStore], steps: Dict[str, int], layout,
              join_elems: int) -> Optional["ResidentPlan"]:
        """The plan of the next steps of an optimizer (its groups, parameter keys, stores,
        step counts and :class:`~statestore.optim._torch_layout.TorchLayout`), or None."""
        if not layout.elementwise:
            return None
        plan = cls()
        plan.groups = list(param_groups)
        plan.ids = [list(map(id, g["params"])) for g in plan.groups]
        plan.structures = [layout.structure_of(g) for g in plan.groups]
        batches: Dict[tuple, Batch] = {}
        plan.idle = []          # parameters without a gradient (frozen ones): they must stay so
        for gi, group in enumerate(plan.groups):
            for p in group["params"]:
                store, g = stores.get(p), p.grad
                if g is None:
                    plan.idle.append(p)
                    continue
                if (type(store) not in (DeviceStore, PinnedCPUStore) or local(p) is not p
                        or is_offloaded(p) or p.dtype not in (torch.float32, torch.float64)
                        or not 0 < p.numel() <= join_elems or store.device != p.device
                        or g.dtype != p.dtype or g.layout != torch.strided):
                    return None
                key = keys[p]
                names = tuple(layout.names(p, group))
                kinds = state_kinds(layout, p, names, store.device)
                if kinds is None or not all(StateKey(key, nm) in store for nm in names):
                    return None
                count = steps.get(key, 0)
                bk = (gi, id(store), names, kinds, count, p.dtype)
                b = batches.get(bk)
                if b is None:
                    b = batches[bk] = Batch(gi, store, names, kinds, count, p.dtype)
                b.params.append(p)
                b.keys.append(key)
                b.shapes.append(p.shape)
        plan.batches = list(batches.values())
        if not plan.batches or not all(b._finish() for b in plan.batches):
            return None
        plan.stores = list({id(b.store): b.store for b in plan.batches}.values())
        plan.lens = [s.layout_version for s in plan.stores]
        plan.keys = [k for b in plan.batches for k in b.keys]
        return plan

    def grads(self, param_groups: Sequence[dict], steps: Dict[str, int],
              layout) -> Optional[List[List[Tensor]]]:
        """Each batch's gradients and the values of its scalar states (``{name: value}``)
        when nothing the plan depends on changed, else None."""
        if len(param_groups) != len(self.groups) or not all(map(is_, param_groups, self.groups)):
            return None
        for g, ids, st in zip(param_groups, self.ids, self.structures):
            if list(map(id, g["params"])) != ids or layout.structure_of(g) != st:
                return None
        for s, n in zip(self.stores, self.lens):
            if s.closed or s.layout_version != n:
                return None
        if not all(p.grad is None for p in self.idle):
            return None
        grads = []
        for b in self.batches:
            if list(map(steps.get, b.keys)).count(b.count) != len(b.keys):
                return None
            if list(map(Tensor.data_ptr, b.params)) != b.ptrs:   # p.data = ... from outside
                return None
            gs = [p.grad for p in b.params]
            try:        # a gradient of each parameter's shape, dtype, device, dense
                if (list(map(_shape, gs)) != b.shapes or set(map(_dtype, gs)) != {b.dtype}
                        or set(map(_device, gs)) != {b.store.device}
                        or set(map(_layout, gs)) != {torch.strided}):
                    return None
            except AttributeError:      # None: no gradient
                return None
            grads.append(gs)
        values = []
        for b in self.batches:      # scalars (NAdam's mu_product) joined while they agree
            vals = {}
            for name, st in zip(b.names, b.states):
                if isinstance(st, Scalars):
                    v = st.common()
                    if v is None:
                        return None
                    vals[name] = v
            values.append(vals)
        return [(gs, vals) for gs, vals in zip(grads, values)]

"""A step's work and its pipeline units, for every statestore optimizer: which parameters a
step updates and their gradients (:func:`collect_work`), their states created before a first
step (:func:`ensure_states`), and the units a store's pipeline visits (:func:`plan_step`),
all in terms of the optimizer's :class:`~statestore.optim._layout.StateLayout`.

A unit is a list of ``Slice(key, start, stop)``; its *entries* say which parameter range each
group of slices belongs to: ``(parameter, start, stop, state names)``, the names in the order
of the unit's tensors. A parameter the layout calls divisible is cut into element ranges of
about ``store.unit_bytes`` and small parameters are packed together; any other parameter is
one range, and a parameter whose states alone exceed a disk store's RAM budget is refused by
name before anything changes (:class:`~statestore.BudgetError` with the budget it needs).
"""
from __future__ import annotations

import math
import os
from typing import Callable, Collection, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._ring import round_up
from .._signals import deferred_signals
from .._types import Slice, StateKey
from ..errors import BudgetError, StateStoreError, StateStoreValueError
from ..offload._seam import is_offloaded, param_value
from ..pipeline import pack_runs
from ._dtensor import local, local_grad

__all__ = ["Entry", "Work", "collect_work", "work_of", "checked_grad", "plan_step",
           "ensure_states", "budget_of", "PlanMemo"]

#: one parameter's part of a unit: (parameter, start, stop, its store states in unit order)
Entry = Tuple[Tensor, int, int, List[str]]
#: a step's work: ``{store: [(group, params)]}``
Work = Dict[object, List[Tuple[dict, List[Tensor]]]]

#: parameter gradient dtypes an optimizer takes
_GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def collect_work(param_groups: Sequence[dict], keys: Dict[Tensor, str],
                 stores: Dict[Tensor, object], owns: Callable[[Tensor], bool],
                 released: Collection[Tensor], owner: str, *, contiguous: bool = True,
                 fp64: bool = False) -> Tuple[Work, Dict[Tensor, Tensor]]:
    """What a step updates: ``{store: [(group, params)]}`` over the parameters with a
    gradient whose states this rank keeps (``owns``), plus those whose gradient backward
    applied and ``released``; and every parameter's gradient (checked:
    :func:`checked_grad` with ``contiguous`` and ``fp64``, ``owner`` naming the optimizer).

    Raises:
        StateStoreError: a group holds tensors the optimizer was not given (its ``params``
            replaced from outside, as DeepSpeed's ZeRO-1/2 and fp16 wrappers do).
    """
    for i, group in enumerate(param_groups):
        if any(p not in keys for p in group["params"]):
            raise StateStoreError(
                f"{owner}: param_groups[{i}]['params'] holds tensors this optimizer was not "
                f"given: they were replaced from outside (DeepSpeed's ZeRO stages 1-2 and its "
                f"fp16/bf16 wrappers step a client optimizer on flat partitions of their own). "
                f"A statestore optimizer keeps states per parameter, by name: use it without "
                f"such a wrapper (FSDP2, or process_group=), or DeepSpeed's own offload "
                f"(docs/distributed.md, \"DeepSpeed\")")
    grads: Dict[Tensor, Tensor] = {p: checked_grad(p, keys[p], owner, contiguous, fp64)
                                   for group in param_groups for p in group["params"]
                                   if p.grad is not None}
    return work_of(param_groups, stores,
                   lambda p: (p in grads or p in released) and owns(p)), grads


def work_of(param_groups: Sequence[dict], stores: Dict[Tensor, object],
            include: Callable[[Tensor], bool]) -> Work:
    """The parameters ``include`` picks as a step's work: ``{store: [(group, params)]}``, in
    the groups' order and each group's parameter order."""
    work: Work = {}
    for group in param_groups:
        per_store: Dict[object, List[Tensor]] = {}
        for p in group["params"]:
            if include(p):
                per_store.setdefault(stores[p], []).append(p)
        for store, ps in per_store.items():
            work.setdefault(store, []).append((group, ps))
    return work


def checked_grad(p: Tensor, key: str, owner: str, contiguous: bool = True,
                 fp64: bool = False) -> Tensor:
    """The gradient of ``p``'s local tensor (a DTensor parameter's: the local shard of its
    gradient), contiguous (unless ``contiguous`` is False), after checking it fits ``p``
    (``owner``: the optimizer's class name, for messages).

    Raises:
        RuntimeError: a sparse gradient.
        StateStoreValueError: a gradient on another device or of another shape.
        TypeError: a gradient of another dtype than fp32, fp16, bf16 (and fp64 for an fp64
            parameter where ``fp64``).
    """
    g = p.grad
    if g.is_sparse:
        raise RuntimeError(f"{owner} does not support sparse gradients (parameter {key!r})")
    g, w = local_grad(p, g), local(p)
    if g.device != w.device:
        raise StateStoreValueError(f"parameter {key!r} is on {w.device} but its "
                                   f"gradient is on {g.device}; a gradient must be on its "
                                   f"parameter's device: p.grad = p.grad.to(p.device)")
    if g.shape != w.shape:
        raise StateStoreValueError(f"parameter {key!r} has shape {tuple(w.shape)} "
                                   f"but its gradient has {tuple(g.shape)}")
    if g.dtype not in _GRAD_DTYPES or g.dtype == torch.float64 and not (
            fp64 and w.dtype == torch.float64):
        fix = ("train the model in float32 (model.float())" if w.dtype == torch.float64
               else "cast it (p.grad = p.grad.float())")
        raise TypeError(f"gradient of {key!r} has dtype {g.dtype}; {fix}: {owner} accepts "
                        f"float32, float16 and bfloat16 gradients")
    return g if g.is_contiguous() or not contiguous else g.contiguous()


def budget_of(store) -> Optional[int]:
    """The RAM budget a pipeline unit of ``store`` must fit (None: a resident store, whose
    units are views and need none)."""
    if store.resident:
        return None
    tiers = [t for t in getattr(store, "tiers", ()) or () if not t.resident]
    return min(t.budget_bytes for t in tiers) if tiers else store.budget_bytes


def plan_step(store, items, keys: Dict[Tensor, str], layout,
              order: Optional[Dict[Tensor, int]] = None
              ) -> Tuple[List[List[Slice]], List[Tuple[dict, List[Entry]]]]:
    """Pipeline units over ``items`` (``(group, params)`` pairs) on ``store`` and, per unit,
    its group and entries. With ``order`` (rank of each parameter's gradient in the last
    backward), units come in the order backward finishes their gradients.

    Raises:
        BudgetError: a parameter updated whole whose states exceed the store's budget.
    """
    planned: List[Tuple[int, List[Slice], Tuple[dict, list]]] = []
    # Cut points where the store aligned the states' data (a unit holds up to 4 states).
    align = max(1, store.cut_alignment(store.unit_bytes and store.unit_bytes // 4) // 4)
    align = layout.cut_elems(store, align)
    max_bytes, slice_round, budget = store.unit_bytes, store.alignment, budget_of(store)
    last = len(order) if order else 0
    for group, ps in items:
        if order:
            ps = sorted(ps, key=lambda p: order.get(p, last))
        pieces: List[Tuple[int, int, int, int]] = []       # (param index, a, b, bytes)
        for i, p in enumerate(ps):
            names = layout.names(p, group)
            n = local(p).numel()
            if not layout.divisible(p, group):
                nbytes = _whole_bytes(layout, p, names, slice_round)
                if budget is not None and nbytes > budget:
                    raise BudgetError(
                        f"parameter {keys[p]!r}: its states ({nbytes} bytes) are updated "
                        f"together, in one pipeline unit, and exceed the store's RAM budget "
                        f"of {budget} bytes; build the store with budget_bytes >= {nbytes}")
                pieces.append((i, 0, n, nbytes))
                continue
            pieces += _cut(i, n, layout.unit_itemsize(p, names), max_bytes, align, slice_round,
                           _fixed_bytes(layout, p, names, slice_round))
        for unit in _pack(pieces, max_bytes):
            rank = max(order.get(ps[i], last) for i, _, _ in unit) if order else 0
            slices, entries = [], []
            for i, a, b in unit:
                p = ps[i]
                names = []
                for name in layout.names(p, group):
                    rng = layout.state_range(name, p, a, b)
                    if rng is not None:
                        slices.append(Slice(StateKey(keys[p], name), *rng))
                        names.append(name)
                entries.append((p, a, b, names))
            planned.append((rank, slices, (group, entries)))
    planned.sort(key=lambda x: x[0])        # stable: param order among equal ranks
    return [u for _, u, _ in planned], [m for _, _, m in planned]


_PLAIN = (bool, int, str, type(None))


class PlanMemo:
    """:func:`plan_step` of an optimizer (its ``keys`` and ``layout``), remembered per store
    while nothing the plan reads changed: the store's unit size, alignment and budget, the
    groups and their parameters (identity, dtype, shape), the groups' options that are not
    numbers of a schedule (``amsgrad`` and the like decide the states; ``lr`` is read later,
    per unit) and the backward order. A training loop's steps plan the same units: planning
    them anew cost ~30 us a parameter on the host, which a GPU step (a few ms for thousands of
    parameters) waited for. The plans handed out are shared: callers only read them.
    ``STATESTORE_PLAN_MEMO=0`` plans every step (for comparisons)."""

    __slots__ = ("keys", "layout", "_memo")

    def __init__(self, keys: Dict[Tensor, str], layout):
        self.keys, self.layout = keys, layout
        self._memo: Dict[int, tuple] = {}

    def __call__(self, store, items, order: Optional[Dict[Tensor, int]] = None):
        if os.environ.get("STATESTORE_PLAN_MEMO", "1") == "0":     # for comparisons
            return plan_step(store, items, self.keys, self.layout, order)
        sig = [id(store), store.unit_bytes, store.alignment, budget_of(store)]
        for group, ps in items:
            sig.append(id(group))
            sig.append(tuple((k, v) for k, v in group.items()
                             if k != "params" and type(v) in _PLAIN))
            sig.append(tuple((id(p), self.keys[p], p.dtype, p.shape) for p in ps))
            if order:
                sig.append(tuple(order.get(p, -1) for p in ps))
        sig = tuple(sig)
        hit = self._memo.get(id(store))
        if hit is not None and hit[0] == sig:
            return hit[1]
        plan = plan_step(store, items, self.keys, self.layout, order)
        self._memo[id(store)] = (sig, plan)
        return plan


def _whole_bytes(layout, p: Tensor, names: Sequence[str], slice_round: int) -> int:
    """Ring bytes of every state of ``p`` in one unit."""
    total = 0
    for name in names:
        shape, dtype = layout.spec(name, p)
        total += round_up(max(math.prod(shape) * dtype.itemsize, 1), slice_round)
    return total


def _fixed_bytes(layout, p: Tensor, names: Sequence[str], slice_round: int) -> int:
    """Ring bytes of the states of a divisible ``p`` that do not follow its elements (they
    ride in its first unit: per-parameter scalars)."""
    n = local(p).numel()
    return sum(round_up(max(math.prod(s) * d.itemsize, 1), slice_round)
               for s, d in (layout.spec(name, p) for name in names) if math.prod(s) != n)


def _cut(i: int, n: int, size: Tuple[int, int], max_bytes: Optional[int], align: int,
         slice_round: int, fixed: int) -> List[Tuple[int, int, int, int]]:
    """Element ranges of parameter ``i`` (``n`` elements, ``size``: ``(itemsize, count)``
    of its element-following states) of at most ``max_bytes`` each, cut at multiples of
    ``align``; each with its ring bytes (``fixed`` added to the first)."""
    itemsize, count = size
    if max_bytes is None:
        return [(i, 0, n, 0)]
    per_elem = itemsize * max(count, 1)
    cap = max(align, (max_bytes // per_elem) // align * align)
    out, start = [], 0
    while start < n or (n == 0 and start == 0):
        stop = min(n, start + cap)
        nbytes = count * round_up(max((stop - start) * itemsize, 1), slice_round)
        out.append((i, start, stop, nbytes + (fixed if start == 0 else 0)))
        if n == 0:
            break
        start = stop
    return out


def _pack(pieces: List[Tuple[int, int, int, int]], max_bytes: Optional[int]
          ) -> List[List[Tuple[int, int, int]]]:
    """Pack pieces in order into units of at most ``max_bytes`` (None: one unit)."""
    return pack_runs((((i, a, b), nbytes) for i, a, b, nbytes in pieces), max_bytes)


def ensure_states(store, params: Sequence[Tensor], keys: Dict[Tensor, str],
                  group_of: Dict[Tensor, dict], layout) -> None:
    """Create the states of ``params`` that ``store`` does not hold yet, from
    ``layout.initial`` (zeros where None); an initial value taken from an offloaded
    parameter is read from its store, one at a time. A failure or Ctrl-C leaves no state
    without its initial value (those not written yet are removed again)."""
    entries, later = [], []
    for p in params:
        key = keys[p]
        for name in layout.names(p, group_of[p]):
            sk = StateKey(key, name)
            if sk in store:
                continue
            shape, dtype = layout.spec(name, p)
            init = layout.initial(name, p)
            if init is not None and is_offloaded(p):
                later.append((sk, p, dtype))    # read from its store, below
                init = None
            entries.append((sk, shape, dtype, init))
    done = 0
    try:
        if entries:
            store.create_many(entries)
        for sk, p, dtype in later:
            store.put(sk, param_value(p).to(dtype))
            done += 1
    except BaseException:
        # never a state without its initial value (a zero master would be taken as the
        # parameter's value by the step made again): those not written yet go again
        with deferred_signals():
            try:
                store.delete([k for k, _, _ in later[done:] if k in store])
            except Exception:
                pass
        raise

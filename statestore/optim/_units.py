"""The units of a step: which states a step visits, cut into pipeline units
(:func:`plan_step`), the states a parameter needs before its first step
(:func:`ensure_states`), and the tensors of one unit gathered for the kernel and its results
put back (:class:`UnitTensors`). This is the optimizer's hot path: work per unit, a few
operations per parameter slice.
"""
from __future__ import annotations

from typing import Callable, Collection, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._types import Slice, StateKey
from ..errors import StateStoreError, StateStoreValueError
from ..kernels import adam_step
from ..kernels._moments import adam_step_moments
from ..offload._seam import is_offloaded, param_value
from ..pipeline import plan_units
from ._dtensor import local, local_grad
from ._metadata import state_names

__all__ = ["collect_work", "work_of", "plan_step", "ensure_states", "checked_grad", "UnitTensors", "Entry"]

#: one parameter's part of a unit: (parameter, start, stop, its store states in unit order)
Entry = Tuple[Tensor, int, int, List[str]]


def collect_work(param_groups: Sequence[dict], keys: Dict[Tensor, str],
                 stores: Dict[Tensor, object], owns: Callable[[Tensor], bool],
                 released: Collection[Tensor], owner: str
                 ) -> Tuple[Dict[object, List[Tuple[dict, List[Tensor]]]], Dict[Tensor, Tensor]]:
    """What a step updates: ``{store: [(group, params)]}`` over the parameters with a
    gradient whose states this rank keeps (``owns``), plus those whose gradient backward
    applied and ``released``; and every parameter's gradient (checked:
    :func:`checked_grad`, ``owner`` naming the optimizer).

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
    grads: Dict[Tensor, Tensor] = {p: checked_grad(p, keys[p], owner)
                                   for group in param_groups for p in group["params"]
                                   if p.grad is not None}
    return work_of(param_groups, stores,
                   lambda p: (p in grads or p in released) and owns(p)), grads


def work_of(param_groups: Sequence[dict], stores: Dict[Tensor, object],
            include: Callable[[Tensor], bool]) -> Dict[object, List[Tuple[dict, List[Tensor]]]]:
    """The parameters ``include`` picks as a step's work: ``{store: [(group, params)]}``, in
    the groups' order and each group's parameter order."""
    work: Dict[object, List[Tuple[dict, List[Tensor]]]] = {}
    for group in param_groups:
        per_store: Dict[object, List[Tensor]] = {}
        for p in group["params"]:
            if include(p):
                per_store.setdefault(stores[p], []).append(p)
        for store, ps in per_store.items():
            work.setdefault(store, []).append((group, ps))
    return work


def plan_step(store, items, keys: Dict[Tensor, str], fmt,
              order: Optional[Dict[Tensor, int]] = None
              ) -> Tuple[List[List[Slice]], List[Tuple[dict, List[Entry]]]]:
    """Pipeline units over ``items`` (``(group, params)`` pairs) on ``store`` and, per unit,
    its group and entries. With ``order`` (rank of each parameter's gradient in the last
    backward), units come in the order backward finishes their gradients."""
    planned: List[Tuple[int, List[Slice], Tuple[dict, list]]] = []
    # Cut points where the store aligned the states' data (a unit holds up to 4 states).
    align = max(1, store.cut_alignment(store.unit_bytes and store.unit_bytes // 4) // 4)
    align = fmt.cut_elems(store, align)     # compressed moments: whole blocks, aligned
    last = len(order) if order else 0
    for group, ps in items:
        if order:
            ps = sorted(ps, key=lambda p: order.get(p, last))
        names = [fmt.stored_names(state_names(p, group)) for p in ps]
        skeys = [[StateKey(keys[p], n) for n in ns] for p, ns in zip(ps, names)]
        # compressed: each state's bytes an element, counted as that many 1-byte states
        itemsize = 1 if fmt.compressed else 4
        groups_ = [[None] * fmt.unit_itemsize(ns)[1] for ns in names] if fmt.compressed \
            else skeys
        plan = plan_units(groups_, [local(p).numel() for p in ps], itemsize, store.unit_bytes,
                          align, slice_round=store.alignment)
        for unit in plan:
            rank = max(order.get(ps[i], last) for i, _, _ in unit) if order else 0
            planned.append((rank, [Slice(k, *fmt.state_range(k.state, a, b))
                                   for i, a, b in unit for k in skeys[i]],
                            (group, [(ps[i], a, b, names[i]) for i, a, b in unit])))
    planned.sort(key=lambda x: x[0])        # stable: param order among equal ranks
    return [u for _, u, _ in planned], [m for _, _, m in planned]


def ensure_states(store, params: Sequence[Tensor], keys: Dict[Tensor, str],
                  group_of: Dict[Tensor, dict], fmt) -> None:
    """Create, zero-filled, the states of ``params`` that ``store`` does not hold yet; a
    ``master`` starts as the parameter's value. A DTensor parameter's states are its local
    shard's."""
    entries, later = [], []
    for p in params:
        key = keys[p]
        lp = local(p)
        for name in fmt.stored_names(state_names(p, group_of[p])):
            sk = StateKey(key, name)
            if sk in store:
                continue
            if name == "master" and is_offloaded(p):
                later.append((sk, p))       # read from its store, one at a time, below
                init = None
            else:
                # the parameter itself: the store converts it a chunk at a time (a whole
                # fp32 copy of every parameter would come before the first step)
                init = lp.detach() if name == "master" else None
            entries.append((sk, *fmt.spec(name, tuple(lp.shape)), init))
    if entries:
        store.create_many(entries)
    for sk, p in later:
        store.put(sk, param_value(p).float())


def checked_grad(p: Tensor, key: str, owner: str) -> Tensor:
    """``p.grad``, contiguous, after checking it fits ``p`` (``owner``: the optimizer's class
    name, for messages); a DTensor parameter's is the local shard of its gradient.

    Raises:
        RuntimeError: a sparse gradient.
        StateStoreValueError: a gradient on another device or of another shape.
        TypeError: a gradient of another dtype than fp32, fp16 or bf16.
    """
    g = p.grad
    if g.is_sparse:
        raise RuntimeError(f"{owner} does not support sparse gradients (parameter {key!r})")
    g, p = local_grad(p, g), local(p)
    if g.device != p.device:
        raise StateStoreValueError(f"parameter {key!r} is on {p.device} but its "
                                   f"gradient is on {g.device}; a gradient must be on its "
                                   f"parameter's device: p.grad = p.grad.to(p.device)")
    if g.shape != p.shape:
        raise StateStoreValueError(f"parameter {key!r} has shape {tuple(p.shape)} "
                                   f"but its gradient has {tuple(g.shape)}")
    if g.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        fix = ("train the model in float32 (model.float())" if p.dtype == torch.float64
               else "cast it (p.grad = p.grad.float())")
        raise TypeError(f"gradient of {key!r} has dtype {g.dtype}; {fix}: {owner} accepts "
                        f"float32, float16 and bfloat16 gradients")
    return g if g.is_contiguous() else g.contiguous()


class UnitTensors:
    """The tensors of one unit, as the kernel takes them: per entry the parameter slice
    (``params``), gradient, moments, amsgrad's maximum, master, step count and int8
    scales; plus what goes back to the parameters after the kernel (:meth:`put_back`).

    Args:
        tensors: the unit's state tensors, as the pipeline hands them out.
        entries: the unit's entries (:data:`Entry`).
        grads: each parameter's gradient.
        dev: the store's device (where the states are).
        off: the optimizer's offload path (CUDA parameters over host stores), or None.
        keys, steps: the optimizer's parameter keys and step counts.
        fmt: the optimizer's moment format; ``moment_dtypes`` its two moments' dtypes.

    Raises:
        StateStoreValueError: the store holds moments of another dtype than the optimizer's.
    """

    __slots__ = ("entries", "params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs",
                 "masters", "steps", "scales", "writeback", "uploads", "off")

    def __init__(self, tensors: List[Tensor], entries: Sequence[Entry],
                 grads: Dict[Tensor, Tensor], dev: torch.device, off, keys: Dict[Tensor, str],
                 steps: Dict[str, int], fmt, moment_dtypes: Tuple[torch.dtype, torch.dtype]):
        params, gs, m, v, vmax, masters, ssteps, writeback = [], [], [], [], [], [], [], []
        scales: list = []
        uploads: list = []
        pos = 0
        for p, a, b, names in entries:
            st = dict(zip(names, tensors[pos:pos + len(names)]))
            pos += len(names)
            lp = local(p)                            # a DTensor's local shard
            whole = a == 0 and b == lp.numel()       # the common case: no slicing
            pflat = lp.view(-1) if lp.is_contiguous() else None
            if off is not None and off.handles(p):
                # CUDA parameter, host states: page-locked staging, side stream (docs/gpu.md)
                g = off.grad_host(p, grads[p])[a:b]
                w = off.param_host(p)[a:b]
                uploads.append((p, a, b))
            else:
                if pflat is None or lp.device != dev:
                    src = lp.detach().reshape(-1)[a:b]
                    w = src.to(dev, copy=True)
                    writeback.append((lp, a, b, w))
                else:
                    w = pflat if whole else pflat[a:b]
                g = grads[p].view(-1) if whole else grads[p].view(-1)[a:b]
                if g.device != dev:
                    g = g.to(dev)
            params.append(w)
            gs.append(g)
            m.append(st["exp_avg"])
            v.append(st["exp_avg_sq"])
            if (m[-1].dtype, v[-1].dtype) != moment_dtypes:
                raise StateStoreValueError(
                    f"parameter {keys[p]!r}: the store holds exp_avg/exp_avg_sq as "
                    f"{m[-1].dtype}/{v[-1].dtype}, but this optimizer keeps moment_dtype="
                    f"{fmt.name!r} ({moment_dtypes[0]}/{moment_dtypes[1]}); was a checkpoint "
                    f"of another moment_dtype loaded into its store?")
            vmax.append(st.get("max_exp_avg_sq"))
            masters.append(st.get("master"))
            ssteps.append(steps[keys[p]])
            scales.append((st.get("exp_avg_scale"), st.get("exp_avg_sq_scale"), a))
        self.params, self.grads, self.exp_avgs, self.exp_avg_sqs = params, gs, m, v
        self.max_exp_avg_sqs, self.masters, self.steps, self.scales = vmax, masters, ssteps, scales
        self.writeback, self.uploads, self.off = writeback, uploads, off
        self.entries = entries

    def update(self, group: dict, keys: Dict[Tensor, str], fmt, grad_scale: float) -> None:
        """Run the Adam kernel over the unit with ``group``'s hyperparameters (``keys``: the
        parameters' keys, which seed compressed moments' stochastic rounding)."""
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        if isinstance(lr, Tensor):
            lr = lr.item()
        kw = dict(steps=self.steps, lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"],
                  weight_decay=group["weight_decay"], adamw_mode=group["adamw_mode"],
                  amsgrad=group["amsgrad"],
                  max_exp_avg_sqs=self.max_exp_avg_sqs if group["amsgrad"] else None,
                  masters=self.masters if any(x is not None for x in self.masters) else None,
                  maximize=group["maximize"], grad_scale=grad_scale)
        if not fmt.compressed:
            adam_step(self.params, self.grads, self.exp_avgs, self.exp_avg_sqs, **kw)
            return
        scales = self.scales
        names = [keys[e[0]] for e in self.entries]
        adam_step_moments(self.params, self.grads, self.exp_avgs, self.exp_avg_sqs,
                          kind=fmt.name, rounding=fmt.rounding,
                          seeds=[fmt.seeds(k, s) for k, s in zip(names, self.steps)],
                          offsets=[a for _, _, a in scales],
                          exp_avg_scales=[x for x, _, _ in scales],
                          exp_avg_sq_scales=[y for _, y, _ in scales], **kw)

    def put_back(self) -> None:
        """Copy updated values computed away from their parameter back into it (a
        non-contiguous parameter, one on another device than the store), and queue the
        uploads of staged CUDA parameters."""
        for p, a, b, w in self.writeback:
            if p.is_contiguous():
                p.detach().view(-1)[a:b].copy_(w)
            else:
                flat = p.detach().reshape(-1).clone()
                flat[a:b].copy_(w.to(p.device))
                p.detach().copy_(flat.view(p.shape))
        for p, a, b in self.uploads:
            self.off.upload(p, a, b)

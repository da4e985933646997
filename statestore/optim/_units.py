"""Adam's hot path: the tensors of one pipeline unit gathered for the Adam kernel and its
results put back (:class:`UnitTensors`), a few operations per parameter slice. The units
themselves are planned for every optimizer by :mod:`statestore.optim._plan`.

On resident stores a step that repeats the previous one (the same parameters with gradients
of the same kind, the same groups, the same states) is compiled once into a native plan and
then made by one call, with no Python per parameter (:class:`StepProgram`).
"""
from __future__ import annotations

import os
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._trace import span, tracing
from .._types import StateKey
from ..backends._slab import SlabStore
from ..errors import StateStoreValueError
from ..kernels import AdamHyper, AdamTensors, MomentCodes, adam_step, adam_step_moments
from ..kernels._dispatch import force_reference, load_extension
from ..kernels._quant import key_hash
from ..offload._seam import is_offloaded
from ._dtensor import local
from ._plan import Entry

__all__ = ["UnitTensors", "StepProgram", "PLAN_OK", "PLAN_STALE", "PLAN_SKIPPED"]

#: :meth:`StepProgram.run`'s outcomes: the step was made; nothing changed, step the general
#: way (and compile again); every gradient was not finite, the step is skipped
PLAN_OK, PLAN_STALE, PLAN_SKIPPED = 0, 1, 2
_PLAIN = (bool, int, str, type(None))


class UnitTensors:
    """The tensors of one unit, as the kernel takes them: per entry the parameter slice
    (``params``), gradient, moments, amsgrad's maximum, master, step count and int8
    scales; plus what goes back to the parameters after the kernel (:meth:`put_back`).

    Args:
        tensors: the unit's state tensors, as the pipeline hands them out.
        entries: the unit's entries (:data:`Entry`).
        grads: each parameter's gradient.
        dev: the store's device (where the states are).
        off: the optimizer's staging path (CUDA parameters over host stores), or None.
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
            w = local(p)
            whole = a == 0 and b == w.numel()        # the common case: no slicing
            pflat = w.view(-1) if w.is_contiguous() else None
            if off is not None and off.handles(p):
                # CUDA parameter, host states: page-locked staging, side stream (docs/gpu.md)
                g = off.grad_host(p, grads[p])[a:b]
                w = off.param_host(p)[a:b]
                uploads.append((p, a, b))
            else:
                if pflat is None or w.device != dev:
                    src = w.detach().reshape(-1)[a:b]
                    w = src.to(dev, copy=True)
                    writeback.append((p, a, b, w))
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
        hyper = AdamHyper.of_group(group, grad_scale)
        t = AdamTensors(self.params, self.grads, self.exp_avgs, self.exp_avg_sqs, self.steps,
                        self.max_exp_avg_sqs if hyper.amsgrad else None,
                        self.masters if any(x is not None for x in self.masters) else None)
        if not fmt.compressed:
            adam_step(t, hyper)
            return
        scales = self.scales
        names = [keys[e[0]] for e in self.entries]
        adam_step_moments(t, hyper, MomentCodes(
            fmt.name, fmt.rounding, [fmt.seeds(k, s) for k, s in zip(names, self.steps)],
            [a for _, _, a in scales], [x for x, _, _ in scales], [y for _, y, _ in scales]))

    def put_back(self) -> None:
        """Copy updated values computed away from their parameter back into it (a
        non-contiguous parameter, one on another device than the store), and queue the
        uploads of staged CUDA parameters."""
        for p, a, b, w in self.writeback:
            p = local(p)
            if p.is_contiguous():
                p.detach().view(-1)[a:b].copy_(w)
            else:
                flat = p.detach().reshape(-1).clone()
                flat[a:b].copy_(w.to(p.device))
                p.detach().copy_(flat.view(p.shape))
        for p, a, b in self.uploads:
            self.off.upload(p, a, b)


def _group_sig(group: dict) -> tuple:
    """What a compiled step depends on in a group besides its parameters: its options that
    are not numbers of a schedule (``amsgrad`` decides the states). ``lr``, ``betas``,
    ``eps``, ``weight_decay``, ``maximize`` and ``adamw_mode`` are read at every step."""
    return tuple((k, v) for k, v in group.items() if k != "params" and type(v) in _PLAIN)


def step_plans_enabled() -> bool:
    """``STATESTORE_STEP_PLAN=0`` makes every step the general way (for comparisons)."""
    return os.environ.get("STATESTORE_STEP_PLAN", "1") != "0"


class StepProgram:
    """A step compiled once into a native plan (``_C_adam.StepPlan``,
    ``csrc/adam/adam_ops.cpp``) and then made with no Python per parameter: the C++ side
    checks that the groups, parameters and gradients are still those planned (their
    identity, data, dtype, shape and layout; no other parameter has a gradient), advances
    each parameter's step count in the optimizer's ``steps`` dict, computes the bias
    corrections as :func:`statestore.kernels.adam_step` does, and runs the kernel.

    Two kinds: over resident stores (:attr:`units` None) the plan holds every state's live
    tensor and :meth:`run` makes the whole step in one call (the CPU kernel in one parallel
    loop over every tensor; CUDA: one launch a group); over one streaming store (NVMe),
    :attr:`units` is ``(store, pipeline units)``, the units of the step the general way
    planned, and the caller runs the store's pipeline over them, calling
    ``plan.run_unit(i, tensors)`` for each unit after ``plan.begin(...)`` (the pipeline's
    reads ahead, writes behind and prefetch stay as they are).

    What the plan depends on and is checked at each step: a resident store's
    ``layout_version`` (``backends/_slab.py``: states created, removed, loaded) and its own
    checks (``store.pipeline``: open, its files intact; a streaming store's pipeline checks
    the planned units' slices); each
    group's non-schedule options; the parameter set and the gradients' presence, dtype,
    device and layout (in C++). Anything else changed: :data:`PLAN_STALE`, nothing changed,
    and the caller steps the general way. Same bits as that way: the same kernel, arguments
    and order.

    Build one with :meth:`compile` after a step the general way made.
    """

    __slots__ = ("plan", "stores", "sigs", "units")

    def __init__(self, plan, stores: List[Tuple[object, int]], sigs: List[tuple],
                 units: Optional[tuple] = None):
        self.plan, self.stores, self.sigs, self.units = plan, stores, sigs, units

    @staticmethod
    def compile(param_groups: Sequence[dict], work, grads: Dict[Tensor, Tensor],
                keys: Dict[Tensor, str], stores: Dict[Tensor, object], layout, fmt,
                moment_dtypes: Tuple[torch.dtype, torch.dtype], plan_of: Callable,
                check_finite: bool = False) -> Optional["StepProgram"]:
        """The step the general way just made (``work``: ``{store: [(group, params)]}``,
        ``grads``; ``plan_of(store, items)``: the pipeline units it used; ``check_finite``:
        ``skip_nonfinite``) as a program, or None where some part of it cannot be planned:
        CUDA gradients checked for inf/nan (that check stays the general way's), resident
        and streaming stores mixed,
        or several streaming ones, DTensor, offloaded or non-contiguous parameters,
        gradients made contiguous for the kernel, states the kernel does not take as they
        are, several devices, no compiled kernel."""
        ext = load_extension()
        if ext is None or force_reference() or not hasattr(ext, "StepPlan") or not grads:
            return None
        devices = {st.device for st in work}
        resident = all(isinstance(st, SlabStore) for st in work)
        if len(devices) != 1 or not (resident or (len(work) == 1 and not
                                                  next(iter(work)).resident)):
            return None
        dev = next(iter(devices))
        if dev.type not in ("cpu", "cuda") or (dev.type == "cuda" and (
                not resident or check_finite or not getattr(ext, "with_cuda", False))):
            return None
        moments = "fp32" if not fmt.compressed else f"{fmt.name}-{fmt.rounding}"
        plan = ext.StepPlan(moments)
        entry_of: Dict[Tensor, int] = {}
        try:
            for group in param_groups:
                ps = group["params"]
                gi = plan.add_group(group, ps)
                for j, p in enumerate(ps):
                    if p not in grads:
                        continue
                    g = grads[p]
                    if type(p) not in (torch.nn.Parameter, Tensor) or local(p) is not p \
                            or is_offloaded(p) or p.grad is not g or p.device != dev \
                            or stores.get(p) is None:
                        return None
                    entry_of[p] = plan.add_entry(gi, j, keys[p], key_hash(keys[p]), g)
                    if resident and not _set_states(plan, entry_of[p], p, g, keys[p],
                                                    stores[p], layout, group, moment_dtypes):
                        return None
            units = None
            if not resident:
                store = next(iter(work))
                all_units, meta = plan_of(store, work[store])
                for group, entries in meta:
                    u = plan.add_unit()
                    pos = 0
                    for p, a, b, names in entries:
                        at = {name: pos + i for i, name in enumerate(names)}
                        pos += len(names)
                        plan.add_slice(u, entry_of[p], a, b, *(at.get(n, -1) for n in (
                            "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master",
                            "exp_avg_scale", "exp_avg_sq_scale")))
                units = (store, all_units)
        except (RuntimeError, TypeError, ValueError, KeyError):     # a tensor was refused
            return None
        return StepProgram(plan, [(st, getattr(st, "layout_version", 0)) for st in work],
                           [_group_sig(g) for g in param_groups], units)

    def prepare(self, param_groups: Sequence[dict], grad_scale: float) -> Optional[list]:
        """The Python half of a step's checks: each store still as planned (a resident one
        also checked by its own pipeline, raising as the general way would: nothing
        changed), each group's hyperparameters as the op takes them (:class:`AdamHyper`).
        None: stale."""
        if self.units is None:          # resident: the plan holds the states' tensors
            for store, version in self.stores:
                if store.closed or store.layout_version != version:
                    return None
                with store.pipeline((), mode="rw", wait=False):
                    pass
        if len(param_groups) != len(self.sigs):
            return None
        hypers = []
        for group, sig in zip(param_groups, self.sigs):
            if _group_sig(group) != sig:
                return None
            hypers.append(AdamHyper.of_group(group, grad_scale))
        return hypers

    def run(self, param_groups: list, steps: Dict[str, int], hypers: list,
            check_finite: bool) -> int:
        """A resident program's step in one native call (:data:`PLAN_OK`,
        :data:`PLAN_STALE` or :data:`PLAN_SKIPPED`); an exception from it comes after the
        step counts advanced."""
        if not tracing():
            return self.plan.run(param_groups, steps, hypers, check_finite)
        with span("statestore::compute"), span("statestore::adam_plan"):
            return self.plan.run(param_groups, steps, hypers, check_finite)


def _set_states(plan, entry: int, p: Tensor, g: Tensor, key: str, store, layout, group: dict,
                moment_dtypes) -> bool:
    """Give ``plan``'s entry of ``p`` its states' live tensors; False where the kernel does
    not take them as they are (the general way then steps it, or says what is wrong)."""
    st = {name: store.get(StateKey(key, name)) for name in layout.names(p, group)}
    if (st["exp_avg"].dtype, st["exp_avg_sq"].dtype) != moment_dtypes:
        return False
    plan.set_states(entry, g, st["exp_avg"], st["exp_avg_sq"], st.get("max_exp_avg_sq"),
                    st.get("master"), st.get("exp_avg_scale"), st.get("exp_avg_sq_scale"))
    return True

"""``StoreOptimizer``: any torch optimizer whose per-parameter states live in a store.

``StoreOptimizer(torch.optim.Muon, params, state_store=store, lr=0.02)`` keeps every tensor
state ``torch.optim.Muon`` keeps (``momentum_buffer``; Adafactor's row and column variances,
Adam's moments, SGD's momentum...) in ``store`` and computes exactly what
``torch.optim.Muon(params, lr=0.02)`` (with ``foreach=False`` where the class takes it)
computes, bit for bit: each pipeline unit is updated by the class's own ``step()``, run over
the unit's parameter ranges with the unit's state tensors as that instance's ``state``. Which
states a class keeps, and how a parameter is cut into units, is probed from the class
(:mod:`statestore.optim._torch_layout`).

A class outside ``torch.optim`` works when it follows torch's pattern (``docs/extending.md``,
"Adding an optimizer"): hyperparameters in ``param_groups``, per-parameter states in
``self.state[p]`` (tensors, plus an optional ``"step"``), created in ``step()`` (or the
constructor) before any data-dependent operation, and an update of each parameter that reads
only that parameter, its gradient and its states.
"""
from __future__ import annotations

import math
import os
from collections import defaultdict
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor

from .._types import StateKey
from ..errors import StateStoreError
from ..store import StateStore
from ._args import check_arguments
from ._dtensor import local
from ._plan import ensure_states
from ._resident import ResidentPlan, Scalars, joined_view, state_kinds
from .base import StateStoreOptimizer
from ._rounding import round_into, seed_of
from ._torch_layout import (ELEMENTWISE, WHOLE, SavedLayout, TorchLayout, check_class,
                            check_state_dtype, class_name, ctor_kwargs, make_step)
from ._torch_units import Noting, parts, range_proxy, replace_data
from ._whole import WholeUpdates

__all__ = ["StoreOptimizer"]

#: a parameter range of at most this many elements may be updated joined with others
#: (:meth:`StoreOptimizer._update_joined`): below it, the class's own Python per parameter
#: costs more than its arithmetic
_JOIN_ELEMS = 1 << 16


class StoreOptimizer(StateStoreOptimizer):
    """A ``torch.optim.Optimizer`` running ``optimizer_cls``'s update over states kept in a
    :class:`~statestore.StateStore`.

    Args:
        optimizer_cls: a ``torch.optim.Optimizer`` subclass: ``SGD``, ``Adagrad``,
            ``RMSprop``, ``Adam``, ``AdamW``, ``NAdam``, ``RAdam``, ``Adamax``, ``Adadelta``,
            ``ASGD``, ``Rprop``, ``Adafactor``, ``Muon``, or a class following torch's
            pattern (module docstring). ``LBFGS`` and ``SparseAdam`` are refused.
        params: parameters, ``named_parameters()`` pairs, or param-group dicts (as torch).
        state_store: where states live. None: next to the parameters (a
            :class:`~statestore.DeviceStore` per parameter device).
        process_group: shard states over a ``torch.distributed`` group (as ``CPUAdam``'s).
        skip_nonfinite: when True, a step whose gradients hold inf or nan changes nothing
            (no parameter, state or step count), as ``HybridAdam``'s; over sharded
            parameters every rank skips or none does.
        state_dtype: ``"fp32"`` (default: every state as the class keeps it) or ``"bf16"``:
            every floating state the class keeps in a wider dtype (fp32 moments, momentum
            buffers...) is kept in the store as bf16; the class is handed it converted to its
            own dtype and computes as it does, and its result is written back stochastically
            rounded (:mod:`statestore.optim._rounding`: seeded by the parameter, the state
            and the step, so a resumed run is bit for bit the uninterrupted one).
            ``state_dict()`` holds the class's dtypes; a loaded one is rounded to nearest.
        update_in_backward: update each parameter during ``backward()`` as soon as its
            gradient is final (a gradient hook), as ``HybridAdam``'s: the same bits as
            ``step()`` (``optimizer_cls``'s), the same refusals (gradients changed between
            backward and ``step()``: clipping, unscaling, accumulation) and failure contract
            (:mod:`statestore.optim._in_backward`); ``step()`` updates what backward could
            not. Not with ``skip_nonfinite`` or a ``process_group`` (``ValueError``), nor with
            a class needing the whole tensor over DTensor parameters sharded over several
            ranks (``StateStoreError``).
        release_grads: with ``update_in_backward``, set ``param.grad = None`` once backward
            applied it.
        elementwise: whether ``optimizer_cls`` updates each element from that element alone,
            so that fp32/fp64 parameters may be cut into units smaller than a parameter.
            None: True for torch's element-wise classes, False otherwise (Adafactor, Muon,
            and classes outside torch, each parameter then one unit).
        **kwargs: ``optimizer_cls``'s own arguments (``lr=...``); ``foreach``, ``fused``,
            ``capturable`` and ``differentiable`` may not be True.

    Raises:
        TypeError: ``optimizer_cls`` is not an optimizer class.
        StateStoreValueError: LBFGS, SparseAdam, ``foreach=True`` (and the like), or a
            ``state_dtype`` other than ``"fp32"`` and ``"bf16"``.
        StateStoreError: ``update_in_backward`` for a class needing the whole tensor over
            DTensor parameters sharded over several ranks.
        ValueError: ``optimizer_cls``'s own checks of its arguments (its messages);
            ``release_grads`` without ``update_in_backward``, ``update_in_backward`` with
            ``skip_nonfinite`` or a ``process_group``.

    Attributes:
        optimizer_cls: the class whose update runs.

    A step cuts no parameter a disk store's budget cannot hold: a parameter updated whole
    whose states exceed ``budget_bytes`` is refused by :meth:`step` with a
    :class:`~statestore.BudgetError` naming it and the budget it needs.
    """

    def __init__(self, optimizer_cls: type, params, *, state_store: Optional[StateStore] = None,
                 process_group=None, elementwise: Optional[bool] = None,
                 skip_nonfinite: bool = False, state_dtype: str = "fp32",
                 update_in_backward: bool = False, release_grads: bool = False, **kwargs):
        check_class(optimizer_cls)
        check_state_dtype(state_dtype)
        check_arguments("StoreOptimizer", state_store=None, nvme_offload_fraction=0.0,
                        nvme_offload_dir=None, bias_correction=True, unused={},
                        skip_nonfinite=skip_nonfinite, process_group=process_group,
                        update_in_backward=update_in_backward, release_grads=release_grads)
        kwargs = ctor_kwargs(optimizer_cls, kwargs)
        if elementwise is None:
            elementwise = optimizer_cls.__name__ in ELEMENTWISE and \
                getattr(torch.optim, optimizer_cls.__name__, None) is optimizer_cls
        elif not isinstance(elementwise, bool):
            raise TypeError(f"elementwise must be a bool or None, got {elementwise!r}")
        if elementwise and optimizer_cls.__name__ in WHOLE:
            raise StateStoreError(f"{optimizer_cls.__name__}'s update needs the whole tensor: "
                                  f"elementwise=True would change its results")
        self.optimizer_cls = optimizer_cls
        self._kwargs = kwargs
        # the class's defaults, its constructor's checks of kwargs (its own messages)
        template = optimizer_cls([torch.empty(2, 2, device="meta")], **kwargs)
        #: the optimizer instance each unit's update runs on (its groups and state swapped in)
        self._worker = template
        #: its step() as the class wrote it: torch wraps every optimizer class's step() with
        #: the profiler's range and the step hooks, which belong to this optimizer's step,
        #: not to each call over a unit (the wrapped one where torch's wrapping is not found)
        step = optimizer_cls.step
        self._class_step = step.__wrapped__ if getattr(step, "hooked", False) and \
            callable(getattr(step, "__wrapped__", None)) else type(template).step
        #: per step: the values of per-parameter scalar states before the parameter's first
        #: unit updated them, for its later units
        self._scalars: Dict[str, Dict[str, Tensor]] = {}
        #: per step: the states :meth:`_ensure_states` created (the class makes them)
        self._created: set = set()
        #: per unit of the current plans: :meth:`_unit_plan`
        self._unit_plans: Dict[int, tuple] = {}
        #: per store: the structure of the groups its plan was made for, and the plan's
        #: units (:meth:`_plan`)
        self._plan_sigs: Dict[int, tuple] = {}
        self._plan_metas: Dict[int, list] = {}
        layout = TorchLayout(optimizer_cls, kwargs, elementwise, state_dtype)
        #: floating states kept in a lower dtype than the class's (``state_dtype="bf16"``):
        #: each parameter updated alone, neither joined nor by the resident plan (both hand
        #: the class the store's tensors as they lie)
        self._low = layout.low is not None
        #: sharded DTensor parameters a class needing the whole tensor updates gathered
        self._whole = WholeUpdates(not elementwise)
        super().__init__(params, dict(template.defaults), layout, state_store=state_store,
                         process_group=process_group, update_in_backward=update_in_backward,
                         release_grads=release_grads, skip_nonfinite=skip_nonfinite)
        if update_in_backward:
            self._check_backward(self._params)

    def _collect(self, released=(), contiguous: bool = True, fp64: bool = False):
        return super()._collect(released, contiguous=True, fp64=True)

    def step(self, closure=None):
        """One step of ``optimizer_cls`` over every parameter with a gradient: the base's
        (:meth:`StateStoreOptimizer.step`), with the per-step record the unit update keeps
        (scalar states before a parameter's first unit, the states created for the step).
        Over resident stores, a step like the last is made by the plan remembered from it
        (:mod:`statestore.optim._resident`)."""
        if not self._update_in_backward:     # else backward may have begun a parameter
            self._scalars = {}
        self._created = set()
        self._layout.stepping(True)
        try:
            return super().step(closure)
        finally:
            self._scalars = {}
            self._created = set()
            self._layout.stepping(False)

    def _run_remembered(self, plan: ResidentPlan, grad_scale: float) -> bool:
        """A step by ``plan``; False (nothing changed) when it does not apply now."""
        grads = plan.grads(self.param_groups, self._steps, self._layout)
        if grads is None:
            return False
        if self._skipped([g for gs, _ in grads for g in gs]):
            return True
        groups = plan.groups
        with self._table.stepping(plan.keys) as undo:
            self._step_undo = undo
            try:
                self._touch()
                for b, (gs, scalars) in zip(plan.batches, grads):
                    hyper = {k: v for k, v in groups[b.group].items()
                             if k not in ("params", "param_names")}
                    self._update_joined(hyper, b.names, False, b.count, (), b.keys[0],
                                        b.params, gs, b.states, lines=(b.lines, b.sizes),
                                        scalars=scalars)
                    b.count += 1
                self._table.unfinished = None    # made (no call before the with's end: no gap)
            finally:
                self._step_undo = {}
        return True

    def _skipped(self, grads: List[Tensor]) -> bool:
        """Whether this step is skipped: ``skip_nonfinite`` and ``grads`` (every rank's,
        over sharded parameters) hold inf or nan."""
        return self.skip_nonfinite and not self._dtensors.all_finite(grads)

    def _remember(self, work, grads) -> Optional[ResidentPlan]:
        """After a general step: the plan of the next ones over resident stores, when it
        applies (``STATESTORE_RESIDENT_PLAN=0`` turns it off)."""
        if os.environ.get("STATESTORE_RESIDENT_PLAN", "1") == "0" or self._low:
            return None
        return ResidentPlan.build(self.param_groups, self._keys, self._stores, self._steps,
                                  self._layout, _JOIN_ELEMS)

    def _gathered(self, p: Tensor) -> bool:
        return self._whole.covers(p)

    def _forget_pending(self, store=None) -> None:
        super()._forget_pending(store)
        self._unit_plans.clear()

    def _ensure_states(self, work) -> None:
        """The base's, noting the states it creates for this step: a state the class has
        not made yet for a parameter that has stepped (SGD's ``momentum_buffer`` when
        momentum turns on mid-training) is left out of what the class is handed, so that the
        class creates it as it does (``clone(grad)``), not from zeros."""
        group_of = {p: g for items in work.values() for g, ps in items for p in ps}
        for store, items in work.items():
            ensure_states(Noting(store, self._created), [p for _, ps in items for p in ps],
                          self._keys, group_of, self._layout)

    def _plan(self, store, items, order=None):
        """The base's plan, made anew when a group's structure (:func:`group_structure`)
        changed since the last: the states a class keeps may follow a float hyperparameter
        crossing zero (SGD's ``momentum``), which the plan's memo does not watch."""
        layout: TorchLayout = self._layout
        sig = tuple(layout.structure_of(g) for g, _ in items)
        if self._plan_sigs.get(id(store)) != sig:
            self._plan_sigs[id(store)] = sig
            self.__dict__.pop("_plan_memo", None)
        plan = super()._plan(store, items, order)
        if self._plan_metas.get(id(store)) is not plan[1]:     # a new plan: new units
            self._plan_metas[id(store)] = plan[1]
            self._unit_plans.clear()
        return plan

    # ------------------------------------------------------------------ the unit update
    def _update_unit(self, tensors: List[Tensor], group: dict, entries, grads, grad_scale,
                     dev: torch.device) -> None:
        """Run ``optimizer_cls.step`` over the unit: each entry's parameter range (with its
        gradient range) as a parameter, the unit's state tensors as its ``state``; new
        states are the class's own initialization, copied into the unit. Small ranges of an
        element-wise class that share a step count and their states' names are concatenated
        and updated by one call (:meth:`_update_joined`); the others one parameter each
        (:meth:`_update_each`)."""
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        created = self._created
        steps, undo = self._steps, self._step_undo
        joined: Dict[tuple, list] = {}
        each = []
        pos = 0
        for p, a, b, names, key, kinds in self._unit_plan(entries, dev):
            ts = tensors[pos:pos + len(names)]
            pos += len(names)
            count = steps[key] - 1                  # before this step
            first = undo.get(key, count) is None    # its first step: the class begins it
            new = () if first or not created else \
                tuple(n for n in names if StateKey(key, n) in created)
            entry = (p, a, b, names, key, ts, count, first, new)
            if kinds is not None:
                g = grads[p]
                joined.setdefault((first, count, new, g.dtype, p.dtype, names, kinds),
                                  []).append((entry, g))
            else:
                each.append(entry)
        calls = []
        for (first, count, new, _, _, names, kinds), items in joined.items():
            for part in parts(items):
                states = []
                for j, kind in enumerate(kinds):
                    ts = [e[5][j] for e, _ in part]
                    view = joined_view(ts) if kind == "e" else None
                    states.append(Scalars(ts) if kind == "s" else ts if view is None else view)
                scalars = {}
                if not first:       # scalars (NAdam's mu_product) joined while they agree
                    for name, st in zip(names, states):
                        if isinstance(st, Scalars) and name not in new:
                            scalars[name] = st.common()
                if any(v is None for v in scalars.values()):
                    each += [e for e, _ in part]
                    continue
                targets = [p if a == 0 and b == p.numel() else p.detach().view(-1)[a:b]
                           for (p, a, b, *_), _ in part]
                gs = [g if a == 0 and b == g.numel() else g.view(-1)[a:b]
                      for (_, a, b, *_), g in part]
                calls.append((names, first, count, new, part[0][0][4], targets, gs, states,
                              scalars))
        self._touch()
        for names, first, count, new, key, targets, gs, states, scalars in calls:
            self._update_joined(hyper, names, first, count, new, key, targets, gs, states,
                                scalars=scalars)
        if each:
            self._update_each(hyper, each, grads)

    def _unit_plan(self, entries, dev: torch.device):
        """Per entry of a unit, ``(parameter, start, stop, names (a tuple), key, kinds)``,
        remembered while the plan is the same (:meth:`_plan`). ``kinds``
        (:func:`~statestore.optim._resident.state_kinds`), where the range may be joined
        with others: an element-wise class, a plain fp32/fp64 parameter of at most
        :data:`_JOIN_ELEMS` elements in the range, every state shaped like the parameter
        (on its device, the store's) or a per-parameter scalar (the range then the whole
        parameter); else None."""
        hit = self._unit_plans.get(id(entries))
        if hit is not None and hit[0] is entries:
            return hit[1]
        layout: TorchLayout = self._layout
        out = []
        for p, a, b, names in entries:
            w = local(p)
            kinds = None
            if (layout.elementwise and not self._low and w is p
                    and w.dtype in (torch.float32, torch.float64)
                    and 0 < b - a <= _JOIN_ELEMS
                    and len(names) == len(layout.probe_of(p).names)):
                kinds = state_kinds(layout, p, names, dev)
                if kinds is not None and "s" in kinds and not (a == 0 and b == w.numel()):
                    kinds = None
            out.append((p, a, b, tuple(names), self._keys[p], kinds))
        self._unit_plans[id(entries)] = (entries, out)
        return out

    def _update_joined(self, hyper: dict, names: tuple, first: bool, count: int, new: tuple,
                       key: str, targets: List[Tensor], grads: List[Tensor],
                       states: list, lines=None, scalars=None) -> None:
        """One call of the class over parameter ranges ``targets`` (their gradients
        ``grads``) concatenated: a parameter of all their elements, its gradient, per state
        name in ``names`` the concatenation of ``states[j]`` (a list: each range's tensor,
        copied back after; or one view over them all, updated in place), then the
        parameter copied back. An element-wise class computes each element from that element
        alone, so this is its update of each range, bit for bit (as cutting a parameter into
        units is: fp32/fp64 only). ``first``: the ranges' first step (the class begins their
        states); ``new``: states created for this step (the class makes them); ``key``: the
        first range's parameter, for messages; ``lines``: ``(views, sizes)``, each target's
        memory as a 1-D view and its size (a cheaper copy in and out than ``targets``). A
        per-parameter scalar state is a :class:`~statestore.optim._resident.Scalars` in
        ``states`` and its one value in ``scalars``; the class's result is put into each."""
        layout: TorchLayout = self._layout
        cls = self.optimizer_cls
        flatten = torch._C._nn.flatten_dense_tensors
        unflatten = torch._C._nn.unflatten_dense_tensors
        flat = flatten(targets) if lines is None else torch.cat(lines[0])
        total = flat.numel()
        flat.grad = flatten(grads)
        if first:                   # the class's constructor may create states (Adagrad)
            state = dict(cls([dict(hyper, params=[flat])], **self._kwargs).state.get(flat, {}))
        else:
            # a view's own tensor object (the class may assign its .data), or a copy
            state = {name: scalars[name] if isinstance(st, Scalars)
                     else st.view(-1) if isinstance(st, Tensor) else flatten(st)
                     for name, st in zip(names, states) if name not in new}
            kind = layout.step_kind()
            if kind is not None:
                state["step"] = make_step(kind, count, flat.device)
        given = dict(state)
        worker = self._worker
        worker.param_groups = [dict(hyper, params=[flat])]
        worker.state = defaultdict(dict, {flat: state})
        try:
            self._class_step(worker)
            after = worker.state.get(flat, {})
        finally:
            worker.param_groups, worker.state = [], defaultdict(dict)
        if flat.shape != (total,) or flat.dtype != targets[0].dtype:
            raise StateStoreError(
                f"{class_name(cls)} replaced the data of parameter {key!r} (p.data = ...) "
                f"with a tensor of shape {tuple(flat.shape)} and dtype {flat.dtype}; "
                f"StoreOptimizer writes an update back into the parameter, so it must keep "
                f"the parameter's shape {tuple(targets[0].shape)} and dtype")
        if lines is None:
            torch._foreach_copy_(targets, unflatten(flat, targets))
        else:
            torch._foreach_copy_(lines[0], flat.split_with_sizes(lines[1]))
        for name, st in zip(names, states):
            got = after.get(name)
            size = 1 if isinstance(st, Scalars) else total
            if not isinstance(got, Tensor) or got.numel() != size:
                raise StateStoreError(f"{class_name(cls)} left no tensor {name!r} of "
                                      f"{size} element(s) for parameter {key!r} after its step")
            if isinstance(st, Scalars):
                st.put(got)
            elif not isinstance(st, Tensor):
                torch._foreach_copy_(st, unflatten(got.reshape(-1), st))
            elif got is not given.get(name) or got.data_ptr() != st.data_ptr():
                st.copy_(got.reshape(-1))       # replaced, or its .data reassigned
        unknown = [n for n in after if n != "step" and n not in names]
        if unknown:
            raise StateStoreError(f"{class_name(cls)} created states {unknown} for parameter "
                                  f"{key!r} that its probe did not show; StoreOptimizer "
                                  f"cannot keep them")

    def _update_each(self, hyper: dict, each, grads) -> None:
        """One call of the class over parameter ranges ``each`` (``(parameter, start, stop,
        names, key, unit tensors, count, first, new)``), each its own parameter."""
        layout: TorchLayout = self._layout
        proxies, given, fresh, back, placed = [], [], [], [], []
        for p, a, b, names, key, ts, count, first, new in each:
            if self._whole.covers(p):       # all-gathered (_whole.py)
                proxy, writeback, target = self._whole.proxy(p, grads[p]), None, None
            else:
                proxy, writeback, target = range_proxy(p, a, b, grads[p])
            if writeback is not None:
                back.append(writeback)
            elif target is not None:    # p.data = ... on the proxy must reach the parameter
                placed.append((proxy, target, proxy.data_ptr(), key))
            proxies.append(proxy)
            if first:
                fresh.append(proxy)
                given.append((p, key, names, ts, {}, [], a, count))
                continue
            state, moved = self._given_state(p, key, a, names, ts, proxy.device, new)
            if self._whole.covers(p):
                state = self._whole.gather_states(p, state)
            kind = layout.step_kind()
            if kind is not None:
                state["step"] = make_step(kind, count, proxy.device)
            given.append((p, key, names, ts, state, moved, a, count))
        worker = self._worker
        states = defaultdict(dict)
        if fresh:                       # the class's constructor may create states (Adagrad)
            states.update(self.optimizer_cls([dict(hyper, params=fresh)], **self._kwargs).state)
        for proxy, (_, _, _, _, state, *_) in zip(proxies, given):
            if state:
                states[proxy] = dict(state)
        worker.param_groups = [dict(hyper, params=proxies)]
        worker.state = states
        try:
            self._class_step(worker)
            for proxy, (p, key, names, ts, state, moved, a, count) in zip(proxies, given):
                after = worker.state.get(proxy, {})
                if self._whole.covers(p):   # this rank's region of the parameter and states
                    after = self._whole.finish(p, proxy, after)
                self._take_states(after, p, key, names, ts, state, moved, (a, count + 1))
        finally:
            worker.param_groups, worker.state = [], defaultdict(dict)
        for proxy, target, ptr, key in placed:
            if proxy.data_ptr() != ptr:
                replace_data(self.optimizer_cls, proxy, target, key)
        for p, (a, flat) in back:       # a non-contiguous parameter's range, computed apart
            w = local(p).detach()
            full = w.reshape(-1).clone()
            full[a:a + flat.numel()].copy_(flat.reshape(-1))
            w.copy_(full.view(w.shape))

    def _given_state(self, p: Tensor, key: str, a: int, names, ts: List[Tensor],
                     w_dev: torch.device, new=()):
        """The state handed to the class for a unit of ``p`` starting at element ``a``: the
        unit's tensors (shaped as the class keeps them, on the device it keeps them) but the
        ``new`` ones (created for this step: the class makes them), and for a later unit of
        a cut parameter its scalar states as they were before the parameter's first unit.
        Returns ``(state, moved)``: ``moved`` lists ``(unit tensor, tensor given)`` pairs to
        copy back after the update."""
        layout: TorchLayout = self._layout
        n = local(p).numel()
        state: Dict[str, Any] = {}
        moved = []
        for name, t in zip(names, ts):
            if name in new:
                continue
            shape = layout.spec(name, p)[0]
            # a tensor of its own (a view): the class may assign its .data
            v = t.detach() if math.prod(shape) == n and t.numel() != n else t.view(shape)
            target = w_dev if layout.on_param_device(name, p) else torch.device("cpu")
            cd = layout.class_dtype(name, p) if self._low else v.dtype
            if v.device != target or v.dtype != cd:
                dv = v.to(target, cd)           # bf16 states: the class's dtype, rounded back
                moved.append((v, dv))
                v = dv
            state[name] = v
        pr = layout.probe_of(p)
        scalars = [s for s in pr.names if math.prod(pr.specs[s][0]) != n]
        if scalars:
            if a == 0:
                self._scalars[key] = {s: state[s].clone() for s in scalars if s in state}
            else:
                for s in scalars:
                    if s in self._scalars[key]:
                        state[s] = self._scalars[key][s].clone()
        return state, moved

    def _take_states(self, after: Dict[str, Any], p: Tensor, key: str, names: List[str],
                     ts: List[Tensor], given: Dict[str, Any], moved, at=(0, 0)) -> None:
        """Put the states the class left for ``p`` into the unit's tensors ``ts`` (those it
        replaced rather than updated in place: its new states, SGD's first momentum). A
        state kept in a lower dtype than the class's (``state_dtype="bf16"``) is the class's
        result stochastically rounded, seeded by ``key``, the state's name and the step
        written (``at``: ``(first element of the unit, step)``) and indexed by element of
        the state (the same bits however the parameter is cut into units)."""
        start, step = at
        n = local(p).numel()
        for name, t in zip(names, ts):
            got = after.get(name)
            if not isinstance(got, Tensor):
                raise StateStoreError(f"{class_name(self.optimizer_cls)} left no tensor "
                                      f"{name!r} for parameter {key!r} after its step")
            if self._low and t.dtype != got.dtype:
                offset = start if math.prod(self._layout.spec(name, p)[0]) == n else 0
                round_into(t, got, seed_of(key, name, step), offset)
                continue
            was = given.get(name)
            if got is not was or (t.data_ptr() != got.data_ptr() and t.device == got.device):
                t.copy_(got.reshape(t.shape))       # replaced, or its .data reassigned
        for v, dv in moved:
            if v.dtype == dv.dtype:
                v.copy_(dv)
        unknown = [n for n in after if n != "step" and n not in names
                   and n not in self._layout.probe_of(p).names]
        if unknown:
            raise StateStoreError(f"{class_name(self.optimizer_cls)} created states {unknown} "
                                  f"for parameter {key!r} that its probe did not show; "
                                  f"StoreOptimizer cannot keep them")

    @classmethod
    def saved_layout(cls, metadata: Dict[str, Any]) -> SavedLayout:
        """The groups as saved, and a ``"step"`` where the torch class keeps one."""
        return SavedLayout(metadata)

    def _kind(self) -> str:
        return f"StoreOptimizer({class_name(self.optimizer_cls)})"

    def __repr__(self) -> str:
        return (f"StoreOptimizer({class_name(self.optimizer_cls)}, {len(self._params)} params, "
                f"store={self.state_store!r})")


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
from collections import defaultdict
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor

from ..errors import StateStoreError
from ..store import StateStore
from ._dtensor import local, local_grad
from ._torch_layout import (ELEMENTWISE, WHOLE, TorchLayout, check_class, class_name,
                            ctor_kwargs, make_step)
from ._whole import WholeUpdates
from .base import StateStoreOptimizer

__all__ = ["StoreOptimizer"]


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
        elementwise: whether ``optimizer_cls`` updates each element from that element alone,
            so that fp32/fp64 parameters may be cut into units smaller than a parameter.
            None: True for torch's element-wise classes, False otherwise (Adafactor, Muon,
            and classes outside torch, each parameter then one unit).
        **kwargs: ``optimizer_cls``'s own arguments (``lr=...``); ``foreach``, ``fused``,
            ``capturable`` and ``differentiable`` may not be True.

    Raises:
        TypeError: ``optimizer_cls`` is not an optimizer class.
        StateStoreValueError: LBFGS, SparseAdam, or ``foreach=True`` (and the like).
        ValueError: ``optimizer_cls``'s own checks of its arguments (its messages).

    Attributes:
        optimizer_cls: the class whose update runs.

    A step cuts no parameter a disk store's budget cannot hold: a parameter updated whole
    whose states exceed ``budget_bytes`` is refused by :meth:`step` with a
    :class:`~statestore.BudgetError` naming it and the budget it needs.
    """

    def __init__(self, optimizer_cls: type, params, *, state_store: Optional[StateStore] = None,
                 process_group=None, elementwise: Optional[bool] = None, **kwargs):
        check_class(optimizer_cls)
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
        #: per step: the values of per-parameter scalar states before the parameter's first
        #: unit updated them, for its later units
        self._scalars: Dict[str, Dict[str, Tensor]] = {}
        layout = TorchLayout(optimizer_cls, kwargs, elementwise)
        #: sharded DTensor parameters a class needing the whole tensor updates gathered
        self._whole = WholeUpdates(not elementwise)
        super().__init__(params, dict(template.defaults), layout, state_store=state_store,
                         process_group=process_group)

    def _collect(self, released=(), contiguous: bool = True, fp64: bool = False):
        return super()._collect(released, contiguous=True, fp64=True)

    def step(self, closure=None):
        """One step of ``optimizer_cls`` over every parameter with a gradient (see
        :meth:`StateStoreOptimizer.step`)."""
        self._scalars = {}
        try:
            return super().step(closure)
        finally:
            self._scalars = {}

    # ------------------------------------------------------------------ the unit update
    def _update_unit(self, tensors: List[Tensor], group: dict, entries, grads, grad_scale,
                     dev: torch.device) -> None:
        """Run ``optimizer_cls.step`` once over the unit: each entry's parameter range (with
        its gradient range) as a parameter, the unit's state tensors as its ``state``; new
        states are the class's own initialization, copied into the unit."""
        layout: TorchLayout = self._layout
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        proxies, given, fresh, back = [], [], [], []
        pos = 0
        for p, a, b, names in entries:
            ts = tensors[pos:pos + len(names)]
            pos += len(names)
            if self._whole.covers(p):       # all-gathered (_whole.py)
                proxy, writeback = self._whole.proxy(p, grads[p]), None
            else:
                proxy, writeback = self._proxy(p, a, b, grads[p])
            if writeback is not None:
                back.append(writeback)
            proxies.append(proxy)
            key = self._keys[p]
            count = self._steps[key] - 1                # before this step
            if self._step_undo.get(key, count) is None:     # its first step: the class begins it
                fresh.append(proxy)
                given.append((p, key, names, ts, {}, []))
                continue
            state, moved = self._given_state(p, key, a, names, ts, w_dev=proxy.device)
            if self._whole.covers(p):
                state = self._whole.gather_states(p, state)
            kind = layout.step_kind()
            if kind is not None:
                state["step"] = make_step(kind, count, proxy.device)
            given.append((p, key, names, ts, state, moved))
        worker = self._worker
        states = defaultdict(dict)
        if fresh:                       # the class's constructor may create states (Adagrad)
            states.update(self.optimizer_cls([dict(hyper, params=fresh)], **self._kwargs).state)
        for proxy, (_, _, _, _, state, _) in zip(proxies, given):
            if state:
                states[proxy] = dict(state)
        worker.param_groups = [dict(hyper, params=proxies)]
        worker.state = states
        self._touch()
        worker.step()
        for proxy, (p, key, names, ts, state, moved) in zip(proxies, given):
            after = worker.state.get(proxy, {})
            if self._whole.covers(p):       # this rank's region of the parameter and states
                after = self._whole.finish(p, proxy, after)
            self._take_states(after, p, key, names, ts, state, moved)
        for p, (a, flat) in back:       # a non-contiguous parameter's range, computed apart
            w = local(p).detach()
            full = w.reshape(-1).clone()
            full[a:a + flat.numel()].copy_(flat)
            w.copy_(full.view(w.shape))
        worker.param_groups, worker.state = [], defaultdict(dict)

    def _proxy(self, p: Tensor, a: int, b: int, g: Tensor):
        """The parameter the class updates for elements ``[a, b)`` of ``p``: ``p`` itself when
        whole (its gradient as it is), else a flat range of it (a copy, written back after,
        when ``p`` is not contiguous) with the gradient's range. Returns ``(proxy,
        writeback)``."""
        w = local(p)
        if a == 0 and b == w.numel():
            if w is p:
                return p, None
            proxy = w.detach()
            proxy.grad = local_grad(p, p.grad)
            return proxy, None
        if w.is_contiguous():
            proxy = w.detach().view(-1)[a:b]
            writeback = None
        else:
            proxy = w.detach().reshape(-1)[a:b].clone()
            writeback = (p, (a, proxy))
        proxy.grad = g.view(-1)[a:b]
        return proxy, writeback

    def _given_state(self, p: Tensor, key: str, a: int, names: List[str], ts: List[Tensor],
                     w_dev: torch.device):
        """The state handed to the class for a unit of ``p`` starting at element ``a``: the
        unit's tensors (shaped as the class keeps them, on the device it keeps them), and
        for a later unit of a cut parameter its scalar states as they were before the
        parameter's first unit. Returns ``(state, moved)``: ``moved`` lists ``(unit tensor,
        tensor given)`` pairs to copy back after the update."""
        layout: TorchLayout = self._layout
        n = local(p).numel()
        state: Dict[str, Any] = {}
        moved = []
        for name, t in zip(names, ts):
            shape = layout.spec(name, p)[0]
            v = t if math.prod(shape) == n and t.numel() != n else t.view(shape)
            target = w_dev if layout.on_param_device(name, p) else torch.device("cpu")
            if v.device != target:
                dv = v.to(target)
                moved.append((v, dv))
                v = dv
            state[name] = v
        pr = layout.probe(p)
        scalars = [s for s in pr.names if math.prod(pr.specs[s][0]) != n]
        if scalars:
            if a == 0:
                self._scalars[key] = {s: state[s].clone() for s in scalars}
            else:
                for s in scalars:
                    state[s] = self._scalars[key][s].clone()
        return state, moved

    def _take_states(self, after: Dict[str, Any], p: Tensor, key: str, names: List[str],
                     ts: List[Tensor], given: Dict[str, Any], moved) -> None:
        """Put the states the class left for ``p`` into the unit's tensors ``ts`` (those it
        replaced rather than updated in place: its new states, SGD's first momentum)."""
        for name, t in zip(names, ts):
            got = after.get(name)
            if not isinstance(got, Tensor):
                raise StateStoreError(f"{class_name(self.optimizer_cls)} left no tensor "
                                      f"{name!r} for parameter {key!r} after its step")
            if got is not given.get(name):
                t.copy_(got.reshape(t.shape))
        for v, dv in moved:
            v.copy_(dv)
        unknown = [n for n in after if n != "step" and n not in names
                   and n not in self._layout.probe(p).names]
        if unknown:
            raise StateStoreError(f"{class_name(self.optimizer_cls)} created states {unknown} "
                                  f"for parameter {key!r} that its probe did not show; "
                                  f"StoreOptimizer cannot keep them")

    def _kind(self) -> str:
        return f"StoreOptimizer({class_name(self.optimizer_cls)})"

    def __repr__(self) -> str:
        return (f"StoreOptimizer({class_name(self.optimizer_cls)}, {len(self._params)} params, "
                f"store={self.state_store!r})")


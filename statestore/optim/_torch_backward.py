"""``StoreOptimizer(..., update_in_backward=True)``: the class's update of each parameter
run from its gradient hook, through the same stepper as the Adam optimizers'
(:class:`~statestore.optim._in_backward.BackwardStepper`: its plan, read-ahead, refusals of
clipping and accumulation, ``release_grads`` and failure contract), with what a torch class
needs besides:

* whether a parameter's update is its first (the class then begins its states itself, as
  ``SGD`` makes ``momentum_buffer = clone(grad)``): the stepper advances a parameter's step
  count just before its first unit is updated; :class:`RecordingTable` notes each count as it
  was, which the unit update reads as the general step reads ``table.stepping``'s undo;
* the stepper plans through the optimizer's own ``_plan`` (which plans afresh when a group's
  structure changes: the states a class keeps may follow it), held weakly;
* a group whose structure changed since the last step (SGD's ``momentum`` leaving 0: a new
  state) drops the plan before backward uses it (:func:`plans_stale`), so that the class
  creates that state in ``step()``, where the optimizer creates it in the store.
"""
from __future__ import annotations

import weakref
from typing import Callable, Dict, Optional

from torch import Tensor

from ..errors import StateStoreError
from ..store import StateStore
from ._in_backward import BackwardStepper
from ._plan import work_of
from ._torch_layout import class_name
from .base import StateStoreOptimizer, may_prefetch

__all__ = ["InBackward", "RecordingTable", "plans_stale"]


class RecordingTable:
    """An optimizer's :class:`~statestore.optim._table.ParamTable` as the stepper uses it,
    noting in ``prior`` each key's step count before :meth:`advance_steps` advanced it
    (None: it had none). Everything else is the table's."""

    __slots__ = ("_table", "_prior")

    def __init__(self, table, prior: Dict[str, Optional[int]]):
        object.__setattr__(self, "_table", table)
        object.__setattr__(self, "_prior", prior)

    def advance_steps(self, keys, undo=None):
        undo = self._table.advance_steps(keys, undo)
        prior = self._prior
        for k in keys:
            prior[k] = undo[k]
        return undo

    def __getattr__(self, name: str):
        return getattr(self._table, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._table, name, value)


def plans_stale(layout, param_groups, planned_for) -> bool:
    """Whether the groups' structures differ from ``planned_for`` (those the plans were
    made for)."""
    return tuple(layout.structure_of(g) for g in param_groups) != planned_for


class InBackward(StateStoreOptimizer):
    """The base's step, and :class:`~statestore.optim.StoreOptimizer`'s ``update_in_backward``
    and ``release_grads`` (module docstring): the optimizer's base class."""

    def _init_backward(self, update_in_backward: bool, release_grads: bool) -> None:
        """Before the base's constructor (which calls :meth:`_setup_parts` and asks
        :meth:`_wants_hook`)."""
        self._update_in_backward = update_in_backward
        self._release_grads = release_grads
        #: each parameter's step count before the stepper advanced it
        self._prior: Dict[str, Optional[int]] = {}
        #: the groups' structures the stepper's plans were made for
        self._planned_for: Optional[tuple] = None

    def _setup_parts(self) -> None:
        self._stepper = BackwardStepper(RecordingTable(self._table, self._prior),
                                        self._planner(), "StoreOptimizer",
                                        self._apply_in_backward, self._release_grads)
        self._stepper.unplanned = weakref.WeakMethod(self._unplanned_work)

    def _planner(self) -> Callable:
        """``plan(store, items, order)`` by :meth:`_plan`, holding the optimizer weakly."""
        plan = weakref.WeakMethod(self._plan)

        def planned(store, items, order=None):
            return plan()(store, items, order)
        return planned

    def _check_backward(self, params) -> None:
        """Refuse ``update_in_backward`` for ``params`` updated gathered (a collective)."""
        whole = [self._keys[p] for p in params if self._gathered(p)]
        if whole:
            raise StateStoreError(
                f"StoreOptimizer({class_name(self.optimizer_cls)}, update_in_backward=True): "
                f"the class's update needs the whole tensor, and parameters {whole[:3]} are "
                f"DTensors sharded over several ranks: each would be gathered (a collective) "
                f"from backward's gradient hooks, whose order the ranks do not share; use "
                f"update_in_backward=False")

    def _gathered(self, p: Tensor) -> bool:
        """Whether ``p`` is updated gathered whole over its ranks (a collective)."""
        return False

    def _wants_hook(self, p: Tensor) -> bool:
        """With ``update_in_backward`` every parameter's gradient is applied from its hook;
        otherwise disk stores read ahead from it (the base's rule)."""
        return self._update_in_backward or super()._wants_hook(p)

    def _grad_ready(self, p: Tensor) -> None:
        if not self._update_in_backward:
            super()._grad_ready(p)
            return
        st = self._stepper
        if st.passes is None and self._table.next_plans and plans_stale(
                self._layout, self.param_groups, self._planned_for):
            self._table.next_plans.clear()      # new states: the class makes them in step()
        st.grad_ready(p)

    def _apply_in_backward(self, tensors, group, entries, grads, grad_scale, dev) -> None:
        """The stepper's unit update: :meth:`_apply_unit`, each parameter's first update told
        by its step count before the stepper advanced it."""
        self._step_undo = self._prior
        try:
            self._apply_unit(tensors, group, entries, grads, grad_scale, dev)
        finally:
            self._step_undo = {}

    def _unplanned_work(self, params) -> Dict[StateStore, list]:
        """``release_grads`` before a plan exists: ``params`` (gradients final) as a step's
        work ``{store: [(group, params)]}``, their states created."""
        chosen = {p for p in params if p in self._stores and self._owns(p)}
        work = work_of(self.param_groups, self._stores, chosen.__contains__)
        self._ensure_states(work)
        return work

    def _backward_step(self) -> None:
        """``step()`` with ``update_in_backward`` (after its closure): the stepper's."""
        st = self._stepper
        released = st.released
        work, grads = self._collect(released)
        st.before_step(work, grads)
        if not grads and not released:
            return
        self._ensure_states(work)
        st.finish_step(work, grads, may_prefetch)
        self._planned_for = tuple(self._layout.structure_of(g) for g in self.param_groups)

    @property
    def update_in_backward(self) -> bool:
        """Whether parameters are updated during backward (see the class docstring). May be
        switched between steps (as ``HybridAdam``'s).

        Raises (on assignment):
            TypeError: not a bool.
            ValueError: True with ``skip_nonfinite`` or a ``process_group``.
            StateStoreError: backward has updated some parameters: call ``step()`` first;
                True for a class needing the whole tensor over sharded DTensor parameters.
        """
        return self._update_in_backward

    @update_in_backward.setter
    def update_in_backward(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"update_in_backward must be a bool, got {value!r}")
        if value == self._update_in_backward:
            return
        self._stepper.check_switch(value, self.skip_nonfinite, self.process_group)
        if value:
            self._check_backward(self._params)
        self._stepper.reset()
        self._table.next_plans.clear()
        self._update_in_backward = value
        if value:
            self._register_pump_hooks(self._params)

    @property
    def release_grads(self) -> bool:
        """With ``update_in_backward``: whether ``param.grad`` is set to None once backward
        applied it."""
        return self._stepper.release_grads

    @release_grads.setter
    def release_grads(self, value: bool) -> None:
        self._stepper.release_grads = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad`` (with ``update_in_backward``: see
        ``HybridAdam.zero_grad``)."""
        self._stepper.before_zero_grad(set_to_none)
        super().zero_grad(set_to_none)

"""What ``update_in_backward`` needs besides the stepper
(:class:`~statestore.optim._in_backward.BackwardStepper`) for a class that begins its states
itself (``StoreOptimizer``'s torch classes); the optimizer base
(:class:`~statestore.optim.StateStoreOptimizer`) uses both for every optimizer:

* whether a parameter's update is its first (the class then begins its states itself, as
  ``SGD`` makes ``momentum_buffer = clone(grad)``): the stepper advances a parameter's step
  count just before its first unit is updated; :class:`RecordingTable` notes each count as it
  was, which the unit update reads as the general step reads ``table.stepping``'s undo;
* the stepper plans through the optimizer's own ``_plan`` (StoreOptimizer's plans afresh
  when a group's structure changes: the states a class keeps may follow it), held weakly;
* a group whose structure changed since the last step (SGD's ``momentum`` leaving 0: a new
  state) drops the plan before backward uses it (:func:`plans_stale`), so that the class
  creates that state in ``step()``, where the optimizer creates it in the store.
"""
from __future__ import annotations

from typing import Dict, Optional

__all__ = ["RecordingTable", "plans_stale"]


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

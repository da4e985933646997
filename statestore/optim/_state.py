"""``optimizer.state`` of the store-backed optimizers: torch's ``{param: {"step", "exp_avg",
...}}`` mapping, as a view of the store (which states, and whether a ``"step"``, is the
optimizer's :class:`~statestore.optim._layout.StateLayout`'s to say).

For a DTensor parameter (FSDP2) a state reads as a DTensor with the parameter's mesh and
placements over the rank's local state, as torch's optimizers keep them, so DCP's
``get_optimizer_state_dict`` and resharding see the layout; assigning takes the local part of
a DTensor or of a tensor of the parameter's global shape.

torch and its tooling read ``optimizer.state`` to learn whether an optimizer has stepped
(``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` runs a zero-gradient
step on an optimizer whose ``state`` is empty), and some read or replace entries. Here the
mapping holds one entry per parameter that has a step count (stepped, or loaded from a
checkpoint or a state dict) and whose states this rank keeps. Nothing is cached: each access
of a state tensor reads it from the store (:meth:`StateStore.get`: the live tensor on resident
stores, a fresh copy through the pipeline's RAM budget on disk stores), so holding the mapping
costs no memory. Assigning a tensor writes it into the store; assigning ``"step"`` sets the
step count.

The entries are ``Mapping`` objects, not ``dict``: code that copies every ``dict`` entry of an
optimizer's state to a device (Lightning's ``_optimizer_to_device``) leaves them alone instead
of reading every state into memory.
"""
from __future__ import annotations

import numbers
import weakref
from collections.abc import MutableMapping
from typing import Any, Iterator, List

import torch
from torch import Tensor

from .._types import StateKey
from ..errors import StateStoreError, StateStoreValueError
from ._dtensor import as_param_layout, local, local_state
from ._table import ParamTable

__all__ = ["OptimizerState", "ParamState"]


class ParamState(MutableMapping):
    """The states of one parameter: ``"step"`` (as the optimizer's torch class keeps it: a
    float32 scalar tensor for Adam; none for SGD) and each state the store holds, read on
    access."""

    __slots__ = ("_table", "_owner", "_p", "_layout")

    def __init__(self, table: ParamTable, owner: str, p: Tensor, layout):
        self._table, self._owner, self._p, self._layout = table, owner, p, layout

    @property
    def _key(self) -> str:
        return self._table.keys[self._p]

    def _store(self):
        return self._table.stores[self._p]

    def _names(self) -> List[str]:
        store, key = self._store(), self._key
        return [n for n in self._layout.visible_names() if StateKey(key, n) in store]

    def _has_step(self) -> bool:
        return self._key in self._table.steps and self._layout.torch_step(0) is not None

    def __iter__(self) -> Iterator[str]:
        if self._has_step():
            yield "step"
        yield from self._names()

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, name) -> bool:
        if name == "step":
            return self._has_step()
        return isinstance(name, str) and name in self._layout.visible_names() \
            and StateKey(self._key, name) in self._store()

    def __getitem__(self, name: str) -> Any:
        if name == "step":
            if not self._has_step():
                raise KeyError(name)
            return self._layout.torch_step(self._table.steps[self._key])
        if name not in self:
            raise KeyError(name)
        # a DTensor parameter's state: a DTensor of its layout over the local shard's state
        return as_param_layout(self._p, self._store().get(StateKey(self._key, name)))

    def __setitem__(self, name: str, value: Any) -> None:
        key = self._key
        if name == "step":
            if isinstance(value, Tensor) and value.numel() == 1:
                value = value.item()
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or value < 0 \
                    or value != int(value):
                raise StateStoreValueError(f"state of parameter {key!r}: step must be a "
                                           f"non-negative whole number, got {value!r}")
            self._table.steps[key] = int(value)
            return
        names = self._layout.visible_names()
        if name not in names:
            raise StateStoreValueError(f"parameter {key!r}: {self._owner} keeps "
                                       f"only {list(names)} and 'step', not {name!r}")
        shape, dtype = self._layout.spec(name, self._p)
        if tuple(shape) == tuple(local(self._p).shape):
            shape = tuple(self._p.shape)        # given whole (or as a DTensor): the global shape
        if not isinstance(value, Tensor) or tuple(value.shape) != tuple(shape):
            raise StateStoreValueError(
                f"state {name!r} of parameter {key!r} must be a tensor of shape "
                f"{tuple(shape)}, got "
                f"{tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__}")
        store, sk = self._store(), StateKey(key, name)
        value = local_state(self._p, key, name, value)     # DTensor parameters: the local part
        self._table.next_plans.clear()             # the set of states may change: plan afresh
        if sk in store:
            store.put(sk, value.detach())
        else:
            store.create(sk, tuple(value.shape), dtype, value.detach().to(dtype))

    def __delitem__(self, name: str) -> None:
        if name == "step":
            if self._table.steps.pop(self._key, None) is None:
                raise KeyError(name)
            return
        if name not in self:
            raise KeyError(name)
        self._table.next_plans.clear()
        self._store().delete([StateKey(self._key, name)])

    def __repr__(self) -> str:
        return f"ParamState({self._key!r}: {list(self)})"


class OptimizerState(MutableMapping):
    """``optimizer.state``: a :class:`ParamState` per parameter with a step count whose
    states this rank keeps, in parameter order. ``state[p]`` also answers for a parameter
    of the optimizer that has not stepped (an empty entry, as torch's ``defaultdict``)."""

    def __init__(self, opt, table: ParamTable, layout):
        self._ref = weakref.ref(opt)
        self._table = table
        self._layout = layout

    def _live(self) -> ParamTable:
        """The optimizer's table (raises once the optimizer is gone)."""
        if self._ref() is None:
            raise StateStoreError("the optimizer this state belonged to no longer exists")
        return self._table

    def _has(self, table: ParamTable, p) -> bool:
        """``p`` has an entry: it has stepped (or its states were loaded) and its entry is not
        empty (torch's SGD without momentum keeps none)."""
        if not (isinstance(p, Tensor) and p in table.stores and table.keys.get(p) in table.steps):
            return False
        layout = self._layout
        if layout.torch_step(0) is not None:
            return True
        store, key = table.stores[p], table.keys[p]
        return any(StateKey(key, n) in store for n in layout.visible_names())

    def __iter__(self) -> Iterator[Tensor]:
        table = self._live()
        return iter([p for p in table.params if self._has(table, p)])

    def __len__(self) -> int:
        if self._ref() is None:
            return 0
        table = self._table
        return sum(1 for p in table.params if self._has(table, p))

    def __contains__(self, p) -> bool:
        return self._has(self._live(), p)

    def __getitem__(self, p) -> ParamState:
        opt = self._ref()
        table = self._live()
        if not isinstance(p, Tensor) or p not in table.stores:
            raise KeyError(p)
        return ParamState(table, type(opt).__name__, p, self._layout)

    def __setitem__(self, p, value) -> None:
        """Replace ``p``'s states with ``value`` (a mapping of ``"step"`` and state tensors);
        states it leaves out are kept."""
        if hasattr(value, "keys") and isinstance(value, ParamState) and value._p is p:
            return                               # state[p] = state[p]: nothing to do
        entry = self[p]
        for name in value:
            entry[name] = value[name]

    def __delitem__(self, p) -> None:
        entry = self[p]
        for name in list(entry):
            del entry[name]

    def __repr__(self) -> str:
        opt = self._ref()
        if opt is None:
            return "OptimizerState(<optimizer gone>)"
        return f"OptimizerState({len(self)} parameters with states)"

"""What an optimizer keeps per parameter, as the base of every statestore optimizer sees it:
:class:`StateLayout`.

The base (:class:`~statestore.optim.StateStoreOptimizer`) owns the store, the pipeline, step
counts, metadata, checkpoints and torch's format for every optimizer; what differs between
optimizers besides the update itself is described by one ``StateLayout`` object the optimizer
hands to the base:

* **states**: the names of a parameter's states in the store (:meth:`~StateLayout.names`, in
  the order a pipeline unit hands them out), each one's shape and dtype
  (:meth:`~StateLayout.spec`), the value a new one starts from (:meth:`~StateLayout.initial`);
* **units**: whether a parameter may be cut into element ranges (:meth:`~StateLayout.divisible`)
  and which elements of each state a range covers (:meth:`~StateLayout.state_range`);
* **hyperparameters**: their checks, their form in the checkpoint's metadata and in torch's
  ``state_dict()`` (:meth:`~StateLayout.check_group`, :meth:`~StateLayout.group_metadata`,
  :meth:`~StateLayout.group_from_saved`, :meth:`~StateLayout.torch_group`);
* **torch's format**: the names and ``"step"`` of a parameter's entry in ``state_dict()``,
  and the conversions of states on the way out and in (:meth:`~StateLayout.export`,
  :meth:`~StateLayout.encode`).

The defaults describe the common case (every state shaped like the parameter, the group's
hyperparameters as they are): an optimizer of that kind passes
``StateLayout(["exp_avg"], dtype=torch.float32)`` and implements nothing else here. Adam's
layout (:mod:`statestore.optim._adam_layout`) and :class:`~statestore.optim.StoreOptimizer`'s
(:mod:`statestore.optim._torch_layout`) override what they need.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._types import StateKey
from ._dtensor import local_shape

__all__ = ["StateLayout", "json_value", "json_group", "IMPL_KEYS"]

#: torch's implementation switches: how an update runs, never what it computes; they are
#: not carried between optimizers
IMPL_KEYS = frozenset({"foreach", "fused", "capturable", "differentiable"})


def json_value(v: Any) -> Tuple[bool, Any]:
    """``(True, v as plain JSON)`` for numbers, strings, bools, None, one-element tensors and
    lists/tuples of those; ``(False, None)`` for anything else (left out of the metadata)."""
    if v is None or isinstance(v, (bool, str)):
        return True, v
    if isinstance(v, Tensor):
        if v.numel() != 1:
            return False, None
        v = v.item()
    if isinstance(v, numbers.Integral):
        return True, int(v)
    if isinstance(v, numbers.Real):
        f = float(v)
        return (True, f) if math.isfinite(f) else (False, None)
    if isinstance(v, (list, tuple)):
        out = []
        for x in v:
            ok, y = json_value(x)
            if not ok:
                return False, None
            out.append(y)
        return True, out
    return False, None


def json_group(group: Dict[str, Any], skip: Iterable[str] = ()) -> Dict[str, Any]:
    """The keys of a param group that JSON can hold, but its parameters, torch's
    implementation switches and ``skip``."""
    skip = set(skip) | {"params", "param_names"} | IMPL_KEYS
    out = {}
    for k, v in group.items():
        if not isinstance(k, str) or k in skip:
            continue
        ok, j = json_value(v)
        if ok:
            out[k] = j
    return out


def _like(v: Any, like: Any) -> Any:
    """``v`` read back from JSON with the container type of ``like`` (tuples stay tuples)."""
    if isinstance(like, tuple) and isinstance(v, list):
        return tuple(_like(x, y) for x, y in zip(v, like)) if len(v) == len(like) else tuple(v)
    return v


class StateLayout:
    """The states of an optimizer's parameters and the form of its hyperparameters.

    Args:
        names: the states every parameter keeps (in unit order), each shaped like the
            parameter.
        dtype: their dtype (None: the parameter's own).

    Every method may be overridden; the docstring of each says what the base calls it for.
    """

    #: keys of a group the metadata and torch's format leave out (besides the parameters)
    impl_keys = IMPL_KEYS

    def __init__(self, names: Sequence[str] = (), dtype: Optional[torch.dtype] = None):
        self._names = list(names)
        self._dtype = dtype

    def bind(self, param_groups: List[dict], keys: Dict[Tensor, str]) -> None:
        """Called once the optimizer's groups and parameter keys exist (the same containers
        from then on), for layouts that answer by parameter alone."""

    # ------------------------------------------------------------------ states
    def names(self, p: Tensor, group: Dict[str, Any]) -> List[str]:
        """The store states of parameter ``p`` in ``group``, in the order a pipeline unit
        holds them (the unit update receives them in this order)."""
        return list(self._names)

    def known(self, name: str) -> bool:
        """Whether ``name`` is a state this optimizer may keep (a store state of another
        name is a mismatch on resume)."""
        return name in self._names

    def all_names(self) -> List[str]:
        """Every state name this optimizer may keep, for listing and deleting a parameter's
        states."""
        return list(self._names)

    def visible_names(self) -> List[str]:
        """The states ``optimizer.state`` shows (and accepts) by name."""
        return self.all_names()

    def describe(self, owner: str) -> str:
        """What the optimizer keeps, for the message about a state it does not know."""
        return f"{owner} keeps {self.all_names()}"

    def dtype_note(self) -> str:
        """Appended to the message about a state of another dtype than the optimizer's."""
        return ""

    def stored_problem(self, name: str, p: Tensor, group: Dict[str, Any]) -> Optional[str]:
        """Why a store state ``name`` of ``p`` that :meth:`known` accepts cannot be this
        optimizer's after all, or None."""
        return None

    def spec(self, name: str, p: Tensor) -> Tuple[Tuple[int, ...], torch.dtype]:
        """``(shape, dtype)`` of store state ``name`` of parameter ``p``."""
        return local_shape(p), self._dtype or p.dtype

    def initial(self, name: str, p: Tensor) -> Optional[Tensor]:
        """The value a new state starts from (the store converts it chunk by chunk), or None
        for zeros."""
        return None

    # ------------------------------------------------------------------ units
    def divisible(self, p: Tensor, group: Dict[str, Any]) -> bool:
        """Whether a pipeline unit may hold a range of ``p``'s elements (an element-wise
        update); False: ``p`` is updated whole, in one unit."""
        return True

    def state_range(self, name: str, p: Tensor, a: int, b: int) -> Optional[Tuple[int, int]]:
        """The elements of state ``name`` that a unit over parameter elements ``[a, b)``
        holds, or None when that unit does not hold the state. Default: a state of the
        parameter's size follows the range; any other state (a per-parameter scalar) rides
        in the unit that starts the parameter."""
        n = math.prod(self.spec(name, p)[0])
        if n == math.prod(local_shape(p)):
            return a, b
        return (0, n) if a == 0 else None

    def cut_elems(self, store, align: int) -> int:
        """Parameter elements at whose multiples a unit may cut a parameter on ``store``
        (``align``: where the store aligned the states' data)."""
        return max(1, align)

    def unit_itemsize(self, p: Tensor, names: Sequence[str]) -> Tuple[int, int]:
        """``(itemsize, count)``: a parameter element takes ``count`` states of ``itemsize``
        bytes among ``names`` (an upper bound, to size units; states that do not follow the
        parameter's elements are counted apart)."""
        n = max(1, math.prod(local_shape(p)))
        sizes = [dtype.itemsize for shape, dtype in (self.spec(name, p) for name in names)
                 if math.prod(shape) == n]
        if len(set(sizes)) <= 1:
            return (sizes[0] if sizes else 1), len(sizes)
        return 1, sum(sizes)

    # ------------------------------------------------------------------ hyperparameters
    def check_group(self, group: Dict[str, Any]) -> None:
        """Check a group's hyperparameters (a new group, a resumed or loaded one) as the
        constructor does; raises torch's ``ValueError``/``TypeError``."""

    def group_metadata(self, group: Dict[str, Any]) -> Dict[str, Any]:
        """The group's hyperparameters as the checkpoint's metadata keeps them (JSON)."""
        return json_group(group, self.impl_keys)

    def group_from_saved(self, saved: Dict[str, Any], group: Dict[str, Any]) -> Dict[str, Any]:
        """What ``group`` takes from a saved group (metadata or torch's ``state_dict``): every
        key but the parameters and the implementation switches, lists read back as tuples
        where ``group`` holds tuples."""
        return {k: _like(v, group.get(k)) for k, v in saved.items()
                if isinstance(k, str) and k not in ("params", "param_names")
                and k not in self.impl_keys}

    def torch_group(self, group: Dict[str, Any], ids: List[Any]) -> Dict[str, Any]:
        """``group`` in torch's format, its parameters as ``ids``."""
        ng = {k: v for k, v in group.items() if k != "params"}
        ng["params"] = ids
        return ng

    # ------------------------------------------------------------------ metadata
    def metadata(self) -> Dict[str, Any]:
        """Keys the optimizer adds to its checkpoint metadata (e.g. its states' encoding)."""
        return {}

    def resume_problem(self, meta: Dict[str, Any], stored: bool) -> Optional[str]:
        """Why this optimizer cannot take over states described by a store's (checkpoint's)
        metadata ``meta``, or None (``stored``: the store holds states of its parameters)."""
        return None

    # ------------------------------------------------------------------ torch's format
    def torch_names(self, p: Tensor, group: Dict[str, Any]) -> List[str]:
        """The states of ``p``'s entry in torch's ``state_dict()`` (besides ``"step"``)."""
        return self.names(p, group)

    def torch_spec(self, name: str, p: Tensor) -> Tuple[Tuple[int, ...], torch.dtype]:
        """``(shape, dtype)`` of state ``name`` of ``p`` in torch's format."""
        return self.spec(name, p)

    def torch_step(self, count: int) -> Any:
        """``"step"`` of a parameter entry in torch's format after ``count`` steps, or None
        when the optimizer keeps none."""
        return torch.tensor(float(count), dtype=torch.float32)

    def export(self, store, params: Sequence[Tuple[str, Tensor, Dict[str, Any]]]
               ) -> Dict[StateKey, Tensor]:
        """torch's state tensors of ``params`` (``(key, parameter, group)``) kept in
        ``store``: live views on resident stores, mapped snapshots on disk stores (never
        every state in RAM)."""
        from .._snapshot import export_states
        keys = [StateKey(k, n) for k, p, g in params for n in self.torch_names(p, g)
                if StateKey(k, n) in store]
        return export_states(store, keys)

    def optional(self, name: str) -> bool:
        """Whether a parameter's stored states (or its entry in a loaded ``state_dict()``)
        may lack state ``name``: it then starts from :meth:`default_state`."""
        return False

    def default_state(self, name: str, p: Tensor) -> Optional[Tensor]:
        """The value of an :meth:`optional` state a loaded ``state_dict()`` left out."""
        return None

    def encode(self, name: str, src: Tensor, p: Tensor) -> Dict[str, Tensor]:
        """Store states (CPU tensors) holding state ``name`` of ``p`` read from torch's
        format: ``{store name: tensor}``."""
        return {name: src.detach().to("cpu", self.spec(name, p)[1])}

    def structure_of(self, group: Dict[str, Any]) -> Tuple:
        """What in ``group`` decides which states its parameters keep, beyond :meth:`names`
        (a plan of ``update_in_backward`` made for another structure is dropped before
        backward uses it); ``()``: nothing."""
        return ()

    def scale_of(self, name: str) -> Optional[str]:
        """The stored state holding state ``name``'s scales (Adam's int8 moments), or
        None."""
        return None

    def to_torch(self, name: str, t: Tensor, scales: Optional[Tensor] = None) -> Tensor:
        """State ``name`` of a checkpoint as torch's format holds it (``scales``: its
        :meth:`scale_of` state)."""
        return t

    def torch_entry(self, entry: Dict[str, Any]) -> Dict[str, Any]:
        """A parameter's entry read from a checkpoint (``"step"`` and its stored states) in
        torch's form: the default keeps it as it is."""
        return entry

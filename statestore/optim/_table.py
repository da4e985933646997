"""The bookkeeping an optimizer shares with its helper modules (``optimizer.state``, the
update-in-backward stepper, the torch-format conversion, the offload path): one
:class:`ParamTable` per optimizer.

Step counts live here, with the one rollback rule every step path uses: a step advances the
counts of the parameters it updates (:meth:`ParamTable.advance_steps`) before touching
anything; if it fails before any parameter or state changed (``touched`` still False), the
counts go back to exactly what they were (:meth:`ParamTable.rollback_steps`: a parameter
without a count before has none again); once something changed, the optimizer records the
failure in ``failed`` and refuses to go on instead.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..errors import StateStoreError

__all__ = ["ParamTable", "StepUndo", "index_keys", "assign_stores", "offload_store"]

#: what :meth:`ParamTable.rollback_steps` restores: each advanced key's count before (None:
#: it had none)
StepUndo = Dict[str, Optional[int]]


class ParamTable:
    """Per-parameter bookkeeping of one optimizer.

    Attributes:
        keys: each parameter's key (its name, or its index in torch's numbering).
        params: every parameter, in group order.
        stores: the store of each parameter whose states this rank keeps.
        steps: step count per parameter key (parameters stepped, loaded or resumed).
        next_plans: ``update_in_backward``: the units planned for the next step, per store
            (cleared whenever the set of states may change, so that it is planned afresh).
        touched: whether the step under way has changed any parameter or state yet.
        failed: why a step failed part-way (empty: none did); the optimizer then refuses to
            step or checkpoint.
    """

    __slots__ = ("keys", "params", "stores", "steps", "next_plans", "touched", "failed")

    def __init__(self) -> None:
        self.keys: Dict[Tensor, str] = {}
        self.params: List[Tensor] = []
        self.stores: Dict[Tensor, object] = {}
        self.steps: Dict[str, int] = {}
        self.next_plans: Dict[object, Tuple[list, list]] = {}
        self.touched = False
        self.failed: List[str] = []

    def set_keys(self, keys: Dict[Tensor, str], params: List[Tensor]) -> None:
        """Replace the key map and parameter list in place: the metadata source attached to
        the stores holds these containers (a group added later must be in the next save)."""
        self.keys.clear()
        self.keys.update(keys)
        self.params[:] = params

    def advance_steps(self, keys: Sequence[str]) -> StepUndo:
        """Add one to the step count of each of ``keys``; returns what undoes it."""
        steps = self.steps
        undo: StepUndo = {}
        for k in keys:
            before = steps.get(k)
            undo[k] = before
            steps[k] = (before or 0) + 1
        return undo

    def rollback_steps(self, undo: StepUndo) -> None:
        """Put back the step counts :meth:`advance_steps` changed."""
        for k, before in undo.items():
            if before is None:
                self.steps.pop(k, None)
            else:
                self.steps[k] = before


def index_keys(param_groups: Sequence[dict]) -> Tuple[Dict[Tensor, str], List[Tensor]]:
    """Each parameter's key (``param_names`` of its group, else its index over every group,
    torch's numbering) and the parameters in group order.

    Raises:
        ValueError: a parameter in two groups, two parameters of one name, or a name with '/'.
    """
    keys: Dict[Tensor, str] = {}
    params: List[Tensor] = []
    idx = 0
    for group in param_groups:
        names = group.get("param_names")
        for j, p in enumerate(group["params"]):
            if p in keys:
                raise ValueError("some parameters appear in more than one parameter group")
            keys[p] = str(names[j]) if names is not None else str(idx)
            params.append(p)
            idx += 1
    if len(set(keys.values())) != len(keys):
        seen: set = set()
        dup = next(k for k in keys.values() if k in seen or seen.add(k))
        raise ValueError(f"parameter names must be unique: {dup!r} names more than one "
                         f"parameter")
    for k in keys.values():
        if "/" in k:
            raise ValueError(f"parameter name {k!r} must not contain '/'")
    return keys, params


def assign_stores(table: ParamTable, state_store, owns: Callable[[Tensor], bool],
                  owned: List) -> None:
    """Give each parameter this rank keeps and that has no store yet its store:
    ``state_store``, or where None a :class:`~statestore.DeviceStore` on the parameter's
    device (created here, one per device, and appended to ``owned``: the optimizer closes
    them)."""
    default: Dict[torch.device, object] = {}
    stores = table.stores
    for p in table.params:
        if p in stores or not owns(p):
            continue
        if state_store is not None:
            stores[p] = state_store
            continue
        if p.device not in default:
            from ..backends.device import DeviceStore
            default[p.device] = DeviceStore(p.device)
            owned.append(default[p.device])
        stores[p] = default[p.device]


def offload_store(fraction: float, directory: Optional[str]):
    """ColossalAI's ``nvme_offload_fraction``: a tiered store with ``fraction`` of the state
    bytes on disk under ``directory`` (a temporary directory when None), the rest in RAM.

    Raises:
        StateStoreError: the tiered store is not available.
    """
    try:
        from ..backends.tiered import TieredStore
    except ImportError as e:
        raise StateStoreError(f"nvme_offload_fraction needs the tiered store, which is "
                              f"not available: {e}") from e
    return TieredStore.from_fraction(fraction, directory)

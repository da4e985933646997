"""The bookkeeping an optimizer shares with its helper modules (``optimizer.state``, the
update-in-backward stepper, the torch-format conversion, the staging path): one
:class:`ParamTable` per optimizer.

Step counts live here, with the one rollback rule every step path uses
(:meth:`ParamTable.stepping`): a step advances the counts of the parameters it updates before
touching anything; if it fails before any parameter or state changed (``touched`` still
False), the counts go back to exactly what they were (a parameter without a count before has
none again); once something changed, the failure is recorded in ``failed`` and the optimizer
refuses to go on instead. The advance and its undo are atomic with respect to Ctrl-C: each
count's undo is recorded before the count changes, and both run with signals deferred
(:mod:`statestore._signals`), so an interrupt lands before the advance, inside the guarded
update (rolled back while nothing changed) or after it, never between a count and its undo.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._signals import deferred_signals
from ..errors import StateStoreError
from ._dtensor import region_of

__all__ = ["ParamTable", "StepUndo", "failed_message", "index_keys", "assign_stores",
           "fraction_store"]

#: what :meth:`ParamTable.rollback_steps` restores: each advanced key's count before (None:
#: it had none)
StepUndo = Dict[str, Optional[int]]


def failed_message(name: str, cause: str) -> str:
    """What an optimizer whose step failed part-way says when asked to go on."""
    return (f"{name}: an earlier step() failed part-way ({cause}); parameters and states hold a "
            "mix of two steps. Load the last checkpoint into the store (and the model weights) "
            "and build a new optimizer")


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
        closer: what :meth:`end_open_step` calls.
        lost: see :meth:`loaded`.
    """

    __slots__ = ("keys", "params", "stores", "steps", "next_plans", "touched", "failed", "unfinished",
                 "closer", "lost", "lr_after_load", "__weakref__")

    def __init__(self) -> None:
        self.keys: Dict[Tensor, str] = {}
        self.params: List[Tensor] = []
        self.stores: Dict[Tensor, object] = {}
        self.steps: Dict[str, int] = {}
        self.next_plans: Dict[object, Tuple[list, list]] = {}
        self.touched = False
        self.failed: List[str] = []
        #: the undo of the step under way (:meth:`stepping`), None between steps: a step
        #: whose failure handling never ran (a Ctrl-C at the first line of ``__exit__`` or of
        #: :meth:`step_failed`, before any code of theirs: the interpreter checks signals at
        #: a function's entry) is handled by the next :meth:`check_usable`. A step made sets
        #: it to None as the last statement of its ``with`` body, an attribute store (no
        #: call, so no signal check) before ``__exit__`` runs: a Ctrl-C at that first line
        #: then leaves nothing to handle
        self.unfinished: Optional[StepUndo] = None
        #: ends a step left open (update_in_backward: parameters updated during a backward,
        #: the others not yet) before its states are read whole; a weak method, or None
        self.closer: Optional[Callable[[], Optional[Callable[[], None]]]] = None
        #: stores whose states a failed load_checkpoint removed (or replaced by a checkpoint
        #: that does not fit), with why: the optimizer refuses until a load succeeds
        self.lost: Dict[object, str] = {}
        #: (group, lr) as a checkpoint saved under an LR scheduler left them when it was
        #: loaded before the optimizer was built; checked at the first step
        #: (:func:`~statestore.optim._resume_warnings.warn_lr_reset_after_load`), then None
        self.lr_after_load: Optional[List[Tuple[dict, object]]] = None

    def set_keys(self, keys: Dict[Tensor, str], params: List[Tensor]) -> None:
        """Replace the key map and parameter list in place: the metadata source attached to
        the stores holds these containers (a group added later must be in the next save)."""
        self.keys.clear()
        self.keys.update(keys)
        self.params[:] = params

    def check_usable(self, name: str, end_open_step: bool = False) -> None:
        """Refuse once a step failed part-way (every call that steps, reads or saves states);
        with ``end_open_step``, :meth:`end_open_step` first (a call reading states whole).

        Raises:
            StateStoreError: ``failed`` is not empty; says how to recover.
        """
        if self.unfinished is not None:
            self.step_failed(self.unfinished, KeyboardInterrupt(
                "the step was interrupted as its failure was being handled"))
        if end_open_step:
            self.end_open_step()
        if self.failed:
            raise StateStoreError(failed_message(name, self.failed[0]))
        if self.lost:
            raise StateStoreError(
                f"{name}: load_checkpoint into its store failed ({next(iter(self.lost.values()))})"
                f"; the store was left without this optimizer's states, which it will not "
                f"start afresh. Load the last checkpoint into the store again (the same store "
                f"is fine) to go on, or build a new optimizer")

    def loaded(self, store, error: Optional[str] = None) -> bool:
        """``store.load_checkpoint`` ended: True when it succeeded (the optimizer takes the
        checkpoint's counts); False when it failed and left the store empty, or ``error``
        (the checkpoint does not fit the optimizer): remembered in ``lost``, and every call
        refuses until a load into that store succeeds."""
        error = error or getattr(store, "load_error", None)
        if error:
            self.lost[store] = error
            return False
        self.lost.pop(store, None)
        return True

    def end_open_step(self) -> None:
        """Before states are saved or read whole (a checkpoint, ``state_dict()``): end a step
        left open, so that every parameter is at one step with its states that step's."""
        closer = self.closer() if self.closer is not None else None
        if closer is not None:
            closer()

    def advance_steps(self, keys: Sequence[str], undo: Optional[StepUndo] = None) -> StepUndo:
        """Add one to the step count of each of ``keys``; returns what undoes it (``undo``,
        filled in place when given: each key's entry is written before its count changes,
        so that an interrupted advance is undone exactly)."""
        steps = self.steps
        undo = {} if undo is None else undo
        with deferred_signals():
            for k in keys:
                if k in undo:
                    continue
                undo[k] = steps.get(k)
                steps[k] = (undo[k] or 0) + 1
        return undo

    def rollback_steps(self, undo: StepUndo) -> None:
        """Put back the step counts :meth:`advance_steps` changed."""
        with deferred_signals():
            for k, before in undo.items():
                if before is None:
                    self.steps.pop(k, None)
                else:
                    self.steps[k] = before

    def step_failed(self, undo: StepUndo, err: BaseException, record: bool = True) -> None:
        """A step that advanced ``undo``'s counts failed with ``err``: while it had changed
        nothing (``touched`` False) the counts go back; after, the failure is recorded
        (``record``) and the optimizer refuses to go on."""
        with deferred_signals():
            if not self.touched:
                self.rollback_steps(undo)
            elif record:
                self.failed.append(f"{type(err).__name__}: {err}")
            if undo is self.unfinished:
                self.unfinished = None

    def stepping(self, keys: Sequence[str]) -> "_Stepping":
        """``with table.stepping(keys): update...``: a whole step (``touched`` reset, the
        counts of ``keys`` advanced, :meth:`step_failed` on an exception); see the module
        docstring."""
        return _Stepping(self, keys)


class _Stepping:
    __slots__ = ("table", "keys", "undo")

    def __init__(self, table: ParamTable, keys: Sequence[str]):
        self.table, self.keys, self.undo = table, keys, {}

    def __enter__(self) -> StepUndo:
        try:
            with deferred_signals():        # a Ctrl-C meanwhile is raised as this ends:
                self.table.touched = False
                self.table.unfinished = self.undo
                self.table.advance_steps(self.keys, self.undo)
            return self.undo
        except BaseException:               # here, where the undo covers it: nothing was
            self.table.rollback_steps(self.undo)    # touched (`touched` may not be reset yet)
            self.table.unfinished = None
            raise

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.table.step_failed(self.undo, exc)
        elif self.table.unfinished is self.undo:
            self.table.unfinished = None


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
    them). The store of a DTensor parameter's local shard records its region."""
    default: Dict[torch.device, object] = {}
    stores = table.stores
    for p in table.params:
        if p in stores or not owns(p):
            continue
        if state_store is not None:
            stores[p] = state_store
        else:
            if p.device not in default:
                from ..backends.device import DeviceStore
                default[p.device] = DeviceStore(p.device)
                owned.append(default[p.device])
            stores[p] = default[p.device]
        region = region_of(p)
        if region is not None:
            stores[p].record_regions({table.keys[p]: region})


def fraction_store(fraction: float, directory: Optional[str]):
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

"""``OptimizerCore``: the bookkeeping half of :class:`~statestore.optim.StateStoreOptimizer`.

What every optimizer over a :class:`~statestore.StateStore` keeps, apart from its step (as
torch's ``Optimizer`` owns groups and state): the stores (one given, or a
:class:`~statestore.DeviceStore` per parameter device), the per-parameter bookkeeping and step
counts (:class:`~statestore.optim._table.ParamTable`), the metadata every checkpoint of a
store carries and the resume from it in either order, torch's ``state_dict()`` format both
ways, ``optimizer.state``, ``add_param_group`` and the ``process_group`` partition.
:class:`~statestore.optim.StateStoreOptimizer` (``base.py``) is the one class on it: it adds
the step. Two hooks of this class are the step's to fill: :meth:`_group_added` and
:meth:`_forget_pending`.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._malloc import fix_mmap_threshold
from ..errors import StateStoreError
from ..store import StateStore
from ._args import check_params
from ._dtensor import DTensorParams
from ._layout import StateLayout
from ._metadata import metadata_source, resume
from ._resume_warnings import warn_lr_reset_after_load
from ._shared import attach, check_keys, share_of
from ._sharding import Sharding, check_not_partial, refuse_partial, shard_state_dict
from ._state import OptimizerState
from ._table import ParamTable, assign_stores, index_keys
from ._torch_format import export_state_dict, read_state_dict, write_states

__all__ = ["OptimizerCore"]


class OptimizerCore(torch.optim.Optimizer):
    """The groups, stores, step counts, metadata and torch's format of a statestore
    optimizer (module docstring); :class:`~statestore.optim.StateStoreOptimizer`'s
    arguments of the same names.

    Attributes:
        state_store: the store passed (None: one per parameter device).
        process_group: the group states are sharded over, or None.
        state: torch's ``optimizer.state``, a view of the store (read on access).
    """

    def __init__(self, params, defaults: Dict[str, Any], layout: StateLayout, *,
                 state_store: Optional[StateStore] = None, process_group=None,
                 own_store: bool = False):
        self._layout = layout
        super().__init__(params, defaults)
        # the bookkeeping shared with this package's modules; the optimizer's own names for
        # its containers are the same objects
        table = self._table = ParamTable()
        self._keys, self._params, self._stores, self._steps = (
            table.keys, table.params, table.stores, table.steps)
        table.set_keys(*index_keys(self.param_groups))
        check_params(self._params, self._keys)
        layout.bind(self.param_groups, self._keys)
        #: DTensor parameters (FSDP2): updates on local shards, DTensor states (_dtensor.py)
        self._dtensors = DTensorParams(self._params, self._keys, process_group)
        self.process_group = process_group
        self._sharding: Optional[Sharding] = None
        if process_group is not None:
            self._sharding = Sharding(process_group, self._params)
        self._owned_stores: List[StateStore] = [state_store] if own_store else []
        self.state_store = state_store
        assign_stores(table, state_store, self._owns, self._owned_stores)
        attached = list(dict.fromkeys(self._stores.values()))
        if state_store is not None and state_store not in attached:
            attached.append(state_store)     # a rank owning no parameter still saves with the group
        for store in attached:
            self._resume(store, loaded=False)
        if any(not s.resident for s in attached):
            fix_mmap_threshold()        # RSS follows the working set (statestore/_malloc.py)
        #: torch's ``optimizer.state``: a view of the store (statestore/optim/_state.py)
        self.state = OptimizerState(self, table, layout)

    # ------------------------------------------------------------------ set-up
    def _owns(self, p: Tensor) -> bool:
        """True when this rank keeps ``p``'s states (always, without a process group)."""
        return self._sharding is None or self._sharding.owns(p)

    def _resume(self, store: StateStore, loaded: bool) -> None:
        """Take the states already in ``store`` (or just loaded into it), then attach this
        optimizer's metadata to it."""
        check_keys(store, self._keys, self._kind())
        resume(store, self._table, self.param_groups, self._layout,
               owner=type(self).__name__, keep=tuple(self.defaults),
               sharded=self._sharding is not None, loaded=loaded,
               part=share_of(store).part(self._keys))
        self._attach(store)

    def _attach(self, store: StateStore) -> None:
        """Save this optimizer's metadata with ``store``'s checkpoints; hear of its loads."""
        attach(store, self._keys, self._metadata_source(), self._store_loaded,
               self._dtensors.group, self._kind())

    def _kind(self) -> str:
        """What this optimizer is, in messages about several optimizers on one store."""
        return type(self).__name__

    def _store_loaded(self, store: StateStore) -> None:
        """``store.load_checkpoint`` replaced the states under this optimizer (torch's order:
        optimizer and scheduler built first): take the checkpoint's step counts and
        hyperparameters, then save this optimizer's metadata with the store's checkpoints
        again. A checkpoint that does not fit raises, stays detached, and the optimizer
        refuses until a load into the store succeeds (``ParamTable.loaded``)."""
        table = self._table
        if table.failed:            # unusable (see failed_message): stays detached
            return
        if not table.loaded(store):     # refuses until a good load: stays to hear of it
            self._attach(store)
            return
        table.next_plans.clear()
        self._forget_pending(store)
        try:
            self._resume(store, loaded=True)
        except BaseException:
            if store in table.lost:
                self._attach(store)
            raise

    def _metadata(self) -> dict:
        return self._metadata_source()()

    def _metadata_source(self):
        return metadata_source(type(self).__name__, self.param_groups, self._table,
                               self._layout)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a param group, as ``torch.optim.Optimizer.add_param_group``.

        Args:
            param_group: a dict with ``"params"`` (and optionally ``"param_names"`` and any
                hyperparameter; missing ones take the optimizer's defaults).

        Raises:
            ValueError, TypeError: torch's checks, the hyperparameters' checks, or parameters
                the optimizer cannot take; the group is then not added (the optimizer stays
                as it was).
            StateStoreError: the optimizer has a ``process_group`` (its state partition is
                fixed at construction).
        """
        n_groups = len(self.param_groups)
        super().add_param_group(param_group)
        table = getattr(self, "_table", None)   # None: torch's __init__ adding the first groups
        saved = (dict(table.keys), list(table.params), dict(table.stores)) if table else None
        try:
            self._layout.check_group(self.param_groups[-1])
            if table is not None:
                if self._sharding is not None:
                    raise StateStoreError("add_param_group is not supported with a "
                                          "process_group (the state partition is fixed at "
                                          "construction)")
                table.set_keys(*index_keys(self.param_groups))
                check_params(self._params, self._keys)
                dtensors = DTensorParams(self._params, self._keys, group=self._dtensors.group)
                assign_stores(table, self.state_store, self._owns, self._owned_stores)
        except BaseException:
            del self.param_groups[n_groups:]
            if saved is not None:
                table.set_keys(saved[0], saved[1])
                table.stores.clear()
                table.stores.update(saved[2])
            raise
        if table is not None:
            self._dtensors = dtensors
            self._group_added(self.param_groups[-1]["params"])

    def _group_added(self, params: Sequence[Tensor]) -> None:
        """A group of ``params`` was added after construction (the step's side adds its
        hooks)."""

    def _check_usable(self, end_open_step: bool = False) -> None:
        """Refuse once a step failed part-way or a load into a store failed
        (:meth:`ParamTable.check_usable`); ``end_open_step``: a call reading states whole
        ends a step left open first."""
        self._table.check_usable(type(self).__name__, end_open_step=end_open_step)
        pairs = self._table.lr_after_load
        if pairs is not None and not end_open_step:      # the first step after a load-first
            self._table.lr_after_load = None
            warn_lr_reset_after_load(pairs, hasattr(self.step, "_wrapped_by_lr_sched"))

    def _forget_pending(self, store: Optional[StateStore] = None) -> None:
        """States were replaced (a load into ``store``, or ``load_state_dict``): the step's
        side drops what it kept of a step under way."""

    # ------------------------------------------------------------------ torch's state_dict
    def state_dict(self) -> Dict[str, Any]:
        """The optimizer's state in torch's format, which the torch optimizer of the same
        update loads (``torch.optim.AdamW`` for the Adam optimizers, ``optimizer_cls`` for
        :class:`~statestore.optim.StoreOptimizer`).

        Returns:
            ``{"state": {index: {"step", <states>...}}, "param_groups": [...]}``: one entry
            per parameter with a step count (with a ``process_group``: this rank's shard),
            indices in torch's numbering.

        Resident stores return views of the live states (as torch returns its own state
        tensors). Disk stores snapshot their state files as a linked checkpoint does (frozen,
        copy-on-write) and return tensors mapped privately from them (pages load on access
        and the kernel may evict them): no copy, no temporary file, never every state in RAM;
        states whose files cannot be taken whole are streamed into a temporary file of their
        size (see :mod:`statestore._snapshot` and docs/scale.md).

        Raises:
            StateStoreIOError: a disk store failed to read a state.
            StateStoreError: a step failed part-way (:meth:`step`); the optimizer is sharded
                over a ``process_group`` (this rank holds a part: ``docs/distributed.md``,
                :meth:`shard_state_dict`).
        """
        self._check_usable(end_open_step=True)
        refuse_partial(self._sharding, "state_dict()")
        return export_state_dict(self.param_groups, self._table, self._layout)

    def shard_state_dict(self) -> Dict[str, Any]:
        """This rank's shard of :meth:`state_dict`, marked as one (``docs/distributed.md``);
        :meth:`state_dict` without a process group."""
        self._check_usable(end_open_step=True)
        return shard_state_dict(self._sharding, self.param_groups, self._table, self._layout)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load torch's format (from the torch optimizer of the same update, or this class).

        Hyperparameters (every key of the saved groups but their parameters: ``lr``,
        ``initial_lr`` of a scheduler...) are restored from the saved groups, as torch does;
        states are written into the store one parameter at a time. State keys are torch's
        indices, or strings naming the parameters (the fully qualified names of
        ``torch.distributed.checkpoint``'s ``get_optimizer_state_dict``, or the names this
        optimizer was given): names that are exactly the optimizer's are matched by name,
        others by position in the groups, as torch does. Everything is checked first: a
        state dict that fails a check changes nothing.

        Args:
            state_dict: ``{"state": {...}, "param_groups": [...]}``, torch's format.

        Raises:
            ValueError, TypeError: a malformed state dict, naming the group, parameter or
                state at fault.
            CheckpointMismatchError: groups or parameter counts that differ.
            StateStoreError: a step failed part-way; one rank's :meth:`shard_state_dict`.
        """
        self._check_usable(end_open_step=True)
        check_not_partial(state_dict, self._sharding, self._table)
        new_hyper, plan = read_state_dict(state_dict, self.param_groups, self._table,
                                          self._owns, self._layout)
        write_states(self.param_groups, new_hyper, plan, self._table, self._layout)
        self._forget_pending()

    def torch_state_specs(self, p: Tensor) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
        """The states of parameter ``p``'s entry in :meth:`state_dict` once it has stepped,
        ``{name: (shape, dtype)}`` (besides ``"step"``): what a framework allots for a
        parameter that has not stepped yet (``statestore.integrations.dcp``).

        Raises:
            KeyError: ``p`` is not a parameter of this optimizer.
        """
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        layout = self._layout
        return {n: layout.torch_spec(n, p) for n in layout.torch_names(p, group)}

    def step_count(self, p: Tensor) -> int:
        """How many steps parameter ``p`` has made (0: none, or its states live on another
        rank)."""
        return self._steps.get(self._keys[p], 0)

    @property
    def keeps_step(self) -> bool:
        """Whether a parameter's entry in :meth:`state_dict` holds a ``"step"`` (torch's
        Adam does; SGD and Muon do not)."""
        return self._layout.torch_step(0) is not None

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Close the stores this optimizer created itself (never a store passed in)."""
        for s in self._owned_stores:
            s.close()
        self._owned_stores = []

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self._params)} params, store={self.state_store!r})"

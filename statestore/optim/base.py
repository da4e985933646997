"""``StateStoreOptimizer``: the base every statestore optimizer is one class on.

The base owns what every optimizer over a :class:`~statestore.StateStore` shares (as torch's
``Optimizer`` owns groups, state and hooks): the stores (one given, or a
:class:`~statestore.DeviceStore` per parameter device), the per-parameter bookkeeping and step
counts (:class:`~statestore.optim._table.ParamTable`), the plan of a step's pipeline units
and the loop over them, the metadata every checkpoint of a store carries and the resume from
it in either order, torch's ``state_dict()`` format both ways, ``optimizer.state``, the
``process_group`` sharding, the read-ahead of disk stores during backward, and the seam the
integrations find (``isinstance(opt, StateStoreOptimizer)``, ``opt.state_store``).

An optimizer on it is one class (``docs/extending.md``, "Adding an optimizer"): it passes
its defaults and a :class:`~statestore.optim._layout.StateLayout` (which states a parameter
keeps, how its hyperparameters are saved) to ``__init__`` and implements
:meth:`StateStoreOptimizer._update_unit`, the update of one pipeline unit. ``CPUAdam`` and
``HybridAdam`` (``adam.py``) and :class:`~statestore.optim.StoreOptimizer` are such classes.
"""
from __future__ import annotations

import os
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._hook_handles import HookHandles
from .._malloc import fix_mmap_threshold
from ..errors import StateStoreError
from ..offload._seam import update_begin, update_end
from ..store import StateStore
from ._args import check_params
from ._dtensor import DTensorParams
from ._layout import StateLayout
from ._metadata import metadata_source, resume
from ._plan import PlanMemo, Work, collect_work, ensure_states
from ._resume_warnings import warn_lr_reset_after_load
from ._shared import attach, check_keys, share_of
from ._sharding import Sharding, check_not_partial, refuse_partial, shard_state_dict
from ._state import OptimizerState
from ._table import ParamTable, StepUndo, assign_stores, index_keys
from ._torch_format import export_state_dict, read_state_dict, write_states

__all__ = ["StateStoreOptimizer", "may_prefetch"]


def may_prefetch(store: StateStore) -> bool:
    """Whether a step ends by starting the next step's reads on ``store``: disk stores,
    unless ``STATESTORE_PREFETCH=0`` (for comparisons)."""
    return not store.resident and os.environ.get("STATESTORE_PREFETCH", "1") != "0"


def _opaque_to_compiler(cls: type) -> None:
    """Make ``step()`` opaque to ``torch.compile``: compiling ``opt.step`` (or a training step
    that calls it) runs the store's pipeline eagerly behind a graph break, instead of tracing
    into I/O threads, ring buffers and C++ kernels (which recompiled until the limit and
    failed). Done once per class, at its first optimizer's construction: ``torch._dynamo``
    is imported by ``torch.optim.Optimizer.__init__`` anyway, so importing this package
    stays cheap."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    if disable is None:         # torch without torch.compile: nothing to hide from
        return
    for c in cls.__mro__:
        step = c.__dict__.get("step")
        if step is None or not issubclass(c, StateStoreOptimizer):
            continue
        if not getattr(step, "_torchdynamo_disable", False):
            c.step = disable(step)


def _grad_hook(owner: "StateStoreOptimizer"):
    """The post-accumulate-grad hook of an optimizer's parameters, holding it weakly:
    :meth:`StateStoreOptimizer._grad_ready`."""
    ref = weakref.ref(owner)

    def hook(param) -> None:
        opt = ref()
        if opt is not None:
            opt._grad_ready(param)
    return hook


class StateStoreOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose per-parameter states live in a
    :class:`~statestore.StateStore`: the base of ``CPUAdam``, ``HybridAdam`` and
    ``StoreOptimizer`` (see the module docstring; build one of those).

    Args:
        params: parameters, ``named_parameters()`` pairs, or param-group dicts (as torch);
            DTensors of ``fully_shard`` (FSDP2) too (``docs/distributed.md``, "FSDP2").
        defaults: the hyperparameters' defaults (as ``torch.optim.Optimizer``).
        layout: what a parameter keeps (:class:`~statestore.optim._layout.StateLayout`).
        state_store: where states live. None: next to the parameters (a
            :class:`~statestore.DeviceStore` per parameter device).
        process_group: shard states over a ``torch.distributed`` group: each rank keeps the
            states of the parameters :func:`statestore.distributed.partition` assigns it,
            gradients are averaged with all-reduce, owners update and broadcast parameters.
        own_store: ``state_store`` was made for this optimizer: :meth:`close` closes it.

    Attributes:
        state_store: the store passed (None: one per parameter device).
        process_group: the group states are sharded over, or None.
        state: torch's ``optimizer.state``, a view of the store (read on access).
    """

    #: parameter offload's seam (``statestore/offload/_seam.py``): this optimizer updates
    #: offloaded parameters a unit at a time through ``update_begin``/``update_end``
    updates_offloaded_parameters = True

    def __init__(self, params, defaults: Dict[str, Any], layout: StateLayout, *,
                 state_store: Optional[StateStore] = None, process_group=None,
                 own_store: bool = False):
        self._layout = layout
        _opaque_to_compiler(type(self))     # before torch wraps step() with its hooks
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
        self._prefetching: "weakref.WeakSet[StateStore]" = weakref.WeakSet()
        #: during a step: each stepped key's count before it (None: its first step)
        self._step_undo: StepUndo = {}
        self._hooked: set = set()
        self._pump_hooks = HookHandles()
        #: torch's ``optimizer.state``: a view of the store (statestore/optim/_state.py)
        self.state = OptimizerState(self, table, layout)
        self._setup_parts()
        self._register_pump_hooks(self._params)

    # ------------------------------------------------------------------ what a subclass implements
    def _update_unit(self, tensors: List[Tensor], group: dict, entries, grads: Dict[Tensor, Tensor],
                     grad_scale: float, dev: torch.device) -> None:
        """Update one pipeline unit (the optimizer's math).

        Args:
            tensors: the unit's state tensors (flat, on ``dev``), entry by entry, each
                entry's in the order of its names; updated in place.
            group: the param group of every entry.
            entries: ``(parameter, start, stop, names)``: elements ``[start, stop)`` of the
                parameter's local tensor (:func:`statestore.optim._dtensor.local`) and
                the states of the unit that are its, in order.
            grads: each parameter's (local) gradient, contiguous.
            grad_scale: divide the gradients by it (1.0: as they are).
            dev: the store's device (where the states are).

        Call :meth:`_touch` just before the first change to a parameter or state: a failure
        before it rolls the step back exactly; after it, the optimizer refuses to go on.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement _update_unit")

    def _setup_parts(self) -> None:
        """Build the optimizer's own parts once the base is set up (its table, stores and
        ``optimizer.state`` exist) and before the gradient hooks are registered (optional)."""

    def _touch(self) -> None:
        """The unit update is about to change a parameter or a state."""
        self._table.touched = True

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
        self._forget_pending()
        self._prefetching.discard(store)
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

    def _wants_hook(self, p: Tensor) -> bool:
        """Whether backward tells this optimizer when ``p``'s gradient is final: parameters
        kept in a disk store (resident stores never prefetch, so an optimizer over RAM/GPU
        stores adds nothing to backward)."""
        return not self._stores[p].resident

    def _register_pump_hooks(self, params: Sequence[Tensor]) -> None:
        """Hook :meth:`_grad_ready` on the parameters :meth:`_wants_hook` picks."""
        if not hasattr(Tensor, "register_post_accumulate_grad_hook"):
            return
        hook = _grad_hook(self)
        for p in params:
            if p.requires_grad and p in self._stores and p not in self._hooked \
                    and self._wants_hook(p):
                self._pump_hooks.add(p.register_post_accumulate_grad_hook(hook))
                self._hooked.add(p)

    def _grad_ready(self, p: Tensor) -> None:
        """Backward has finished ``p``'s gradient: let disk stores start the next step's
        reads (:meth:`StateStore.pump`, which never blocks)."""
        prefetching = self._prefetching
        for store in list(prefetching):
            try:
                store.pump()
            except StateStoreError:      # surfaces again at the step that needs it
                store.cancel_prefetch()
                prefetching.discard(store)

    def __del__(self) -> None:
        hooks = getattr(self, "_pump_hooks", None)
        if hooks is not None:
            hooks.remove_all()

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
        """A group of ``params`` was added after construction."""
        self._register_pump_hooks(params)

    # ------------------------------------------------------------------ step
    def _check_usable(self, end_open_step: bool = False) -> None:
        """Refuse once a step failed part-way or a load into a store failed
        (:meth:`ParamTable.check_usable`); ``end_open_step``: a call reading states whole
        ends a step left open first."""
        self._table.check_usable(type(self).__name__, end_open_step=end_open_step)
        pairs = self._table.lr_after_load
        if pairs is not None and not end_open_step:      # the first step after a load-first
            self._table.lr_after_load = None
            warn_lr_reset_after_load(pairs, hasattr(self.step, "_wrapped_by_lr_sched"))

    def _forget_pending(self) -> None:
        """States were replaced (a load, ``load_state_dict``): drop what the class kept of a
        step under way (optional)."""

    @staticmethod
    def _run_closure(closure):
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def _collect(self, released=(), contiguous: bool = True,
                 fp64: bool = False) -> Tuple[Work, Dict[Tensor, Tensor]]:
        """The step's work ``{store: [(group, params)]}`` and gradients (all-reduced over the
        process group, whose owners alone update)."""
        work, grads = collect_work(self.param_groups, self._keys, self._stores, self._owns,
                                   released, type(self).__name__, contiguous=contiguous,
                                   fp64=fp64)
        if grads and self._sharding is not None:
            self._sharding.allreduce_grads(self._params, grads)
            work = {st: [(g, [p for p in ps if self._owns(p)]) for g, ps in items]
                    for st, items in work.items()}
        return work, grads

    def _ensure_states(self, work: Work) -> None:
        """Create the states the work's parameters do not have yet (first steps)."""
        group_of = {p: g for items in work.values() for g, ps in items for p in ps}
        for store, items in work.items():
            ensure_states(store, [p for _, ps in items for p in ps], self._keys, group_of,
                          self._layout)

    def _run_step(self, work: Work, grads: Dict[Tensor, Tensor], grad_scale: float = 1.0,
                  after=None) -> None:
        """Advance the step counts of the parameters with gradients, update every unit of
        every store, then call ``after()`` (also on failure). A failure before anything
        changed (e.g. an I/O error the store reports) only rolls the counts back; after, some
        parameters and states hold this step and others the previous one: the optimizer
        refuses to go on (or to checkpoint) rather than diverge (``ParamTable.stepping``).
        While it runs, :attr:`_step_undo` holds each stepped key's count before the step
        (None: its first)."""
        keys = self._keys
        with self._table.stepping([keys[p] for p in grads if self._owns(p)]) as undo:
            self._step_undo = undo
            try:
                for store, items in work.items():
                    self._step_store(store, items, grads, grad_scale)
            finally:
                self._step_undo = {}
                if after is not None:
                    after()
        if self._sharding is not None:
            for store in work:
                store.sync()
            self._sharding.broadcast_params([p for p in self._params if p in grads])

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step over every parameter with a gradient.

        On return, resident stores are updated; disk stores may still be writing the last
        states back (any later read, ``sync()``, ``state_dict()`` or checkpoint waits).

        Args:
            closure: re-evaluates the model and returns the loss (as torch), or None.

        Returns:
            the closure's loss, or None.

        Raises:
            TypeError: a closure that is not callable, or a gradient of an unsupported dtype.
            StateStoreValueError: a gradient on another device or of another shape than its
                parameter.
            StateStoreError: an earlier step failed part-way (the optimizer must be rebuilt
                from a checkpoint).
            BudgetError: a parameter updated whole whose states exceed a disk store's budget
                (nothing changed).
            StateStoreIOError: the store failed to read or write a state (a step that
                changed nothing can be retried).
        """
        if closure is not None and not callable(closure):
            raise TypeError(f"closure must be callable or None, got {type(closure).__name__}")
        self._check_usable()
        loss = self._run_closure(closure)
        work, grads = self._collect()
        if not grads:
            return loss
        self._ensure_states(work)
        self._run_step(work, grads)
        return loss

    def _plan(self, store: StateStore, items, order: Optional[Dict[Tensor, int]] = None):
        memo = self.__dict__.get("_plan_memo")
        if memo is None or memo.keys is not self._keys or memo.layout is not self._layout:
            memo = self._plan_memo = PlanMemo(self._keys, self._layout)
        return memo(store, items, order)

    def _step_store(self, store: StateStore, items, grads: Dict[Tensor, Tensor],
                    grad_scale: float) -> None:
        all_units, meta = self._plan(store, items)
        dev = store.device
        with store.pipeline(all_units, mode="rw", wait=False) as pipe:
            for tensors, (group, entries) in zip(pipe, meta):
                self._apply_unit(tensors, group, entries, grads, grad_scale, dev)
        if may_prefetch(store):
            # Start reading the next step's first units now (the same plan, as long as the
            # same parameters get gradients); gradient hooks pump more during backward.
            store.prefetch(all_units, mode="rw")
            self._prefetching.add(store)

    def _apply_unit(self, tensors: List[Tensor], group: dict, entries, grads, grad_scale,
                    dev: torch.device) -> None:
        """:meth:`_update_unit`, offloaded parameters fetched for it and written back after
        (``statestore/offload/_seam.py``)."""
        offloaded = update_begin(entries)
        self._update_unit(tensors, group, entries, grads, grad_scale, dev)
        update_end(offloaded)

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

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of every parameter, as ``torch.optim.Optimizer.zero_grad``.

        Args:
            set_to_none: set ``param.grad = None`` (default) instead of zeroing it.
        """
        super().zero_grad(set_to_none)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Close the stores this optimizer created itself (never a store passed in)."""
        for s in self._owned_stores:
            s.close()
        self._owned_stores = []

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self._params)} params, store={self.state_store!r})"

"""``StateStoreOptimizer``: the base every statestore optimizer is one class on.

The base owns what every optimizer over a :class:`~statestore.StateStore` shares (as torch's
``Optimizer`` owns groups, state and hooks). Its bookkeeping (stores, step counts, metadata
and resume, torch's ``state_dict()`` format, ``optimizer.state``) is the class it derives
from, :class:`~statestore.optim._core.OptimizerCore`; this module is its step, ONE for every
optimizer: the work collected, the plan of a step's pipeline units and the loop over them,
the rollback or refusal after a failure, ``skip_nonfinite``, ``div_scale``,
``update_in_backward`` and ``release_grads`` (:class:`~statestore.optim._in_backward.
BackwardStepper`), CUDA staging's seam, the read-ahead of disk stores during backward, and
a step remembered from the last one (:meth:`StateStoreOptimizer._remember`).

An optimizer on it is one class (``docs/extending.md``, "Adding an optimizer"): it passes
its defaults and a :class:`~statestore.optim._layout.StateLayout` (which states a parameter
keeps, how its hyperparameters are saved) to ``__init__`` and implements
:meth:`StateStoreOptimizer._update_unit`, the update of one pipeline unit (its kernel).
``CPUAdam`` and ``HybridAdam`` (``adam.py``: Adam's fused kernel) and
:class:`~statestore.optim.StoreOptimizer` (the torch class's own ``step()``) are such
classes. The integrations find ``isinstance(opt, StateStoreOptimizer)``,
``opt.state_store``.
"""
from __future__ import annotations

import os
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._hook_handles import HookHandles
from ..errors import CheckpointError, StateStoreError
from ..offload._seam import update_begin, update_end
from ..store import StateStore
from ._args import grad_scale_of
from ._core import OptimizerCore
from ._in_backward import BackwardStepper
from ._layout import StateLayout
from ._plan import PlanMemo, Work, collect_work, ensure_states, work_of
from ._table import StepUndo
from ._torch_backward import RecordingTable, plans_stale

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


class StateStoreOptimizer(OptimizerCore):
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
        update_in_backward, release_grads, skip_nonfinite: as ``HybridAdam``'s (each
            checked by the class first: ``statestore.optim._args.check_arguments``).

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
                 own_store: bool = False, update_in_backward: bool = False,
                 release_grads: bool = False, skip_nonfinite: bool = False):
        #: skip a step whose gradients hold inf or nan (nothing changes)
        self.skip_nonfinite = bool(skip_nonfinite)
        self._update_in_backward = update_in_backward
        #: update_in_backward: each parameter's step count before the stepper advanced it,
        #: and the groups' structures the stepper's plans were made for
        self._prior: Dict[str, Optional[int]] = {}
        self._planned_for: Optional[tuple] = None
        #: CUDA parameters over host stores: page-locked staging (an optimizer's part), or None
        self._staging = None
        #: the step remembered from the last made the general way (:meth:`_remember`), or
        #: None; general steps before the next try, the tries' backoff, plans gone stale
        self._remembered = None
        self._remember_wait = self._remember_backoff = self._remember_misses = 0
        self._prefetching: "weakref.WeakSet[StateStore]" = weakref.WeakSet()
        #: during a step: each stepped key's count before it (None: its first step)
        self._step_undo: StepUndo = {}
        self._hooked: set = set()
        self._pump_hooks = HookHandles()
        _opaque_to_compiler(type(self))     # before torch wraps step() with its hooks
        super().__init__(params, defaults, layout, state_store=state_store,
                         process_group=process_group, own_store=own_store)
        #: the step made during backward (update_in_backward, _in_backward.py)
        self._stepper = BackwardStepper(RecordingTable(self._table, self._prior),
                                        self._planner(), type(self).__name__,
                                        self._apply_in_backward, release_grads)
        self._setup_parts()
        if self._staging is None:       # CUDA staging needs the whole step's gradients
            self._stepper.unplanned = weakref.WeakMethod(self._unplanned_work)
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
        """Build the optimizer's own parts once the base is set up (its table, stores,
        ``optimizer.state`` and stepper exist) and before the gradient hooks are registered
        (optional)."""

    def _remember(self, work: Work, grads: Dict[Tensor, Tensor]):
        """After a step made the general way over ``work`` and ``grads``: a plan that makes
        the next steps like it faster (Adam's native step program, StoreOptimizer's resident
        batches), or None (optional; tried again after 1, 2, 4 ... 64 general steps)."""
        return None

    def _run_remembered(self, plan, grad_scale: float) -> bool:
        """Make this step by ``plan`` (from :meth:`_remember`): True when made (or skipped
        for non-finite gradients); False when it no longer applies (nothing changed: the
        general way steps, and the plan is dropped)."""
        return False

    def _touch(self) -> None:
        """The unit update is about to change a parameter or a state."""
        self._table.touched = True

    def _wants_hook(self, p: Tensor) -> bool:
        """Whether backward tells this optimizer when ``p``'s gradient is final: every
        parameter with ``update_in_backward``, else those kept in a disk store (resident
        stores never prefetch, so an optimizer over RAM/GPU stores adds nothing to
        backward)."""
        return self._update_in_backward or not self._stores[p].resident

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
        """Backward has finished ``p``'s gradient: with ``update_in_backward`` the stepper
        applies it (a plan made for groups of another structure dropped first: the class
        makes the new states in ``step()``); else let disk stores start the next step's
        reads (:meth:`StateStore.pump`, which never blocks)."""
        if self._update_in_backward:
            st = self._stepper
            if st.passes is None and self._table.next_plans and plans_stale(
                    self._layout, self.param_groups, self._planned_for):
                self._table.next_plans.clear()
            st.grad_ready(p)
            return
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
        off = getattr(self, "_staging", None)
        if off is not None:
            off.remove_hooks()

    def _group_added(self, params: Sequence[Tensor]) -> None:
        """A group of ``params`` was added after construction."""
        if self._update_in_backward:
            self._check_backward(params)
        self._remembered = None
        self._remember_wait = 0
        self._register_pump_hooks(params)

    def _forget_pending(self, store: Optional[StateStore] = None) -> None:
        """States were replaced (a load into ``store``, or ``load_state_dict``): drop a pass
        of ``update_in_backward`` under way, the remembered step and the store's read-ahead
        (a class adds what else it kept of a step under way)."""
        self._remembered = None
        self._remember_wait = 0
        self._stepper.forget()
        if store is not None:
            self._prefetching.discard(store)

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
                self._table.unfinished = None    # made (no call before the with's end: no gap)
            finally:
                self._step_undo = {}
                if after is not None:
                    after()
        if self._sharding is not None:
            for store in work:
                store.sync()
            self._sharding.broadcast_params([p for p in self._params if p in grads])

    @torch.no_grad()
    def step(self, closure=None, div_scale: float = -1.0):
        """One optimizer step over every parameter with a gradient: with
        ``update_in_backward``, what backward could not update (:meth:`_backward_step`);
        else by the plan remembered from the last step when it still applies
        (:meth:`_run_remembered`), or the general way: the work collected, step counts
        advanced, each store's pipeline units updated (:meth:`_update_unit`), and the next
        plan remembered (:meth:`_remember`).

        On return, resident stores are updated; disk stores may still be writing the last
        states back (any later read, ``sync()``, ``state_dict()`` or checkpoint waits).

        Args:
            closure: re-evaluates the model and returns the loss (as torch), or None.
            div_scale: when > 0, gradients are divided by it (ColossalAI's argument, for
                loss scaling; not with ``update_in_backward``).

        Returns:
            the closure's loss, or None.

        Raises:
            TypeError: a closure that is not callable, a ``div_scale`` that is not a number,
                or a gradient of an unsupported dtype.
            StateStoreValueError: a gradient on another device or of another shape than its
                parameter; a ``div_scale`` that is nan or infinite, or given with
                ``update_in_backward`` (checked first: nothing changes).
            StateStoreError: an earlier step failed part-way (the optimizer must be rebuilt
                from a checkpoint), or ``update_in_backward`` found the gradients changed
                between backward and ``step()``.
            BudgetError: a parameter updated whole whose states exceed a disk store's budget
                (nothing changed).
            StateStoreIOError: the store failed to read or write a state (a step that
                changed nothing can be retried).

        With ``skip_nonfinite=True`` a step whose gradients hold inf or nan changes nothing.
        """
        if closure is not None and not callable(closure):
            raise TypeError(f"closure must be callable or None, got {type(closure).__name__}")
        scale = grad_scale_of(div_scale, self._update_in_backward)
        grad_scale = 1.0 if scale is None else scale
        self._check_usable()
        loss = self._run_closure(closure)
        if self._update_in_backward:
            self._backward_step()
            return loss
        st, plan = self._stepper, self._remembered
        if plan is not None:
            if not (st.released or st.spent or st.backward_failed) \
                    and self._run_remembered(plan, grad_scale):
                self._remember_misses = 0
                return loss
            self._remembered = None
        released = st.released
        work, grads = self._collect(released)
        st.before_step(work, grads)
        if not grads and not released:
            return loss
        if self.skip_nonfinite and not self._dtensors.all_finite(list(grads.values())):
            return loss
        self._ensure_states(work)
        self._run_step(work, grads, grad_scale, self._staged(grads))
        self._remember_next(work, grads, released)
        return loss

    def _staged(self, grads: Dict[Tensor, Tensor]):
        """CUDA staging's step begun (``grads`` on their way to the host); the call that
        ends it, or None without staging."""
        off = self._staging
        if off is None:
            return None
        try:
            off.before_step(grads)
        except BaseException:
            off.after_step()
            raise
        return off.after_step

    def _remember_next(self, work: Work, grads: Dict[Tensor, Tensor], released) -> None:
        """After a general step: :meth:`_remember` it, unless waiting. Tries that give no
        plan back off (1, 2, 4 ... 64 steps); plans that go stale at once are built ever
        more rarely, so a loop that never repeats pays little."""
        if self._remember_wait > 0:
            self._remember_wait -= 1
            return
        plan = None
        if not released and self._sharding is None:
            plan = self._remember(work, grads)
        self._remembered = plan
        if plan is None:
            self._remember_backoff = min(64, 2 * self._remember_backoff or 1)
            self._remember_wait = self._remember_backoff
        else:
            self._remember_backoff = 0
            self._remember_wait = min(2 ** self._remember_misses, 64) - 1
            self._remember_misses += 1

    def _backward_step(self) -> None:
        """``step()`` with ``update_in_backward`` (after its closure): the stepper checks
        the gradients backward applied and updates the rest
        (:meth:`BackwardStepper.finish_step`)."""
        st = self._stepper
        released = st.released
        work, grads = self._collect(released)
        st.before_step(work, grads)
        if not grads and not released:
            return
        self._ensure_states(work)
        after = self._staged(grads)
        try:
            st.finish_step(work, grads, may_prefetch)
        finally:
            if after is not None:
                after()
        self._planned_for = tuple(self._layout.structure_of(g) for g in self.param_groups)

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

    # ------------------------------------------------------------------ checkpoints
    @classmethod
    def saved_layout(cls, metadata: Dict[str, Any]) -> StateLayout:
        """The layout this class's checkpoints are read with in torch's format
        (``statestore convert --to torch``), from the metadata it saved with them. A class
        implements it to make its checkpoints convertible.

        Raises:
            CheckpointError: this class does not.
        """
        raise CheckpointError(f"the checkpoint holds the states of {cls.__name__}, which does "
                              f"not say how to read them in torch's format (saved_layout): "
                              f"load the checkpoint into a store and take the optimizer's "
                              f"state_dict()")

    @staticmethod
    def checkpoint_layout(path: str, metadata: Dict[str, Any]) -> StateLayout:
        """The layout of the optimizer class a checkpoint's metadata names (its
        ``"optimizer"``): that class's :meth:`saved_layout`. The classes are this base's
        subclasses imported in the process (``CPUAdam``, ``HybridAdam``,
        ``StoreOptimizer``, and a user's own).

        Raises:
            CheckpointError: no such class.
        """
        name = metadata.get("optimizer")
        todo = [StateStoreOptimizer]
        while todo:
            cls = todo.pop()
            if cls.__name__ == name:
                return cls.saved_layout(metadata)
            todo.extend(cls.__subclasses__())
        raise CheckpointError(f"{path}: the checkpoint's metadata names optimizer {name!r}, "
                              f"which is no statestore optimizer class; its states cannot be "
                              f"read in torch's format")

    # ------------------------------------------------------------------ update_in_backward
    @property
    def update_in_backward(self) -> bool:
        """Whether parameters are updated during backward (see ``HybridAdam``). May be
        switched between steps, e.g. off after a step() refused a loop that clips or
        accumulates gradients (that step can then be made again).

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
        self._remembered = None
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

    def _check_backward(self, params) -> None:
        """Refuse ``update_in_backward`` for ``params`` updated gathered (a collective)."""
        whole = [self._keys[p] for p in params if self._gathered(p)]
        if whole:
            raise StateStoreError(
                f"{self._kind()}(update_in_backward=True): the class's update needs the "
                f"whole tensor, and parameters {whole[:3]} are DTensors sharded over several "
                f"ranks: each would be gathered (a collective) from backward's gradient "
                f"hooks, whose order the ranks do not share; use update_in_backward=False")

    def _gathered(self, p: Tensor) -> bool:
        """Whether ``p`` is updated gathered whole over its ranks (a collective)."""
        return False

    def _planner(self):
        """``plan(store, items, order)`` by :meth:`_plan`, holding the optimizer weakly."""
        plan = weakref.WeakMethod(self._plan)

        def planned(store, items, order=None):
            return plan()(store, items, order)
        return planned

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
        if self._staging is not None:       # CUDA staging needs the whole step's gradients
            return {}
        chosen = {p for p in params if p in self._stores and self._owns(p)}
        work = work_of(self.param_groups, self._stores, chosen.__contains__)
        self._ensure_states(work)
        return work

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of every parameter, as ``torch.optim.Optimizer.zero_grad``.

        Args:
            set_to_none: set ``param.grad = None`` (default) instead of zeroing it (which,
                with ``update_in_backward``, first finishes what a failed backward updated
                in part: ``docs/reliability.md``).
        """
        self._stepper.before_zero_grad(set_to_none)
        super().zero_grad(set_to_none)

    def close(self) -> None:
        """Close the stores this optimizer created itself (never a store passed in) and
        release the page-locked staging of CUDA parameters."""
        super().close()
        if self._staging is not None:
            self._staging.after_step()
            self._staging.close()
            self._staging = None

"""``CPUAdam`` and ``HybridAdam``: Adam/AdamW whose states live in a :class:`StateStore`.

Layers (as in ``torch/optim/adam.py``): the class validates arguments and owns param groups,
step counts and the store; each ``step()`` plans pipeline units over the parameters that have
gradients and hands every unit to :func:`statestore.kernels.adam_step`, which only computes.
States are reached only through :meth:`StateStore.pipeline`, so every optimizer works on every
store.

States per parameter (the parameter's shape): ``exp_avg``, ``exp_avg_sq`` (fp32, or compressed
with ``moment_dtype``: see :mod:`statestore.optim._moments`), ``max_exp_avg_sq`` (``amsgrad``)
and ``master`` (an fp32 master copy for fp16/bf16 parameters), both fp32. Step counts are kept
per parameter in the optimizer and saved with checkpoints through
:meth:`StateStore.attach_metadata`.

Each concept lives in a module of this package (``docs/architecture.md``, "Optimizers").
"""
from __future__ import annotations

import os
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..errors import StateStoreError
from ..offload._seam import update_begin, update_end
from ..store import StateStore
from ._args import check_arguments, check_params, grad_scale_of, validate_hyper
from ._dtensor import DTensorParams
from ._in_backward import BackwardStepper, backward_hook
from ._metadata import OPTIMIZER_METADATA_VERSION, metadata_source, resume
from ._moments import MomentFormat
from ._offload_path import OffloadPath, attach_offload_path
from ._sharding import Sharding, check_not_partial, refuse_partial, shard_state_dict
from ._state import OptimizerState
from ._table import ParamTable, assign_stores, index_keys, offload_store
from ._torch_format import export_state_dict, read_state_dict, write_states
from ._units import UnitTensors, collect_work, ensure_states, plan_step, work_of

__all__ = ["CPUAdam", "HybridAdam", "OPTIMIZER_METADATA_VERSION"]


def _opaque_to_compiler() -> None:
    """Make ``step()`` opaque to ``torch.compile``: compiling ``opt.step`` (or a training step
    that calls it) runs the store's pipeline eagerly behind a graph break, instead of tracing
    into I/O threads, ring buffers and C++ kernels (which recompiled until the limit and
    failed). Done once, at the first optimizer's construction: ``torch._dynamo`` is imported
    by ``torch.optim.Optimizer.__init__`` anyway, so importing this package stays cheap."""
    step = _StoreAdam.__dict__["step"]
    if getattr(step, "_torchdynamo_disable", False):
        return
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    if disable is None:         # torch without torch.compile: nothing to hide from
        return
    _StoreAdam.step = disable(step)


def _may_prefetch(store: StateStore) -> bool:
    """Whether a step ends by starting the next step's reads on ``store``: disk stores,
    unless ``STATESTORE_PREFETCH=0`` (for comparisons)."""
    return not store.resident and os.environ.get("STATESTORE_PREFETCH", "1") != "0"


class _StoreAdam(torch.optim.Optimizer):
    """Adam/AdamW over a state store. Use :class:`CPUAdam` or :class:`HybridAdam`.

    Args:
        params: parameters, ``named_parameters()`` pairs, or param-group dicts (as torch);
            DTensors of ``fully_shard`` (FSDP2) too (``docs/distributed.md``, "FSDP2").
        lr, betas, eps, weight_decay, amsgrad: as ``torch.optim.AdamW``; defaults are
            ColossalAI's (``weight_decay=0.0``; torch's AdamW defaults to 0.01).
        adamw_mode: True: decoupled weight decay (``AdamW``); False: L2 (``Adam``).
        state_store: where states live. None: next to the parameters (a
            :class:`~statestore.DeviceStore` per parameter device), or a tiered store when
            ``nvme_offload_fraction > 0``.
        nvme_offload_fraction: ColossalAI's: this fraction of state bytes on disk under
            ``nvme_offload_dir`` (a temporary directory when None), the rest in RAM.
        maximize: maximize the objective (as torch).
        bias_correction: only True is supported (ColossalAI's argument, kept for its users).
        skip_nonfinite: skip the whole step (no state or step count changes) when any
            gradient holds inf or nan, as loss-scaled mixed precision needs.
        process_group: shard states over a ``torch.distributed`` group: each rank keeps the
            states of the parameters :func:`statestore.distributed.partition` assigns it,
            gradients are averaged with all-reduce, owners update and broadcast parameters.
        update_in_backward: update each parameter during ``backward()``, as soon as its
            gradient is final (a gradient hook), so that a disk store's reads and writes run
            while backward computes instead of inside ``step()``. ``step()`` is still called
            after every backward: it updates what backward could not and starts the next
            step's reads. The gradients must reach ``step()`` as backward left them: no
            clipping, no ``div_scale``, no accumulation over several backward calls. A loop
            that does one of these is refused at its first ``step()``, which changes nothing
            (:class:`~statestore.StateStoreError` saying what changed); set
            ``optimizer.update_in_backward = False`` (allowed between steps) and call
            ``step()`` again to train on with it. Incompatible with ``skip_nonfinite`` and
            ``process_group``. Results are bit-identical to ``update_in_backward=False``.
            See ``docs/nvme.md``.
        release_grads: with ``update_in_backward``, set ``param.grad = None`` as soon as
            backward has applied it, so that gradients do not pile up: a model then needs
            about its parameters plus a layer's gradients (and up to the store's
            ``budget_bytes`` of gradients waiting for their states, beyond which backward
            waits for the disk). The gradients are gone after backward (``step()`` still
            finishes the step). The first step (and the first after a resume) has no plan
            yet: beyond the smallest ``budget_bytes`` of the optimizer's stores, backward
            applies the gradients it holds unit by unit, waiting for the store; a step
            whose parameters with gradients differ from the previous one's keeps the
            gradients of the unplanned ones until ``step()``. See ``docs/scale.md``.
        moment_dtype: how ``exp_avg``/``exp_avg_sq`` are kept in the store: ``"fp32"``
            (torch's), ``"bf16"`` (half the bytes) or ``"int8"`` (a quarter, plus one fp32
            scale per block of 256 elements). The kernels decode, update and re-encode in one
            pass; ``state_dict()`` gives fp32 moments and ``load_state_dict`` encodes them;
            checkpoints keep the encoded states and record the format, and a resume checks
            it (:class:`~statestore.CheckpointMismatchError` on a different one). Format and
            accuracy: ``docs/kernels.md``, "Compressed moments".
        moment_rounding: ``"stochastic"`` or ``"nearest"`` rounding of compressed moments;
            None (default): stochastic for bf16, nearest for int8 (the measured choice).
    """

    #: parameter offload's seam (``statestore/offload/_seam.py``): this optimizer updates
    #: offloaded parameters a unit at a time through ``update_begin``/``update_end``
    updates_offloaded_parameters = True

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *,
                 adamw_mode: bool = True, state_store: Optional[StateStore] = None,
                 nvme_offload_fraction: float = 0.0, nvme_offload_dir: Optional[str] = None,
                 maximize: bool = False, bias_correction: bool = True,
                 skip_nonfinite: bool = False, process_group=None,
                 update_in_backward: bool = False, release_grads: bool = False,
                 moment_dtype: str = "fp32", moment_rounding: Optional[str] = None, **unused):
        validate_hyper(lr, betas, eps, weight_decay)
        self._moments = MomentFormat(moment_dtype, moment_rounding)
        self._moment_dtypes = (self._moments.spec("exp_avg", (1,))[1],
                               self._moments.spec("exp_avg_sq", (1,))[1])
        check_arguments(type(self).__name__, state_store=state_store,
                        nvme_offload_fraction=nvme_offload_fraction,
                        nvme_offload_dir=nvme_offload_dir, bias_correction=bias_correction,
                        unused=unused, skip_nonfinite=skip_nonfinite,
                        process_group=process_group, update_in_backward=update_in_backward,
                        release_grads=release_grads)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=bool(amsgrad), maximize=bool(maximize),
                        adamw_mode=bool(adamw_mode))
        _opaque_to_compiler()       # before torch wraps step() with its hooks
        super().__init__(params, defaults)
        self.skip_nonfinite = bool(skip_nonfinite)
        # the bookkeeping shared with this package's modules; the optimizer's own names for
        # its containers are the same objects
        table = self._table = ParamTable()
        self._keys, self._params, self._stores, self._steps = (
            table.keys, table.params, table.stores, table.steps)
        table.set_keys(*index_keys(self.param_groups))
        check_params(self._params, self._keys)
        #: DTensor parameters (FSDP2): updates on local shards, DTensor states (_dtensor.py)
        self._dtensors = DTensorParams(self._params, self._keys, process_group)
        self.process_group = process_group
        self._sharding: Optional[Sharding] = None
        if process_group is not None:
            self._sharding = Sharding(process_group, self._params)
        self._owned_stores: List[StateStore] = []
        if state_store is None and nvme_offload_fraction > 0:
            state_store = offload_store(float(nvme_offload_fraction), nvme_offload_dir)
            self._owned_stores.append(state_store)
        self.state_store = state_store
        assign_stores(table, state_store, self._owns, self._owned_stores)
        attached = list(dict.fromkeys(self._stores.values()))
        if state_store is not None and state_store not in attached:
            attached.append(state_store)     # a rank owning no parameter still saves with the group
        for store in attached:
            resume(store, table, self.param_groups, self._moments,
                   sharded=self._sharding is not None)
            store.attach_metadata(self._metadata_source(), process_group=self._dtensors.group,
                                  on_load=self._store_loaded)
        self._prefetching: "weakref.WeakSet[StateStore]" = weakref.WeakSet()
        #: update_in_backward: the step made during backward (_in_backward.py)
        self._update_in_backward = update_in_backward
        self._stepper = BackwardStepper(table, self._moments, type(self).__name__,
                                        self._update_unit, release_grads)
        self._hooked: set = set()
        self._pump_hooks: list = []
        #: CUDA parameters over host or disk stores: page-locked staging on a side stream
        #: (docs/gpu.md); None while no parameter takes that path
        self._offload: Optional[OffloadPath] = attach_offload_path(None, self, self._params,
                                                                   self._stores)
        if self._offload is None:
            self._stepper.unplanned = weakref.WeakMethod(self._unplanned_work)
        self._register_pump_hooks(self._params)
        #: torch's ``optimizer.state``: a view of the store (statestore/optim/_state.py)
        self.state = OptimizerState(self, table)

    # ------------------------------------------------------------------ set-up
    def _register_pump_hooks(self, params: Sequence[Tensor]) -> None:
        """While backward produces gradients, let disk stores start the next step's reads
        (:meth:`StateStore.pump`, which never blocks), or, with ``update_in_backward``,
        update the parameters whose gradients are final. The hooks hold the optimizer
        weakly."""
        pump = backward_hook(self, self._stepper, self._prefetching)
        if not hasattr(Tensor, "register_post_accumulate_grad_hook"):
            return
        # Only parameters kept in a disk store: resident stores never prefetch, so an
        # optimizer over RAM/GPU stores adds nothing to backward.
        for p in params:
            if p.requires_grad and p in self._stores and p not in self._hooked \
                    and (self.update_in_backward or not self._stores[p].resident):
                self._pump_hooks.append(p.register_post_accumulate_grad_hook(pump))
                self._hooked.add(p)

    def __del__(self) -> None:
        off = getattr(self, "_offload", None)
        if off is not None:
            off.remove_hooks()
        for h in getattr(self, "_pump_hooks", ()):
            try:
                h.remove()
            except Exception:
                pass

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
            g = self.param_groups[-1]
            validate_hyper(g["lr"], g["betas"], g["eps"], g["weight_decay"])
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
            added = self.param_groups[-1]["params"]
            self._dtensors = dtensors
            self._offload = attach_offload_path(self._offload, self, added, self._stores)
            self._register_pump_hooks(added)

    def _owns(self, p: Tensor) -> bool:
        """True when this rank keeps ``p``'s states (always, without a process group)."""
        return self._sharding is None or self._sharding.owns(p)

    @property
    def moment_dtype(self) -> str:
        """How ``exp_avg``/``exp_avg_sq`` are stored: "fp32", "bf16" or "int8"."""
        return self._moments.name

    @property
    def release_grads(self) -> bool:
        """With ``update_in_backward``: whether ``param.grad`` is set to None once backward
        applied it (see the class docstring)."""
        return self._stepper.release_grads

    @release_grads.setter
    def release_grads(self, value: bool) -> None:
        self._stepper.release_grads = value

    def _store_loaded(self, store: StateStore) -> None:
        """``store.load_checkpoint`` replaced the states under this optimizer (torch's order:
        optimizer and scheduler built first): take the checkpoint's step counts and
        hyperparameters, then save this optimizer's metadata with the store's checkpoints
        again. A checkpoint that does not fit raises, stays detached, and the optimizer
        refuses until a load into the store succeeds (``ParamTable.loaded``)."""
        if self._table.failed or not self._table.loaded(store):    # refuses: stays detached
            return
        self._table.next_plans.clear()
        self._stepper.forget()
        self._prefetching.discard(store)
        resume(store, self._table, self.param_groups, self._moments,
               sharded=self._sharding is not None, loaded=True)
        store.attach_metadata(self._metadata_source(), process_group=self._dtensors.group,
                              on_load=self._store_loaded)

    def _metadata(self) -> dict:
        return self._metadata_source()()

    def _metadata_source(self):
        return metadata_source(type(self).__name__, self.param_groups, self._table,
                               self._moments.metadata())

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None, div_scale: float = -1.0):
        """One optimizer step over every parameter with a gradient.

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
            StateStoreIOError: the store failed to read or write a state (a step that
                changed nothing can be retried).

        With ``skip_nonfinite=True`` a step whose gradients hold inf or nan changes nothing.
        """
        if closure is not None and not callable(closure):
            raise TypeError(f"closure must be callable or None, got {type(closure).__name__}")
        scale = grad_scale_of(div_scale, self.update_in_backward)
        table = self._table
        table.check_usable(type(self).__name__)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        keys, released = self._keys, self._stepper.released
        work, grads = collect_work(self.param_groups, keys, self._stores, self._owns, released,
                                   type(self).__name__)
        self._stepper.before_step(work, grads)
        if not grads and not released:
            return loss
        if self._sharding is not None:
            self._sharding.allreduce_grads(self._params, grads)
            work = {st: [(g, [p for p in ps if self._owns(p)]) for g, ps in items]
                    for st, items in work.items()}
        if self.skip_nonfinite and not self._dtensors.all_finite(list(grads.values())):
            return loss
        grad_scale = 1.0 if scale is None else scale
        group_of = {p: g for g in self.param_groups for p in g["params"]}
        for store, items in work.items():
            ensure_states(store, [p for _, ps in items for p in ps], keys, group_of,
                          self._moments)
        if self._offload is not None:
            try:
                self._offload.before_step(grads)
            except BaseException:
                self._offload.after_step()
                raise
        if self.update_in_backward:
            try:
                self._stepper.finish_step(work, grads, _may_prefetch)
            finally:
                if self._offload is not None:
                    self._offload.after_step()
            return loss
        # A failure before anything changed (e.g. an I/O error the store reports) only rolls
        # the counts back; after, some parameters and states hold this step and others the
        # previous one: the optimizer refuses to go on (or to checkpoint) rather than diverge.
        with table.stepping([keys[p] for p in grads if self._owns(p)]):
            try:
                for store, items in work.items():
                    self._step_store(store, items, grads, grad_scale)
            finally:
                if self._offload is not None:
                    self._offload.after_step()
        if self._sharding is not None:
            for store in work:
                store.sync()
            self._sharding.broadcast_params([p for p in self._params if p in grads])
        return loss

    def _unplanned_work(self, params: Sequence[Tensor]) -> Dict[StateStore, list]:
        """``update_in_backward`` with ``release_grads`` before a plan exists: ``params``
        (gradients final) as a step's work ``{store: [(group, params)]}``, their states
        created."""
        if self._offload is not None:       # CUDA staging needs the whole step's gradients
            return {}
        chosen = {p for p in params if p in self._stores and self._owns(p)}
        work = work_of(self.param_groups, self._stores, chosen.__contains__)
        group_of = {p: g for items in work.values() for g, ps in items for p in ps}
        for store, items in work.items():
            ensure_states(store, [p for _, ps in items for p in ps], self._keys, group_of,
                          self._moments)
        return work

    def _plan(self, store: StateStore, items, order: Optional[Dict[Tensor, int]] = None):
        return plan_step(store, items, self._keys, self._moments, order)

    def _step_store(self, store: StateStore, items, grads: Dict[Tensor, Tensor],
                    grad_scale: float) -> None:
        all_units, meta = self._plan(store, items)
        dev = store.device
        with store.pipeline(all_units, mode="rw", wait=False) as pipe:
            for tensors, (group, entries) in zip(pipe, meta):
                self._update_unit(tensors, group, entries, grads, grad_scale, dev)
        if _may_prefetch(store):
            # Start reading the next step's first units now (the same plan, as long as the
            # same parameters get gradients); gradient hooks pump more during backward.
            store.prefetch(all_units, mode="rw")
            self._prefetching.add(store)

    def _update_unit(self, tensors: List[Tensor], group: dict, entries, grads, grad_scale,
                     dev: torch.device) -> None:
        """Run the kernel over one unit: its parameter slices, gradients and states."""
        offloaded = update_begin(entries)   # offloaded parameters: fetched for the update
        u = UnitTensors(tensors, entries, grads, dev, self._offload, self._keys, self._steps,
                        self._moments, self._moment_dtypes)
        self._table.touched = True
        u.update(group, self._keys, self._moments, grad_scale)
        u.put_back()
        update_end(offloaded)               # ... and written back to their store

    @property
    def update_in_backward(self) -> bool:
        """Whether parameters are updated during backward (see the class docstring). May be
        switched between steps, e.g. off after a step() refused a loop that clips or
        accumulates gradients (that step can then be made again).

        Raises (on assignment):
            TypeError: not a bool.
            ValueError: True with ``skip_nonfinite`` or a ``process_group``.
            StateStoreError: backward has updated some parameters: call ``step()`` first.
        """
        return self._update_in_backward

    @update_in_backward.setter
    def update_in_backward(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"update_in_backward must be a bool, got {value!r}")
        if value == self._update_in_backward:
            return
        self._stepper.check_switch(value, self.skip_nonfinite, self.process_group)
        self._stepper.reset()
        self._table.next_plans.clear()
        self._update_in_backward = value
        if value:
            self._register_pump_hooks(self._params)

    # ------------------------------------------------------------------ torch's state_dict
    def state_dict(self) -> Dict[str, Any]:
        """The optimizer's state in torch's format, which ``torch.optim.AdamW`` loads.

        Returns:
            ``{"state": {index: {"step", "exp_avg", "exp_avg_sq", ...}}, "param_groups":
            [...]}``: one entry per parameter with a step count, indices in torch's
            numbering; groups carry torch's keys (``decoupled_weight_decay``, ``foreach``...).

        Resident stores return views of the live states (as torch returns its own state
        tensors). Disk stores snapshot their state files as a linked checkpoint does (frozen,
        copy-on-write) and return tensors mapped privately from them (pages load on access
        and the kernel may evict them): no copy, no temporary file, never every state in RAM;
        states whose files cannot be taken whole are streamed into a temporary file of their
        size (see :mod:`statestore._snapshot` and docs/scale.md). Compressed moments
        (``moment_dtype`` "bf16"/"int8") are decoded into new fp32 tensors (streamed through
        the budget for disk stores), so that ``torch.optim.AdamW`` loads them.

        A bf16/fp16 parameter's state also holds ``"master"`` (its fp32 copy, which torch's
        AdamW ignores): :meth:`master_weights` or :meth:`save_master_weights` take it out.

        Raises:
            StateStoreIOError: a disk store failed to read a state.
            StateStoreError: a step failed part-way (:meth:`step`); sharded (docs/distributed.md).
        """
        self._table.check_usable(type(self).__name__, end_open_step=True)
        refuse_partial(self._sharding, "state_dict()")
        return export_state_dict(self.param_groups, self._table, self._moments)

    def shard_state_dict(self) -> Dict[str, Any]:
        """This rank's shard of :meth:`state_dict`, marked as one (``docs/distributed.md``)."""
        return shard_state_dict(self._sharding, self.param_groups, self._table, self._moments)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load torch's format (from ``torch.optim.AdamW``/``Adam`` or from this class).

        Hyperparameters (every key of the saved groups but their parameters: ``lr``,
        ``betas``, ``initial_lr`` of a scheduler...) are restored from the saved groups, as
        torch does; states are written into the store one tensor at a time (compressed
        moments encoded, rounding to nearest). State keys are torch's indices, or strings
        naming the parameters (the fully qualified names of ``torch.distributed.checkpoint``'s
        ``get_optimizer_state_dict``, or the names this optimizer was given): names that are
        exactly the optimizer's are matched by name, others by position in the groups, as
        torch does. Everything is checked first: a state dict that fails a check changes
        nothing.

        Args:
            state_dict: ``{"state": {...}, "param_groups": [...]}``, torch's format.

        Raises:
            ValueError, TypeError: a malformed state dict, naming the group, parameter or
                state at fault.
            CheckpointMismatchError: groups or parameter counts that differ.
            StateStoreError: a step failed part-way; one rank's :meth:`shard_state_dict`.
        """
        self._table.check_usable(type(self).__name__, end_open_step=True)
        check_not_partial(state_dict, self._sharding, self._table)
        new_hyper, plan = read_state_dict(state_dict, self.param_groups, self._table,
                                          self._owns)
        write_states(self.param_groups, new_hyper, plan, self._table, self._moments)
        self._stepper.forget()

    # ------------------------------------------------------------------ fp32 weights
    def master_weights(self) -> Dict[str, Tensor]:
        """The fp32 weights this optimizer trains: the fp32 ``master`` of each bf16/fp16
        parameter (as the store holds it; the parameter itself is its rounding) and a copy of
        each fp32 parameter. ``model.float().load_state_dict(opt.master_weights(),
        strict=False)`` gives an fp32 model. Every tensor is in RAM at once;
        :meth:`save_master_weights` streams them to a file instead. ``state_dict()`` also
        carries each master (as ``"master"``), which ``torch.optim.AdamW.load_state_dict``
        ignores.

        Returns:
            ``{parameter key: fp32 CPU tensor}``, keys as given through
            ``named_parameters()`` (else torch's indices); with a ``process_group``, this
            rank's shard only.

        Raises:
            StateStoreIOError: a disk store failed to read a master.
            StateStoreError: an earlier step failed part-way (see :meth:`step`).
        """
        from ._masters import master_weights
        self._table.check_usable(type(self).__name__, end_open_step=True)
        return master_weights(self._table)

    def save_master_weights(self, path: str) -> None:
        """Write :meth:`master_weights` to one safetensors file, streaming a chunk at a time
        through the store's budget: ``safetensors.torch.load_file(path)`` reads it back as
        ``{parameter key: fp32 tensor}``.

        Args:
            path: a local path or an fsspec URL (written under a temporary name, then
                renamed).

        Raises:
            StateStoreIOError: a disk store failed to read a master.
            StateStoreError: an earlier step failed part-way (see :meth:`step`).
            OSError: writing the file failed (the temporary file is removed).
        """
        from ._masters import save_master_weights
        self._table.check_usable(type(self).__name__, end_open_step=True)
        save_master_weights(self._table, path)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of every parameter, as ``torch.optim.Optimizer.zero_grad``.

        Args:
            set_to_none: set ``param.grad = None`` (default) instead of zeroing it (which
                first finishes what a failed backward updated in part: ``docs/reliability.md``).
        """
        self._stepper.before_zero_grad(set_to_none)
        super().zero_grad(set_to_none)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Close the stores this optimizer created itself (never a store passed in) and
        release the page-locked staging of CUDA parameters."""
        for s in self._owned_stores:
            s.close()
        self._owned_stores = []
        if self._offload is not None:
            self._offload.after_step()
            self._offload.close()
            self._offload = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self._params)} params, store={self.state_store!r})"


class CPUAdam(_StoreAdam):
    """Adam/AdamW for CPU parameters, states in any store; the C++ SIMD kernel computes.

    Same arguments as :class:`HybridAdam`; GPU parameters also work (their update runs on
    their device).
    """


class HybridAdam(_StoreAdam):
    """Adam/AdamW for CPU and GPU parameters, states in any store: the C++ SIMD kernel for
    CPU parameters, the fused CUDA kernel for GPU ones. GPU parameters whose states are in
    host memory or on disk are updated by the SIMD kernel, their gradients and new values
    moving through page-locked buffers on a side stream, overlapped with backward
    (``docs/gpu.md``). ColossalAI's arguments (``nvme_offload_fraction``,
    ``nvme_offload_dir``, ``adamw_mode``) keep working."""

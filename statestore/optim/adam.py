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

import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..errors import StateStoreError
from ..store import StateStore
from ._adam_layout import AdamLayout
from ._args import check_arguments, grad_scale_of, validate_hyper
from ._in_backward import BackwardStepper
from ._metadata import OPTIMIZER_METADATA_VERSION
from ._moments import MomentFormat
from ._staging import StagingPath, attach_staging
from ._plan import work_of
from ._table import fraction_store
from ._units import PLAN_OK, PLAN_STALE, StepProgram, UnitTensors, step_plans_enabled
from .base import StateStoreOptimizer, may_prefetch

__all__ = ["CPUAdam", "HybridAdam", "OPTIMIZER_METADATA_VERSION"]


class _StoreAdam(StateStoreOptimizer):
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
        layout = AdamLayout(self._moments)
        self._moment_dtypes = layout.moment_dtypes
        check_arguments(type(self).__name__, state_store=state_store,
                        nvme_offload_fraction=nvme_offload_fraction,
                        nvme_offload_dir=nvme_offload_dir, bias_correction=bias_correction,
                        unused=unused, skip_nonfinite=skip_nonfinite,
                        process_group=process_group, update_in_backward=update_in_backward,
                        release_grads=release_grads)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=bool(amsgrad), maximize=bool(maximize),
                        adamw_mode=bool(adamw_mode))
        own = state_store is None and nvme_offload_fraction > 0
        if own:
            state_store = fraction_store(float(nvme_offload_fraction), nvme_offload_dir)
        self.skip_nonfinite = bool(skip_nonfinite)
        #: update_in_backward: the step made during backward (_in_backward.py)
        self._update_in_backward = update_in_backward
        self._release_grads = release_grads
        try:
            super().__init__(params, defaults, layout, state_store=state_store,
                             process_group=process_group, own_store=own)
        except BaseException:
            if own:
                state_store.close()
            raise

    def _setup_parts(self) -> None:
        self._stepper = BackwardStepper(self._table, self._planner(), type(self).__name__,
                                        self._apply_unit, self._release_grads)
        #: the step compiled into a native plan (_units.py), or None; general steps before
        #: the next compile attempt, and how many programs went stale at their first use
        self._program: Optional[StepProgram] = None
        self._program_wait, self._program_misses = 0, 0
        #: CUDA parameters over host or disk stores: page-locked staging on a side stream
        #: (docs/gpu.md); None while no parameter takes that path
        self._staging: Optional[StagingPath] = attach_staging(None, self, self._params,
                                                                   self._stores)
        if self._staging is None:
            self._stepper.unplanned = weakref.WeakMethod(self._unplanned_work)

    def _planner(self):
        """The stepper's planner, holding the layout (not the optimizer)."""
        from ._plan import PlanMemo
        return PlanMemo(self._keys, self._layout)

    # ------------------------------------------------------------------ set-up
    def _wants_hook(self, p: Tensor) -> bool:
        """With ``update_in_backward`` every parameter's gradient is applied from its hook;
        otherwise disk stores read ahead from it (the base's rule)."""
        return self.update_in_backward or super()._wants_hook(p)

    def _grad_ready(self, p: Tensor) -> None:
        if self.update_in_backward:
            self._stepper.grad_ready(p)
            return
        super()._grad_ready(p)

    def __del__(self) -> None:
        off = getattr(self, "_staging", None)
        if off is not None:
            off.remove_hooks()
        super().__del__()

    def _group_added(self, params: Sequence[Tensor]) -> None:
        self._program = None
        self._staging = attach_staging(self._staging, self, params, self._stores)
        super()._group_added(params)

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

    def _forget_pending(self) -> None:
        """States were replaced (a load): a pass of ``update_in_backward`` under way is
        forgotten, and the compiled step with it."""
        self._program = None
        self._stepper.forget()

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
        self._check_usable()
        loss = self._run_closure(closure)
        if self._program is not None and self._planned_step(1.0 if scale is None else scale):
            return loss
        released = self._stepper.released
        work, grads = self._collect(released)
        self._stepper.before_step(work, grads)
        if not grads and not released:
            return loss
        if self.skip_nonfinite and not self._dtensors.all_finite(list(grads.values())):
            return loss
        grad_scale = 1.0 if scale is None else scale
        self._ensure_states(work)
        off = self._staging
        if off is not None:
            try:
                off.before_step(grads)
            except BaseException:
                off.after_step()
                raise
        if self.update_in_backward:
            try:
                self._stepper.finish_step(work, grads, may_prefetch)
            finally:
                if off is not None:
                    off.after_step()
            return loss
        self._run_step(work, grads, grad_scale, off.after_step if off is not None else None)
        self._compile_step(work, grads, released)
        return loss

    def _planned_step(self, grad_scale: float) -> bool:
        """The step by the compiled program (``_units.py``, :class:`StepProgram`): True when
        made (or skipped for non-finite gradients); False when something it depends on
        changed (nothing changed: the caller steps the general way, and compiles again)."""
        prog, stepper = self._program, self._stepper
        if self._update_in_backward or stepper.released or stepper.spent \
                or stepper.backward_failed or not step_plans_enabled():
            self._program = None
            return False
        hypers = prog.prepare(self.param_groups, grad_scale)
        if hypers is None:
            self._program = None
            return False
        table = self._table
        if prog.units is not None:
            status = self._planned_units(prog, hypers)
        else:
            table.touched = False
            try:
                status = prog.run(self.param_groups, self._steps, hypers, self.skip_nonfinite)
            except BaseException as e:      # after the counts advanced: refuse from now on
                table.touched = True
                table.step_failed({}, e)
                raise
        if status == PLAN_STALE:
            self._program = None
            return False
        table.touched = True
        self._program_misses = 0
        return True

    def _planned_units(self, prog: StepProgram, hypers: list) -> int:
        """A streaming store's planned step: the counts (rolled back as the general way's
        if the pipeline fails before a unit changed), then the pipeline over the planned
        units, each updated by one native call, and the next step's prefetch."""
        plan, (store, units) = prog.plan, prog.units
        with self._table.stepping(()) as undo:
            self._step_undo = undo
            try:
                status = plan.begin(self.param_groups, self._steps, undo, hypers,
                                    self.skip_nonfinite)
                if status != PLAN_OK:
                    return status
                with store.pipeline(units, mode="rw", wait=False) as pipe:
                    for i, tensors in enumerate(pipe):
                        self._touch()
                        plan.run_unit(i, tensors)
            finally:
                plan.end()
                self._step_undo = {}
        if may_prefetch(store):
            store.prefetch(units, mode="rw")
            self._prefetching.add(store)
        return PLAN_OK

    def _compile_step(self, work, grads: Dict[Tensor, Tensor], released) -> None:
        """After a step the general way: compile it (the next steps, if alike, are made by
        one native call). Programs that go stale at once (the gradients change from step to
        step) are compiled ever more rarely, so a loop that never repeats pays little."""
        if self._program_wait > 0:
            self._program_wait -= 1
            return
        if released or self._update_in_backward or self._staging is not None \
                or self._sharding is not None or not step_plans_enabled():
            return
        self._program = StepProgram.compile(self.param_groups, work, grads, self._keys,
                                            self._stores, self._layout, self._moments,
                                            self._moment_dtypes, self._plan,
                                            self.skip_nonfinite)
        if self._program is not None:
            self._program_wait = min(2 ** self._program_misses, 64) - 1
            self._program_misses += 1

    def _unplanned_work(self, params: Sequence[Tensor]) -> Dict[StateStore, list]:
        """``update_in_backward`` with ``release_grads`` before a plan exists: ``params``
        (gradients final) as a step's work ``{store: [(group, params)]}``, their states
        created."""
        if self._staging is not None:       # CUDA staging needs the whole step's gradients
            return {}
        chosen = {p for p in params if p in self._stores and self._owns(p)}
        work = work_of(self.param_groups, self._stores, chosen.__contains__)
        self._ensure_states(work)
        return work

    def _update_unit(self, tensors: List[Tensor], group: dict, entries, grads, grad_scale,
                     dev: torch.device) -> None:
        """Run the Adam kernel over one unit: its parameter slices, gradients and states."""
        u = UnitTensors(tensors, entries, grads, dev, self._staging, self._keys, self._steps,
                        self._moments, self._moment_dtypes)
        self._touch()
        u.update(group, self._keys, self._moments, grad_scale)
        u.put_back()

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
        self._program = None
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
        return super().state_dict()

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
        super().load_state_dict(state_dict)

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
        self._check_usable(end_open_step=True)
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
        self._check_usable(end_open_step=True)
        save_master_weights(self._table, path)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of every parameter, as ``torch.optim.Optimizer.zero_grad``.

        Args:
            set_to_none: set ``param.grad = None`` (default) instead of zeroing it (which
                first finishes what a failed backward updated in part: ``docs/reliability.md``).
        """
        self._stepper.before_zero_grad(set_to_none)
        super().zero_grad(set_to_none)

    def staging_stats(self) -> Dict[str, int]:
        """The page-locked staging of CUDA parameters over host or disk stores
        (``docs/gpu.md``): ``staged_params`` (parameters staged so far),
        ``staging_pinned_bytes`` (registered with CUDA) and ``staging_pageable_bytes``
        (where registration failed); all zero while no parameter takes that path."""
        if self._staging is None:
            return {"staged_params": 0, "staging_pinned_bytes": 0, "staging_pageable_bytes": 0}
        return self._staging.stats()

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Close the stores this optimizer created itself (never a store passed in) and
        release the page-locked staging of CUDA parameters."""
        super().close()
        if self._staging is not None:
            self._staging.after_step()
            self._staging.close()
            self._staging = None


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

"""``CPUAdam`` and ``HybridAdam``: Adam/AdamW whose states live in a :class:`StateStore`.

The optimizer base plus Adam's kernel (``docs/architecture.md``, "Optimizers"): the class
validates Adam's arguments and gives the base (:class:`~statestore.optim.StateStoreOptimizer`,
whose ``step()``, ``update_in_backward``, ``skip_nonfinite`` and ``div_scale`` are every
optimizer's) its defaults and :class:`~statestore.optim._adam_layout.AdamLayout`; the base
hands every pipeline unit to :meth:`_StoreAdam._update_unit`, which runs
:func:`statestore.kernels.adam_step` (a step like the last: the native plan of
:class:`~statestore.optim._units.StepProgram`, the base's remembered step). States are reached
only through :meth:`StateStore.pipeline`, so every optimizer works on every store.

``state_dict()`` gives torch's ``AdamW`` format: compressed moments (``moment_dtype``
"bf16"/"int8") decoded to fp32, ``adamw_mode`` as ``decoupled_weight_decay``; a bf16/fp16
parameter's entry also holds ``"master"`` (its fp32 copy, which torch's AdamW ignores:
:meth:`_StoreAdam.master_weights` takes them out).

States per parameter (the parameter's shape): ``exp_avg``, ``exp_avg_sq`` (fp32, or compressed
with ``moment_dtype``: see :mod:`statestore.optim._moments`), ``max_exp_avg_sq`` (``amsgrad``)
and ``master`` (an fp32 master copy for fp16/bf16 parameters), both fp32. Step counts are kept
per parameter in the optimizer and saved with checkpoints through
:meth:`StateStore.attach_metadata`.

Each concept lives in a module of this package (``docs/architecture.md``, "Optimizers").
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..store import StateStore
from ._adam_layout import AdamLayout
from ._args import check_arguments, validate_hyper
from ._metadata import OPTIMIZER_METADATA_VERSION
from ._moments import MomentFormat
from ._staging import attach_staging
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
        try:
            super().__init__(params, defaults, layout, state_store=state_store,
                             process_group=process_group, own_store=own,
                             update_in_backward=update_in_backward,
                             release_grads=release_grads, skip_nonfinite=skip_nonfinite)
        except BaseException:
            if own:
                state_store.close()
            raise

    def _setup_parts(self) -> None:
        #: CUDA parameters over host or disk stores: page-locked staging on a side stream
        #: (docs/gpu.md); None while no parameter takes that path
        self._staging = attach_staging(None, self, self._params, self._stores)

    def _group_added(self, params: Sequence[Tensor]) -> None:
        self._staging = attach_staging(self._staging, self, params, self._stores)
        super()._group_added(params)

    @property
    def moment_dtype(self) -> str:
        """How ``exp_avg``/``exp_avg_sq`` are stored: "fp32", "bf16" or "int8"."""
        return self._moments.name

    @classmethod
    def saved_layout(cls, metadata: Dict) -> AdamLayout:
        """Adam's layout of the ``moment_dtype`` (and encoding) ``metadata`` records."""
        return AdamLayout.of_metadata(metadata)

    # ------------------------------------------------------------------ the kernel
    def _update_unit(self, tensors: List[Tensor], group: dict, entries, grads, grad_scale,
                     dev: torch.device) -> None:
        """Run the Adam kernel over one unit: its parameter slices, gradients and states."""
        u = UnitTensors(tensors, entries, grads, dev, self._staging, self._keys, self._steps,
                        self._moments, self._moment_dtypes)
        self._touch()
        u.update(group, self._keys, self._moments, grad_scale)
        u.put_back()

    def _remember(self, work, grads: Dict[Tensor, Tensor]) -> Optional[StepProgram]:
        """The step just made, compiled into a native plan (``_units.py``,
        :class:`StepProgram`): the next steps, if alike, are made by one native call."""
        if self._staging is not None or not step_plans_enabled():
            return None
        return StepProgram.compile(self.param_groups, work, grads, self._keys, self._stores,
                                   self._layout, self._moments, self._moment_dtypes,
                                   self._plan, self.skip_nonfinite)

    def _run_remembered(self, prog: StepProgram, grad_scale: float) -> bool:
        """The step by the compiled program: True when made (or skipped for non-finite
        gradients); False when something it depends on changed (nothing changed)."""
        if not step_plans_enabled():
            return False
        hypers = prog.prepare(self.param_groups, grad_scale)
        if hypers is None:
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
            return False
        table.touched = True
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
                self._table.unfinished = None    # made (no call before the with's end: no gap)
            finally:
                plan.end()
                self._step_undo = {}
        if may_prefetch(store):
            store.prefetch(units, mode="rw")
            self._prefetching.add(store)
        return PLAN_OK

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

    def staging_stats(self) -> Dict[str, int]:
        """The page-locked staging of CUDA parameters over host or disk stores
        (``docs/gpu.md``): ``staged_params`` (parameters staged so far),
        ``staging_pinned_bytes`` (registered with CUDA) and ``staging_pageable_bytes``
        (where registration failed); all zero while no parameter takes that path."""
        if self._staging is None:
            return {"staged_params": 0, "staging_pinned_bytes": 0, "staging_pageable_bytes": 0}
        return self._staging.stats()


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

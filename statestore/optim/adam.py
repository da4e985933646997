"""``CPUAdam`` and ``HybridAdam``: Adam/AdamW whose states live in a :class:`StateStore`.

Layers (as in ``torch/optim/adam.py``): the class validates arguments and owns param groups,
step counts and the store; each ``step()`` plans pipeline units over the parameters that have
gradients and hands every unit to :func:`statestore.kernels.adam_step`, which only computes.
States are reached only through :meth:`StateStore.pipeline`, so every optimizer works on every
store.

States per parameter (the parameter's shape): ``exp_avg``, ``exp_avg_sq`` (fp32, or compressed
with ``moment_dtype``: see :mod:`statestore.optim._moments`), ``max_exp_avg_sq`` (``amsgrad``)
and ``master`` (an fp32 master copy for fp16/bf16 parameters), both fp32. Step counts are kept per parameter in the optimizer and saved with checkpoints
through :meth:`StateStore.attach_metadata`.
"""
from __future__ import annotations

import numbers
import os
import warnings
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._types import Slice, StateKey
from ..errors import (CheckpointMismatchError, StateStoreClosedError, StateStoreError,
                      StateStoreValueError)
from ..kernels import adam_step, grads_finite
from ..kernels._moments import adam_step_moments
from ._moments import SCALE_OF, MomentFormat, export_fp32
from ..offload._handle import PARAM_STATE, is_offloaded, param_value, update_begin, update_end
from ..distributed import group_info, partition
from . import _offload_path
from ..pipeline import plan_units
from ..store import StateStore
from ._in_backward import misuse_reason, mixed_message, refused_message
from ._state import OptimizerState
from ._resume import MismatchReport, group_extras, saved_group_hyper, short_names

__all__ = ["CPUAdam", "HybridAdam", "OPTIMIZER_METADATA_VERSION"]

OPTIMIZER_METADATA_VERSION = 1
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_STATE_NAMES = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master") + tuple(SCALE_OF.values())
# Hyperparameters saved in metadata and state_dict (torch's AdamW keys plus ours).
_HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "adamw_mode")


def _is_real(x) -> bool:
    """A real number (numpy scalars included), not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _validate_hyper(lr, betas, eps, weight_decay) -> None:
    """torch's checks and messages (``ValueError("Invalid learning rate: -1")``), plus a
    ``TypeError`` naming the argument where torch would fail comparing a non-number."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        lr = lr.item()
    eps, weight_decay = (v.item() if isinstance(v, Tensor) and v.numel() == 1 else v
                         for v in (eps, weight_decay))
    for name, v in (("learning rate", lr), ("epsilon value", eps),
                    ("weight_decay value", weight_decay)):
        if not _is_real(v):
            raise TypeError(f"Invalid {name}: {v!r} (expected a float)")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    try:
        b0, b1 = betas
    except (TypeError, ValueError):
        raise ValueError(f"Invalid betas: {betas!r} (expected a pair of floats)") from None
    for i, b in enumerate((b0, b1)):
        if isinstance(b, Tensor) and b.numel() == 1:
            b = b.item()
        if not _is_real(b):
            raise TypeError(f"Invalid beta parameter at index {i}: {b!r} (expected a float)")
    if not 0.0 <= b0 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {b0}")
    if not 0.0 <= b1 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {b1}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


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
        params: parameters, ``named_parameters()`` pairs, or param-group dicts (as torch).
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
            finishes the step); the first step, and a step whose parameters with gradients
            differ from the previous one's, keep every gradient until ``step()``. See
            ``docs/scale.md``.
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
        _validate_hyper(lr, betas, eps, weight_decay)
        self._moments = MomentFormat(moment_dtype, moment_rounding)
        self._moment_dtypes = (self._moments.spec("exp_avg", (1,))[1],
                               self._moments.spec("exp_avg_sq", (1,))[1])
        if not bias_correction:
            raise ValueError("bias_correction=False is not supported (results would differ "
                             "from torch.optim.AdamW)")
        if unused:
            raise TypeError(f"{type(self).__name__} got unexpected keyword arguments: "
                            f"{sorted(unused)}")
        if isinstance(nvme_offload_fraction, bool) or not isinstance(nvme_offload_fraction, (int, float)) \
                or not 0.0 <= float(nvme_offload_fraction) <= 1.0:
            raise ValueError(f"Invalid nvme_offload_fraction: {nvme_offload_fraction!r} "
                             f"(expected a float in [0, 1])")
        if state_store is not None and not isinstance(state_store, StateStore):
            raise TypeError(f"state_store must be a statestore.StateStore, got "
                            f"{type(state_store).__name__}")
        if state_store is not None and nvme_offload_fraction > 0:
            raise ValueError("pass either state_store or nvme_offload_fraction, not both")
        if nvme_offload_dir is not None and not nvme_offload_fraction:
            where = "in the state_store passed" if state_store is not None else "in RAM"
            warnings.warn(f"nvme_offload_dir={nvme_offload_dir!r} has no effect without "
                          f"nvme_offload_fraction > 0: optimizer states stay {where}; pass "
                          f"nvme_offload_fraction=1.0 to keep them on disk under that directory",
                          UserWarning, stacklevel=2)
        if state_store is not None and state_store.closed:
            raise StateStoreClosedError(f"state_store: the {type(state_store).__name__} is closed")
        if not isinstance(update_in_backward, bool):
            raise TypeError(f"update_in_backward must be a bool, got {update_in_backward!r}")
        if not isinstance(release_grads, bool):
            raise TypeError(f"release_grads must be a bool, got {release_grads!r}")
        if release_grads and not update_in_backward:
            raise ValueError("release_grads=True needs update_in_backward=True (gradients are "
                             "applied, and can be released, during backward only then)")
        if update_in_backward and skip_nonfinite:
            raise ValueError("update_in_backward=True cannot be combined with skip_nonfinite=True "
                             "(parameters are updated before every gradient is known)")
        if update_in_backward and process_group is not None:
            raise ValueError("update_in_backward=True cannot be combined with process_group "
                             "(gradients are averaged over the group only after backward)")
        if update_in_backward and not hasattr(Tensor, "register_post_accumulate_grad_hook"):
            raise StateStoreError("update_in_backward=True needs "
                                  "Tensor.register_post_accumulate_grad_hook (torch >= 2.1)")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=bool(amsgrad), maximize=bool(maximize),
                        adamw_mode=bool(adamw_mode))
        _opaque_to_compiler()       # before torch wraps step() with its hooks
        super().__init__(params, defaults)
        self.skip_nonfinite = bool(skip_nonfinite)
        self._keys: Dict[Tensor, str] = {}
        self._params: List[Tensor] = []
        self._index_keys()
        self._check_params()
        self.process_group = process_group
        self._owner: Optional[Dict[Tensor, int]] = None
        if process_group is not None:
            self._rank, self._world = group_info(process_group)
            owners = partition([p.numel() for p in self._params], self._world)
            self._owner = dict(zip(self._params, owners))
        self._owned_stores: List[StateStore] = []
        self._stores: Dict[Tensor, StateStore] = {}
        self._steps: Dict[str, int] = {}
        #: why a step() failed part-way (empty: none did); shared with the metadata source
        self._failed: List[str] = []
        self._touched = False
        if state_store is None:
            if nvme_offload_fraction > 0:
                state_store = self._make_offload_store(float(nvme_offload_fraction), nvme_offload_dir)
                self._owned_stores.append(state_store)
        self.state_store = state_store
        self._assign_stores()
        attached = list(dict.fromkeys(self._stores.values()))
        if state_store is not None and state_store not in attached:
            attached.append(state_store)     # a rank owning no parameter still saves with the group
        for store in attached:
            self._resume_from(store)
            store.attach_metadata(self._metadata_source(), process_group=self.process_group,
                                  on_load=self._store_loaded)
        self._prefetching: "weakref.WeakSet[StateStore]" = weakref.WeakSet()
        #: update_in_backward: parameters whose gradient backward has finished since the last
        #: step (in that order), the units planned for the next step per store, the step being
        #: made during backward ([store, pipeline, meta, units done] per store), and the
        #: parameters it updated with (gradient, version).
        self._update_in_backward = update_in_backward
        #: parameters whose hook fired twice before step() (accumulation), and each
        #: gradient as its hook saw it (tensor, version): step() checks them
        self._second_grad: Dict[Tensor, None] = {}
        self._seen: Dict[Tensor, Tuple[Tensor, int]] = {}
        self._hooked: set = set()
        #: release_grads: parameters whose gradient was applied and released this backward,
        #: and the bytes of gradients backward has finished but not yet applied.
        self.release_grads = release_grads
        self._released: set = set()
        self._held_grad_bytes = 0
        self._ready: Dict[Tensor, int] = {}
        self._next_plans: Dict[StateStore, Tuple[List[List[Slice]], list]] = {}
        self._pass: Optional[List[list]] = None
        self._early_done: Dict[Tensor, Tuple[Tensor, int]] = {}
        self._pump_hooks: list = []
        #: CUDA parameters over host or disk stores: page-locked staging on a side stream
        #: (docs/gpu.md); None while no parameter takes that path
        self._offload: Optional[_offload_path.OffloadPath] = None
        _offload_path.attach(self, self._params)
        self._register_pump_hooks(self._params)
        #: torch's ``optimizer.state``: a view of the store (statestore/optim/_state.py)
        self.state = OptimizerState(self)

    # ------------------------------------------------------------------ set-up
    def _make_offload_store(self, fraction: float, directory: Optional[str]) -> StateStore:
        try:
            from ..backends.tiered import TieredStore
        except ImportError as e:
            raise StateStoreError(f"nvme_offload_fraction needs the tiered store, which is "
                                  f"not available: {e}") from e
        return TieredStore.from_fraction(fraction, directory)

    def _index_keys(self) -> None:
        keys: Dict[Tensor, str] = {}
        params: List[Tensor] = []
        idx = 0
        for group in self.param_groups:
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
        self._set_keys(keys, params)

    def _set_keys(self, keys: Dict[Tensor, str], params: List[Tensor]) -> None:
        """Replace the key map and parameter list in place: the metadata source attached to
        the stores holds these containers (a group added later must be in the next save)."""
        self._keys.clear()
        self._keys.update(keys)
        self._params[:] = params

    def _check_params(self) -> None:
        for p in self._params:
            if not isinstance(p, Tensor):
                raise TypeError(f"optimizer can only optimize Tensors, got {type(p).__name__}")
            if p.dtype not in _FLOATS:
                raise TypeError(f"parameter {self._keys[p]!r} has dtype {p.dtype}; "
                                f"expected float32, float16 or bfloat16")
            if p.is_sparse:
                raise TypeError(f"parameter {self._keys[p]!r} is sparse; not supported")
            if p.is_meta:
                raise StateStoreValueError(f"parameter {self._keys[p]!r} is on the meta device, "
                                           f"which holds no data; materialize it first")

    def _assign_stores(self) -> None:
        default: Dict[torch.device, StateStore] = {}
        for p in self._params:
            if p in self._stores or not self._owns(p):
                continue
            if self.state_store is not None:
                self._stores[p] = self.state_store
                continue
            if p.device not in default:
                from ..backends.device import DeviceStore
                default[p.device] = DeviceStore(p.device)
                self._owned_stores.append(default[p.device])
            self._stores[p] = default[p.device]

    def _register_pump_hooks(self, params: Sequence[Tensor]) -> None:
        """While backward produces gradients, let disk stores start the next step's reads
        (:meth:`StateStore.pump`, which never blocks), or, with ``update_in_backward``,
        update the parameters whose gradients are final. The hooks hold the optimizer
        weakly."""
        ref = weakref.ref(self)

        def pump(param) -> None:
            opt = ref()
            if opt is None:
                return
            if opt.update_in_backward:
                opt._grad_ready(param)
                return
            if not opt._prefetching:
                return
            for store in list(opt._prefetching):
                try:
                    store.pump()
                except StateStoreError:      # surfaces again at the step that needs it
                    store.cancel_prefetch()
                    opt._prefetching.discard(store)

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
        """torch's, plus checks of the group's hyperparameters and parameters; a group that
        fails them is not added (the optimizer stays as it was)."""
        n_groups = len(self.param_groups)
        super().add_param_group(param_group)
        keys = dict(self._keys) if hasattr(self, "_keys") else None
        params = list(self._params) if hasattr(self, "_params") else None
        stores = dict(self._stores) if hasattr(self, "_stores") else None
        try:
            g = self.param_groups[-1]
            _validate_hyper(g["lr"], g["betas"], g["eps"], g["weight_decay"])
            self._add_param_group_after_init()
        except BaseException:
            del self.param_groups[n_groups:]
            if keys is not None:
                self._set_keys(keys, params)
            if stores is not None:
                self._stores = stores
            raise
        if hasattr(self, "_pump_hooks"):
            _offload_path.attach(self, self.param_groups[-1]["params"])
            self._register_pump_hooks(self.param_groups[-1]["params"])

    def _add_param_group_after_init(self) -> None:
        if hasattr(self, "_stores"):        # after __init__: a group added later
            if self._owner is not None:
                raise StateStoreError("add_param_group is not supported with a process_group "
                                      "(the state partition is fixed at construction)")
            self._index_keys()
            self._check_params()
            self._assign_stores()

    def _owns(self, p: Tensor) -> bool:
        """True when this rank keeps ``p``'s states (always, without a process group)."""
        return self._owner is None or self._owner[p] == self._rank

    def _state_names(self, p: Tensor, group: dict) -> List[str]:
        names = ["exp_avg", "exp_avg_sq"]
        if group["amsgrad"]:
            names.append("max_exp_avg_sq")
        if p.dtype in _LOW_PRECISION:
            names.append("master")
        return names

    def _stored_names(self, p: Tensor, group: dict) -> List[str]:
        """The store states of ``p``: its logical states plus, for int8 moments, their
        scales."""
        return self._moments.stored_names(self._state_names(p, group))

    @property
    def moment_dtype(self) -> str:
        """How ``exp_avg``/``exp_avg_sq`` are stored: "fp32", "bf16" or "int8"."""
        return self._moments.name

    def _group_of(self) -> Dict[Tensor, dict]:
        return {p: g for g in self.param_groups for p in g["params"]}

    def _resume_from(self, store: StateStore, loaded: bool = False) -> None:
        """Pick up the states already in ``store`` (a loaded checkpoint, or an earlier
        optimizer on it): step counts, and, from a loaded checkpoint, the param groups'
        hyperparameters. ``loaded``: called because ``store.load_checkpoint`` just replaced
        the states under this optimizer (torch's resume order). Everything is checked before
        anything changes; differences raise one CheckpointMismatchError summarizing them."""
        ours = {self._keys[p]: p for p, s in self._stores.items() if s is store}
        store.load_deferred(list(ours))          # states a sharded load left to other ranks
        if self._owner is not None:              # drop states other ranks own
            every_name = set(self._keys.values())
            theirs = [k for k in store.keys() if k.param in every_name and k.param not in ours]
            if theirs:
                store.delete(theirs)
        ckpt = store.loaded_metadata
        meta = ckpt if loaded else store.metadata()
        # Hyperparameters come from a checkpoint, not from an earlier optimizer on the store,
        # unless that optimizer took the checkpoint's when it was loaded and has not stepped
        # since (an optimizer of torch's resume order still alive when a new one is built).
        from_ckpt = meta is not None and (meta is ckpt or (
            isinstance(meta, dict) and isinstance(ckpt, dict)
            and meta.get("steps") == ckpt.get("steps")
            and meta.get("param_groups") == ckpt.get("param_groups")))
        meta = meta if isinstance(meta, dict) else {}
        if not loaded and len(store) == 0 and not meta.get("params"):
            return
        stored_params: Dict[str, Dict[str, Any]] = {}
        for k in store.keys():
            if k.state != PARAM_STATE:      # not a parameter's data (offload_parameters)
                stored_params.setdefault(k.param, {})[k.state] = store.spec(k)
        every = {self._keys[p]: p for p in self._params}
        saved = meta.get("params")
        saved = saved if isinstance(saved, dict) and saved else None
        saved_groups = meta.get("param_groups") if from_ckpt else None
        saved_groups = saved_groups if isinstance(saved_groups, list) and saved_groups else None
        report = MismatchReport(list(saved) if saved else list(stored_params), list(every),
                                len(saved_groups) if saved_groups else None,
                                len(self.param_groups))
        for name in sorted(set(stored_params) - set(ours)):
            report.add("parameters with states in the store, not in the optimizer",
                       f"unexpected parameter {name!r} in the store")
        new_hyper: List[Dict[str, Any]] = [{} for _ in self.param_groups]
        if saved_groups is not None:
            if len(saved_groups) != len(self.param_groups):
                report.add("param groups", f"the checkpoint has {len(saved_groups)} param "
                           f"groups, the optimizer {len(self.param_groups)}")
            else:
                for i, (g, sg) in enumerate(zip(self.param_groups, saved_groups)):
                    ck = [n for n in sg.get("params", [])]
                    op = [self._keys[p] for p in g["params"]]
                    if set(ck) != set(op):
                        only_ck = [n for n in ck if n not in set(op)]
                        only_op = [n for n in op if n not in set(ck)]
                        report.add("param groups", f"param group {i}: {len(ck)} parameters in "
                                   f"the checkpoint, {len(op)} in the optimizer (only in the "
                                   f"checkpoint: {short_names(only_ck) or 'none'}; only in the "
                                   f"optimizer: {short_names(only_op) or 'none'})")
                    new_hyper[i] = saved_group_hyper(sg)
        if saved is not None:
            for name in sorted(set(saved) - set(every)):
                report.add("parameters of the checkpoint not in the optimizer",
                           f"parameter {name!r} of the checkpoint is not in the optimizer")
            for name in sorted(set(every) - set(saved)):
                report.add("parameters of the optimizer not in the checkpoint",
                           f"parameter {name!r} of the optimizer is not in the checkpoint")
            for name in sorted(set(saved) & set(every)):
                shape = tuple(saved[name].get("shape", ())) if isinstance(saved[name], dict) else ()
                if shape != tuple(every[name].shape):
                    report.add("shapes", f"parameter {name!r}: shape {tuple(every[name].shape)} "
                               f"in the optimizer, {shape} in the checkpoint")
                dtype = saved[name].get("dtype") if isinstance(saved[name], dict) else None
                ours_dtype = str(every[name].dtype).replace("torch.", "")
                if isinstance(dtype, str) and dtype != ours_dtype:
                    report.add("dtypes", f"parameter {name!r}: dtype {ours_dtype} in the "
                               f"optimizer, {dtype} in the checkpoint")
        groups = {p: {**g, **h} for g, h in zip(self.param_groups, new_hyper)
                  for p in g["params"]}
        fmt = self._moments
        # checkpoints of optimizers from before moment_dtype existed hold fp32 moments; a store
        # without optimizer metadata is checked by its states' dtypes alone (below)
        saved_fmt = meta.get("moment_dtype", "fp32" if meta.get("optimizer") else None) \
            if isinstance(meta, dict) else None
        if stored_params and saved_fmt is not None and saved_fmt != fmt.name:
            report.add("states", f"moment_dtype {fmt.name!r} in the optimizer, {saved_fmt!r} in "
                       f"the store's metadata (load the states through state_dict() to convert)")
        for name, p in ours.items():
            if name not in stored_params:
                continue        # new parameter: its states start fresh
            for state, spec in stored_params[name].items():
                if not fmt.known(state):
                    report.add("states", f"parameter {name!r}: unexpected state {state!r} in "
                               f"the store (an Adam optimizer with moment_dtype={fmt.name!r} "
                               f"keeps {fmt.stored_names(_STATE_NAMES[:4])})")
                    continue
                shape, dtype = fmt.spec(state, tuple(p.shape))
                if spec.shape != shape:
                    report.add("states", f"parameter {name!r}: state {state!r} has shape "
                               f"{spec.shape}, the optimizer expects {shape}")
                if spec.dtype != dtype:
                    report.add("states", f"parameter {name!r}: state {state!r} has dtype "
                               f"{spec.dtype}, the optimizer keeps {dtype} "
                               f"(moment_dtype={fmt.name!r})")
                if state == "master" and p.dtype not in _LOW_PRECISION:
                    report.add("states", f"parameter {name!r}: the store holds an fp32 master "
                               f"but the parameter is {p.dtype}")
            needed = self._stored_names(p, groups[p])
            missing = [s for s in needed if s not in stored_params[name] and s != "master"]
            if missing and stored_params[name]:
                report.add("states", f"parameter {name!r}: states {missing} missing from the "
                           f"store")
        report.raise_if_any()
        for g, h in zip(self.param_groups, new_hyper):
            merged = {**g, **h}
            _validate_hyper(merged["lr"], merged["betas"], merged["eps"], merged["weight_decay"])
        # apply: a group becomes the saved one (as torch's load_state_dict), its parameters
        # and this optimizer's own hyperparameters kept where the checkpoint has none
        for g, h, sg in zip(self.param_groups, new_hyper, saved_groups or [None] * len(new_hyper)):
            if sg is not None:
                for k in [k for k in g if k not in h and k not in ("params", "param_names")
                          and k not in _HYPER]:
                    del g[k]
            g.update(h)
        steps = meta.get("steps", {})
        steps = steps if isinstance(steps, dict) else {}
        for name in ours:
            if name in stored_params:
                self._steps[name] = int(steps.get(name, 0))
            elif loaded:
                self._steps.pop(name, None)     # its states were replaced by none

    def _store_loaded(self, store: StateStore) -> None:
        """``store.load_checkpoint`` replaced the states under this optimizer (torch's order:
        optimizer and scheduler built first): take the checkpoint's step counts and
        hyperparameters, then save this optimizer's metadata with the store's checkpoints
        again. A checkpoint that does not fit raises and stays detached from the optimizer."""
        if self._failed:            # unusable (see _failed_message): stays detached
            return
        self._next_plans = {}
        self._ready = {}
        self._prefetching.discard(store)
        self._resume_from(store, loaded=True)
        store.attach_metadata(self._metadata_source(), process_group=self.process_group,
                              on_load=self._store_loaded)

    # ------------------------------------------------------------------ metadata
    def _metadata(self) -> dict:
        return self._metadata_source()()

    def _metadata_source(self):
        """A callable producing this optimizer's metadata that holds the containers it reads
        (groups, keys, step counts), not the optimizer: the store keeps it after the
        optimizer is gone, so a later optimizer on the store picks up the step counts."""
        name, param_groups, keys, steps, params, failed, moments = (
            type(self).__name__, self.param_groups, self._keys, self._steps, self._params,
            self._failed, self._moments.metadata())

        def metadata() -> dict:
            if failed:   # a checkpoint now would mix states of two steps and look valid
                raise StateStoreError(_failed_message(name, failed[0]))
            groups = []
            for g in param_groups:
                hyper = {k: (list(g[k]) if k == "betas" else g[k]) for k in _HYPER}
                if isinstance(hyper["lr"], Tensor):
                    hyper["lr"] = hyper["lr"].item()
                for k in ("lr", "eps", "weight_decay"):     # numpy scalars: plain JSON numbers
                    hyper[k] = float(hyper[k])
                hyper["betas"] = [float(b) for b in hyper["betas"]]
                for k in ("amsgrad", "maximize", "adamw_mode"):
                    hyper[k] = bool(hyper[k])
                hyper.update(group_extras(g))       # initial_lr of a scheduler, and others
                hyper["params"] = [keys[p] for p in g["params"]]
                groups.append(hyper)
            return {
                "optimizer": name,
                "version": OPTIMIZER_METADATA_VERSION,
                "param_groups": groups,
                "steps": dict(steps),
                "params": {keys[p]: {"shape": list(p.shape),
                                     "dtype": str(p.dtype).replace("torch.", "")}
                           for p in params},
                **moments,
            }
        return metadata

    # ------------------------------------------------------------------ step
    def _ensure_states(self, store: StateStore, params: Sequence[Tensor]) -> None:
        groups = self._group_of()
        entries, later = [], []
        for p in params:
            key = self._keys[p]
            for name in self._stored_names(p, groups[p]):
                sk = StateKey(key, name)
                if sk in store:
                    continue
                if name == "master" and is_offloaded(p):
                    later.append((sk, p))       # read from its store, one at a time, below
                    init = None
                else:
                    # the parameter itself: the store converts it a chunk at a time (a whole
                    # fp32 copy of every parameter would come before the first step)
                    init = p.detach() if name == "master" else None
                entries.append((sk, *self._moments.spec(name, tuple(p.shape)), init))
        if entries:
            store.create_many(entries)
        for sk, p in later:
            store.put(sk, param_value(p).float())

    def _grad_of(self, p: Tensor) -> Tensor:
        g = p.grad
        if g.is_sparse:
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients "
                               f"(parameter {self._keys[p]!r})")
        if g.device != p.device:
            raise StateStoreValueError(f"parameter {self._keys[p]!r} is on {p.device} but its "
                                       f"gradient is on {g.device}")
        if g.shape != p.shape:
            raise StateStoreValueError(f"parameter {self._keys[p]!r} has shape {tuple(p.shape)} "
                                       f"but its gradient has {tuple(g.shape)}")
        if g.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"gradient of {self._keys[p]!r} has dtype {g.dtype}")
        return g if g.is_contiguous() else g.contiguous()

    @torch.no_grad()
    def step(self, closure=None, div_scale: float = -1.0):
        """One optimizer step over every parameter with a gradient.

        ``div_scale > 0`` divides gradients by it (ColossalAI's argument, for loss scaling).
        With ``skip_nonfinite=True`` a step whose gradients hold inf or nan changes nothing.
        On return, resident stores are updated; disk stores may still be writing the last
        states back (any later read, ``sync()``, ``state_dict()`` or checkpoint waits).
        """
        if closure is not None and not callable(closure):
            raise TypeError(f"closure must be callable or None, got {type(closure).__name__}")
        if div_scale is not None and not _is_real(div_scale) \
                and not (isinstance(div_scale, Tensor) and div_scale.numel() == 1):
            raise TypeError(f"div_scale must be a float, got {div_scale!r}")
        if self._failed:
            raise StateStoreError(_failed_message(type(self).__name__, self._failed[0]))
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work: Dict[StateStore, List[Tuple[dict, List[Tensor]]]] = {}
        grads: Dict[Tensor, Tensor] = {}
        for group in self.param_groups:
            per_store: Dict[StateStore, List[Tensor]] = {}
            for p in group["params"]:
                if p.grad is None:
                    if p in self._released and self._owns(p):   # applied during backward
                        per_store.setdefault(self._stores[p], []).append(p)
                    continue
                grads[p] = self._grad_of(p)
                if self._owns(p):
                    per_store.setdefault(self._stores[p], []).append(p)
            for store, ps in per_store.items():
                work.setdefault(store, []).append((group, ps))
        if not grads and not self._released:
            return loss
        if self._owner is not None:
            self._allreduce_grads(grads)
            work = {st: [(g, [p for p in ps if self._owns(p)]) for g, ps in items]
                    for st, items in work.items()}
        if self.skip_nonfinite and not grads_finite(list(grads.values())):
            return loss
        grad_scale = float(div_scale) if div_scale is not None and div_scale > 0 else 1.0
        for store, items in work.items():
            self._ensure_states(store, [p for _, ps in items for p in ps])
        if self._offload is not None:
            try:
                self._offload.before_step(grads)
            except BaseException:
                self._offload.after_step()
                raise
        if self.update_in_backward:
            try:
                self._finish_backward_step(work, grads, div_scale)
            finally:
                if self._offload is not None:
                    self._offload.after_step()
            return loss
        before = dict(self._steps)
        for p in grads:
            if self._owns(p):
                k = self._keys[p]
                self._steps[k] = self._steps.get(k, 0) + 1
        self._touched = False
        try:
            try:
                for store, items in work.items():
                    self._step_store(store, items, grads, grad_scale)
            finally:
                if self._offload is not None:
                    self._offload.after_step()
        except BaseException as e:
            if self._touched:
                # Some parameters and states hold this step, others the previous one: refuse
                # to go on (or to checkpoint) rather than diverge silently.
                self._failed.append(f"{type(e).__name__}: {e}")
            else:           # failed before anything changed (e.g. an I/O error reported by
                self._steps.clear()         # the store): nothing to undo but the counts
                self._steps.update(before)
            raise
        if self._owner is not None:
            for store in work:
                store.sync()
            self._broadcast_params([p for p in self._params if p in grads])
        return loss

    def _allreduce_grads(self, grads: Dict[Tensor, Tensor]) -> None:
        """Average gradients over the group (all-reduce, as DDP does): afterwards every
        rank's ``p.grad`` holds the group mean."""
        import torch.distributed as dist
        handles = []
        for p in self._params:
            g = grads.get(p)
            if g is None:
                continue
            if g is not p.grad:          # made contiguous: reduce the copy, then store it back
                p.grad = g
            handles.append(dist.all_reduce(g, op=dist.ReduceOp.SUM, group=self.process_group,
                                           async_op=True))
        for h in handles:
            h.wait()
        for g in grads.values():
            g.div_(self._world)

    def _broadcast_params(self, params: List[Tensor]) -> None:
        """Each owner sends its updated parameters to every rank (the all-gather step)."""
        import torch.distributed as dist
        handles = []
        for p in params:
            src = dist.get_global_rank(self.process_group, self._owner[p]) \
                if self.process_group is not dist.group.WORLD else self._owner[p]
            handles.append(dist.broadcast(p.detach(), src=src, group=self.process_group,
                                          async_op=True))
        for h in handles:
            h.wait()

    def _plan(self, store: StateStore, items, order: Optional[Dict[Tensor, int]] = None):
        """Pipeline units over ``items`` (``(group, params)`` pairs) and, per unit, its group
        and ``(param, start, stop, state names)`` entries. With ``order`` (rank of each
        parameter's gradient in the last backward), units come in the order backward
        finishes their gradients."""
        planned: List[Tuple[int, List[Slice], Tuple[dict, list]]] = []
        # Cut points where the store aligned the states' data (a unit holds up to 4 states).
        align = max(1, store.cut_alignment(store.unit_bytes and store.unit_bytes // 4) // 4)
        fmt = self._moments
        align = fmt.cut_elems(store, align)     # compressed moments: whole blocks, aligned
        last = len(order) if order else 0
        for group, ps in items:
            if order:
                ps = sorted(ps, key=lambda p: order.get(p, last))
            names = [self._stored_names(p, group) for p in ps]
            keys = [[StateKey(self._keys[p], n) for n in ns] for p, ns in zip(ps, names)]
            # compressed: each state's bytes an element, counted as that many 1-byte states
            itemsize = 1 if fmt.compressed else 4
            groups_ = [[None] * fmt.unit_itemsize(ns)[1] for ns in names] if fmt.compressed \
                else keys
            plan = plan_units(groups_, [p.numel() for p in ps], itemsize, store.unit_bytes,
                              align, slice_round=store.alignment)
            for unit in plan:
                rank = max(order.get(ps[i], last) for i, _, _ in unit) if order else 0
                planned.append((rank, [Slice(k, *fmt.state_range(k.state, a, b))
                                       for i, a, b in unit for k in keys[i]],
                                (group, [(ps[i], a, b, names[i]) for i, a, b in unit])))
        planned.sort(key=lambda x: x[0])        # stable: param order among equal ranks
        return [u for _, u, _ in planned], [m for _, _, m in planned]

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

    # ------------------------------------------------------------------ update_in_backward
    def _grad_ready(self, p: Tensor) -> None:
        """Gradient hook (``update_in_backward``): ``p``'s gradient is final. Updates, in the
        planned order, every unit whose parameters all have final gradients and whose states
        have arrived from the store; never waits for I/O (that is left to ``step()``)."""
        if p in self._ready:
            # A second gradient before step() (accumulation): explained at step(); backward
            # goes on, and nothing more is updated during it.
            self._second_grad[p] = None
            return
        self._ready[p] = len(self._ready)
        if p.grad is not None:
            self._seen[p] = (p.grad, p.grad._version)
            if self.release_grads:
                self._held_grad_bytes += p.grad.numel() * p.grad.element_size()
        if self._failed or self._second_grad or (self._pass is None and not self._next_plans):
            return
        try:
            with torch.no_grad():
                self._open_pass()
                self._advance_pass(block=False)
        except BaseException as e:
            self._abort_pass(e)
            raise

    def _open_pass(self) -> None:
        if self._pass is not None:
            return
        self._touched = False               # this step's first update
        self._pass = []
        for store, (units, meta) in self._next_plans.items():
            # The prefetch started by the last step() is handed out here.
            self._pass.append([store, store.pipeline(units, mode="rw", wait=False), meta, 0])

    def _advance_pass(self, block: bool, grads: Optional[Dict[Tensor, Tensor]] = None) -> None:
        """Update the pass's next units: those ready now (``block=False``), or all of them."""
        for sp in self._pass or ():
            store, pipe, meta = sp[0], sp[1], sp[2]
            while sp[3] < len(meta):
                group, entries = meta[sp[3]]
                if block:
                    tensors = next(pipe)
                elif not all(e[0] in self._ready for e in entries):
                    pipe.ready()                # start the reads that need no waiting
                    break
                else:
                    tensors = pipe.take()       # None: its states have not arrived yet
                    if tensors is None:
                        if not self._too_many_grads(sp[0]):
                            break
                        tensors = pipe.wait_next()      # release_grads: backward waits
                sp[3] += 1
                self._apply_unit(tensors, group, entries, store.device, grads)
                pipe.commit()
            if block:
                pipe.close()

    def _apply_unit(self, tensors: List[Tensor], group: dict, entries, dev: torch.device,
                    grads: Optional[Dict[Tensor, Tensor]], grad_scale: float = 1.0) -> None:
        """Update the entries of one planned unit that have a gradient (``grads``: the
        step's; None: during backward, where every entry's gradient is final). A parameter's
        step count advances at its first slice."""
        early = grads is None
        sel_t: List[Tensor] = []
        sel_e = []
        pos = 0
        for e in entries:
            p, a, _, names = e
            n = len(names)
            if grads is None or p in grads:
                sel_t += tensors[pos:pos + n]
                sel_e.append(e)
            pos += n
        if not sel_e:
            return
        if grads is None:
            grads = {e[0]: self._grad_of(e[0]) for e in sel_e}
        counted = [self._keys[e[0]] for e in sel_e if e[1] == 0]
        for k in counted:
            self._steps[k] = self._steps.get(k, 0) + 1
        try:
            self._update_unit(sel_t, group, sel_e, grads, grad_scale, dev)
        except BaseException:
            if not self._touched:
                for k in counted:
                    self._steps[k] -= 1
            raise
        if early:
            for e in sel_e:
                p = e[0]
                if self.release_grads and e[2] == p.numel():     # its last slice
                    g = p.grad
                    self._held_grad_bytes -= g.numel() * g.element_size()
                    p.grad = None
                    self._seen.pop(p, None)     # it held the gradient too
                    self._released.add(p)
                    self._early_done[p] = (None, -1)
                    continue
                g = p.grad
                if p not in self._early_done:
                    self._early_done[p] = (g, g._version)

    def _too_many_grads(self, store: StateStore) -> bool:
        """``release_grads``: more gradient bytes wait for their states than the store's RAM
        budget; backward then waits for the disk instead of piling them up."""
        return self.release_grads and self._held_grad_bytes > store.budget_bytes

    def _abort_pass(self, err: BaseException) -> None:
        """A pass failed: give its buffers back; once anything was updated the optimizer
        refuses to go on (parameters and states hold a mix of two steps)."""
        if self._touched or self._early_done:
            self._failed.append(f"{type(err).__name__}: {err}")
        else:                   # nothing changed: a new backward (or step()) starts afresh
            self._ready = {}
        for sp in self._pass or ():
            try:
                sp[1].__exit__(type(err), err, None)
            except BaseException:
                pass
        self._pass = None

    def _finish_backward_step(self, work, grads: Dict[Tensor, Tensor], div_scale) -> None:
        """``step()`` with ``update_in_backward``: check the gradients backward already used,
        update every remaining unit, plan the next step in gradient order and prefetch it."""
        done = self._early_done
        changed = [self._keys[p] for p, (g, version) in self._seen.items()
                   if p not in self._released and (p.grad is not g or g._version != version)]
        reason = misuse_reason([self._keys[p] for p in self._second_grad], changed)
        if reason and not done and not self._touched:
            self._reset_backward_pass()         # nothing changed: the step can be made again
            raise StateStoreError(refused_message(reason))
        try:
            if div_scale is not None and div_scale > 0:
                raise StateStoreValueError(
                    "update_in_backward: step(div_scale=...) is not supported (backward has "
                    "already applied the gradients unscaled); unscale the loss instead")
            with torch.no_grad():
                self._open_pass()
                self._advance_pass(block=True, grads=grads)
            self._pass = None
            covered = {e[0] for _, meta in self._next_plans.values() for _, es in meta for e in es}
            for store, items in work.items():
                rest = [(g, [p for p in ps if p not in covered]) for g, ps in items]
                rest = [(g, ps) for g, ps in rest if ps]
                if not rest:
                    continue
                units, meta = self._plan(store, rest, self._ready)
                with store.pipeline(units, mode="rw", wait=False) as pipe:
                    for tensors, (group, entries) in zip(pipe, meta):
                        self._apply_unit(tensors, group, entries, store.device, grads)
        except BaseException as e:
            self._abort_pass(e)
            self._ready = {}
            raise
        finally:
            early = [self._keys[p] for p in self._early_done]
            self._early_done = {}
            self._seen = {}
            self._second_grad = {}
            self._released = set()
            self._held_grad_bytes = 0
        order, self._ready = self._ready, {}
        self._touched = False
        self._next_plans = {}
        for store, items in work.items():
            self._next_plans[store] = self._plan(store, items, order)
            if _may_prefetch(store):
                store.prefetch(self._next_plans[store][0], mode="rw")
        if reason:                  # the step is complete and consistent: now say what happened
            raise StateStoreError(mixed_message(reason, early))

    def _reset_backward_pass(self) -> None:
        """Forget what backward reported since the last step and give the pass's buffers
        back; only while nothing was updated."""
        for sp in self._pass or ():
            try:
                err = StateStoreError("the step was refused")
                sp[1].__exit__(type(err), err, None)        # buffers back, nothing written
            except BaseException:
                pass
        self._pass = None
        self._ready, self._seen, self._second_grad, self._early_done = {}, {}, {}, {}
        self._released, self._held_grad_bytes = set(), 0

    @property
    def update_in_backward(self) -> bool:
        """Whether parameters are updated during backward (see the class docstring). May be
        switched between steps, e.g. off after a step() refused a loop that clips or
        accumulates gradients (that step can then be made again)."""
        return self._update_in_backward

    @update_in_backward.setter
    def update_in_backward(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"update_in_backward must be a bool, got {value!r}")
        if value == self._update_in_backward:
            return
        if value and self.skip_nonfinite:
            raise ValueError("update_in_backward=True cannot be combined with skip_nonfinite=True")
        if value and self.process_group is not None:
            raise ValueError("update_in_backward=True cannot be combined with process_group")
        if self._early_done or self._touched and self._pass is not None:
            raise StateStoreError("update_in_backward cannot change while backward has updated "
                                  "some parameters: call step() first")
        self._reset_backward_pass()
        self._next_plans = {}
        self._update_in_backward = value
        if value:
            self._register_pump_hooks(self._params)

    def _update_unit(self, tensors: List[Tensor], group: dict, entries, grads, grad_scale,
                     dev: torch.device) -> None:
        offloaded = update_begin(entries)   # offloaded parameters: fetched for the update
        params, gs, m, v, vmax, masters, steps, writeback = [], [], [], [], [], [], [], []
        scales: list = []
        pos = 0
        off, uploads = self._offload, []
        for p, a, b, names in entries:
            st = dict(zip(names, tensors[pos:pos + len(names)]))
            pos += len(names)
            whole = a == 0 and b == p.numel()        # the common case: no slicing
            pflat = p.view(-1) if p.is_contiguous() else None
            if off is not None and off.handles(p):
                # CUDA parameter, host states: page-locked staging, side stream (docs/gpu.md)
                g = off.grad_host(p, grads[p])[a:b]
                w = off.param_host(p)[a:b]
                uploads.append((p, a, b))
            else:
                if pflat is None or p.device != dev:
                    src = p.detach().reshape(-1)[a:b]
                    w = src.to(dev, copy=True)
                    writeback.append((p, a, b, w))
                else:
                    w = pflat if whole else pflat[a:b]
                g = grads[p].view(-1) if whole else grads[p].view(-1)[a:b]
                if g.device != dev:
                    g = g.to(dev)
            params.append(w)
            gs.append(g)
            m.append(st["exp_avg"])
            v.append(st["exp_avg_sq"])
            if (m[-1].dtype, v[-1].dtype) != self._moment_dtypes:
                raise StateStoreValueError(
                    f"parameter {self._keys[p]!r}: the store holds exp_avg/exp_avg_sq as "
                    f"{m[-1].dtype}/{v[-1].dtype}, but this optimizer keeps moment_dtype="
                    f"{self._moments.name!r} ({self._moment_dtypes[0]}/"
                    f"{self._moment_dtypes[1]}); was a checkpoint of another moment_dtype "
                    f"loaded into its store?")
            vmax.append(st.get("max_exp_avg_sq"))
            masters.append(st.get("master"))
            steps.append(self._steps[self._keys[p]])
            scales.append((st.get("exp_avg_scale"), st.get("exp_avg_sq_scale"), a))
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        if isinstance(lr, Tensor):
            lr = lr.item()
        self._touched = True
        kw = dict(steps=steps, lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"],
                  weight_decay=group["weight_decay"], adamw_mode=group["adamw_mode"],
                  amsgrad=group["amsgrad"], max_exp_avg_sqs=vmax if group["amsgrad"] else None,
                  masters=masters if any(x is not None for x in masters) else None,
                  maximize=group["maximize"], grad_scale=grad_scale)
        fmt = self._moments
        if not fmt.compressed:
            adam_step(params, gs, m, v, **kw)
        else:
            keys = [self._keys[e[0]] for e in entries]
            adam_step_moments(params, gs, m, v, kind=fmt.name, rounding=fmt.rounding,
                              seeds=[fmt.seeds(k, s) for k, s in zip(keys, steps)],
                              offsets=[a for _, _, a in scales],
                              exp_avg_scales=[x for x, _, _ in scales],
                              exp_avg_sq_scales=[y for _, y, _ in scales], **kw)
        for p, a, b, w in writeback:
            if p.is_contiguous():
                p.detach().view(-1)[a:b].copy_(w)
            else:
                flat = p.detach().reshape(-1).clone()
                flat[a:b].copy_(w.to(p.device))
                p.detach().copy_(flat.view(p.shape))
        for p, a, b in uploads:
            off.upload(p, a, b)
        update_end(offloaded)               # ... and written back to their store

    # ------------------------------------------------------------------ torch's state_dict
    def state_dict(self) -> Dict[str, Any]:
        """torch's format: ``{"state": {index: {"step", "exp_avg", ...}}, "param_groups"}``.

        Resident stores return views of the live states (as torch returns its own state
        tensors). Disk stores snapshot their state files as a linked checkpoint does (frozen,
        copy-on-write) and return tensors mapped privately from them (pages load on access
        and the kernel may evict them): no copy, no temporary file, never every state in RAM;
        states whose files cannot be taken whole are streamed into a temporary file of their
        size (see :mod:`statestore._snapshot` and docs/scale.md). Compressed moments
        (``moment_dtype`` "bf16"/"int8") are decoded into new fp32 tensors (streamed through
        the budget for disk stores), so that ``torch.optim.AdamW`` loads them.

        A bf16/fp16 parameter's state also holds ``"master"``, its fp32 master copy, which
        ``torch.optim.AdamW.load_state_dict`` ignores (torch keeps no such state): take the
        fp32 weights out with :meth:`master_weights` or :meth:`save_master_weights`.
        """
        index = {p: i for i, p in enumerate(self._params)}
        groups = []
        for g in self.param_groups:
            ng = {k: v for k, v in g.items() if k not in ("params", "adamw_mode")}
            ng["betas"] = tuple(g["betas"])
            ng["decoupled_weight_decay"] = bool(g["adamw_mode"])
            ng["adamw_mode"] = bool(g["adamw_mode"])
            ng.setdefault("foreach", None)
            ng.setdefault("capturable", False)
            ng.setdefault("differentiable", False)
            ng.setdefault("fused", None)
            ng["params"] = [index[p] for p in g["params"]]
            groups.append(ng)
        state: Dict[int, Dict[str, Any]] = {}
        by_store: Dict[StateStore, List[Tensor]] = {}
        for p in self._params:
            if p in self._stores:           # with a process group: this rank's shard only
                by_store.setdefault(self._stores[p], []).append(p)
        fmt = self._moments
        plain = ("max_exp_avg_sq", "master") if fmt.compressed else \
            ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master")
        for store, ps in by_store.items():
            tensors = _export_states(store, [StateKey(self._keys[p], n) for p in ps
                                             for n in plain
                                             if StateKey(self._keys[p], n) in store])
            if fmt.compressed:      # decoded to fp32: torch's format
                tensors.update(export_fp32(store, fmt, [(self._keys[p], tuple(p.shape))
                                                        for p in ps]))
            for p in ps:
                k = self._keys[p]
                if k not in self._steps:
                    continue
                entry: Dict[str, Any] = {"step": torch.tensor(float(self._steps[k]))}
                for n in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master"):
                    t = tensors.get(StateKey(k, n))
                    if t is not None:
                        entry[n] = t
                state[index[p]] = entry
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load torch's format (from ``torch.optim.AdamW``/``Adam`` or from this class).

        Hyperparameters (every key of the saved groups but their parameters: ``lr``,
        ``betas``, ``initial_lr`` of a scheduler...) are restored from the saved groups, as
        torch does; states are written into the store one tensor at a time. State keys are
        torch's indices, or strings naming the parameters (the fully qualified names of
        ``torch.distributed.checkpoint``'s ``get_optimizer_state_dict``, or the names this
        optimizer was given): names that are exactly the optimizer's are matched by name,
        others by position in the groups, as torch does. Groups or parameter counts that
        differ raise :class:`~statestore.CheckpointMismatchError`. Everything is checked first: a state dict
        that fails a check changes nothing (ValueError/TypeError naming the group, parameter
        or state at fault).
        """
        if not isinstance(state_dict, dict) or "state" not in state_dict \
                or "param_groups" not in state_dict:
            raise ValueError("state_dict must be a dict with 'state' and 'param_groups'")
        saved_groups = state_dict["param_groups"]
        states = state_dict["state"]
        if not isinstance(saved_groups, (list, tuple)):
            raise TypeError(f"state_dict['param_groups'] must be a list, got "
                            f"{type(saved_groups).__name__}")
        if not isinstance(states, dict):
            raise TypeError(f"state_dict['state'] must be a dict, got {type(states).__name__}")
        for i, sg in enumerate(saved_groups):
            if not isinstance(sg, dict) or not isinstance(sg.get("params"), (list, tuple)):
                raise ValueError(f"loaded state dict: parameter group {i} must be a dict with "
                                 f"a 'params' list")
        every = [self._keys[p] for p in self._params]
        saved_ids = [sid for sg in saved_groups for sid in sg["params"]]
        report = MismatchReport([str(x) for x in saved_ids], every, len(saved_groups),
                                len(self.param_groups), source="state dict")
        if len(saved_groups) != len(self.param_groups):
            report.add("param groups", f"loaded state dict has {len(saved_groups)} parameter "
                       f"groups, optimizer has {len(self.param_groups)}")
        else:
            for i, (g, sg) in enumerate(zip(self.param_groups, saved_groups)):
                if len(g["params"]) != len(sg["params"]):
                    report.add("param groups", f"loaded state dict contains a parameter group "
                               f"{i} with {len(sg['params'])} parameters, optimizer's has "
                               f"{len(g['params'])}")
        report.raise_if_any()
        id_map = {}
        by_name = {self._keys[p]: p for p in self._params}
        if saved_ids and all(isinstance(x, str) for x in saved_ids) \
                and set(saved_ids) == set(by_name):
            # string keys naming our parameters (DCP's fully qualified names, or our own
            # named_parameters() keys): matched by name, whatever their order
            for g, sg in zip(self.param_groups, saved_groups):
                ours = {self._keys[p] for p in g["params"]}
                if set(sg["params"]) != ours:
                    raise CheckpointMismatchError(
                        f"loaded state dict: parameter group {self.param_groups.index(g)} "
                        f"holds {short_names(sorted(set(sg['params']) - ours))}, which the "
                        f"optimizer has in another group")
            id_map = dict(by_name)
        else:
            for g, sg in zip(self.param_groups, saved_groups):
                for p, sid in zip(g["params"], sg["params"]):
                    id_map[sid] = p
        for sid in states:
            if sid not in id_map:
                raise ValueError(f"loaded state dict has state for unknown parameter {sid!r}")
        # 1. the new hyperparameters of each group (every saved key, as torch's
        # load_state_dict), checked as the constructor checks them
        new_hyper: List[Dict[str, Any]] = []
        for i, (g, sg) in enumerate(zip(self.param_groups, saved_groups)):
            h = saved_group_hyper(sg)
            if "betas" in h and not isinstance(h["betas"], tuple):
                raise ValueError(f"loaded state dict: parameter group {i}: "
                                 f"Invalid betas: {h['betas']!r}")
            merged = {**g, **h}
            _validate_hyper(merged["lr"], merged["betas"], merged["eps"], merged["weight_decay"])
            new_hyper.append(h)
        # 2. every state, checked before anything changes
        new_groups = {p: {**g, **h} for g, h in zip(self.param_groups, new_hyper)
                      for p in g["params"]}
        plan = []
        for sid, st in states.items():
            p = id_map[sid]
            if not self._owns(p):
                continue                    # another rank's shard
            key = self._keys[p]
            if not isinstance(st, dict):
                raise TypeError(f"state of parameter {key!r} must be a dict, got "
                                f"{type(st).__name__}")
            store = self._stores[p]
            names = self._state_names(p, new_groups[p])
            for n in names:
                if n != "master" and n not in st:
                    raise ValueError(f"state of parameter {key!r} lacks {n!r}")
            entries = []
            for n in names:
                src = st.get(n)
                if n == "master" and src is None:
                    src = param_value(p)
                if not isinstance(src, Tensor):
                    raise TypeError(f"state {n!r} of parameter {key!r} must be a tensor, got "
                                    f"{type(src).__name__}")
                if src.layout != torch.strided or src.is_meta or not src.is_floating_point():
                    raise TypeError(f"state {n!r} of parameter {key!r} must be a dense "
                                    f"floating-point tensor with data, got {src.layout} "
                                    f"{src.dtype} on {src.device}")
                if tuple(src.shape) != tuple(p.shape):
                    raise ValueError(f"state {n!r} of parameter {key!r} has shape "
                                     f"{tuple(src.shape)}, parameter has {tuple(p.shape)}")
                entries.append((n, src))
            step = st.get("step", 0)
            if isinstance(step, Tensor) and step.numel() == 1:
                step = step.item()
            if not _is_real(step) or step < 0 or step != int(step):
                raise ValueError(f"state of parameter {key!r}: step must be a non-negative "
                                 f"whole number, got {step!r}")
            plan.append((p, key, store, entries, int(step)))
        # 3. apply
        self._next_plans = {}              # state names may change (amsgrad): plan afresh
        for g, h in zip(self.param_groups, new_hyper):
            g.update(h)
        for p, key, store, entries, step in plan:
            existing = [StateKey(key, n) for n in _STATE_NAMES if StateKey(key, n) in store]
            if existing:
                store.delete(existing)
            fmt = self._moments
            new = []
            for n, src in entries:
                enc = fmt.from_fp32(n, src) \
                    if fmt.compressed and n in SCALE_OF else {n: src.detach().float().cpu()}
                for sn, t in enc.items():
                    shape, dtype = fmt.spec(sn, tuple(p.shape))
                    t = t.reshape(shape)
                    new.append((StateKey(key, sn), shape, dtype,
                                t if store.device.type == "cpu" else t.to(store.device)))
            store.create_many(new)
            self._steps[key] = step

    # ------------------------------------------------------------------ fp32 weights
    def master_weights(self) -> Dict[str, Tensor]:
        """The fp32 weights this optimizer trains, as ``{parameter key: fp32 CPU tensor}``:
        the fp32 ``master`` of each bf16/fp16 parameter (as the store holds it; the
        parameter itself is its rounding) and a copy of each fp32 parameter. Keys are the
        names given through ``named_parameters()`` (else torch's indices), so
        ``model.float().load_state_dict(opt.master_weights(), strict=False)`` gives an fp32
        model. With a ``process_group``: this rank's shard only. Every tensor is in RAM at
        once; :meth:`save_master_weights` streams them to a file instead.

        ``state_dict()`` also carries each master (as ``"master"``), which
        ``torch.optim.AdamW.load_state_dict`` ignores."""
        from ._masters import master_weights
        return master_weights(self)

    def save_master_weights(self, path: str) -> None:
        """Write :meth:`master_weights` to one safetensors file at ``path`` (local or an
        fsspec URL; written under a temporary name, then renamed), streaming a chunk at a
        time through the store's budget: ``safetensors.torch.load_file(path)`` reads it
        back as ``{parameter key: fp32 tensor}``."""
        from ._masters import save_master_weights
        save_master_weights(self, path)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Close the stores this optimizer created itself (never a store passed in)."""
        for s in self._owned_stores:
            s.close()
        self._owned_stores = []
        if self._offload is not None:
            self._offload.after_step()
            self._offload.close()
            self._offload = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self._params)} params, store={self.state_store!r})"


def _failed_message(name: str, cause: str) -> str:
    return (f"{name}: an earlier step() failed part-way ({cause}); parameters and states hold a "
            "mix of two steps. Load the last checkpoint into the store (and the model weights) "
            "and build a new optimizer")


def _export_states(store: StateStore, keys: List[StateKey]) -> Dict[StateKey, Tensor]:
    """Resident stores: views. Others: snapshots of the store's files, mapped (see
    :mod:`statestore._snapshot`)."""
    from .._snapshot import export_states
    return export_states(store, keys)


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

"""``offload_parameters`` and :class:`OffloadHandle`: the mechanics of parameter offload.

Life of a parameter ``p`` (an ``nn.Parameter`` of the model, kept as the same object):

* **In the store.** Its data is the state ``(name, "param")`` of the store (``name``: its
  first name in ``model.named_parameters()``, so tied weights are stored once). While
  released, ``p.data`` is a zero-stride view of one shared element (NaN for floating
  dtypes): shape, dtype and device stay (``p.shape``, ``p.numel()`` and optimizers that
  read them keep working), the memory is gone, and an accidental read gives NaN, an
  in-place write an error.
* **Materialized** while someone holds it: a module's forward (pre-hook to forward hook),
  its backward (from the gradient of one of its outputs, or the unpacking of a tensor saved
  for backward, to its gradient's accumulation, or for frozen parameters to the gradient of
  the module's inputs, at the latest to the end of that backward), or an optimizer's update
  (``update_begin`` / ``update_end`` of :mod:`._seam`, called by statestore's optimizers). A resident
  store on the compute device is aliased (``p.data`` is the store's live tensor, updates go
  straight to the store); otherwise the value is read (disk stores: through the store's
  pipeline) into a tensor of the handle's own, and written back after an optimizer update.
* **Read ahead.** The handle records the order in which modules ask for their parameters in
  one iteration (forward, backward, activation-checkpoint recomputation) and, in the next,
  reads ``prefetch`` modules ahead through one pipeline at a time ("windows" of up to
  ``prefetch`` modules and half the store's budget; the next window starts when the last
  module of the current one is taken). A module asked for out of the recorded order is read
  synchronously and the order is recorded anew.

Tensors that autograd saves for backward and that are views of a materialized parameter
(``F.linear`` saves ``weight.t()``) are replaced by a reference to the parameter while the
root module's forward runs (``torch.autograd.graph`` saved-tensor hooks), so they do not keep
the memory alive; unpacking fetches the parameter again. A parameter used by a module that
does not own it (``x @ self.emb.weight.t()`` in a parent's forward) is fetched on first use
(a ``TorchFunctionMode`` active during the root's forward) and from then on with that module.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Set

import torch
from torch import Tensor, nn

from .._malloc import fix_mmap_threshold
from .._types import Slice, StateKey
from ..errors import (StateKeyError, StateStoreClosedError, StateStoreError,
                      StateStoreValueError)
from ..store import StateStore
from ._device import Mover
from ._hooks import ModuleHooks
from ._readahead import Holds, ReadAhead
from ._seam import (PARAM_STATE, attach, detach, handle_of, is_offloaded, param_value,
                    update_begin, update_end)

__all__ = ["PARAM_STATE", "OffloadHandle", "offload_parameters", "update_begin",
           "update_end", "param_value", "is_offloaded"]

# ---------------------------------------------------------------------------------- handle
class OffloadHandle:
    """Keeps ``model``'s parameters in ``store``; made by :func:`offload_parameters` (its
    arguments are this constructor's). It holds a
    :class:`~statestore.offload._readahead.ReadAhead` (materializing, releasing, reading
    ahead, writing back) and a
    :class:`~statestore.offload._hooks.ModuleHooks` (the model's hooks and who holds each
    parameter), and talks to both through their public methods.

    While open, every parameter of the model is released (``p.data`` a zero-stride
    placeholder of the right shape and dtype) except while a forward, a backward or an
    optimizer update holds it. A context manager: leaving the ``with`` block calls
    :meth:`close`.

    Attributes:
        model: the module.
        store: the store holding the parameters' data, under ``(name, "param")``.
        prefetch: modules read ahead.
        device: the device modules compute on.
        parameters: the offloaded parameters by name (each once, under its first name).

    Raises:
        StateStoreValueError: a bad argument (not a module or a store, ``prefetch`` not an int
            >= 0, an unusable ``device``, a model without parameters, a parameter already
            offloaded by another handle, a complex or sparse parameter, a meta module with
            no ``reset_parameters()`` and no ``init``).
        StateKeyError: the store holds parameter data of some, but not all, of the model's
            parameters (or of other shapes or dtypes).
        StateStoreError: the store is closed.
    """

    def __init__(self, model: nn.Module, store: StateStore, prefetch: int = 2,
                 device=None, init: Optional[Callable[[nn.Module], None]] = None):
        if not isinstance(model, nn.Module):
            raise StateStoreValueError(f"offload_parameters: model must be a torch.nn.Module, "
                                       f"got {type(model).__name__}")
        if not isinstance(store, StateStore):
            raise StateStoreValueError(f"offload_parameters: store must be a "
                                       f"statestore.StateStore, got {type(store).__name__}")
        if store.closed:
            raise StateStoreClosedError(f"offload_parameters: {type(store).__name__} is closed")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise StateStoreValueError(f"offload_parameters: prefetch must be an int >= 0, "
                                       f"got {prefetch!r}")
        if init is not None and not callable(init):
            raise StateStoreValueError("offload_parameters: init must be callable or None")
        named = list(model.named_parameters())
        if not named:
            raise StateStoreValueError("offload_parameters: the model has no parameters")
        for name, p in named:
            if handle_of(p) is not None:
                raise StateStoreValueError(f"offload_parameters: parameter {name!r} is already "
                                           f"offloaded by another handle; close it first")
        devs = {p.device for _, p in named if not p.is_meta}
        if device is None:
            if len(devs) > 1:
                raise StateStoreValueError(f"offload_parameters: parameters on several devices "
                                           f"({sorted(map(str, devs))}); pass device=")
            device = devs.pop() if devs else torch.device("cpu")
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise StateStoreValueError(f"offload_parameters: invalid device {device!r}: {e}") from None
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise StateStoreValueError(f"offload_parameters: device {device} requested but "
                                           "CUDA is not available")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        elif device.type != "cpu":
            raise StateStoreValueError(f"offload_parameters: device must be 'cpu' or a CUDA "
                                       f"device, got {device}")
        self.model = model
        self.store = store
        self.prefetch = prefetch
        self.device = device
        self._closed = False
        # parameters (each once, under its first name) and every name they have
        self._params: List[nn.Parameter] = [p for _, p in named]
        self._name: Dict[Tensor, str] = {p: n for n, p in named}
        self._key: Dict[Tensor, StateKey] = {p: StateKey(n, PARAM_STATE) for n, p in named}
        self._by_key: Dict[StateKey, Tensor] = {k: p for p, k in self._key.items()}
        self._names: Dict[Tensor, List[str]] = {p: [] for p in self._params}
        for n, p in model.named_parameters(remove_duplicate=False):
            self._names[p].append(n)
        for p in self._params:
            if p.dtype.is_complex or p.layout != torch.strided:
                raise StateStoreValueError(f"offload_parameters: parameter {self._name[p]!r} "
                                           f"({p.dtype}, {p.layout}) is not supported")
        # modules that own parameters directly (and the root), in model order
        self._modules: List[nn.Module] = []
        self._mod_params: List[List[Tensor]] = []
        for m in model.modules():
            own = list(dict.fromkeys(p for p in m.parameters(recurse=False)))
            if own or m is model:
                self._modules.append(m)
                self._mod_params.append(own)
        # The objects it holds (the lists and dicts above are shared with them and kept up
        # to date in place): who holds each parameter, the data movement, the model's hooks.
        holds = Holds()
        self._ra = ReadAhead(store, device, prefetch, Mover(device), self._key, self._by_key,
                             self._mod_params, holds)
        self._hooks = ModuleHooks(self, model, self._params, self._names, self._modules,
                                  self._mod_params, self._ra, holds)
        fix_mmap_threshold()         # RSS follows the working set (statestore/_malloc.py)
        self._offload_all(init)
        self._hooks.install()

    # ------------------------------------------------------------------ set-up
    def _offload_all(self, init) -> None:
        store = self.store
        existing = [p for p in self._params if self._key[p] in store]
        if existing:
            bad = [self._name[p] for p in self._params
                   if self._key[p] not in store
                   or store.spec(self._key[p]).shape != tuple(p.shape)
                   or store.spec(self._key[p]).dtype != p.dtype]
            if bad:
                raise StateKeyError(
                    f"offload_parameters: the store holds parameter data of "
                    f"{[self._name[p] for p in existing][:5]} but not (or not of the model's "
                    f"shape and dtype) of {bad[:5]}{'...' if len(bad) > 5 else ''}; give each "
                    f"model a store of its own (or close the earlier handle)")
            # the store holds every parameter (e.g. loaded from a checkpoint that has them):
            # those values are the model's from now on
            for p in self._params:
                attach(p, self)
                self._ra.release_now(p)
            return
        done: Set[Tensor] = set()
        created: List[StateKey] = []
        try:
            for i, m in enumerate(self._modules):
                own = self._mod_params[i]
                todo = [p for p in own if p not in done]
                if not todo:
                    continue
                if any(p.is_meta for p in todo):
                    self._materialize_meta(m, init)
                    for old_p, new_p in zip(own, dict.fromkeys(m.parameters(recurse=False))):
                        if new_p is not old_p:
                            self._replace_param(old_p, new_p)
                    todo = [p for p in dict.fromkeys(m.parameters(recurse=False))
                            if p not in done]
                store.create_many([(self._key[p], tuple(p.shape), p.dtype, p.detach())
                                   for p in todo])
                created += [self._key[p] for p in todo]
                for p in todo:
                    done.add(p)
                    attach(p, self)
                    self._ra.release_now(p)
        except BaseException:
            for p in done:
                try:
                    p.data = store.get(self._key[p]).to(self.device, copy=True)
                except Exception:
                    pass
                detach(p, self)
            self._ra.forget()
            try:
                if created:
                    store.delete(created)
            except Exception:
                pass
            raise
        store.sync()

    def _replace_param(self, old: Tensor, new: Tensor) -> None:
        """``to_empty`` gave a meta parameter a new Parameter object: track that one."""
        self._params[:] = [new if p is old else p for p in self._params]
        for d in (self._name, self._key, self._names):
            d[new] = d.pop(old)
        self._by_key[self._key[new]] = new
        self._mod_params[:] = [[new if p is old else p for p in ps] for ps in self._mod_params]

    def _materialize_meta(self, m: nn.Module, init) -> None:
        """Parameters created on the meta device get memory here, one module at a time."""
        m.to_empty(device="cpu", recurse=False)
        if init is not None:
            with torch.no_grad():
                init(m)
        elif hasattr(m, "reset_parameters"):
            with torch.no_grad():
                m.reset_parameters()
        else:
            raise StateStoreValueError(
                f"offload_parameters: module {type(m).__name__} has parameters on the meta "
                f"device and no reset_parameters(); pass init=callable(module) to fill them")

    # ------------------------------------------------------------------ public
    @property
    def parameters(self) -> Dict[str, Tensor]:
        """The offloaded parameters by name (each once, under its first name)."""
        return {self._name[p]: p for p in self._params}

    def key(self, name: str) -> StateKey:
        """The store key of parameter ``name``."""
        for p in self._params:
            if name in self._names[p]:
                return self._key[p]
        raise StateStoreValueError(f"no offloaded parameter named {name!r}")

    def stats(self) -> Dict[str, Any]:
        """Counters: parameters and bytes offloaded, materialized now, reads (and those made
        synchronously, outside the read-ahead), write-backs."""
        data = self._ra.data
        return {"params": len(self._params),
                "nbytes": sum(p.numel() * p.dtype.itemsize for p in self._params),
                "materialized": len(data),
                "materialized_bytes": sum(t.numel() * t.dtype.itemsize for t in data.values()),
                **self._ra.stats}

    def sync(self) -> None:
        """Write every updated parameter back and wait until the store has it."""
        self._check_open()
        self._ra.suspend()
        self.store.sync()

    # the seam's optimizer side (``_seam.OffloadSeam``; ``update_begin``/``update_end``)
    def value(self, p: Tensor) -> Tensor:
        """``p``'s current value (read from the store if needed, not kept materialized)."""
        return self._ra.value(p)

    def begin_update(self, items) -> None:
        """Materialize the parameters of ``items`` (``(param, start, stop)``) for an
        optimizer's update (:func:`~statestore.offload._seam.update_begin` calls it)."""
        self._hooks.begin_update(items)

    def end_update(self, items) -> None:
        """After the update of ``items``: a parameter whose last range was updated is
        written back to the store and released."""
        self._hooks.end_update(items)

    # the seam's checkpoint side (``_seam.OffloadSeam``; ``_checkpoint.py`` uses these)
    @property
    def in_model_pass(self) -> bool:
        """True during the model's forward or backward."""
        return self._hooks.in_model_pass

    def release_all(self) -> None:
        """Release every materialized parameter (its value stays in the store).

        Raises:
            StateStoreError: a forward, backward or optimizer update holds one.
        """
        ra = self._ra
        ra.suspend()
        for p in list(ra.data):
            if ra.holds.held(p):
                raise StateStoreError("offload handle: parameters are in use")
            ra.release_now(p)

    def chunks(self, p: Tensor):
        """``p``'s value, flattened, piece by piece (at most the store's unit size each,
        through its pipeline for streaming stores); each piece is valid until the next."""
        if p in self._ra.data:
            yield self._ra.data[p].reshape(-1)
            return
        if self.store.resident:
            yield self.store.get(self._key[p]).reshape(-1)
            return
        slices = self._ra.slices_of(p)
        with self.store.pipeline([[s] for s in slices], mode="r") as pipe:
            for (t,) in pipe:
                yield t

    def slices(self, p: Tensor) -> List[Slice]:
        """The store slices holding ``p``'s data, in order (each at most a unit)."""
        return list(self._ra.slices_of(p))

    def names(self, p: Tensor) -> List[str]:
        """Every name of ``p`` in the model (tied weights have several), its first first."""
        return list(self._names[p])

    def state_dict(self) -> Dict[str, Tensor]:
        """The model's state_dict with every parameter's value (read from the store, copies):
        the whole model in memory at once, as ``model.state_dict()`` would be."""
        self._check_open()
        self._ra.suspend()
        out = {}
        for name, t in self.model.state_dict(keep_vars=True).items():
            if isinstance(t, nn.Parameter) and handle_of(t) is self:
                v = self.value(t)
                live = self._ra.alias or v is self._ra.data.get(t)
                out[name] = v.detach().clone() if live else v.detach()
            else:
                out[name] = t.detach()
        return out

    def save_checkpoint(self, path: str, optimizer_store: Optional[StateStore] = None,
                        **kwargs) -> None:
        """One checkpoint of the parameters and the optimizer's states: ``path`` is
        ``optimizer_store``'s checkpoint (as ``optimizer_store.save_checkpoint(path)``
        writes it) plus ``model.safetensors``, a stock safetensors file of the model's
        state_dict under its own names. See :mod:`statestore.offload._checkpoint`.

        Args:
            path: a local directory or an fsspec URL.
            optimizer_store: the optimizer's store (None: the parameters alone).
            **kwargs: for ``optimizer_store.save_checkpoint`` (``shard_bytes``,
                ``progress``, ``link``); not ``metadata``.

        Raises:
            StateStoreError: called during the model's forward or backward, or the handle
                is closed.
            StateStoreValueError: ``optimizer_store`` is not a store, or ``metadata`` given.
            StateStoreIOError: writing failed; the previous checkpoint at ``path`` is kept.
        """
        self._check_open()
        from ._checkpoint import save_checkpoint
        save_checkpoint(self, path, optimizer_store, **kwargs)

    def load_checkpoint(self, path: str, optimizer_store: Optional[StateStore] = None) -> None:
        """Load the parameters of a checkpoint written by :meth:`save_checkpoint` (and,
        given ``optimizer_store``, its optimizer states into that store: build the
        optimizer after this call, as after ``store.load_checkpoint``).

        Raises:
            CheckpointError: ``path`` holds no model parameters.
            CheckpointCorruptError: the model file, or one of its tensors, is missing,
                damaged (checksum) or of another shape or dtype (nothing is changed).
            StateStoreError: called during the model's forward or backward, a parameter is
                in use, or the handle is closed.
        """
        self._check_open()
        from ._checkpoint import load_checkpoint
        load_checkpoint(self, path, optimizer_store)

    def _check_open(self) -> None:
        if self._closed:
            raise StateStoreError("the offload handle is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Put every parameter back in memory (on the compute device), remove the hooks and
        the parameters' data from the store. Idempotent.

        Raises:
            StateStoreError: called during the model's forward or backward.
        """
        if self._closed:
            return
        if self._hooks.in_model_pass:
            raise StateStoreError("offload handle: close() called during the model's forward "
                                  "or backward")
        self._hooks.stop()
        ra = self._ra
        err = None
        try:
            ra.stop()
            for p in self._params:
                if p in ra.data and not ra.alias:
                    value = ra.data[p]
                else:
                    value = ra.mover.to_device(self.store.get(self._key[p]),
                                               owned=not self.store.resident)
                ra.set_data(p, value)
        except BaseException as e:
            err = e
        self._hooks.remove()
        for p in self._params:
            detach(p, self)
        ra.forget()
        self._closed = True
        if err is not None:
            raise err
        if not self.store.closed:
            self.store.delete(list(self._key.values()))

    def __enter__(self) -> "OffloadHandle":
        self._check_open()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def __repr__(self) -> str:
        st = "closed" if self._closed else f"{len(self._params)} params"
        return f"OffloadHandle({st}, store={type(self.store).__name__}, prefetch={self.prefetch})"


def offload_parameters(model: nn.Module, store: StateStore, prefetch: int = 2, *,
                       device=None, init: Optional[Callable[[nn.Module], None]] = None
                       ) -> OffloadHandle:
    """Keep every parameter of ``model`` in ``store`` and fetch each module's parameters
    around its forward and backward; returns the :class:`OffloadHandle` (a context manager:
    ``close()`` puts the parameters back in memory).

    Args:
        model: the module; its parameters stay the same ``nn.Parameter`` objects.
        store: any :class:`~statestore.StateStore` holding no parameter data yet; use a store
            of its own, not the optimizer's (``docs/offload.md``).
        prefetch: modules read ahead through the store's pipeline (disk stores; resident
            stores are read in place).
        device: where modules compute (default: the parameters' device; ``"cuda"``: data is
            copied from pinned host memory on a side stream).
        init: fills parameters created on the ``meta`` device, one module at a time
            (default: the module's ``reset_parameters()``), so a model larger than RAM can
            be built straight into the store.

    Returns:
        The open :class:`OffloadHandle`. The model's parameters are in ``store`` when it
        returns; a store that already held every parameter (loaded from a checkpoint that
        has them) gives its values to the model instead.

    Raises:
        StateStoreValueError: a bad argument (see :class:`OffloadHandle`).
        StateKeyError: the store holds data of only some of the model's parameters.
        StateStoreIOError: writing the parameters into the store failed (the parameters
            are then put back in memory and nothing is left in the store).
    """
    return OffloadHandle(model, store, prefetch=prefetch, device=device, init=init)

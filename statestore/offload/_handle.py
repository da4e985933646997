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
  (:func:`update_begin` / :func:`update_end`, called by statestore's optimizers). A resident
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

import os
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .._types import Slice, StateKey
from ..errors import StateKeyError, StateStoreError, StateStoreValueError
from ..store import StateStore

__all__ = ["PARAM_STATE", "OffloadHandle", "offload_parameters", "update_begin",
           "update_end", "param_value", "is_offloaded"]

#: State name under which a parameter's data is kept in the store: ``(name, "param")``.
PARAM_STATE = "param"
_ATTR = "_statestore_offload"          # set on every offloaded Parameter: its handle


_MALLOC_FIXED = False


def _fix_malloc_threshold() -> None:
    """glibc raises its mmap threshold to the size of every large block freed (up to 32
    MiB), after which parameter buffers of that size come from the heap, where freed ones
    stay resident: measured on a 24-layer model of 4 MiB layers, RSS grew by ~60 MiB over
    the working set. A fixed threshold (1 MiB) gives each large buffer back to the system
    when freed. Process-wide, once; ``STATESTORE_MALLOPT=0`` leaves malloc alone."""
    global _MALLOC_FIXED
    if _MALLOC_FIXED or os.environ.get("STATESTORE_MALLOPT", "1") == "0":
        return
    _MALLOC_FIXED = True
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 1 << 20)       # M_MMAP_THRESHOLD
    except (OSError, AttributeError):   # not glibc
        pass


def _task() -> int:
    """Id of the autograd graph task running now (-1 outside backward)."""
    return torch._C._current_graph_task_id()


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


# ---------------------------------------------------------------------------------- optimizer
# The few calls statestore's optimizers make (statestore/optim/adam.py): a parameter is
# materialized around its update and written back after its last slice.

def is_offloaded(p: Tensor) -> bool:
    """True when ``p`` is a parameter of an open :class:`OffloadHandle`."""
    return getattr(p, _ATTR, None) is not None


def param_value(p: Tensor) -> Tensor:
    """``p``'s current value as a tensor (``p.detach()`` when it is not offloaded; for an
    offloaded parameter the stored value, read if needed, without keeping it materialized)."""
    h = getattr(p, _ATTR, None)
    if h is None:
        return p.detach()
    return h._value(p)


def update_begin(entries) -> Optional[list]:
    """Before an optimizer updates ``entries`` (``(param, start, stop, ...)`` tuples, one
    pipeline unit): materialize the offloaded ones. Returns a token for :func:`update_end`
    (None when none is offloaded)."""
    by_handle: Optional[Dict[Any, list]] = None
    for e in entries:
        h = getattr(e[0], _ATTR, None)
        if h is not None:
            if by_handle is None:
                by_handle = {}
            by_handle.setdefault(h, []).append((e[0], e[1], e[2]))
    if by_handle is None:
        return None
    token = list(by_handle.items())
    for h, items in token:
        h._opt_acquire(items)
    return token


def update_end(token: Optional[list]) -> None:
    """After the update of :func:`update_begin`'s entries: a parameter whose last slice was
    updated is written back to its store and released."""
    if token is None:
        return
    for h, items in token:
        h._opt_done(items)


# ---------------------------------------------------------------------------------- helpers
class _Saved:
    """What a saved-for-backward view of a parameter is packed into."""

    __slots__ = ("p", "offset", "size", "stride")

    def __init__(self, p, offset, size, stride):
        self.p, self.offset, self.size, self.stride = p, offset, size, stride


def _metadata_functions() -> frozenset:
    T = Tensor
    out = {T.size, T.dim, T.numel, T.stride, T.is_contiguous, T.element_size,
           T.is_floating_point, T.register_hook, T.requires_grad_, T.__len__,
           T.register_post_accumulate_grad_hook, T.data_ptr}
    for name in ("shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "ndim",
                 "layout", "is_cuda", "is_meta", "grad_fn", "names", "_version"):
        attr = getattr(T, name, None)
        for acc in ("__get__", "__set__"):
            f = getattr(attr, acc, None)
            if f is not None:
                out.add(f)
    data = getattr(T, "data", None)
    if data is not None and hasattr(data, "__set__"):
        out.add(data.__set__)
    return frozenset(out)


#: Tensor functions that read no data: a released parameter passed to them is not fetched.
_METADATA = _metadata_functions()


class _FetchMode(TorchFunctionMode):
    """Active during the root module's forward: fetches a released offloaded parameter that
    a torch function is about to read (a module using a parameter it does not own)."""

    def __init__(self, handle: "OffloadHandle"):
        super().__init__()
        self.h = handle

    def __torch_function__(self, func, types, args=(), kwargs=None):
        h = self.h
        if h._released and not h._busy and func not in _METADATA:
            for a in args:
                if isinstance(a, Tensor):
                    if a in h._released:
                        h._fallback_forward(a)
                elif isinstance(a, (list, tuple)):
                    for b in a:
                        if isinstance(b, Tensor) and b in h._released:
                            h._fallback_forward(b)
            if kwargs:
                for a in kwargs.values():
                    if isinstance(a, Tensor) and a in h._released:
                        h._fallback_forward(a)
        return func(*args, **(kwargs or {}))


class _Window:
    __slots__ = ("pipe", "start", "events")

    def __init__(self, pipe, start: int, events: list):
        self.pipe, self.start, self.events = pipe, start, events


class _Run:
    """One iteration (the root's forward to the end of the backward that follows)."""

    __slots__ = ("grad", "plan", "pos", "record", "diverged", "window")

    def __init__(self, grad: bool, plan: Optional[List[int]]):
        self.grad = grad
        self.plan = plan
        self.pos = 0
        self.record: List[int] = []
        self.diverged = plan is None
        self.window: Optional[_Window] = None


class _Mover:
    """Copies between the store's memory and the compute device. CUDA: host tensors are
    staged in pinned memory and copied on a side stream the compute stream waits for."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._inflight: list = []

    def host_buffer(self, numel: int, dtype: torch.dtype) -> Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=self.cuda)

    def to_device(self, src: Tensor, owned: bool) -> Tensor:
        """``src`` on the compute device; a copy unless ``owned`` and already there."""
        if src.device == self.device:
            return src if owned else src.clone()
        if not self.cuda or src.device.type != "cpu":
            return src.to(self.device, copy=True)
        if not src.is_pinned():
            src = src.pin_memory()
        cur = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(cur)
        with torch.cuda.stream(self.stream):
            dst = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        cur.wait_event(ev)
        dst.record_stream(cur)
        self._inflight.append((ev, src))            # the pinned source lives until copied
        self._inflight = [(e, s) for e, s in self._inflight if not e.query()]
        return dst

    def to_host(self, t: Tensor) -> Tensor:
        return t if t.device.type == "cpu" else t.to("cpu")


def _tensors_in(obj, depth: int = 0):
    if isinstance(obj, Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors_in(o, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors_in(o, depth + 1)


# ---------------------------------------------------------------------------------- handle
class OffloadHandle:
    """Keeps ``model``'s parameters in ``store``; see :func:`offload_parameters`."""

    def __init__(self, model: nn.Module, store: StateStore, prefetch: int = 2,
                 device=None, init: Optional[Callable[[nn.Module], None]] = None):
        if not isinstance(model, nn.Module):
            raise StateStoreValueError(f"offload_parameters: model must be a torch.nn.Module, "
                                       f"got {type(model).__name__}")
        if not isinstance(store, StateStore):
            raise StateStoreValueError(f"offload_parameters: store must be a "
                                       f"statestore.StateStore, got {type(store).__name__}")
        store._check_open()
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise StateStoreValueError(f"offload_parameters: prefetch must be an int >= 0, "
                                       f"got {prefetch!r}")
        if init is not None and not callable(init):
            raise StateStoreValueError("offload_parameters: init must be callable or None")
        named = list(model.named_parameters())
        if not named:
            raise StateStoreValueError("offload_parameters: the model has no parameters")
        for name, p in named:
            if getattr(p, _ATTR, None) is not None:
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
        self._mover = _Mover(device)
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
        self._alias = store.resident and store.device == device
        self._io = not store.resident
        # runtime state of each parameter
        self._data: Dict[Tensor, Tensor] = {}       # materialized: p -> its data
        self._released: Set[Tensor] = set()
        self._fwd: Dict[Tensor, int] = {}
        self._bw: Dict[Tensor, Set[int]] = {}
        self._opt: Set[Tensor] = set()
        self._uib: Set[Tensor] = set()          # parameters an optimizer updates in backward
        self._opt_wait: Set[Tensor] = set()     # ... kept from their gradient to their update
        self._applied: Set[Tensor] = set()      # ... updated before their accumulation hook
        self._dirty: Dict[Tensor, Tensor] = {}      # updated values not yet written back
        self._to_release: List[Tensor] = []
        self._placeholders: Dict[Tuple[torch.dtype, torch.device], Tensor] = {}
        self._slices: Dict[Tensor, List[Slice]] = {}
        self._busy = 0
        # iterations and their recorded order of module requests (by grad mode)
        self._plans: Dict[bool, List[int]] = {}
        self._run: Optional[_Run] = None
        self._next_run: Optional[_Run] = None
        self._stack: List[Tuple[int, bool]] = []
        self._outer_task: Optional[int] = None
        self._tasks: Set[int] = set()
        self._root_ctx: List[Any] = []
        self._hooks: list = []
        self._foreign: Dict[int, List[Tensor]] = {}
        self._stats = {"reads": 0, "read_bytes": 0, "writes": 0, "sync_reads": 0}
        _fix_malloc_threshold()
        self._offload_all(init)
        self._install_hooks()

    # ------------------------------------------------------------------ set-up
    def _placeholder(self, p: Tensor) -> Tensor:
        if p.numel() == 0:
            return torch.empty(p.shape, dtype=p.dtype, device=self.device)
        k = (p.dtype, self.device)
        base = self._placeholders.get(k)
        if base is None:
            fill = float("nan") if p.dtype.is_floating_point else 0
            base = torch.full((1,), fill, dtype=p.dtype, device=self.device)
            self._placeholders[k] = base
        return base.view(()).expand(p.shape)

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
                setattr(p, _ATTR, self)
                self._release_now(p)
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
                    setattr(p, _ATTR, self)
                    self._release_now(p)
        except BaseException:
            for p in done:
                try:
                    p.data = store.get(self._key[p]).to(self.device, copy=True)
                except Exception:
                    pass
                if getattr(p, _ATTR, None) is self:
                    delattr(p, _ATTR)
            self._released.clear()
            try:
                if created:
                    store.delete(created)
            except Exception:
                pass
            raise
        store.sync()

    def _replace_param(self, old: Tensor, new: Tensor) -> None:
        """``to_empty`` gave a meta parameter a new Parameter object: track that one."""
        self._params = [new if p is old else p for p in self._params]
        for d in (self._name, self._key, self._names):
            d[new] = d.pop(old)
        self._by_key[self._key[new]] = new
        self._mod_params = [[new if p is old else p for p in ps] for ps in self._mod_params]

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

    def _install_hooks(self) -> None:
        for idx, m in enumerate(self._modules):
            self._hooks.append(m.register_forward_pre_hook(self._make_pre(idx)))
            self._hooks.append(m.register_forward_hook(self._make_post(idx), always_call=True))
        for p in self._params:
            if p.requires_grad:
                self._hooks.append(p.register_hook(self._make_pre_acc(p)))
                self._hooks.append(p.register_post_accumulate_grad_hook(self._post_acc))
        self._hooks.append(self.model._register_state_dict_hook(self._state_dict_hook))
        self._hooks.append(self.model.register_load_state_dict_pre_hook(self._load_pre_hook))
        self._hooks.append(self.model.register_load_state_dict_post_hook(self._load_post_hook))
        from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                           register_optimizer_step_pre_hook)
        self._hooks.append(register_optimizer_step_pre_hook(self._before_step))
        self._hooks.append(register_optimizer_step_post_hook(self._after_step))

    # ------------------------------------------------------------------ materialize / release
    def _set(self, p: Tensor, t: Tensor) -> None:
        self._busy += 1
        try:
            p.data = t
        finally:
            self._busy -= 1
        self._data[p] = t
        self._released.discard(p)

    def _release_now(self, p: Tensor) -> None:
        self._busy += 1
        try:
            p.data = self._placeholder(p)
        finally:
            self._busy -= 1
        self._data.pop(p, None)
        if p.numel():
            self._released.add(p)

    def _held(self, p: Tensor) -> bool:
        return self._fwd.get(p, 0) > 0 or bool(self._bw.get(p)) or p in self._opt

    def _maybe_release(self, p: Tensor) -> None:
        if p in self._data and not self._held(p):
            self._release_now(p)

    def _flush_releases(self) -> None:
        todo, self._to_release = self._to_release, []
        for p in todo:
            self._maybe_release(p)

    def _slices_of(self, p: Tensor) -> List[Slice]:
        s = self._slices.get(p)
        if s is None:
            n, size = p.numel(), p.dtype.itemsize
            limit = self.store.unit_bytes or max(n * size, 1)
            align = max(1, self.store.cut_alignment(limit) // size)
            step = max(align, (limit // size) // align * align)
            k = self._key[p]
            s = [Slice(k, a, min(a + step, n)) for a in range(0, n, step)]
            self._slices[p] = s
        return s

    def _units_of(self, ps: Sequence[Tensor]) -> List[List[Slice]]:
        """Pipeline units over the parameters ``ps``: slices packed up to the store's unit size."""
        limit = self.store.unit_bytes
        align = self.store.alignment
        units: List[List[Slice]] = []
        cur: List[Slice] = []
        cur_b = 0
        for p in dict.fromkeys(ps):
            size = p.dtype.itemsize
            for s in self._slices_of(p):
                nb = _round_up(max(s.numel * size, 1), align)
                if cur and limit is not None and cur_b + nb > limit:
                    units.append(cur)
                    cur, cur_b = [], 0
                cur.append(s)
                cur_b += nb
        if cur:
            units.append(cur)
        return units

    def _fetch(self, ps: Sequence[Tensor]) -> None:
        """Materialize ``ps`` now (synchronously); read-ahead in flight is dropped."""
        need = [p for p in dict.fromkeys(ps) if p not in self._data]
        if not need:
            return
        store = self.store
        if self._alias:
            for p in need:
                self._set(p, store.get(self._key[p]))
            return
        if store.resident:
            for p in need:
                self._set(p, self._mover.to_device(store.get(self._key[p]), owned=False))
            return
        rest = []
        for p in need:
            if p in self._dirty:
                self._set(p, self._dirty[p])
            elif p.numel() == 0:
                self._set(p, torch.empty(p.shape, dtype=p.dtype, device=self.device))
            else:
                rest.append(p)
        if not rest:
            return
        self._suspend()
        self._stats["sync_reads"] += 1
        dest = {p: self._mover.host_buffer(p.numel(), p.dtype) for p in rest}
        units = self._units_of(rest)
        with store.pipeline(units, mode="r", wait=False) as pipe:
            for unit, tensors in zip(units, pipe):
                for s, t in zip(unit, tensors):
                    dest[self._by_key[s.key]][s.start:s.stop].copy_(t)
        for p in rest:
            self._count_read(p)
            self._set(p, self._mover.to_device(dest[p].view(p.shape), owned=True))

    def _count_read(self, p: Tensor) -> None:
        self._stats["reads"] += 1
        self._stats["read_bytes"] += p.numel() * p.dtype.itemsize

    def _value(self, p: Tensor) -> Tensor:
        if p in self._data:
            return self._data[p]
        self._fetch([p])
        t = self._data[p]
        self._maybe_release(p)
        return t

    # ------------------------------------------------------------------ read-ahead windows
    def _open_window(self, run: _Run, start: int) -> None:
        events = []
        total = 0
        limit = max(1, self.prefetch)
        budget = self.store.budget_bytes // 2
        for i in range(start, len(run.plan)):
            ps = self._mod_params[run.plan[i]]
            units = self._units_of(ps)
            nb = sum(_round_up(max(s.numel * self.store.spec(s.key).itemsize, 1),
                               self.store.alignment) for u in units for s in u)
            if events and (len(events) >= limit or total + nb > budget):
                break
            events.append((run.plan[i], units, list(ps)))
            total += nb
        flat = [u for _, us, _ in events for u in us]
        pipe = self.store.pipeline(flat, mode="r", wait=False) if flat else None
        run.window = _Window(pipe, start, events)

    def _close_window(self, run: Optional[_Run]) -> None:
        if run is None or run.window is None:
            return
        w, run.window = run.window, None
        if w.pipe is not None:
            w.pipe.close()

    def _suspend(self) -> None:
        """Before any other use of the store: close the read-ahead pipelines (reads in flight
        are drained, their data dropped) and write the updated parameters back."""
        self._close_window(self._run)
        self._close_window(self._next_run)
        self._next_run = None
        self._flush_dirty()

    def _flush_dirty(self) -> None:
        todo, self._dirty = self._dirty, {}
        for p, t in todo.items():
            self.store.put(self._key[p], self._mover.to_host(t))
            self._stats["writes"] += 1

    def _take_planned(self, run: _Run) -> None:
        w = run.window
        if w is None or not (w.start <= run.pos < w.start + len(w.events)):
            self._close_window(run)
            self._open_window(run, run.pos)
            w = run.window
        _, units, ps = w.events[run.pos - w.start]
        dest: Dict[Tensor, Tensor] = {}
        for p in ps:
            if p not in self._data and p not in self._dirty and p.numel():
                dest[p] = self._mover.host_buffer(p.numel(), p.dtype)
        for unit in units:
            tensors = next(w.pipe)
            for s, t in zip(unit, tensors):
                d = dest.get(self._by_key[s.key])
                if d is not None:
                    d[s.start:s.stop].copy_(t)
        for p in ps:
            if p in self._data:
                continue
            if p in self._dirty:
                self._set(p, self._dirty[p])
            elif p.numel() == 0:
                self._set(p, torch.empty(p.shape, dtype=p.dtype, device=self.device))
            else:
                self._count_read(p)
                self._set(p, self._mover.to_device(dest[p].view(p.shape), owned=True))
        run.pos += 1
        if run.pos == w.start + len(w.events):
            self._close_window(run)
            self._flush_dirty()
            if run.pos < len(run.plan) and self.prefetch > 0:
                self._open_window(run, run.pos)

    def _event(self, idx: int) -> None:
        """Module ``idx`` asks for its parameters (holds are added by the caller)."""
        self._flush_releases()
        run = self._run
        if run is not None:
            run.record.append(idx)
        ps = self._mod_params[idx]
        if not self._io:
            self._fetch(ps)
            return
        if run is not None and not run.diverged:
            if run.pos < len(run.plan) and run.plan[run.pos] == idx:
                self._take_planned(run)
                return
            run.diverged = True
            self._close_window(run)
        self._fetch(ps)

    # ------------------------------------------------------------------ iterations
    def _begin_iteration(self) -> None:
        if self._run is not None:
            self._end_iteration()
        self._applied.clear()
        for p in self._opt_wait:            # step() was not called: nothing will update them
            self._opt.discard(p)
            self._to_release.append(p)
        self._opt_wait.clear()
        if self._tasks or self._outer_task is not None:
            # a backward that raised never reached its end callbacks: no backward runs now
            self._tasks.clear()
            self._outer_task = None
            for p, tasks in self._bw.items():
                if tasks:
                    tasks.clear()
                    self._to_release.append(p)
            self._flush_releases()
        grad = torch.is_grad_enabled()
        nxt, self._next_run = self._next_run, None
        if nxt is not None and nxt.grad == grad and nxt.plan is self._plans.get(grad):
            self._run = nxt
        else:
            self._close_window(nxt)
            self._run = _Run(grad, self._plans.get(grad))

    def _end_iteration(self) -> None:
        run, self._run = self._run, None
        if run is None:
            return
        self._close_window(run)
        if self._io:
            self._flush_dirty()
        if run.record:
            self._plans[run.grad] = run.record

    def _note_task(self) -> int:
        task = _task()
        if task >= 0 and task not in self._tasks:
            self._tasks.add(task)
            if self._outer_task is None:
                self._outer_task = task
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: self._task_end(task))
        return task

    def _task_end(self, task: int) -> None:
        self._tasks.discard(task)
        for p, tasks in self._bw.items():
            if task in tasks:
                tasks.discard(task)
                self._to_release.append(p)
        self._flush_releases()
        if task == self._outer_task:
            self._outer_task = None
            self._end_iteration()

    # ------------------------------------------------------------------ hooks
    def _make_pre(self, idx: int):
        def pre(module, args):
            self._busy += 1
            try:
                self._pre(idx, args)
            finally:
                self._busy -= 1
        return pre

    def _pre(self, idx: int, args) -> None:
        if True:
            root = idx == 0
            pushed = False
            if root and _task() < 0:
                self._begin_iteration()
                torch._C._autograd._push_saved_tensors_default_hooks(self._pack, self._unpack)
                mode = _FetchMode(self)
                mode.__enter__()
                self._root_ctx.append(mode)
                pushed = True
            self._stack.append((idx, pushed))
            self._event(idx)
            for p in self._mod_params[idx]:
                self._fwd[p] = self._fwd.get(p, 0) + 1
            if torch.is_grad_enabled() and any(not p.requires_grad for p in self._mod_params[idx]):
                hooked = False
                for x in _tensors_in(args):
                    if x.requires_grad:
                        x.register_hook(lambda g, i=idx: self._inputs_done(i))
                        hooked = True
                if not hooked:
                    pass   # frozen parameters then serve no backward of this module

    def _make_post(self, idx: int):
        def post(module, args, output):
            self._busy += 1
            try:
                self._post(idx, output)
            finally:
                self._busy -= 1
        return post

    def _post(self, idx: int, output) -> None:
        if True:
            if not self._stack or self._stack[-1][0] != idx:
                return          # the pre-hook did not run (it raised before its push)
            _, pushed = self._stack.pop()
            for p in self._mod_params[idx]:
                n = self._fwd.get(p, 0) - 1
                if n <= 0:
                    self._fwd.pop(p, None)
                    self._maybe_release(p)
                else:
                    self._fwd[p] = n
            if pushed:
                mode = self._root_ctx.pop()
                mode.__exit__(None, None, None)
                torch._C._autograd._pop_saved_tensors_default_hooks()
            if output is not None and torch.is_grad_enabled():
                for y in _tensors_in(output):
                    if y.requires_grad and y.grad_fn is not None:
                        y.register_hook(lambda g, i=idx: self._backward_event(i))

    def _backward_event(self, idx: int) -> None:
        task = self._note_task()
        self._event(idx)
        for p in self._mod_params[idx]:
            self._bw.setdefault(p, set()).add(task)

    def _inputs_done(self, idx: int) -> None:
        task = _task()
        for p in self._mod_params[idx]:
            if not p.requires_grad and task in self._bw.get(p, ()):
                self._bw[p].discard(task)
                self._to_release.append(p)

    def _make_pre_acc(self, p: Tensor):
        ref = weakref.ref(p)

        def pre_acc(grad):
            q = ref()
            if q is not None and q not in self._data:
                # backward reached the parameter without one of its modules asking for it:
                # accumulating into a released parameter would give its gradient its layout
                task = self._note_task()
                self._fetch([q])
                self._bw.setdefault(q, set()).add(task)
            return None
        return pre_acc

    def _post_acc(self, p: Tensor) -> None:
        task = _task()
        tasks = self._bw.get(p)
        if tasks and task in tasks:
            tasks.discard(task)
        if p in self._applied:              # its update came first (the optimizer's hook ran
            self._applied.discard(p)        # before this one)
        elif p in self._uib:
            # an optimizer updates it during backward, maybe only once its states arrive:
            # keep it until then rather than read it again (released by _opt_done)
            self._opt.add(p)
            self._opt_wait.add(p)
        self._to_release.append(p)

    def _fallback_forward(self, p: Tensor) -> None:
        """A torch function reads released parameter ``p`` in the root's forward: fetch it
        and from now on with the innermost running module."""
        self._busy += 1
        try:
            idx = self._stack[-1][0] if self._stack else 0
            if not any(q is p for q in self._mod_params[idx]):
                self._mod_params[idx] = self._mod_params[idx] + [p]
                self._plans.clear()
                if self._run is not None:
                    self._run.diverged = True
                    self._close_window(self._run)
            self._fetch([p])
            self._fwd[p] = self._fwd.get(p, 0) + 1
        finally:
            self._busy -= 1

    def _pack(self, t: Tensor):
        if not self._data or t.device != self.device or t.layout != torch.strided:
            return t
        ptr = t.data_ptr()
        if ptr == 0:
            return t
        for p, d in self._data.items():
            if d.dtype != t.dtype:
                continue
            base = d.data_ptr()
            size = d.dtype.itemsize
            if base <= ptr < base + d.numel() * size:
                extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
                off = (ptr - base) // size
                if t.numel() and off + extent <= d.numel():
                    return _Saved(p, off, tuple(t.shape), tuple(t.stride()))
        return t

    def _unpack(self, x):
        if not isinstance(x, _Saved):
            return x
        p = x.p
        if p not in self._data:
            task = self._note_task()
            self._fetch([p])
            self._bw.setdefault(p, set()).add(task)
        d = self._data[p]
        return d.as_strided(x.size, x.stride, d.storage_offset() + x.offset)

    # ------------------------------------------------------------------ optimizers
    def _opt_acquire(self, items) -> None:
        ps = [p for p, _, _ in items]
        if _task() >= 0:
            self._uib.update(ps)            # updated during backward (update_in_backward)
        self._fetch(ps)
        self._opt.update(ps)

    def _opt_done(self, items) -> None:
        for p, a, b in items:
            if b >= p.numel():
                self._write_back(p)
                self._opt.discard(p)
                if p in self._opt_wait:
                    self._opt_wait.discard(p)
                elif _task() >= 0:
                    self._applied.add(p)
                self._maybe_release(p)

    def _write_back(self, p: Tensor) -> None:
        if self._alias or p not in self._data:
            return
        t = self._data[p]
        if self.store.resident:
            self.store.put(self._key[p], t)
            return
        self._dirty[p] = t
        run = self._run
        if run is None or run.window is None:
            self._flush_dirty()

    def _ours(self, optimizer) -> List[Tensor]:
        return [p for g in optimizer.param_groups for p in g["params"]
                if getattr(p, _ATTR, None) is self]

    def _before_step(self, optimizer, args, kwargs) -> None:
        from ..optim.adam import _StoreAdam
        if isinstance(optimizer, _StoreAdam):
            if self._io and getattr(optimizer, "state_store", None) is self.store \
                    and self._ours(optimizer):
                raise StateStoreValueError(
                    f"{type(optimizer).__name__}: its state_store is the store the parameters "
                    f"are offloaded to; give the parameters a store of their own (two "
                    f"pipelines at once on one disk store could wait on each other)")
            return      # updates parameters a unit at a time through update_begin/update_end
        ps = self._ours(optimizer)
        if ps:          # another optimizer reads every parameter: materialize them all
            self._fetch(ps)
            self._opt.update(ps)
            self._foreign[id(optimizer)] = ps

    def _after_step(self, optimizer, args, kwargs) -> None:
        ps = self._foreign.pop(id(optimizer), None)
        if ps:
            for p in ps:
                self._write_back(p)
                self._opt.discard(p)
                self._maybe_release(p)
        if not self._io or self._run is not None or self._next_run is not None:
            return
        plan = self._plans.get(True)
        if plan and self.prefetch > 0 and (ps or self._ours(optimizer)):
            # the next iteration's first modules are read while the caller zeroes
            # gradients and loads the next batch
            self._flush_dirty()
            run = _Run(True, plan)
            self._open_window(run, 0)
            self._next_run = run

    # ------------------------------------------------------------------ model.state_dict()
    def _state_dict_hook(self, module, state_dict, prefix, local_metadata) -> None:
        """``model.state_dict()`` gives the stored values (``keep_vars=True``: the
        parameters themselves, as torch)."""
        for p in self._params:
            for n in self._names[p]:
                k = prefix + n
                v = state_dict.get(k)
                if v is not None and not isinstance(v, nn.Parameter):
                    state_dict[k] = self._value(p).detach()

    def _load_pre_hook(self, module, state_dict, prefix, *args) -> None:
        """``model.load_state_dict()``: every parameter materialized for torch to copy into,
        written back by :meth:`_load_post_hook`."""
        self._suspend()
        self._fetch(self._params)
        self._opt.update(self._params)
        self._loading = True

    def _load_post_hook(self, module, incompatible_keys) -> None:
        if not getattr(self, "_loading", False):
            return
        self._loading = False
        for p in self._params:
            if self._alias or p not in self._data:
                pass
            elif self.store.resident:
                self.store.put(self._key[p], self._data[p])
            else:
                self._dirty[p] = self._data[p]
            self._opt.discard(p)
            self._maybe_release(p)
        self._flush_dirty()

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
        return {"params": len(self._params),
                "nbytes": sum(p.numel() * p.dtype.itemsize for p in self._params),
                "materialized": len(self._data),
                "materialized_bytes": sum(t.numel() * t.dtype.itemsize
                                          for t in self._data.values()),
                **self._stats}

    def sync(self) -> None:
        """Write every updated parameter back and wait until the store has it."""
        self._check_open()
        self._suspend()
        self.store.sync()

    def state_dict(self) -> Dict[str, Tensor]:
        """The model's state_dict with every parameter's value (read from the store, copies):
        the whole model in memory at once, as ``model.state_dict()`` would be."""
        self._check_open()
        self._suspend()
        out = {}
        for name, t in self.model.state_dict(keep_vars=True).items():
            h = getattr(t, _ATTR, None) if isinstance(t, nn.Parameter) else None
            if h is self:
                v = self._value(t)
                out[name] = v.detach().clone() if (self._alias or v is self._data.get(t)) \
                    else v.detach()
            else:
                out[name] = t.detach()
        return out

    def save_checkpoint(self, path: str, optimizer_store: Optional[StateStore] = None,
                        **kwargs) -> None:
        """One checkpoint of the parameters and the optimizer's states: ``path`` is
        ``optimizer_store``'s checkpoint (as ``optimizer_store.save_checkpoint(path)``
        writes it) plus ``model.safetensors``, a stock safetensors file of the model's
        state_dict under its own names. See :mod:`statestore.offload._checkpoint`."""
        self._check_open()
        from ._checkpoint import save_checkpoint
        save_checkpoint(self, path, optimizer_store, **kwargs)

    def load_checkpoint(self, path: str, optimizer_store: Optional[StateStore] = None) -> None:
        """Load the parameters of a checkpoint written by :meth:`save_checkpoint` (and,
        given ``optimizer_store``, its optimizer states into that store: build the
        optimizer after this call, as after ``store.load_checkpoint``)."""
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
        the parameters' data from the store. Idempotent."""
        if self._closed:
            return
        if self._stack or _task() >= 0:
            raise StateStoreError("offload handle: close() called during the model's forward "
                                  "or backward")
        self._tasks.clear()
        self._outer_task = None
        self._bw.clear()
        self._fwd.clear()
        self._opt.clear()
        self._opt_wait.clear()
        err = None
        try:
            self._suspend()
            self._run = None
            values = {}
            for p in self._params:
                if p in self._data and not self._alias:
                    values[p] = self._data[p]
                else:
                    values[p] = self._mover.to_device(self.store.get(self._key[p]), owned=False) \
                        if self.store.resident else \
                        self._mover.to_device(self.store.get(self._key[p]), owned=True)
                self._busy += 1
                try:
                    p.data = values.pop(p)
                finally:
                    self._busy -= 1
        except BaseException as e:
            err = e
        for h in self._hooks:
            try:
                h.remove()
            except Exception:
                pass
        self._hooks = []
        for p in self._params:
            if getattr(p, _ATTR, None) is self:
                delattr(p, _ATTR)
        self._data.clear()
        self._released.clear()
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
    """
    return OffloadHandle(model, store, prefetch=prefetch, device=device, init=init)

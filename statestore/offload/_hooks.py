"""The hooks through which an :class:`~statestore.offload.OffloadHandle` follows the model.

:class:`ModuleHooks`, an object the handle holds, installs and serves them: each module's
forward pre-hook and forward hook (parameters held for the forward), a hook on each output's
gradient and the unpacking of tensors saved for backward (held again for the backward), the
parameters' gradient accumulation hooks (released after), a ``TorchFunctionMode``
(:class:`FetchMode`) for parameters read by a module that does not own them, the global
optimizer step hooks (optimizers other than statestore's get every parameter for their
``step()``) and ``model.state_dict()`` / ``load_state_dict()`` hooks. It keeps who holds each parameter
(:class:`~statestore.offload._readahead.Holds`) and moves data only through the handle's
:class:`~statestore.offload._readahead.ReadAhead`.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .._hook_handles import HookHandles
from ..errors import StateStoreValueError
from ._readahead import Holds, ReadAhead
from ._seam import handle_of, updates_offloaded

__all__ = ["ModuleHooks", "FetchMode", "Saved", "graph_task", "tensors_in",
           "METADATA_FUNCTIONS"]


def graph_task() -> int:
    """Id of the autograd graph task running now (-1 outside backward)."""
    return torch._C._current_graph_task_id()


# ---------------------------------------------------------------------------------- helpers
class Saved:
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
METADATA_FUNCTIONS = _metadata_functions()


class FetchMode(TorchFunctionMode):
    """Active during the root module's forward: fetches a released offloaded parameter that
    a torch function is about to read (a module using a parameter it does not own)."""

    def __init__(self, released: Set[Tensor], busy: Callable[[], bool],
                 fetch: Callable[[Tensor], None]):
        super().__init__()
        self.released = released        # the handle's released parameters (a live set)
        self.busy = busy                # True while the handle itself moves data
        self.fetch = fetch              # fetch one released parameter for this forward

    def __torch_function__(self, func, types, args=(), kwargs=None):
        released, fetch = self.released, self.fetch
        if released and not self.busy() and func not in METADATA_FUNCTIONS:
            for a in args:
                if isinstance(a, Tensor):
                    if a in released:
                        fetch(a)
                elif isinstance(a, (list, tuple)):
                    for b in a:
                        if isinstance(b, Tensor) and b in released:
                            fetch(b)
            if kwargs:
                for a in kwargs.values():
                    if isinstance(a, Tensor) and a in released:
                        fetch(a)
        return func(*args, **(kwargs or {}))


def tensors_in(obj, depth: int = 0):
    if isinstance(obj, Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for o in obj:
            yield from tensors_in(o, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for o in obj.values():
            yield from tensors_in(o, depth + 1)


class ModuleHooks:
    """The hooks of an :class:`~statestore.offload.OffloadHandle` (module docstring).

    Args:
        owner: the handle (which parameters are its: ``handle_of(p) is owner``).
        model: the module.
        params: its offloaded parameters; names: every name of each (kept up to date by
            the handle).
        modules, mod_params: the modules owning parameters directly (and the root), in model
            order, and their parameters (a list kept up to date in place).
        ra: the handle's :class:`~statestore.offload._readahead.ReadAhead`.
        holds: who holds each parameter (shared with ``ra``).
    """

    def __init__(self, owner, model: nn.Module, params: List[Tensor],
                 names: Dict[Tensor, List[str]], modules: List[nn.Module],
                 mod_params: List[List[Tensor]], ra: ReadAhead, holds: Holds):
        self.owner, self.model, self.params, self.names = owner, model, params, names
        self.modules, self.mod_params, self.ra, self.holds = modules, mod_params, ra, holds
        self._uib: Set[Tensor] = set()          # parameters an optimizer updates in backward
        # ... kept from their gradient to their update (their bytes, oldest first), at most
        # ReadAhead.hold_cap bytes of them: the older ones beyond are released (_trim_waiting)
        self._opt_wait: Dict[Tensor, int] = {}
        self._wait_bytes = 0
        self._trimmed: Set[Tensor] = set()     # ... released by the cap before their update
        self._applied: Set[Tensor] = set()      # ... updated before their accumulation hook
        self._to_release: List[Tensor] = []
        self._stack: List[Tuple[int, bool]] = []
        self._outer_task: Optional[int] = None
        self._tasks: Set[int] = set()
        self._root_ctx: List[Any] = []
        self._foreign: Dict[int, List[Tensor]] = {}
        self._loading = False
        self._handles = HookHandles()

    def install(self) -> None:
        """Register every hook (removed by :meth:`remove`)."""
        add = self._handles.add
        for idx, m in enumerate(self.modules):
            add(m.register_forward_pre_hook(self._make_pre(idx)))
            add(m.register_forward_hook(self._make_post(idx), always_call=True))
        for p in self.params:
            if p.requires_grad:
                add(p.register_hook(self._make_pre_acc(p)))
                add(p.register_post_accumulate_grad_hook(self._post_acc))
        add(self.model._register_state_dict_hook(self._state_dict_hook))
        add(self.model.register_load_state_dict_pre_hook(self._load_pre_hook))
        add(self.model.register_load_state_dict_post_hook(self._load_post_hook))
        from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                           register_optimizer_step_pre_hook)
        add(register_optimizer_step_pre_hook(self._before_step))
        add(register_optimizer_step_post_hook(self._after_step))

    @property
    def in_model_pass(self) -> bool:
        """True during the model's forward or backward."""
        return bool(self._stack) or graph_task() >= 0

    def stop(self) -> None:
        """The handle closes (outside any forward or backward): nothing holds a parameter."""
        self._tasks.clear()
        self._outer_task = None
        self.holds.clear()
        self._opt_wait.clear()
        self._wait_bytes = 0
        self._trimmed.clear()

    def remove(self) -> None:
        self._handles.remove_all()

    def _flush_releases(self) -> None:
        todo, self._to_release = self._to_release, []
        for p in todo:
            self.ra.maybe_release(p)

    def _event(self, idx: int) -> None:
        """Module ``idx`` asks for its parameters (holds are added by the caller)."""
        self._flush_releases()
        self.ra.event(idx)

    def _note_task(self) -> int:
        task = graph_task()
        if task >= 0 and task not in self._tasks:
            self._tasks.add(task)
            if self._outer_task is None:
                self._outer_task = task
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: self._task_end(task))
        return task

    def _task_end(self, task: int) -> None:
        self._tasks.discard(task)
        for p, tasks in self.holds.bw.items():
            if task in tasks:
                tasks.discard(task)
                self._to_release.append(p)
        self._flush_releases()
        if task == self._outer_task:
            self._outer_task = None
            self.ra.end_iteration()

    def _begin_iteration(self) -> None:
        ra, holds = self.ra, self.holds
        ra.end_iteration()
        self._applied.clear()
        self._trimmed.clear()
        for p in self._opt_wait:            # step() was not called: nothing will update them
            holds.opt.discard(p)
            self._to_release.append(p)
        self._opt_wait.clear()
        self._wait_bytes = 0
        if self._tasks or self._outer_task is not None:
            # a backward that raised never reached its end callbacks: no backward runs now
            self._tasks.clear()
            self._outer_task = None
            for p, tasks in holds.bw.items():
                if tasks:
                    tasks.clear()
                    self._to_release.append(p)
            self._flush_releases()
        ra.begin_iteration(torch.is_grad_enabled())

    # ------------------------------------------------------------------ hooks
    def _make_pre(self, idx: int):
        def pre(module, args):
            self.ra.busy += 1
            try:
                self._pre(idx, args)
            finally:
                self.ra.busy -= 1
        return pre

    def _pre(self, idx: int, args) -> None:
        root = idx == 0
        pushed = False
        if root and graph_task() < 0:
            self._begin_iteration()
            torch._C._autograd._push_saved_tensors_default_hooks(self._pack, self._unpack)
            ra = self.ra
            mode = FetchMode(ra.released, lambda: ra.busy > 0, self._fallback_forward)
            mode.__enter__()
            self._root_ctx.append(mode)
            pushed = True
        self._stack.append((idx, pushed))
        self._event(idx)
        for p in self.mod_params[idx]:
            self.holds.fwd[p] = self.holds.fwd.get(p, 0) + 1
        if torch.is_grad_enabled() and any(not p.requires_grad for p in self.mod_params[idx]):
            # (no input requiring grad: frozen parameters then serve no backward of it)
            for x in tensors_in(args):
                if x.requires_grad:
                    x.register_hook(lambda g, i=idx: self._inputs_done(i))

    def _make_post(self, idx: int):
        def post(module, args, output):
            self.ra.busy += 1
            try:
                self._post(idx, output)
            finally:
                self.ra.busy -= 1
        return post

    def _post(self, idx: int, output) -> None:
        if not self._stack or self._stack[-1][0] != idx:
            return          # the pre-hook did not run (it raised before its push)
        _, pushed = self._stack.pop()
        for p in self.mod_params[idx]:
            n = self.holds.fwd.get(p, 0) - 1
            if n <= 0:
                self.holds.fwd.pop(p, None)
                self.ra.maybe_release(p)
            else:
                self.holds.fwd[p] = n
        if pushed:
            mode = self._root_ctx.pop()
            mode.__exit__(None, None, None)
            torch._C._autograd._pop_saved_tensors_default_hooks()
        if output is not None and torch.is_grad_enabled():
            for y in tensors_in(output):
                if y.requires_grad and y.grad_fn is not None:
                    y.register_hook(lambda g, i=idx: self._backward_event(i))

    def _backward_event(self, idx: int) -> None:
        task = self._note_task()
        self._event(idx)
        for p in self.mod_params[idx]:
            self.holds.bw.setdefault(p, set()).add(task)

    def _inputs_done(self, idx: int) -> None:
        task = graph_task()
        for p in self.mod_params[idx]:
            if not p.requires_grad and task in self.holds.bw.get(p, ()):
                self.holds.bw[p].discard(task)
                self._to_release.append(p)

    def _make_pre_acc(self, p: Tensor):
        ref = weakref.ref(p)

        def pre_acc(grad):
            q = ref()
            if q is not None and q not in self.ra.data:
                # backward reached the parameter without one of its modules asking for it:
                # accumulating into a released parameter would give its gradient its layout
                task = self._note_task()
                self.ra.fetch([q])
                self.holds.bw.setdefault(q, set()).add(task)
            return None
        return pre_acc

    def _post_acc(self, p: Tensor) -> None:
        task = graph_task()
        tasks = self.holds.bw.get(p)
        if tasks and task in tasks:
            tasks.discard(task)
        if p in self._applied:              # its update came first (the optimizer's hook ran
            self._applied.discard(p)        # before this one)
        elif p in self._uib and p not in self._opt_wait:
            # an optimizer updates it during backward, maybe only once its states arrive:
            # keep it until then rather than read it again (released by end_update), within
            # the cap of _trim_waiting
            self.holds.opt.add(p)
            nb = p.numel() * p.dtype.itemsize
            self._opt_wait[p] = nb
            self._wait_bytes += nb
            self._trim_waiting()
        self._to_release.append(p)

    def _trim_waiting(self) -> None:
        """Keep at most ``ra.hold_cap`` bytes of parameters waiting for their update (the
        newest always): an optimizer whose states arrive late (its store's reads and write-
        behind decide when) would otherwise hold every parameter of the backward so far
        (7 of 12 layers, 3x the store's budget). The oldest are released: their values are
        in the store (not yet updated), and their update reads them again."""
        cap = self.ra.hold_cap
        while cap is not None and self._wait_bytes > cap and len(self._opt_wait) > 1:
            p = next(iter(self._opt_wait))
            self._wait_bytes -= self._opt_wait.pop(p)
            self.holds.opt.discard(p)
            self._trimmed.add(p)
            self.ra.maybe_release(p)

    def _fallback_forward(self, p: Tensor) -> None:
        """A torch function reads released parameter ``p`` in the root's forward: fetch it
        and from now on with the innermost running module."""
        self.ra.busy += 1
        try:
            idx = self._stack[-1][0] if self._stack else 0
            if not any(q is p for q in self.mod_params[idx]):
                self.mod_params[idx] = self.mod_params[idx] + [p]
                self.ra.diverge()
            self.ra.fetch([p])
            self.holds.fwd[p] = self.holds.fwd.get(p, 0) + 1
        finally:
            self.ra.busy -= 1

    def _pack(self, t: Tensor):
        data = self.ra.data
        if not data or t.device != self.ra.device or t.layout != torch.strided:
            return t
        ptr = t.data_ptr()
        if ptr == 0:
            return t
        for p, d in data.items():
            if d.dtype != t.dtype:
                continue
            base = d.data_ptr()
            size = d.dtype.itemsize
            if base <= ptr < base + d.numel() * size:
                extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
                off = (ptr - base) // size
                if t.numel() and off + extent <= d.numel():
                    return Saved(p, off, tuple(t.shape), tuple(t.stride()))
        return t

    def _unpack(self, x):
        if not isinstance(x, Saved):
            return x
        p = x.p
        if p not in self.ra.data:
            task = self._note_task()
            self.ra.fetch([p])
            self.holds.bw.setdefault(p, set()).add(task)
        d = self.ra.data[p]
        return d.as_strided(x.size, x.stride, d.storage_offset() + x.offset)

    # ------------------------------------------------------------------ optimizers
    def begin_update(self, items) -> None:
        """The handle's ``begin_update``: materialize the parameters of ``items``."""
        ps = [p for p, _, _ in items]
        if graph_task() >= 0:
            self._uib.update(ps)            # updated during backward (update_in_backward)
        self.ra.fetch(ps)
        self.holds.opt.update(ps)

    def end_update(self, items) -> None:
        """The handle's ``end_update``: write back and release fully updated parameters."""
        for p, a, b in items:
            if b >= p.numel():
                self.ra.write_back(p)
                self.holds.opt.discard(p)
                if p in self._opt_wait:
                    self._wait_bytes -= self._opt_wait.pop(p)
                elif p in self._trimmed:
                    self._trimmed.discard(p)
                elif graph_task() >= 0:
                    self._applied.add(p)
                self.ra.maybe_release(p)

    def _ours(self, optimizer) -> List[Tensor]:
        return [p for g in optimizer.param_groups for p in g["params"]
                if handle_of(p) is self.owner]

    def _before_step(self, optimizer, args, kwargs) -> None:
        if updates_offloaded(optimizer):
            if self.ra.io and getattr(optimizer, "state_store", None) is self.ra.store \
                    and self._ours(optimizer):
                raise StateStoreValueError(
                    f"{type(optimizer).__name__}: its state_store is the store the parameters "
                    f"are offloaded to; give the parameters a store of their own (two "
                    f"pipelines at once on one disk store could wait on each other)")
            return      # updates parameters a unit at a time through update_begin/update_end
        ps = self._ours(optimizer)
        if ps:          # another optimizer reads every parameter: materialize them all
            self.ra.fetch(ps)
            self.holds.opt.update(ps)
            self._foreign[id(optimizer)] = ps

    def _after_step(self, optimizer, args, kwargs) -> None:
        ps = self._foreign.pop(id(optimizer), None)
        if ps:
            for p in ps:
                self.ra.write_back(p)
                self.holds.opt.discard(p)
                self.ra.maybe_release(p)
        if self.ra.io and (ps or self._ours(optimizer)):
            self.ra.read_next_iteration()

    # ------------------------------------------------------------------ model.state_dict()
    def _state_dict_hook(self, module, state_dict, prefix, local_metadata) -> None:
        """``model.state_dict()`` gives the stored values (``keep_vars=True``: the
        parameters themselves, as torch)."""
        for p in self.params:
            for n in self.names[p]:
                k = prefix + n
                v = state_dict.get(k)
                if v is not None and not isinstance(v, nn.Parameter):
                    state_dict[k] = self.ra.value(p).detach()

    def _load_pre_hook(self, module, state_dict, prefix, *args) -> None:
        """``model.load_state_dict()``: every parameter materialized for torch to copy into,
        written back by :meth:`_load_post_hook`."""
        self.ra.suspend()
        self.ra.fetch(self.params)
        self.holds.opt.update(self.params)
        self._loading = True

    def _load_post_hook(self, module, incompatible_keys) -> None:
        if not self._loading:
            return
        self._loading = False
        for p in self.params:
            self.ra.stage_write(p)
            self.holds.opt.discard(p)
            self.ra.maybe_release(p)
        self.ra.flush_dirty()

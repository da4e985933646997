"""The data path of CUDA parameters whose states live in host memory or on disk.

ZeRO-Offload's path, for :class:`~statestore.optim.HybridAdam` (and ``CPUAdam``) when a
parameter is on a CUDA device and its store hands out host tensors (``store.device`` is the
CPU: ``PinnedCPUStore``, ``DeviceStore("cpu")``, ``FileStore``, ``NVMeStore``, tiered stores):

1. **During backward** a post-accumulate-grad hook copies each gradient, as soon as backward has
   finished it, into a page-locked staging buffer on a side CUDA stream (device to host,
   asynchronous; the side stream first waits for the work already queued on the stream
   backward runs on). fp32 parameters (no fp32 master in the store) are staged the same way:
   the CPU update needs their value.
2. **In step()** the optimizer walks the store's pipeline as for CPU parameters; for each unit
   it waits on the host for the copies of that unit's gradients only (a CUDA event each), runs
   the CPU Adam kernel on the staging buffers and the store's states (the fp32 master, or the
   staged fp32 parameter), and queues the host-to-device copy of the updated parameter on the
   side stream. Units further on are computed while earlier ones are uploaded.
3. **Each upload** is followed by the current stream waiting (on the device) for the side
   stream, so whatever reads the parameter afterwards (the next forward, a copy to the host)
   sees the update; the host does not wait.

A gradient staged by the hook is used only when it is still the parameter's gradient, unchanged
(same tensor, same ``_version``): clipping, unscaling, accumulation over several backward calls
or an all-reduce after the hook make ``step()`` stage it again (correct, just without the overlap
with backward). The same holds for the staged value of an fp32 parameter.

Staging memory is page-locked once per parameter set (one slab per device and call, exact size,
registered with ``cudaHostRegister``; unregistered when the lane closes or goes away, after the
device is synchronized), reused every step, and reported by :meth:`StagingPath.stats` (public:
``staging_stats()`` of the optimizers): the gradients' and parameters' bytes of the offloaded
parameters.

The device side (stream, events, copies, page-locked memory) is a *lane*; :class:`CudaLane` is the
real one. Tests run the same code with CPU parameters through a lane that defers every copy until
its event is waited on (``tests/helpers/deferred_lane.py``), so a missing wait shows up as wrong values.
See ``docs/gpu.md``.
"""
from __future__ import annotations

import threading
import warnings
import weakref
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor

from .._hook_handles import HookHandles
from ..io.buffers import clear_cuda_error
from ._dtensor import local, local_grad

__all__ = ["StagingPath", "CudaLane", "attach_staging", "default_select"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_ALIGN = 64


class CudaLane:
    """Side stream, events and page-locked host memory of one CUDA device."""

    _warned = False

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._buffers: List[Tensor] = []     # the page-locked buffers, kept alive here
        self._ptrs: List[int] = []
        # unregistered when the lane goes away, even where close() is never called
        self._finalizer = weakref.finalize(self, _unregister_all, self._ptrs, device)

    def alloc(self, nbytes: int) -> Tuple[Tensor, bool]:
        """A host buffer of ``nbytes`` bytes and whether it is page-locked (registered with
        ``cudaHostRegister``; pageable, with one warning, where registration fails)."""
        buf = torch.empty(max(int(nbytes), 1), dtype=torch.uint8)
        rc = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0))
        if rc != 0:
            clear_cuda_error()          # else torch's next kernel launch reports it
            if not CudaLane._warned:
                CudaLane._warned = True
                warnings.warn(f"HybridAdam: cudaHostRegister of {buf.numel()} staging bytes "
                              f"failed (error {rc}); gradients and parameters go through "
                              f"pageable memory (synchronous copies)", RuntimeWarning,
                              stacklevel=4)
            return buf, False
        self._buffers.append(buf)
        self._ptrs.append(buf.data_ptr())
        return buf, True

    def copy(self, dst: Tensor, src: Tensor):
        """``dst.copy_(src)`` on the side stream, after the work queued so far on the current
        stream; returns an event recorded after the copy."""
        cur = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(cur)
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        for t in (dst, src):
            if t.is_cuda:
                # the caching allocator must not hand this memory to another tensor before
                # the side stream is done with it (a gradient freed by zero_grad)
                t.record_stream(self.stream)
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def wait_host(self, event) -> None:
        """Block the calling thread until ``event`` has completed."""
        if event is not None:
            event.synchronize()

    def join(self) -> None:
        """Make the current stream wait (on the device) for everything queued on the side
        stream so far."""
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def close(self) -> None:
        """Wait for the side stream, then unregister the page-locked buffers (views still
        held elsewhere stay usable, as pageable memory)."""
        self.stream.synchronize()
        self._finalizer()
        self._buffers = []


def _unregister_all(ptrs: List[int], device: torch.device) -> None:
    try:
        torch.cuda.synchronize(device)      # no copy may still be reading or writing them
        for ptr in ptrs:
            torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:       # interpreter shutdown: the process is leaving anyway
        pass
    ptrs.clear()


class _Staging:
    """Staging buffers of one parameter and the copies that filled or drain them."""

    __slots__ = ("grad", "param", "grad_event", "grad_src", "param_event", "param_src",
                 "upload_event", "updated", "lane")

    def __init__(self, grad: Tensor, param: Tensor, lane):
        self.grad = grad                    # flat host buffer, the gradient's dtype
        self.param = param                  # flat host buffer, the parameter's dtype
        self.lane = lane
        self.grad_event = None              # D2H copy of the gradient
        self.grad_src: Optional[tuple] = None   # (weakref to the gradient, its _version)
        self.param_event = None             # D2H copy of an fp32 parameter
        self.param_src: Optional[tuple] = None  # (data_ptr, _version) of the staged value
        self.upload_event = None            # H2D copy of the last update
        self.updated = False                # uploaded since the last after_step()


class StagingPath:
    """Moves gradients and parameters of CUDA parameters through page-locked buffers on a side
    stream (module docstring). One per optimizer; the optimizer calls :meth:`before_step`,
    :meth:`grad_host`, :meth:`param_host`, :meth:`upload` and :meth:`after_step`.

    Args:
        select: which parameters take this path (the optimizer's rule: a contiguous CUDA
            parameter whose store hands out host tensors).
        lane_factory: ``device -> lane`` (default :class:`CudaLane`).
    """

    def __init__(self, select: Callable[[Tensor], bool],
                 lane_factory: Callable[[torch.device], object] = CudaLane):
        self._select = select
        self._lane_factory = lane_factory
        self._lanes: Dict[torch.device, object] = {}
        self._staging: Dict[Tensor, _Staging] = {}     # keyed by identity (a plain dict)
        self._used: Dict[torch.device, object] = {}
        self._hooks = HookHandles()
        self._watched: List[Tensor] = []     # parameters with a hook, in order
        # backward runs the hooks of each device on that device's autograd thread
        self._lock = threading.RLock()
        self.closed = False
        self.pinned_bytes = 0
        self.pageable_bytes = 0

    # ------------------------------------------------------------------ set-up
    def handles(self, p: Tensor) -> bool:
        return p in self._staging or self._select(p)

    def watch(self, params: Iterable[Tensor], owner) -> None:
        """Register the backward hook on ``params`` this path takes; ``owner`` (held weakly)
        is the optimizer: the hook does nothing once it is gone or this path is closed."""
        if not hasattr(Tensor, "register_post_accumulate_grad_hook"):
            return
        ref = weakref.ref(owner)
        path = weakref.ref(self)

        def hook(param) -> None:
            opt, me = ref(), path()
            if opt is None or me is None or me.closed:
                return
            if param.grad is not None and not param.grad.is_sparse:
                with me._lock:
                    me.stage(param, param.grad)

        for p in params:
            if p.requires_grad and self._select(p):
                self._hooks.add(p.register_post_accumulate_grad_hook(hook))
                self._watched.append(p)

    def remove_hooks(self) -> None:
        self._hooks.remove_all()

    def _lane(self, device: torch.device):
        lane = self._lanes.get(device)
        if lane is None:
            lane = self._lanes[device] = self._lane_factory(device)
        return lane

    def _prepare(self, params: List[Tensor]) -> None:
        """Staging buffers for ``params`` that have none: one slab per device."""
        by_dev: Dict[torch.device, List[Tensor]] = {}
        for p in params:
            if p not in self._staging:
                by_dev.setdefault(p.device, []).append(p)
        for dev, ps in by_dev.items():
            lane = self._lane(dev)
            offsets, pos = [], 0
            for p in ps:
                n, item = local(p).numel(), p.element_size()       # a DTensor: its shard
                pos += (-pos) % _ALIGN
                g_off = pos
                pos += n * item
                pos += (-pos) % _ALIGN
                offsets.append((g_off, pos))
                pos += n * item
            slab, locked = lane.alloc(pos)
            if locked:
                self.pinned_bytes += slab.numel()
            else:
                self.pageable_bytes += slab.numel()
            for p, (g_off, p_off) in zip(ps, offsets):
                nb = local(p).numel() * p.element_size()
                self._staging[p] = _Staging(slab[g_off:g_off + nb].view(p.dtype),
                                            slab[p_off:p_off + nb].view(p.dtype), lane)

    # ------------------------------------------------------------------ the copies
    def stage(self, p: Tensor, g: Tensor) -> None:
        """Queue the D2H copies of ``p``'s gradient ``g`` (and of ``p`` itself when it is
        fp32: no master in the store) into its staging buffers."""
        st = self._staging.get(p)
        if st is None:      # first use: one slab for every watched parameter still without
            self._prepare([p] + [q for q in self._watched if q is not p])
            st = self._staging[p]
        lane = st.lane
        g, lp = local_grad(p, g), local(p)        # DTensor parameters: the local shards
        if g.dtype != st.grad.dtype:        # a gradient of another dtype than the parameter
            buf, locked = lane.alloc(g.numel() * g.element_size())
            if locked:
                self.pinned_bytes += buf.numel()
            else:
                self.pageable_bytes += buf.numel()
            st.grad = buf[:g.numel() * g.element_size()].view(g.dtype)
        st.grad_event = lane.copy(st.grad, g.detach().reshape(-1))
        st.grad_src = (weakref.ref(g), g._version)
        if p.dtype not in _LOW_PRECISION:
            st.param_event = lane.copy(st.param, lp.detach().reshape(-1))
            st.param_src = (lp.data_ptr(), lp._version)
        self._used[p.device] = lane

    def _fresh(self, st: _Staging, p: Tensor, g: Tensor, param: bool) -> bool:
        """Whether the staged gradient is ``g`` as it is now (and, with ``param``, the staged
        value of an fp32 ``p`` is ``p`` as it is now)."""
        if st.grad_src is None or st.grad_src[0]() is not g or st.grad_src[1] != g._version:
            return False
        lp = local(p)
        if param and p.dtype not in _LOW_PRECISION and \
                st.param_src != (lp.data_ptr(), lp._version):
            return False
        return True

    def before_step(self, grads: Dict[Tensor, Tensor]) -> None:
        """Queue the copies of every gradient (and fp32 parameter) of this step that backward's
        hook did not stage, or that changed since: all of them before the first unit's
        compute, so that they overlap it. Parameters already updated in this step
        (``update_in_backward``) are left alone."""
        todo = [p for p in grads if self.handles(p)]
        self._prepare(todo)
        for p in todo:
            st = self._staging[p]
            if not st.updated and not self._fresh(st, p, grads[p], param=True):
                self.stage(p, grads[p])

    def grad_host(self, p: Tensor, g: Tensor) -> Tensor:
        """The staged gradient of ``p`` (flat, host), once its copy has arrived."""
        st = self._staging.get(p)
        if st is None or not self._fresh(st, p, g, param=not st.updated):
            self.stage(p, g)
            st = self._staging[p]
        st.lane.wait_host(st.grad_event)
        return st.grad

    def param_host(self, p: Tensor) -> Tensor:
        """The host buffer the update of ``p`` is computed in (flat): the staged value of an
        fp32 parameter, or the buffer the kernel writes a low-precision parameter into from
        its master. Waits until the host may read and write it."""
        st = self._staging[p]
        st.lane.wait_host(st.upload_event)      # last step's upload has read the buffer
        if p.dtype not in _LOW_PRECISION:
            st.lane.wait_host(st.param_event)
        return st.param

    def upload(self, p: Tensor, a: int, b: int) -> None:
        """Queue the H2D copy of elements ``[a, b)`` of ``p``'s updated value; work queued
        on the current stream from now on (on the device: the host does not wait) runs after
        it, so anything that reads ``p`` later in the step sees the update."""
        st = self._staging[p]
        st.upload_event = st.lane.copy(local(p).detach().view(-1)[a:b], st.param[a:b])
        st.lane.join()
        st.updated = True
        self._used[p.device] = st.lane

    def after_step(self) -> None:
        """The current streams wait for the uploads (on the device: the host goes on)."""
        used, self._used = self._used, {}
        for st in self._staging.values():
            if st.updated:
                st.updated = False
                st.param_src = None     # p changed: stage its value again next time
        for lane in used.values():
            lane.join()

    # ------------------------------------------------------------------ reporting, lifetime
    def stats(self) -> Dict[str, int]:
        """What the optimizer's ``staging_stats()`` reports (``docs/gpu.md``)."""
        return {"staged_params": len(self._staging), "staging_pinned_bytes": self.pinned_bytes,
                "staging_pageable_bytes": self.pageable_bytes}

    def close(self) -> None:
        self.closed = True
        self.remove_hooks()
        self._watched = []
        self._staging = {}
        for lane in self._lanes.values():
            lane.close()
        self._lanes = {}
        self.pinned_bytes = self.pageable_bytes = 0


def default_select(stores: Dict[Tensor, object]) -> Callable[[Tensor], bool]:
    """The optimizer's rule: a contiguous CUDA parameter whose store (``stores``: the
    optimizer's store of each parameter it keeps) hands out host tensors."""
    def select(p: Tensor) -> bool:
        if not p.is_cuda or not p.is_contiguous():
            return False
        store = stores.get(p)
        return store is not None and store.device.type == "cpu"
    return select


def attach_staging(path: Optional[StagingPath], owner, params: Iterable[Tensor],
                        stores: Dict[Tensor, object]) -> Optional[StagingPath]:
    """The optimizer ``owner``'s path (``path``: the one it has, or None) for ``params``,
    created when the first of them takes it, with backward hooks on them; None while no
    parameter takes it."""
    params = list(params)
    if path is None:
        if not torch.cuda.is_available():
            return None
        select = default_select(stores)
        if not any(select(p) for p in params):
            return None
        path = StagingPath(select)
    path.watch(params, owner)
    return path

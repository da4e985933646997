"""Materializing and releasing offloaded parameters, and reading them ahead.

:class:`ReadAhead` is the object of an :class:`~statestore.offload.OffloadHandle` that
moves data: a parameter is materialized (:meth:`~ReadAhead.set`) from a synchronous read
(:meth:`~ReadAhead.fetch`) or from the read-ahead window, and released
(:meth:`~ReadAhead.release_now`) when no forward, backward or optimizer update holds it
(:class:`Holds`, kept by the handle's :class:`~statestore.offload._hooks.ModuleHooks`). It
records, per iteration (:class:`Run`), the order in which modules ask for their parameters
and, in the next iteration, reads up to ``prefetch`` modules ahead through one store pipeline
at a time (:class:`Window`); updated parameters of a disk store are written back
(write-behind) when a window closes, never while a read pipeline is open on the store.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor

from .._ring import round_up
from .._stream import chunk_ranges
from ..pipeline import pack_runs
from .._types import Slice, StateKey, StateSpec

__all__ = ["Holds", "ReadAhead", "Run", "Window", "round_up"]


class Window:
    __slots__ = ("pipe", "start", "events")

    def __init__(self, pipe, start: int, events: list):
        self.pipe, self.start, self.events = pipe, start, events


class Run:
    """One iteration (the root's forward to the end of the backward that follows)."""

    __slots__ = ("grad", "plan", "pos", "record", "diverged", "window")

    def __init__(self, grad: bool, plan: Optional[List[int]]):
        self.grad = grad
        self.plan = plan
        self.pos = 0
        self.record: List[int] = []
        self.diverged = plan is None
        self.window: Optional[Window] = None


class Holds:
    """Who holds each materialized parameter: forwards running (a count), backward graph
    tasks (ids), optimizer updates. The hooks keep it; a parameter held by none is released.
    """

    __slots__ = ("fwd", "bw", "opt")

    def __init__(self) -> None:
        self.fwd: Dict[Tensor, int] = {}
        self.bw: Dict[Tensor, Set[int]] = {}
        self.opt: Set[Tensor] = set()

    def held(self, p: Tensor) -> bool:
        return self.fwd.get(p, 0) > 0 or bool(self.bw.get(p)) or p in self.opt

    def clear(self) -> None:
        self.fwd.clear()
        self.bw.clear()
        self.opt.clear()


class ReadAhead:
    """Data movement of an :class:`~statestore.offload.OffloadHandle` (module docstring).

    Args:
        store, device, prefetch: the handle's.
        mover: copies between the store's tensors and ``device`` (``_device.Mover``).
        keys, by_key: each parameter's store key and back (dicts the handle keeps up to
            date).
        mod_params: each hooked module's parameters (a list the handle and the hooks keep
            up to date in place).
        holds: who holds each parameter (:class:`Holds`).

    Attributes:
        data: the materialized parameters and their data.
        released: the parameters released now (a live set the hooks' fetch mode reads).
        busy: > 0 while the handle itself sets parameters' data (the fetch mode stands by).
        stats: reads, bytes read, writes, reads made outside the read-ahead.
    """

    def __init__(self, store, device: torch.device, prefetch: int, mover,
                 keys: Dict[Tensor, StateKey], by_key: Dict[StateKey, Tensor],
                 mod_params: List[List[Tensor]], holds: Holds):
        self.store, self.device, self.prefetch, self.mover = store, device, prefetch, mover
        self.keys, self.by_key, self.mod_params, self.holds = keys, by_key, mod_params, holds
        self.alias = store.resident and store.device == device
        self.io = not store.resident
        # Most bytes of parameters kept materialized for an optimizer, beyond the modules
        # computing: waiting for their update in backward (ModuleHooks._trim_waiting), and
        # updated but not yet written back (write_back), each at most half the store's budget
        # (None: the data is the store's own tensor, nothing is held)
        self.hold_cap: Optional[int] = None if self.alias else max(1, store.budget_bytes // 2)
        self.data: Dict[Tensor, Tensor] = {}
        self.released: Set[Tensor] = set()
        self.busy = 0
        self.stats = {"reads": 0, "read_bytes": 0, "writes": 0, "sync_reads": 0}
        self._dirty: Dict[Tensor, Tensor] = {}      # updated values not yet written back
        self._dirty_bytes = 0
        self._slices: Dict[Tensor, List[Slice]] = {}
        self._placeholders: Dict[Tuple[torch.dtype, torch.device], Tensor] = {}
        # iterations and their recorded order of module requests (by grad mode)
        self._plans: Dict[bool, List[int]] = {}
        self._run: Optional[Run] = None
        self._next_run: Optional[Run] = None

    # ------------------------------------------------------------------ materialize / release
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

    def set_data(self, p: Tensor, t: Tensor) -> None:
        """``p.data = t`` with the fetch mode standing by."""
        self.busy += 1
        try:
            p.data = t
        finally:
            self.busy -= 1

    def set(self, p: Tensor, t: Tensor) -> None:
        """``p`` is materialized with data ``t``."""
        self.set_data(p, t)
        self.data[p] = t
        self.released.discard(p)

    def release_now(self, p: Tensor) -> None:
        """``p``'s data becomes the placeholder (its value stays in the store)."""
        self.set_data(p, self._placeholder(p))
        self.data.pop(p, None)
        if p.numel():
            self.released.add(p)

    def maybe_release(self, p: Tensor) -> None:
        """Release ``p`` when materialized and held by nobody."""
        if p in self.data and not self.holds.held(p):
            self.release_now(p)

    def forget(self) -> None:
        """The handle closes: no parameter is materialized or released any more."""
        self.data.clear()
        self.released.clear()

    def slices_of(self, p: Tensor) -> List[Slice]:
        """The store slices of ``p``'s data, in order (each at most a unit)."""
        s = self._slices.get(p)
        if s is None:
            n = p.numel()
            limit = self.store.unit_bytes or max(n * p.dtype.itemsize, 1)
            k = self.keys[p]
            spec = StateSpec(tuple(p.shape), p.dtype)
            s = [Slice(k, a, b) for a, b in
                 chunk_ranges(spec, limit, self.store.cut_alignment(limit))] if n else []
            self._slices[p] = s
        return s

    def _units_of(self, ps: Sequence[Tensor]) -> List[List[Slice]]:
        """Pipeline units over the parameters ``ps``: slices packed up to the store's unit size."""
        align = self.store.alignment
        return pack_runs(((s, round_up(max(s.numel * p.dtype.itemsize, 1), align))
                          for p in dict.fromkeys(ps) for s in self.slices_of(p)),
                         self.store.unit_bytes)

    def fetch(self, ps: Sequence[Tensor]) -> None:
        """Materialize ``ps`` now (synchronously); read-ahead in flight is dropped."""
        need = [p for p in dict.fromkeys(ps) if p not in self.data]
        if not need:
            return
        store = self.store
        if self.alias:
            for p in need:
                self.set(p, store.get(self.keys[p]))
            return
        if store.resident:
            for p in need:
                self.set(p, self.mover.to_device(store.get(self.keys[p]), owned=False))
            return
        rest = [p for p in need if not self._set_local(p)]
        if not rest:
            return
        self.suspend()
        self.stats["sync_reads"] += 1
        dest = {p: self.mover.host_buffer(p.numel(), p.dtype) for p in rest}
        units = self._units_of(rest)
        with store.pipeline(units, mode="r", wait=False) as pipe:
            for unit, tensors in zip(units, pipe):
                for s, t in zip(unit, tensors):
                    dest[self.by_key[s.key]][s.start:s.stop].copy_(t)
        for p in rest:
            self._count_read(p)
            self.set(p, self.mover.to_device(dest[p].view(p.shape), owned=True))

    def _set_local(self, p: Tensor) -> bool:
        """Materialize ``p`` without the store where it can be: from its update not yet
        written back, or empty (no elements). False: it needs a read."""
        if p in self._dirty:
            self.set(p, self._dirty[p])
        elif p.numel() == 0:
            self.set(p, torch.empty(p.shape, dtype=p.dtype, device=self.device))
        else:
            return False
        return True

    def _count_read(self, p: Tensor) -> None:
        self.stats["reads"] += 1
        self.stats["read_bytes"] += p.numel() * p.dtype.itemsize

    def value(self, p: Tensor) -> Tensor:
        """``p``'s current value (read from the store if needed, not kept materialized)."""
        if p in self.data:
            return self.data[p]
        self.fetch([p])
        t = self.data[p]
        self.maybe_release(p)
        return t

    # ------------------------------------------------------------------ write-back
    def stage_write(self, p: Tensor) -> None:
        """``p``'s data was updated: into the store now (resident stores), or kept to be
        written back (disk stores: :meth:`flush_dirty`). Nothing for an alias."""
        if self.alias or p not in self.data:
            return
        if self.store.resident:
            self.store.put(self.keys[p], self.data[p])
        else:
            t = self.data[p]
            old = self._dirty.get(p)
            if old is not None:
                self._dirty_bytes -= old.numel() * old.dtype.itemsize
            self._dirty[p] = t
            self._dirty_bytes += t.numel() * t.dtype.itemsize

    def write_back(self, p: Tensor) -> None:
        """As :meth:`stage_write`, and written back at once unless a read-ahead window is
        open (then when it closes) and the updates kept stay within :attr:`hold_cap`: past
        it, the window is closed (its reads are dropped, and made again at the next module)
        and everything is written back now, so an optimizer updating many parameters while
        one window is open never keeps them all."""
        self.stage_write(p)
        if p not in self._dirty:
            return
        run = self._run
        if run is None or run.window is None:
            self.flush_dirty()
        elif self.hold_cap is not None and self._dirty_bytes > self.hold_cap:
            self.suspend()

    def flush_dirty(self) -> None:
        todo, self._dirty = self._dirty, {}
        self._dirty_bytes = 0
        for p, t in todo.items():
            self.store.put(self.keys[p], self.mover.to_host(t))
            self.stats["writes"] += 1

    # ------------------------------------------------------------------ read-ahead windows
    def _open_window(self, run: Run, start: int) -> None:
        events = []
        total = 0
        limit = max(1, self.prefetch)
        budget = self.store.budget_bytes // 2
        for i in range(start, len(run.plan)):
            ps = self.mod_params[run.plan[i]]
            units = self._units_of(ps)
            nb = sum(round_up(max(s.numel * self.store.spec(s.key).itemsize, 1),
                               self.store.alignment) for u in units for s in u)
            if events and (len(events) >= limit or total + nb > budget):
                break
            events.append((run.plan[i], units, list(ps)))
            total += nb
        flat = [u for _, us, _ in events for u in us]
        pipe = self.store.pipeline(flat, mode="r", wait=False) if flat else None
        run.window = Window(pipe, start, events)

    @staticmethod
    def _close_window(run: Optional[Run]) -> None:
        if run is None or run.window is None:
            return
        w, run.window = run.window, None
        if w.pipe is not None:
            w.pipe.close()

    def suspend(self) -> None:
        """Before any other use of the store: close the read-ahead pipelines (reads in flight
        are drained, their data dropped) and write the updated parameters back."""
        self._close_window(self._run)
        self._close_window(self._next_run)
        self._next_run = None
        self.flush_dirty()

    def stop(self) -> None:
        """:meth:`suspend`, and no iteration runs any more (the handle closes)."""
        self.suspend()
        self._run = None

    def _take_planned(self, run: Run) -> None:
        w = run.window
        if w is None or not (w.start <= run.pos < w.start + len(w.events)):
            self._close_window(run)
            self._open_window(run, run.pos)
            w = run.window
        _, units, ps = w.events[run.pos - w.start]
        dest: Dict[Tensor, Tensor] = {}
        for p in ps:
            if p not in self.data and p not in self._dirty and p.numel():
                dest[p] = self.mover.host_buffer(p.numel(), p.dtype)
        for unit in units:
            tensors = next(w.pipe)
            for s, t in zip(unit, tensors):
                d = dest.get(self.by_key[s.key])
                if d is not None:
                    d[s.start:s.stop].copy_(t)
        for p in ps:
            if p in self.data or self._set_local(p):
                continue
            self._count_read(p)
            self.set(p, self.mover.to_device(dest[p].view(p.shape), owned=True))
        run.pos += 1
        if run.pos == w.start + len(w.events):
            self._close_window(run)
            self.flush_dirty()
            if run.pos < len(run.plan) and self.prefetch > 0:
                self._open_window(run, run.pos)

    def event(self, idx: int) -> None:
        """Module ``idx`` asks for its parameters (holds are added by the caller): taken
        from the read-ahead window when it comes in the recorded order, else read now."""
        run = self._run
        if run is not None:
            run.record.append(idx)
        ps = self.mod_params[idx]
        if not self.io:
            self.fetch(ps)
            return
        if run is not None and not run.diverged:
            if run.pos < len(run.plan) and run.plan[run.pos] == idx:
                self._take_planned(run)
                return
            run.diverged = True
            self._close_window(run)
        self.fetch(ps)

    def diverge(self) -> None:
        """A module's parameters changed: the recorded orders are forgotten and the running
        iteration reads without a plan."""
        self._plans.clear()
        if self._run is not None:
            self._run.diverged = True
            self._close_window(self._run)

    # ------------------------------------------------------------------ iterations
    @property
    def in_iteration(self) -> bool:
        return self._run is not None

    def begin_iteration(self, grad: bool) -> None:
        """The root's forward starts (the previous iteration is ended first by the caller):
        the run read ahead after the last step is taken when it fits ``grad``."""
        nxt, self._next_run = self._next_run, None
        if nxt is not None and nxt.grad == grad and nxt.plan is self._plans.get(grad):
            self._run = nxt
        else:
            self._close_window(nxt)
            self._run = Run(grad, self._plans.get(grad))

    def end_iteration(self) -> None:
        run, self._run = self._run, None
        if run is None:
            return
        self._close_window(run)
        if self.io:
            self.flush_dirty()
        if run.record:
            self._plans[run.grad] = run.record

    def read_next_iteration(self) -> None:
        """After an optimizer step: start reading the next iteration's first modules (while
        the caller zeroes gradients and loads the next batch), when a disk store has a
        recorded order and nothing runs."""
        if not self.io or self._run is not None or self._next_run is not None:
            return
        plan = self._plans.get(True)
        if plan and self.prefetch > 0:
            self.flush_dirty()
            run = Run(True, plan)
            self._open_window(run, 0)
            self._next_run = run

"""Materializing and releasing offloaded parameters, and reading them ahead.

:class:`ReadAhead` is the part of :class:`~statestore.offload.OffloadHandle` that moves
data: a parameter is materialized (``_set``) from a synchronous read (``_fetch``) or from
the read-ahead window, and released (``_release_now``) when no forward, backward or
optimizer update holds it. The handle records, per iteration (:class:`Run`), the order in
which modules ask for their parameters and, in the next iteration, reads up to ``prefetch``
modules ahead through one store pipeline at a time (:class:`Window`); updated parameters of a
disk store are written back (write-behind) when a window closes, never while a read pipeline
is open on the store.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor

from .._stream import chunk_ranges
from .._types import Slice, StateSpec

__all__ = ["ReadAhead", "Run", "Window", "round_up"]


def round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


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


class ReadAhead:
    """Data movement of :class:`~statestore.offload.OffloadHandle` (a base class of it: the
    attributes used here are set by the handle's ``__init__``)."""

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
            n = p.numel()
            limit = self.store.unit_bytes or max(n * p.dtype.itemsize, 1)
            k = self._key[p]
            spec = StateSpec(tuple(p.shape), p.dtype)
            s = [Slice(k, a, b) for a, b in
                 chunk_ranges(spec, limit, self.store.cut_alignment(limit))] if n else []
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
                nb = round_up(max(s.numel * size, 1), align)
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
        rest = [p for p in need if not self._set_local(p)]
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

    def _set_local(self, p: Tensor) -> bool:
        """Materialize ``p`` without the store where it can be: from its update not yet
        written back, or empty (no elements). False: it needs a read."""
        if p in self._dirty:
            self._set(p, self._dirty[p])
        elif p.numel() == 0:
            self._set(p, torch.empty(p.shape, dtype=p.dtype, device=self.device))
        else:
            return False
        return True

    def _count_read(self, p: Tensor) -> None:
        self._stats["reads"] += 1
        self._stats["read_bytes"] += p.numel() * p.dtype.itemsize

    def value(self, p: Tensor) -> Tensor:
        """``p``'s current value (read from the store if needed, not kept materialized)."""
        if p in self._data:
            return self._data[p]
        self._fetch([p])
        t = self._data[p]
        self._maybe_release(p)
        return t

    # ------------------------------------------------------------------ read-ahead windows
    def _open_window(self, run: Run, start: int) -> None:
        events = []
        total = 0
        limit = max(1, self.prefetch)
        budget = self.store.budget_bytes // 2
        for i in range(start, len(run.plan)):
            ps = self._mod_params[run.plan[i]]
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

    def _close_window(self, run: Optional[Run]) -> None:
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

    def _take_planned(self, run: Run) -> None:
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
            if p in self._data or self._set_local(p):
                continue
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
            self._run = Run(grad, self._plans.get(grad))

    def _end_iteration(self) -> None:
        run, self._run = self._run, None
        if run is None:
            return
        self._close_window(run)
        if self._io:
            self._flush_dirty()
        if run.record:
            self._plans[run.grad] = run.record

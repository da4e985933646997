"""The update-in-backward stepper (``update_in_backward=True``): each parameter is updated
from a gradient hook as soon as backward has produced its gradient, through the units the last
``step()`` planned (in the order backward finished their gradients) and prefetched; ``step()``
then updates what backward could not and plans the next step (:class:`BackwardStepper`).

Backward never waits for I/O (the hook takes a unit only once its states have arrived: the
pipeline's polling calls), except with ``release_grads`` when more gradient bytes wait for their
states than the store's budget.

The gradient must reach ``step()`` unchanged (no clipping, unscaling or accumulation over
several backward calls). The optimizer
records each gradient (tensor and version) when its hook fires; ``step()`` compares, and a
second hook call for one parameter before ``step()`` marks accumulation. Backward is never
interrupted: the misuse is explained at ``step()``:

* when nothing was updated yet (the first step: no plan to update during backward exists yet,
  so any loop that clips or accumulates is caught there), ``step()`` changes nothing and
  raises; setting ``optimizer.update_in_backward = False`` and calling ``step()`` again makes
  the step from the gradients as they are. With ``release_grads``, a first backward whose
  gradients outgrow the states' budget applies them unit by unit as it goes (no plan, so it
  waits for the store: :meth:`BackwardStepper._apply_unplanned`), and falls in the next case;
* when backward already updated some parameters (a loop that starts clipping later),
  ``step()`` updates the others from their current gradients, so that every parameter makes
  the step exactly once and the optimizer stays consistent, then raises; the next step works
  once the loop is fixed or the mode is off.
"""
from __future__ import annotations

import weakref
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor

from ..errors import StateStoreError
from ._metadata import short_names
from ._table import ParamTable
from ._dtensor import local
from ._units import checked_grad, plan_step

__all__ = ["misuse_reason", "refused_message", "mixed_message", "PassState", "BackwardStepper",
           "backward_hook"]

_RULE = ("with update_in_backward=True each gradient is applied as soon as backward produces "
         "it, so gradients must reach step() unchanged: no clipping or unscaling between "
         "backward and step(), no accumulation over several backward calls")


def misuse_reason(second_gradient: Sequence[str], changed: Sequence[str]) -> str:
    """What the loop did, or '' when nothing."""
    if second_gradient:
        return (f"{len(second_gradient)} parameter(s) ({short_names(list(second_gradient))}) "
                f"got a second gradient before step() (gradient accumulation over several "
                f"backward calls)")
    if changed:
        return (f"the gradients of {len(changed)} parameter(s) ({short_names(list(changed))}) "
                f"changed after backward produced them (clipping, unscaling or scaling "
                f"gradients between backward and step())")
    return ""


def refused_message(reason: str) -> str:
    return (f"update_in_backward: {reason}; {_RULE}. Nothing was updated: remove that from "
            f"the training loop, or set optimizer.update_in_backward = False and call step() "
            f"again (this step's gradients are kept)")


def mixed_message(reason: str, early: Sequence[str]) -> str:
    return (f"update_in_backward: {reason}, after backward had already updated "
            f"{len(early)} parameter(s) ({short_names(list(early))}) from the gradients it "
            f"produced; step() updated the others from their current gradients, so every "
            f"parameter made this step once, not all from the same gradients. {_RULE}: remove "
            f"that from the training loop, or set optimizer.update_in_backward = False; the "
            f"next step() works either way")


def backward_hook(owner, stepper: "BackwardStepper", prefetching) -> Callable[[Tensor], None]:
    """The gradient hook of an optimizer's parameters: with ``update_in_backward``, hands the
    parameter whose gradient is final to ``stepper``; otherwise lets the disk stores in
    ``prefetching`` (a WeakSet of the optimizer's) start the next step's reads
    (:meth:`StateStore.pump`, which never blocks). Holds the optimizer and stepper weakly."""
    ref, sref = weakref.ref(owner), weakref.ref(stepper)

    def hook(param) -> None:
        opt = ref()
        if opt is None:
            return
        if opt.update_in_backward:
            st = sref()
            if st is not None:
                st.grad_ready(param)
            return
        if not prefetching:
            return
        for store in list(prefetching):
            try:
                store.pump()
            except StateStoreError:      # surfaces again at the step that needs it
                store.cancel_prefetch()
                prefetching.discard(store)
    return hook


class PassState:
    """One store's part of the step made during backward: the pipeline over the units
    planned for it, each unit's group and entries, and how many units are done."""

    __slots__ = ("store", "pipe", "meta", "done")

    def __init__(self, store, pipe, meta: list):
        self.store, self.pipe, self.meta, self.done = store, pipe, meta, 0

    def close_refused(self, err: BaseException) -> None:
        """Give the pipeline's buffers back without writing the unit in hand."""
        try:
            self.pipe.__exit__(type(err), err, None)
        except BaseException:
            pass


class BackwardStepper:
    """The step an optimizer makes during backward.

    Args:
        table: the optimizer's bookkeeping (keys, step counts, the next step's plans,
            ``touched``, ``failed``).
        fmt: the optimizer's moment format (for planning).
        owner: the optimizer's class name, for messages.
        update: the optimizer's unit update ``(tensors, group, entries, grads, grad_scale,
            device)``; held weakly (a bound method of the optimizer).
        release_grads: set ``param.grad = None`` once backward applied it.

    Attributes:
        ready: parameters whose gradient backward finished since the last step, in order.
        released: parameters whose gradient was applied and released this backward.
    """

    def __init__(self, table: ParamTable, fmt, owner: str, update: Callable,
                 release_grads: bool):
        self.table, self.fmt, self.owner = table, fmt, owner
        self._update = weakref.WeakMethod(update)
        self.release_grads = release_grads
        self.ready: Dict[Tensor, int] = {}
        #: parameters whose hook fired twice before step() (accumulation), and each
        #: gradient as its hook saw it (tensor, version): step() checks them
        self.second_grad: Dict[Tensor, None] = {}
        self.seen: Dict[Tensor, Tuple[Tensor, int]] = {}
        self.released: Set[Tensor] = set()
        #: bytes of gradients backward has finished but not yet applied (release_grads)
        self.held_grad_bytes = 0
        #: parameters backward updated, with the gradient (and its version) it used
        self.early_done: Dict[Tensor, Tuple[Optional[Tensor], int]] = {}
        self.passes: Optional[List[PassState]] = None
        #: the optimizer's ``(params) -> {store: [(group, params)]}`` that creates the states
        #: of ``params`` and groups them for a step (held weakly), used with
        #: ``release_grads`` while no plan exists; None: gradients wait for ``step()``
        self.unplanned: Optional[weakref.WeakMethod] = None
        self._budget: Optional[int] = None

    @property
    def busy(self) -> bool:
        """Whether backward has updated some parameters since the last step."""
        return bool(self.early_done) or self.table.touched and self.passes is not None

    def check_switch(self, value: bool, skip_nonfinite: bool, process_group) -> None:
        """Whether ``optimizer.update_in_backward`` may become ``value`` now.

        Raises:
            ValueError: True with ``skip_nonfinite`` or a ``process_group``.
            StateStoreError: backward has updated some parameters since the last step.
        """
        if value and skip_nonfinite:
            raise ValueError("update_in_backward=True cannot be combined with skip_nonfinite=True")
        if value and process_group is not None:
            raise ValueError("update_in_backward=True cannot be combined with process_group")
        if self.busy:
            raise StateStoreError("update_in_backward cannot change while backward has updated "
                                  "some parameters: call step() first")

    # ------------------------------------------------------------------ during backward
    def grad_ready(self, p: Tensor) -> None:
        """Gradient hook: ``p``'s gradient is final. Updates, in the planned order, every
        unit whose parameters all have final gradients and whose states have arrived from
        the store; never waits for I/O (that is left to ``step()``)."""
        if p in self.ready:
            # A second gradient before step() (accumulation): explained at step(); backward
            # goes on, and nothing more is updated during it.
            self.second_grad[p] = None
            return
        self.ready[p] = len(self.ready)
        if p.grad is not None:
            self.seen[p] = (p.grad, p.grad._version)
            if self.release_grads:
                self.held_grad_bytes += local(p.grad).numel() * p.grad.element_size()
        table = self.table
        if table.failed or self.second_grad:
            return
        unplanned = self.passes is None and not table.next_plans
        if unplanned and not (self.release_grads and self._unplanned_over_budget()):
            return
        try:
            with torch.no_grad():
                if unplanned:
                    self._apply_unplanned()
                else:
                    self._open()
                    self._advance(block=False)
        except BaseException as e:
            self.abort(e)
            raise

    def _unplanned_over_budget(self) -> bool:
        """No plan yet (the first step, the first after a resume or a change of mode):
        more gradient bytes held than the smallest budget of the optimizer's stores."""
        if self.unplanned is None:
            return False
        if self._budget is None:
            self._budget = min((getattr(s, "budget_bytes", 0) or 0
                                for s in set(self.table.stores.values())), default=0)
        return self.held_grad_bytes > self._budget

    def _apply_unplanned(self) -> None:
        """``release_grads`` with no plan: update now, unit by unit and waiting for the
        store, every parameter whose gradient is final and not yet applied (its states
        created first), and release those gradients; so the first step holds at most about a
        budget of gradients too, not all of them."""
        unplanned = self.unplanned()
        if unplanned is None:
            return
        pending = [p for p in self.ready if p not in self.early_done and p.grad is not None]
        for store, items in unplanned(pending).items():
            units, meta = plan_step(store, items, self.table.keys, self.fmt, self.ready)
            with store.pipeline(units, mode="rw", wait=False) as pipe:
                for tensors, (group, entries) in zip(pipe, meta):
                    self._apply(tensors, group, entries, store.device, None)

    def _open(self) -> None:
        if self.passes is not None:
            return
        self.table.touched = False          # this step's first update
        # The prefetch started by the last step() is handed out here.
        self.passes = [PassState(store, store.pipeline(units, mode="rw", wait=False), meta)
                       for store, (units, meta) in self.table.next_plans.items()]

    def _advance(self, block: bool, grads: Optional[Dict[Tensor, Tensor]] = None) -> None:
        """Update the pass's next units: those ready now (``block=False``), or all of them."""
        for sp in self.passes or ():
            pipe, meta = sp.pipe, sp.meta
            while sp.done < len(meta):
                group, entries = meta[sp.done]
                if block:
                    tensors = next(pipe)
                elif not all(e[0] in self.ready for e in entries):
                    pipe.ready()                # start the reads that need no waiting
                    break
                else:
                    tensors = pipe.take()       # None: its states have not arrived yet
                    if tensors is None:
                        if not self._too_many_grads(sp.store):
                            break
                        tensors = pipe.wait_next()      # release_grads: backward waits
                sp.done += 1
                self._apply(tensors, group, entries, sp.store.device, grads)
                pipe.commit()
            if block:
                pipe.close()

    def _apply(self, tensors: List[Tensor], group: dict, entries, dev: torch.device,
               grads: Optional[Dict[Tensor, Tensor]]) -> None:
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
        table = self.table
        if grads is None:
            grads = {e[0]: checked_grad(e[0], table.keys[e[0]], self.owner) for e in sel_e}
        undo: dict = {}
        try:
            table.advance_steps([table.keys[e[0]] for e in sel_e if e[1] == 0], undo)
            self._update()(sel_t, group, sel_e, grads, 1.0, dev)
        except BaseException as e:
            table.step_failed(undo, e, record=False)     # abort() records a failure
            raise
        if early:
            for e in sel_e:
                p = e[0]
                if self.release_grads and e[2] == local(p).numel():     # its last slice
                    g = p.grad
                    self.held_grad_bytes -= local(g).numel() * g.element_size()
                    p.grad = None
                    self.seen.pop(p, None)     # it held the gradient too
                    self.released.add(p)
                    self.early_done[p] = (None, -1)
                    continue
                g = p.grad
                if p not in self.early_done:
                    self.early_done[p] = (g, g._version)

    def _too_many_grads(self, store) -> bool:
        """``release_grads``: more gradient bytes wait for their states than the store's RAM
        budget; backward then waits for the disk instead of piling them up."""
        return self.release_grads and self.held_grad_bytes > store.budget_bytes

    def abort(self, err: BaseException) -> None:
        """A pass failed: give its buffers back; once anything was updated the optimizer
        refuses to go on (parameters and states hold a mix of two steps)."""
        if self.table.touched or self.early_done:
            self.table.failed.append(f"{type(err).__name__}: {err}")
        else:                   # nothing changed: a new backward (or step()) starts afresh
            self.ready = {}
        for sp in self.passes or ():
            sp.close_refused(err)
        self.passes = None

    # ------------------------------------------------------------------ in step()
    def finish_step(self, work, grads: Dict[Tensor, Tensor],
                    may_prefetch: Callable[[object], bool]) -> None:
        """``step()``: check the gradients backward already used, update every remaining
        unit, plan the next step in gradient order and prefetch it where ``may_prefetch``.

        Args:
            work: ``{store: [(group, params)]}``, the parameters this step updates.
            grads: their gradients.

        Raises:
            StateStoreError: the loop changed gradients between backward and ``step()``
                (before anything was updated: nothing changed; after: every parameter made
                the step, and the error says which from which gradients).
        """
        table, keys = self.table, self.table.keys
        changed = [keys[p] for p, (g, version) in self.seen.items()
                   if p not in self.released and (p.grad is not g or g._version != version)]
        reason = misuse_reason([keys[p] for p in self.second_grad], changed)
        if reason and not self.early_done and not table.touched:
            self.reset()            # nothing changed: the step can be made again
            raise StateStoreError(refused_message(reason))
        try:
            with torch.no_grad():
                self._open()
                self._advance(block=True, grads=grads)
            self.passes = None
            covered = {e[0] for _, meta in table.next_plans.values() for _, es in meta
                       for e in es}
            covered.update(self.released)       # applied and released during backward
            for store, items in work.items():
                rest = [(g, [p for p in ps if p not in covered]) for g, ps in items]
                rest = [(g, ps) for g, ps in rest if ps]
                if not rest:
                    continue
                units, meta = plan_step(store, rest, keys, self.fmt, self.ready)
                with store.pipeline(units, mode="rw", wait=False) as pipe:
                    for tensors, (group, entries) in zip(pipe, meta):
                        self._apply(tensors, group, entries, store.device, grads)
        except BaseException as e:
            self.abort(e)
            self.ready = {}
            raise
        finally:
            early = [keys[p] for p in self.early_done]
            self.early_done = {}
            self.seen = {}
            self.second_grad = {}
            self.released = set()
            self.held_grad_bytes = 0
            self._budget = None
        order, self.ready = self.ready, {}
        table.touched = False
        table.next_plans.clear()
        for store, items in work.items():
            table.next_plans[store] = plan_step(store, items, keys, self.fmt, order)
            if may_prefetch(store):
                store.prefetch(table.next_plans[store][0], mode="rw")
        if reason:                  # the step is complete and consistent: now say what happened
            raise StateStoreError(mixed_message(reason, early))

    def reset(self) -> None:
        """Forget what backward reported since the last step and give the pass's buffers
        back; only while nothing was updated."""
        err = StateStoreError("the step was refused")
        for sp in self.passes or ():
            sp.close_refused(err)               # buffers back, nothing written
        self.passes = None
        self.ready, self.seen, self.second_grad, self.early_done = {}, {}, {}, {}
        self.released, self.held_grad_bytes, self._budget = set(), 0, None

"""The update-in-backward stepper (``update_in_backward=True``): each parameter is updated
from a gradient hook as soon as backward has produced its gradient, through the units the last
``step()`` planned (in the order backward finished their gradients) and prefetched; ``step()``
then updates what backward could not and plans the next step (:class:`BackwardStepper`).

Backward never waits for I/O (the hook takes a unit only once its states have arrived: the
pipeline's polling calls), except with ``release_grads`` when more gradient bytes wait for their
states than the store's budget.

The gradient must reach ``step()`` unchanged (no clipping, unscaling or accumulation over
several backward calls). The optimizer records each gradient (tensor, version and a digest
of its values: :class:`~statestore.optim._backward_watch.GradMark`) when its hook fires;
``step()`` compares, and a second hook call for one parameter before ``step()`` marks
accumulation. Backward is never interrupted: the misuse is explained at ``step()``:

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

A backward that raises part-way (the model's exception, a Ctrl-C) ends its step: the
parameters it updated have made it, the others have not (a torch step in which only they had
gradients), and none is left half updated. The engine tells (a callback queued at a
backward's first hook is dropped without running when that backward fails:
:class:`~statestore.optim._backward_watch.BackwardWatch`); the next call (a hook of the next
backward, ``step()``, ``zero_grad()``, a save, ``state_dict()``) ends the step first
(:meth:`BackwardStepper.close_step`): a parameter a unit updated in part (a long parameter cut
in units whose next states had not arrived) is finished from the gradient it started with,
and the gradients applied are not applied again by a ``step()`` (so ``step()`` right after the
failure updates the others from the gradients they hold, as torch's would; retrying the batch
makes a new step). A retry cannot reproduce a backward that never failed: its forward already
sees the updated parameters. Signals are deferred inside the hooks, so a Ctrl-C lands between
them, as a failure of backward. The pass's read-ahead is lent to the store
(:meth:`~statestore.pipeline.StatePipeline.lend`): any other use of the store ends it first, so
a failed backward never leaves the store without RAM for a save or a load.
"""
from __future__ import annotations

import weakref
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor

from .._signals import deferred_signals
from ..errors import StateStoreError
from ._backward_watch import (BackwardWatch, GradMark, mixed_message, misuse_reason,
                              refused_message)
from ._dtensor import any_rank, local
from ._plan import checked_grad
from ._table import ParamTable

__all__ = ["PassState", "BackwardStepper"]


class PassState:
    """One store's part of the step made during backward: the pipeline over the units
    planned for it, the units, each unit's group and entries, and how many units are done."""

    __slots__ = ("store", "pipe", "units", "meta", "done")

    def __init__(self, store, pipe, units: list, meta: list):
        self.store, self.pipe, self.units, self.meta, self.done = store, pipe, units, meta, 0

    def close_refused(self, err: BaseException) -> None:
        """Give the pipeline's buffers back without writing the unit in hand."""
        try:
            self.pipe.__exit__(type(err), err, None)
        except BaseException:
            pass


def _give_back_of(stepper: "BackwardStepper") -> Callable[[], bool]:
    """:meth:`BackwardStepper.give_back`, holding the stepper weakly (stores keep it)."""
    ref = weakref.ref(stepper)

    def give_back() -> bool:
        st = ref()
        return True if st is None else st.give_back()
    return give_back


class BackwardStepper:
    """The step an optimizer makes during backward.

    Args:
        table: the optimizer's bookkeeping (keys, step counts, the next step's plans,
            ``touched``, ``failed``).
        plan: ``plan(store, items, order)``: a step's pipeline units and their entries
            (:func:`statestore.optim._plan.plan_step` over the optimizer's layout).
        owner: the optimizer's class name, for messages.
        update: the optimizer's unit update ``(tensors, group, entries, grads, grad_scale,
            device)``; held weakly (a bound method of the optimizer).
        release_grads: set ``param.grad = None`` once backward applied it.

    Attributes:
        ready: parameters whose gradient backward finished since the last step, in order.
        released: parameters whose gradient was applied and released this backward.
    """

    def __init__(self, table: ParamTable, plan: Callable, owner: str, update: Callable,
                 release_grads: bool):
        self.table, self.plan, self.owner = table, plan, owner
        self._update = weakref.WeakMethod(update)
        self.release_grads = release_grads
        self.ready: Dict[Tensor, int] = {}
        #: parameters whose hook fired twice before step() (accumulation), and each
        #: gradient as its hook saw it (tensor, version, digest): step() checks them
        self.second_grad: Dict[Tensor, None] = {}
        self.seen: Dict[Tensor, GradMark] = {}
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
        #: elements of each parameter updated this step (its slices come in order): a
        #: parameter is updated in part while 0 < applied_to[p] < local(p).numel()
        self.applied_to: Dict[Tensor, int] = {}
        #: set when a backward this stepper saw raised part-way (BackwardWatch)
        self.backward_failed = False
        #: gradients (tensor, version) a step closed early applied: the next step() skips
        #: a parameter still holding it
        self.spent: Dict[Tensor, Tuple[Tensor, int]] = {}
        self.watch = BackwardWatch(self)
        self._busy = False          # in a hook or step(): requests to give the ring back wait
        table.closer = weakref.WeakMethod(self.close_step)

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
        the store; never waits for I/O (that is left to ``step()``). Signals are deferred
        meanwhile: a Ctrl-C lands between hooks, where every unit is whole."""
        with deferred_signals():
            self._busy = True
            try:
                self._grad_ready(p)
            finally:
                self._busy = False

    def _grad_ready(self, p: Tensor) -> None:
        if self.backward_failed or self.watch.dropped():
            self._close_step()
        self.watch.saw_hook()
        if p in self.ready:
            # A second gradient before step() (accumulation): explained at step(); backward
            # goes on, and nothing more is updated during it.
            self.second_grad[p] = None
            return
        self.ready[p] = len(self.ready)
        if p.grad is not None:
            self.seen[p] = GradMark(p.grad)
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
            units, meta = self.plan(store, items, self.ready)
            with store.pipeline(units, mode="rw", wait=False) as pipe:
                for tensors, (group, entries) in zip(pipe, meta):
                    self._apply(tensors, group, entries, store.device, None)

    def _open(self) -> None:
        if self.passes is not None:
            return
        self.table.touched = False          # this step's first update
        # The prefetch started by the last step() is handed out here, lent to its store.
        self.passes = []
        give_back = _give_back_of(self)
        for store, (units, meta) in self.table.next_plans.items():
            self.passes.append(PassState(store, store.pipeline(units, mode="rw", wait=False),
                                         units, meta))
            self.passes[-1].pipe.lend(give_back)

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
        use: Dict[Tensor, Tensor] = {}
        pos = 0
        for e in entries:
            p, a, _, names = e
            n = len(names)
            g = self._grad_for(p, grads)
            if g is not None:
                sel_t += tensors[pos:pos + n]
                sel_e.append(e)
                use[p] = g
            pos += n
        if not sel_e:
            return
        table = self.table
        undo: dict = {}
        try:
            table.advance_steps([table.keys[e[0]] for e in sel_e if e[1] == 0], undo)
            self._update()(sel_t, group, sel_e, use, 1.0, dev)
        except BaseException as e:
            table.step_failed(undo, e, record=False)     # abort() records a failure
            raise
        for e in sel_e:
            self.applied_to[e[0]] = e[2]
        if early:
            for e in sel_e:
                p = e[0]
                g = use[p]
                if self.release_grads and e[2] == local(p).numel():     # its last slice
                    if p.grad is g:
                        self.held_grad_bytes -= local(g).numel() * g.element_size()
                        p.grad = None
                    self.seen.pop(p, None)     # it held the gradient too
                    self.released.add(p)
                    self.early_done[p] = (None, -1)
                    continue
                if p not in self.early_done:
                    self.early_done[p] = (g, g._version)

    def _grad_for(self, p: Tensor, grads: Optional[Dict[Tensor, Tensor]]) -> Optional[Tensor]:
        """The gradient to update ``p``'s next slice from (None: not now): a parameter
        already updated in part goes on from the gradient it started with, one updated
        whole is never updated again this step; otherwise the step's (``grads``), or during
        backward its final ``p.grad``.

        Raises:
            StateStoreError: after a failed backward, the gradient a parameter updated in
                part started with was changed in place (``zero_grad(set_to_none=False)``):
                it cannot be finished exactly (the optimizer then refuses to go on).
        """
        done = self.applied_to.get(p)
        if done is not None and done >= local(p).numel():
            return None
        if done is not None and p in self.early_done:
            g, version = self.early_done[p]
            if g is not None and g._version == version:
                return g
            if not self.backward_failed and grads is not None and p in grads:
                return grads[p]     # a loop that changed it: reported by step() (mixed)
            raise StateStoreError(
                f"{self.owner}: backward failed after updating part of parameter "
                f"{self.table.keys[p]!r}, and the gradient it started from was changed in "
                f"place before the rest could be updated (zero_grad(set_to_none=False) or a "
                f"model's zero_grad after the failure)")
        if grads is None:
            return checked_grad(p, self.table.keys[p], self.owner)
        return grads.get(p)

    def _too_many_grads(self, store) -> bool:
        """``release_grads``: more gradient bytes wait for their states than the store's RAM
        budget; backward then waits for the disk instead of piling them up."""
        return self.release_grads and self.held_grad_bytes > store.budget_bytes

    def abort(self, err: BaseException) -> None:
        """A pass failed: give its buffers back; once anything was updated the optimizer
        refuses to go on (parameters and states hold a mix of two steps)."""
        if self.table.touched or self.early_done or self.applied_to:
            self.table.failed.append(f"{type(err).__name__}: {err}")
        else:                   # nothing changed: a new backward (or step()) starts afresh
            self.ready = {}
        self._drop_passes(err)

    def _drop_passes(self, err: BaseException) -> None:
        passes, self.passes = self.passes, None
        for sp in passes or ():
            sp.close_refused(err)

    # ------------------------------------------------------------------ an open step
    def settle(self) -> None:
        """Give the pass's ring buffers back now (its unread units are dropped) and finish
        the parameters it updated in part, from the gradient each started with; the step
        stays open (``step()`` or a retried backward finishes it, without the read-ahead).

        Raises:
            StateStoreError, StateStoreIOError: a part could not be finished (the optimizer
                then refuses to go on).
        """
        if not self.passes:
            return
        passes, self.passes = self.passes, []           # []: this step's pass is over
        rest = []
        for sp in passes:
            for j in range(sp.done, len(sp.meta)):
                group, entries = sp.meta[j]
                pos = 0
                for e in entries:
                    n = len(e[3])
                    if 0 < self.applied_to.get(e[0], 0) < local(e[0]).numel():
                        rest.append((sp.store, sp.units[j][pos:pos + n], group, e))
                    pos += n
            sp.close_refused(StateStoreError("the pass was given back"))
        try:
            with torch.no_grad():
                for store in dict.fromkeys(r[0] for r in rest):
                    mine = [r for r in rest if r[0] is store]
                    with store.pipeline([r[1] for r in mine], mode="rw") as pipe:
                        for tensors, (_, _, group, e) in zip(pipe, mine):
                            self._apply(tensors, group, [e], store.device, None)
        except BaseException as e:
            self.abort(e)
            raise

    def give_back(self) -> bool:
        """A store needs the pass's ring (:meth:`StatePipeline.lend`): :meth:`settle`, unless
        this stepper is using the pass right now (False: asked again later). Never raises:
        a failure makes the optimizer refuse to go on (it says why)."""
        if self._busy:
            return False
        self._guarded(self.settle)
        return True

    def close_step(self) -> None:
        """After a failed backward, and before a save, ``state_dict()``, ``load_state_dict()``
        or master weights: an open step (parameters updated during backward, the others
        waiting for ``step()``) ends here, consistent: :meth:`settle`, then what was updated
        has made the step and the gradients it applied are left out of the next ``step()``
        (:meth:`before_step`). Errors make the optimizer refuse to go on (it says why)."""
        if self._busy or self.table.failed:
            return
        self._guarded(self._close_step)

    def _guarded(self, work) -> None:
        """``work()`` marked busy, with signals deferred; its errors were recorded by abort()
        (every later call says so), so they are not raised here."""
        self._busy = True
        try:
            with deferred_signals():
                work()
        except Exception:
            pass
        finally:
            self._busy = False

    def _close_step(self) -> None:
        self.watch.ran = None           # that backward's failure is dealt with
        self.settle()
        if not (self.early_done or self.applied_to):
            self.reset()            # nothing was updated: the next backward starts afresh
            return
        self.spent.update((p, rec) for p, rec in self.early_done.items() if rec[0] is not None)
        released = self.released
        self.reset()
        self.released = released        # still out of step(): their gradients are gone
        self.table.touched = False

    def forget(self) -> None:
        """The states were replaced (a load): drop the open step and its pass, unwritten."""
        self._drop_passes(StateStoreError("the states were replaced"))
        self.reset()
        self.spent = {}
        self.table.next_plans.clear()

    def before_zero_grad(self, set_to_none: bool) -> None:
        """``zero_grad()``: end a failed backward's step, or a step that ``step()`` never
        finished (interrupted: the gradients are dropped, so the next backward starts a new
        step, not an accumulation), or (zeroing in place) finish what the pass updated in
        part, while the gradients they started from are intact."""
        if self.backward_failed or self.watch.unfinished() or self.ready:
            self.close_step()
        elif not set_to_none:
            self.give_back()

    def before_step(self, work, grads: Dict[Tensor, Tensor]) -> None:
        """``step()``, before anything: end a failed backward's step; leave out of ``work``
        and ``grads`` the parameters still holding a gradient a step closed early
        (:meth:`close_step`) already applied."""
        if self.backward_failed or self.watch.unfinished():
            self.close_step()
        if not self.spent:
            return
        spent = {p for p, (g, v) in self.spent.items() if p.grad is g and g._version == v}
        self.spent = {}
        for p in spent:
            grads.pop(p, None)
        for store in list(work):
            items = [(g, [p for p in ps if p not in spent]) for g, ps in work[store]]
            work[store] = [(g, ps) for g, ps in items if ps]
            if not work[store]:
                del work[store]

    # ------------------------------------------------------------------ in step()
    def finish_step(self, work, grads: Dict[Tensor, Tensor],
                    may_prefetch: Callable[[object], bool]) -> None:
        """``step()``: check the gradients backward already used, update every remaining
        unit, plan the next step in gradient order and prefetch it where ``may_prefetch``.
        After a backward that failed, the gradients it left are the loop's to keep or drop:
        not checked (module docstring).

        Args:
            work: ``{store: [(group, params)]}``, the parameters this step updates.
            grads: their gradients.

        Raises:
            StateStoreError: the loop changed gradients between backward and ``step()``
                (before anything was updated: nothing changed; after: every parameter made
                the step, and the error says which from which gradients).
        """
        table, keys = self.table, self.table.keys
        changed = [keys[p] for p, mark in self.seen.items()
                   if p not in self.released and mark.changed(p.grad)]
        reason = misuse_reason([keys[p] for p in self.second_grad], changed)
        # DTensor parameters: every rank of their mesh takes the same branch (a rank whose
        # shards are empty sees no change; another rank's hooks may have updated more)
        elsewhere, updated = any_rank(table.params, [bool(reason),
                                                     bool(self.early_done or table.touched)])
        if elsewhere and not reason:
            reason = ("the gradients changed after backward produced them on another rank of "
                      "the parameters' mesh (clipping, unscaling or scaling gradients between "
                      "backward and step(), or accumulation)")
        if reason and not updated:
            self.reset()            # nothing changed: the step can be made again
            raise StateStoreError(refused_message(reason))
        whole = deferred_signals()  # entered once the last unit is done, left at the end
        try:
            self._busy = True
            with torch.no_grad():
                self._open()
                self._advance(block=True, grads=grads)
            self.passes = None
            covered = set(self.applied_to) | self.released
            for store, items in work.items():
                rest = [(g, [p for p in ps if p not in covered]) for g, ps in items]
                rest = [(g, ps) for g, ps in rest if ps]
                if not rest:
                    continue
                units, meta = self.plan(store, rest, self.ready)
                with store.pipeline(units, mode="rw", wait=False) as pipe:
                    for tensors, (group, entries) in zip(pipe, meta):
                        self._apply(tensors, group, entries, store.device, grads)
            # A Ctrl-C from here on waits until the step is recorded whole (one landing
            # just before: the step failed after changing things, and the optimizer refuses)
            whole.__enter__()
        except BaseException as e:
            self.abort(e)
            self.ready = {}
            raise
        finally:
            self._busy = False
            early = [keys[p] for p in self.early_done]
            order = self.ready
            self.reset(keep_passes=True)
        try:
            table.touched = False
            table.next_plans.clear()
            for store, items in work.items():
                table.next_plans[store] = self.plan(store, items, order)
                if may_prefetch(store):
                    store.prefetch(table.next_plans[store][0], mode="rw")
        finally:
            whole.__exit__(None, None, None)
        if reason:                  # the step is complete and consistent: now say what happened
            raise StateStoreError(mixed_message(reason, early))

    def reset(self, keep_passes: bool = False) -> None:
        """Forget what backward reported since the last step and give the pass's buffers
        back (``keep_passes``: the caller closed them)."""
        if not keep_passes:
            self._drop_passes(StateStoreError("the step was refused"))   # nothing written
        self.ready, self.seen, self.second_grad, self.early_done = {}, {}, {}, {}
        self.released, self.held_grad_bytes, self._budget = set(), 0, None
        self.applied_to, self.backward_failed = {}, False

"""What an update-in-backward step learns from outside the stepper: whether a backward it saw
failed (:class:`BackwardWatch`), whether a gradient changed after its hook saw it
(:class:`GradMark`), and the messages of a loop that misuses the mode (gradients changed or
accumulated between backward and ``step()``)."""
from __future__ import annotations

import threading
import weakref
from typing import Callable, List, Optional, Sequence

import torch

from .._signals import deferred_signals
from ._metadata import short_names

__all__ = ["BackwardWatch", "GradMark", "misuse_reason", "refused_message", "mixed_message"]

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


def _fingerprint(t: torch.Tensor):
    """A digest of ``t``'s values: xxh3-64 of its bytes on the CPU; elsewhere the sum, in
    int64, of its elements' bit patterns (a 0-d tensor on its device, so that no hook waits
    for the device; compared in ``step()``)."""
    t = t.detach()
    if t.device.type == "cpu":
        import xxhash
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        return xxhash.xxh3_64_intdigest(memoryview(raw))
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.reshape(-1).view(bits).sum(dtype=torch.int64)


class GradMark:
    """A gradient as a hook saw it: the tensor, its version and a digest of its values.

    The version counter misses some in-place changes: ``torch._foreach_*_`` ops on DTensor
    gradients (what ``clip_grad_norm_``'s default foreach path does under FSDP2) bump neither
    the DTensor's counter nor its local tensor's, and ``grad.data.mul_()`` bumps another
    counter than ``grad``'s. The digest sees them: :meth:`changed` compares the values too,
    so whether a change is noticed does not depend on how it was made (a change that
    keeps every bit, or on a GPU one that keeps the sum of the bit patterns, is not one).
    Costs one read of the gradient in the hook and one in ``step()``.
    """

    __slots__ = ("grad", "version", "digest")

    def __init__(self, grad: torch.Tensor):
        from ._dtensor import local
        self.grad, self.version = grad, grad._version
        with torch.no_grad():
            self.digest = _fingerprint(local(grad))

    def changed(self, grad: Optional[torch.Tensor]) -> bool:
        """Whether ``grad`` (the parameter's gradient now) is not the gradient marked, with
        the same values."""
        if grad is not self.grad or grad._version != self.version:
            return True
        from ._dtensor import local
        with torch.no_grad():
            now = _fingerprint(local(grad))
        if isinstance(now, torch.Tensor):
            return not bool(torch.equal(now, self.digest))
        return now != self.digest


def _graph_task_id() -> Optional[int]:
    f = getattr(torch._C, "_current_graph_task_id", None)
    return f() if f is not None else None


def _queue_callback(cb: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(cb)


def _dropped(sref, ran: List[bool]) -> None:
    # a finalizer: a KeyboardInterrupt raised in it would be lost (Python discards it), so a
    # Ctrl-C meanwhile is raised again once it has returned
    with deferred_signals(later=True):
        _failed(sref, ran)


def _failed(sref, ran: List[bool]) -> None:
    st = sref()
    if st is None or ran[0]:
        return
    st.backward_failed = True
    if threading.current_thread() is threading.main_thread():
        # The engine drops the callback while the exception unwinds, before the caller sees
        # it: a parameter updated in part is finished now, so that the model the caller
        # catches the exception with holds whole parameters (on another thread, a CUDA
        # backward's, this waits for the next call into the optimizer or store).
        st.give_back()


class BackwardWatch:
    """Tells a :class:`BackwardStepper` when a backward it saw fails: at the first hook of
    each autograd graph task, a callback is queued with the engine, which runs it when that
    backward completes, and drops it unrun when the backward raises (the model's exception,
    a Ctrl-C): then ``stepper.backward_failed`` is set and, on the main thread, the
    parameters updated in part are finished at once (:meth:`BackwardStepper.give_back`)."""

    __slots__ = ("sref", "gid", "ran", "callback")

    def __init__(self, stepper: "BackwardStepper"):
        self.sref, self.gid = weakref.ref(stepper), None
        self.ran: Optional[List[bool]] = None
        self.callback: Optional[weakref.ref] = None

    def dropped(self) -> bool:
        """Whether the engine dropped the last callback unrun: that backward failed (for
        when the finalizer could not say so)."""
        return self.ran is not None and not self.ran[0] and self.callback() is None

    def unfinished(self) -> bool:
        """Outside backward (``step()``, a save...): whether the last backward watched never
        completed (it failed; the flag may not be set yet while the exception, holding the
        engine's callback through a frame, is still alive)."""
        return self.ran is not None and not self.ran[0]

    def saw_hook(self) -> None:
        gid = _graph_task_id()
        if gid is None or gid == self.gid:
            return
        ran = [False]

        def completed() -> None:
            ran[0] = True
        try:
            _queue_callback(completed)
        except (RuntimeError, AttributeError):     # not inside the engine: nothing to watch
            return
        self.gid, self.ran, self.callback = gid, ran, weakref.ref(completed)
        weakref.finalize(completed, _dropped, self.sref, ran)

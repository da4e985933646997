"""Messages of ``update_in_backward=True`` when the training loop changes gradients between
backward and ``step()`` (clipping, unscaling, accumulating over several backward calls).

With ``update_in_backward`` each parameter is updated from a gradient hook as soon as backward
has produced its gradient, so the gradient must reach ``step()`` unchanged. The optimizer
records each gradient (tensor and version) when its hook fires; ``step()`` compares, and a
second hook call for one parameter before ``step()`` marks accumulation. Backward is never
interrupted: the misuse is explained at ``step()``:

* when nothing was updated yet (the first step: no plan to update during backward exists yet,
  so any loop that clips or accumulates is caught there), ``step()`` changes nothing and
  raises; setting ``optimizer.update_in_backward = False`` and calling ``step()`` again makes
  the step from the gradients as they are;
* when backward already updated some parameters (a loop that starts clipping later),
  ``step()`` updates the others from their current gradients, so that every parameter makes
  the step exactly once and the optimizer stays consistent, then raises; the next step works
  once the loop is fixed or the mode is off.
"""
from __future__ import annotations

from typing import Sequence

from ._resume import short_names

__all__ = ["misuse_reason", "refused_message", "mixed_message"]

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

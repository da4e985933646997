"""What a resume replaced that the caller had set, said with a :class:`ResumeWarning`.

A checkpoint's hyperparameters and step counts win when it is applied to an optimizer (as
``load_state_dict``): :func:`warn_replaced` says so where that replaced something the caller
chose. Nothing is said on the normal resume path: an optimizer that has not stepped, built
with the values the checkpoint was saved with (a scheduler's ``lr`` is compared through its
``initial_lr``, the value the optimizer was built with).
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Dict, Iterable, List, Sequence

import torch
from torch import Tensor

from ..errors import ResumeWarning

__all__ = ["warn_replaced", "replaced_hyperparameters", "lrs_to_check", "warn_lr_reset_after_load"]

#: hyperparameters a constructor takes, compared with the checkpoint's (``lr`` apart)
_COMPARED = ("betas", "eps", "weight_decay", "amsgrad", "maximize", "adamw_mode")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: torch's own frames (a no_grad decorator, an LR scheduler's wrapper of ``step``) between
#: the caller and statestore are skipped too
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_SHOW = 3


def _plain(v: Any) -> Any:
    if isinstance(v, Tensor) and v.numel() == 1:
        return v.item()
    if isinstance(v, (list, tuple)):
        return tuple(_plain(x) for x in v)
    return v


def _base_lr(group: Dict[str, Any]) -> Any:
    """The lr a group was built with: a scheduler's ``initial_lr`` where there is one."""
    return _plain(group.get("initial_lr", group.get("lr")))


def replaced_hyperparameters(param_groups: Sequence[Dict[str, Any]],
                             new_hyper: Sequence[Dict[str, Any]]) -> List[str]:
    """One line per group whose hyperparameters the checkpoint's (``new_hyper``) change,
    e.g. ``"param group 0: lr 0.001 -> 0.0003"``."""
    lines = []
    for i, (g, h) in enumerate(zip(param_groups, new_hyper)):
        if not h:
            continue
        diffs = []
        mine, theirs = _base_lr(g), _base_lr(h)
        if mine is not None and theirs is not None and mine != theirs:
            diffs.append(f"lr {mine!r} -> {theirs!r}")
        for k in _COMPARED:
            if k in g and k in h and _plain(g[k]) != _plain(h[k]):
                diffs.append(f"{k} {_plain(g[k])!r} -> {_plain(h[k])!r}")
        if diffs:
            lines.append(f"param group {i}: " + ", ".join(diffs))
    return lines


def _warn(message: str) -> None:
    """``warnings.warn`` attributed to the first caller outside statestore and torch."""
    level, f = 1, sys._getframe(0)
    while f is not None and f.f_code.co_filename.startswith((_PACKAGE, _TORCH)):
        f, level = f.f_back, level + 1
    warnings.warn(message, ResumeWarning, stacklevel=level)


def warn_replaced(param_groups: Sequence[Dict[str, Any]], new_hyper: Sequence[Dict[str, Any]],
                  steps: Dict[str, int], params: Iterable[str], loaded: bool) -> None:
    """Warn (:class:`ResumeWarning`) before a checkpoint is applied to an optimizer, where it
    replaces the states of an optimizer that had stepped (``loaded``: torch's order,
    ``store.load_checkpoint`` under a live optimizer whose step counts are ``steps``) or
    hyperparameters the optimizer was given (``new_hyper``: the checkpoint's, per group)."""
    if loaded:
        stepped = [steps[n] for n in params if steps.get(n, 0) > 0]
        if stepped:
            _warn(f"load_checkpoint replaced the states of an optimizer that had already "
                  f"stepped ({len(stepped)} parameter(s), up to step {max(stepped)}); their "
                  f"updates are discarded. To resume, load before the first step (torch's "
                  f"order: build the optimizer and scheduler, load, then train); to go back "
                  f"to the checkpoint on purpose, ignore this ResumeWarning")
    lines = replaced_hyperparameters(param_groups, new_hyper)
    if lines:
        more = f"; ... and {len(lines) - _SHOW} more group(s)" if len(lines) > _SHOW else ""
        _warn("the checkpoint's hyperparameters replace the optimizer's (as load_state_dict "
              "does): build the optimizer with the values it was saved with, or set "
              "opt.param_groups[i][...] after loading to change them on purpose; "
              + "; ".join(lines[:_SHOW]) + more)



def lrs_to_check(param_groups: Sequence[Dict[str, Any]],
                 saved_groups: Sequence[Dict[str, Any]]) -> Any:
    """``(group, lr)`` for each group whose checkpoint was saved under an LR scheduler (it
    carries ``initial_lr``), for :func:`warn_lr_reset_after_load`; None when there is none."""
    pairs = [(g, _plain(g.get("lr"))) for g, sg in zip(param_groups, saved_groups)
             if isinstance(sg, dict) and sg.get("initial_lr") is not None]
    return pairs or None


def warn_lr_reset_after_load(pairs, scheduled: bool) -> None:
    """At the first step of an optimizer built on a store that had loaded a checkpoint saved
    under an LR scheduler (the load-first order): where a scheduler now drives the optimizer
    (``scheduled``) and changed a group's lr from the checkpoint's, warn
    (:class:`ResumeWarning`): a scheduler built after the load re-derives the lr from
    ``initial_lr`` at its step 0, so this step would not run at the checkpoint's lr (torch's
    own optimizers do the same). torch's order is the one that resumes bit for bit."""
    if not scheduled:
        return
    lines = [f"param group {i}: the checkpoint's lr {lr!r}, now {_plain(g.get('lr'))!r}"
             for i, (g, lr) in enumerate(pairs) if _plain(g.get("lr")) != lr]
    if not lines:
        return
    more = f"; ... and {len(lines) - _SHOW} more group(s)" if len(lines) > _SHOW else ""
    _warn("an LR scheduler built after store.load_checkpoint (the load-first order) reset "
          "the lr from initial_lr, so this step does not run at the checkpoint's lr (torch's "
          "optimizers do the same; the scheduler's next step() goes on from its loaded "
          "state). With a scheduler, resume in torch's order: build the optimizer and the "
          "scheduler, then store.load_checkpoint(path) and scheduler.load_state_dict(...); "
          + "; ".join(lines[:_SHOW]) + more)

"""Resuming an optimizer from the metadata of a loaded checkpoint: its param groups'
hyperparameters, and the short summary a :class:`CheckpointMismatchError` gives when the
checkpoint and the optimizer describe different parameters.

Param groups are matched by position, as ``torch.optim.Optimizer.load_state_dict`` matches
them, and each group's parameters by key (the name given through ``named_parameters()``, else
the index in torch's ``state_dict()`` numbering). A group takes every saved key but its
parameters (``lr``, ``betas``, ``eps``, ``weight_decay``, ``initial_lr`` written by an LR
scheduler, and any other key a user or library added), as ``load_state_dict`` does.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import CheckpointMismatchError

__all__ = ["MismatchReport", "group_extras", "saved_group_hyper", "short_names", "IMPL_KEYS"]

#: torch's implementation switches: never carried between optimizers (ours ignore them).
IMPL_KEYS = frozenset({"foreach", "fused", "capturable", "differentiable",
                       "decoupled_weight_decay"})
#: keys the metadata writes itself (hyperparameters and parameter keys)
_OWN_KEYS = frozenset({"params", "param_names", "lr", "betas", "eps", "weight_decay",
                       "amsgrad", "maximize", "adamw_mode"})
#: how many names a summary line shows
_SHOW = 3


def _json_value(v: Any) -> Tuple[bool, Any]:
    """``(True, v as plain JSON)`` for numbers, strings, bools, None, one-element tensors and
    lists/tuples of those; ``(False, None)`` for anything else (left out of the metadata)."""
    if v is None or isinstance(v, (bool, str)):
        return True, v
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            return False, None
        v = v.item()
    if isinstance(v, numbers.Integral):
        return True, int(v)
    if isinstance(v, numbers.Real):
        f = float(v)
        return (True, f) if math.isfinite(f) else (False, None)
    if isinstance(v, (list, tuple)):
        out = []
        for x in v:
            ok, y = _json_value(x)
            if not ok:
                return False, None
            out.append(y)
        return True, out
    return False, None


def group_extras(group: Dict[str, Any]) -> Dict[str, Any]:
    """The keys of a param group beyond the optimizer's own hyperparameters (``initial_lr``
    of an LR scheduler, a user's ``"name"``...) that JSON can hold, for the metadata."""
    out = {}
    for k, v in group.items():
        if not isinstance(k, str) or k in _OWN_KEYS or k in IMPL_KEYS:
            continue
        ok, j = _json_value(v)
        if ok:
            out[k] = j
    return out


def saved_group_hyper(saved: Dict[str, Any]) -> Dict[str, Any]:
    """What a group takes from a saved group (metadata or torch's ``state_dict``): every key
    but its parameters and torch's implementation switches; ``betas`` as a tuple, torch's
    ``decoupled_weight_decay`` as our ``adamw_mode``."""
    h = {k: v for k, v in saved.items()
         if isinstance(k, str) and k not in ("params", "param_names") and k not in IMPL_KEYS}
    if "betas" in h and isinstance(h["betas"], (list, tuple)):
        h["betas"] = tuple(h["betas"])
    if "adamw_mode" not in h and "decoupled_weight_decay" in saved:
        h["adamw_mode"] = bool(saved["decoupled_weight_decay"])
    for k in ("amsgrad", "maximize", "adamw_mode"):
        if k in h:
            h[k] = bool(h[k])
    return h


def short_names(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in list(names)[:_SHOW])
    more = len(names) - _SHOW
    return shown + (f" and {more} more" if more > 0 else "")


def _numbered(names) -> bool:
    names = list(names)
    return bool(names) and all(n.isdigit() for n in names)


class MismatchReport:
    """Collects the differences between a checkpoint (or a store's states) and an optimizer,
    by kind, and raises one :class:`CheckpointMismatchError` whose message stays short
    whatever the model's size: counts, the first few names of each kind, and a hint."""

    def __init__(self, ckpt_params: Sequence[str], opt_params: Sequence[str],
                 ckpt_groups: Optional[int] = None, opt_groups: Optional[int] = None,
                 source: str = "checkpoint"):
        self.source = source
        self.ckpt_params, self.opt_params = list(ckpt_params), list(opt_params)
        self.ckpt_groups, self.opt_groups = ckpt_groups, opt_groups
        self._kinds: Dict[str, List[str]] = {}
        self._order: List[str] = []

    def add(self, kind: str, line: str) -> None:
        """One difference; ``kind`` groups lines that are summarized together."""
        if kind not in self._kinds:
            self._kinds[kind] = []
            self._order.append(kind)
        if line not in self._kinds[kind]:
            self._kinds[kind].append(line)

    def __bool__(self) -> bool:
        return bool(self._kinds)

    def message(self) -> str:
        total = sum(len(v) for v in self._kinds.values())
        head = (f"the {self.source} does not match the optimizer ({total} difference"
                f"{'s' if total != 1 else ''}): {self.source} has {len(self.ckpt_params)} "
                f"parameters")
        if self.ckpt_groups is not None:
            head += f" in {self.ckpt_groups} param group{'s' if self.ckpt_groups != 1 else ''}"
        head += f", optimizer has {len(self.opt_params)}"
        if self.opt_groups is not None:
            head += f" in {self.opt_groups} param group{'s' if self.opt_groups != 1 else ''}"
        lines = [head]
        for kind in self._order:
            items = self._kinds[kind]
            lines += ["  " + x for x in items[:_SHOW]]
            if len(items) > _SHOW:
                lines.append(f"  ... and {len(items) - _SHOW} more ({kind})")
        lines.append("hint: " + self.hint())
        return "\n".join(lines)

    def hint(self) -> str:
        ck, op = self.ckpt_params, self.opt_params
        if ck and op and _numbered(op) and not _numbered(ck):
            return (f"the {self.source} names its parameters ({short_names(ck)}) but the optimizer "
                    f"numbers them: pass model.named_parameters() to the optimizer")
        if ck and op and _numbered(ck) and not _numbered(op):
            return (f"the {self.source} numbers its parameters ({short_names(ck)}) but the optimizer "
                    f"names them ({short_names(op)}): pass model.parameters() as when it was saved")
        return ("parameters are matched by name where the optimizer was given "
                "named_parameters() (else by position); pass named_parameters(), the same "
                f"param groups in the same order, and the same model as when the {self.source} "
                "was saved")

    def raise_if_any(self) -> None:
        if self._kinds:
            raise CheckpointMismatchError(self.message())

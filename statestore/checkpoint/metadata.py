"""The optimizer metadata a checkpoint carries, and what shape it must have.

The metadata is any JSON object; the keys the optimizers, ``python -m statestore inspect`` and
``convert`` read (``steps``, ``params``, ``param_groups``, ``optimizer``, ``version``) must have
the shape ``docs/checkpoint-format.md`` documents (section "Manifest"). Saves refuse other
metadata (``StateStoreValueError``) and reads refuse a manifest carrying it
(``CheckpointCorruptError``).
"""
from __future__ import annotations

import reprlib
from typing import Any, Optional

from .parquet_guard import MAX_NDIM

__all__ = ["optimizer_metadata_problem", "is_int", "is_num", "clip"]


def is_int(x) -> bool:
    """True for an ``int`` that is not a ``bool``."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_num(x) -> bool:
    """True for an ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def clip(value: Any, limit: int = 120) -> str:
    """``repr(value)`` within about ``limit`` characters (``reprlib``: long strings and
    containers are cut before they are formatted, never copied whole), saying how long a
    long string was: messages name untrusted values (a key, a file name, a hyperparameter)
    without repeating a string or a list of any length."""
    r = reprlib.Repr()
    r.maxstring = r.maxother = r.maxlong = limit
    r.maxlist = r.maxtuple = r.maxdict = r.maxset = r.maxfrozenset = r.maxdeque = 8
    r.maxlevel = 2
    text = r.repr(value)
    if len(text) > 4 * limit:
        text = text[:4 * limit] + "..."
    if isinstance(value, str) and len(value) > limit:
        text += f" ({len(value)} characters)"
    return text


def optimizer_metadata_problem(meta) -> Optional[str]:
    """What is wrong with the optimizer metadata ``meta`` (None when nothing is).

    Any JSON object is accepted; the keys the optimizers, ``inspect`` and ``convert`` read must
    have the documented shape (``docs/checkpoint-format.md``): ``steps`` maps parameter keys to
    non-negative ints, ``params`` maps them to ``{"shape": [ints], "dtype": str}``,
    ``param_groups`` is a list of objects whose ``params`` lists parameter keys (each in one
    group only) and whose hyperparameters have their types.

    Args:
        meta: the decoded metadata (any object).

    Returns:
        A sentence naming the first problem found, or None when ``meta`` is acceptable.
    """
    if not isinstance(meta, dict):
        return f"must be a JSON object, got {type(meta).__name__}"
    steps = meta.get("steps")
    if "steps" in meta:
        if not isinstance(steps, dict):
            return "'steps' must map parameter keys to step counts"
        for k, v in steps.items():
            if not is_int(v) or v < 0:
                return f"'steps'[{clip(k)}] must be a non-negative int, got {clip(v)}"
    params = meta.get("params")
    if "params" in meta:
        if not isinstance(params, dict):
            return "'params' must map parameter keys to {shape, dtype}"
        for k, v in params.items():
            if not isinstance(v, dict):
                return f"'params'[{clip(k)}] must be an object, got {clip(v)}"
            shape = v.get("shape", [])
            if not isinstance(shape, list) or len(shape) > MAX_NDIM \
                    or not all(is_int(d) and d >= 0 for d in shape):
                return f"'params'[{clip(k)}]['shape'] must be a list of non-negative ints"
            if not isinstance(v.get("dtype", ""), str):
                return f"'params'[{clip(k)}]['dtype'] must be a string"
    groups = meta.get("param_groups")
    if "param_groups" in meta:
        if not isinstance(groups, list):
            return "'param_groups' must be a list"
        seen = set()
        for i, g in enumerate(groups):
            if not isinstance(g, dict):
                return f"'param_groups'[{i}] must be an object, got {clip(g)}"
            names = g.get("params", [])
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                return f"'param_groups'[{i}]['params'] must be a list of parameter keys"
            for n in names:
                if n in seen:
                    return f"parameter {clip(n)} is listed in more than one param group"
                seen.add(n)
            for k in ("lr", "weight_decay"):
                if k in g and not is_num(g[k]):
                    return f"'param_groups'[{i}][{clip(k)}] must be a number, got {clip(g[k])}"
            # eps: Adam's number, or Adafactor's (eps1 or null, eps2)
            if "eps" in g and not is_num(g["eps"]) and not (
                    isinstance(g["eps"], list) and all(e is None or is_num(e) for e in g["eps"])):
                return f"'param_groups'[{i}]['eps'] must be a number or a list of numbers, got " \
                       f"{clip(g['eps'])}"
            if "betas" in g and (not isinstance(g["betas"], list) or not g["betas"]
                                 or not all(is_num(b) for b in g["betas"])):
                return f"'param_groups'[{i}]['betas'] must be a list of numbers"
            for k in ("amsgrad", "maximize", "adamw_mode"):
                if k in g and not isinstance(g[k], bool):
                    return f"'param_groups'[{i}][{clip(k)}] must be true or false, got {clip(g[k])}"
    for k, kind in (("optimizer", str), ("version", int), ("optimizer_class", str)):
        if k in meta and not isinstance(meta[k], kind):
            return f"{clip(k)} must be a {kind.__name__}, got {clip(meta[k])}"
    return _parts_problem(meta.get("optimizers"), len(groups) if isinstance(groups, list) else 0) \
        if "optimizers" in meta else None


def _parts_problem(parts, ngroups: int) -> Optional[str]:
    """What is wrong with ``optimizers``, the parts of the metadata of several optimizers on
    one store (each an object whose ``param_groups`` are indices of the metadata's groups,
    each group in one part), or None."""
    if not isinstance(parts, list):
        return "'optimizers' must be a list"
    seen = set()
    for i, part in enumerate(parts):
        idx = part.get("param_groups") if isinstance(part, dict) else None
        if not isinstance(idx, list) or not all(is_int(j) and 0 <= j < ngroups for j in idx):
            return f"'optimizers'[{i}]['param_groups'] must list indices of 'param_groups'"
        if seen & set(idx):
            return f"'optimizers'[{i}] lists a param group another optimizer lists"
        seen |= set(idx)
        if not isinstance(part.get("optimizer", ""), str):
            return f"'optimizers'[{i}]['optimizer'] must be a string"
    return None

"""What every integration shares: finding the statestore optimizer inside a framework's
wrappers, its store, and the *light* state dict that frameworks save in place of the states
when the states went to a statestore checkpoint."""
from __future__ import annotations

import importlib
import os
from typing import Any, Dict, Optional

import torch

from ..errors import CheckpointNotFoundError, StateStoreValueError
from ..store import StateStore

__all__ = ["STATESTORE_KEY", "find_store_optimizer", "store_of", "light_state_dict",
           "is_light_state_dict", "require"]

#: Key of the entry a light state dict carries: ``{"checkpoint": <dir>, "format": 1}``.
STATESTORE_KEY = "statestore"
_LIGHT_FORMAT = 1


def require(module: str, pip_name: str, what: str):
    """Import ``module`` or raise ``ImportError`` saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{what} needs {pip_name}, which is not installed: "
                          f"pip install {pip_name}  ({e})") from e


def find_store_optimizer(optimizer: Any):
    """The statestore optimizer (any :class:`~statestore.optim.StateStoreOptimizer`:
    ``CPUAdam``, ``HybridAdam``, ``StoreOptimizer``) inside ``optimizer``, unwrapping
    framework wrappers (accelerate's ``AcceleratedOptimizer.optimizer``, Lightning's
    ``LightningOptimizer._optimizer``); None when there is none."""
    from ..optim import StateStoreOptimizer
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        if isinstance(optimizer, StateStoreOptimizer):
            return optimizer
        seen.add(id(optimizer))
        inner = None
        for attr in ("optimizer", "_optimizer"):
            candidate = getattr(optimizer, attr, None)
            if isinstance(candidate, torch.optim.Optimizer):
                inner = candidate
                break
        optimizer = inner
    return None


def store_of(optimizer: Any) -> StateStore:
    """The store a statestore optimizer keeps its states in (``opt.state_store``), through
    framework wrappers. Raises :class:`~statestore.StateStoreValueError` when ``optimizer``
    is not a statestore optimizer or was built without ``state_store=`` (nor
    ``nvme_offload_fraction``), in which case its states sit next to their parameters and
    torch's own ``state_dict()`` path is the way to save them."""
    opt = find_store_optimizer(optimizer)
    if opt is None:
        raise StateStoreValueError(f"{type(optimizer).__name__} is not a statestore optimizer "
                                   f"(CPUAdam, HybridAdam or StoreOptimizer, possibly wrapped)")
    if opt.state_store is None:
        raise StateStoreValueError(f"{type(opt).__name__} was built without state_store= (or "
                                   f"nvme_offload_fraction=): there is no single store to "
                                   f"checkpoint; pass state_store=...")
    return opt.state_store


def light_state_dict(optimizer: Any, checkpoint: Optional[str] = None) -> Dict[str, Any]:
    """torch's optimizer format without the states: ``{"state": {}, "param_groups": [...],
    "statestore": {"checkpoint": checkpoint, "format": 1}}``. A framework saves this (a few
    hundred bytes) where it would save ``optimizer.state_dict()``; the states, step counts and
    hyperparameters are in the statestore checkpoint at ``checkpoint`` (a path, relative to the
    framework's checkpoint folder where the integration says so)."""
    opt = find_store_optimizer(optimizer)
    index = {p: i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    groups = []
    for g in opt.param_groups:
        ng = {k: v for k, v in g.items() if k != "params"}
        ng["params"] = [index[p] for p in g["params"]]
        groups.append(ng)
    return {"state": {}, "param_groups": groups,
            STATESTORE_KEY: {"checkpoint": checkpoint, "format": _LIGHT_FORMAT}}


def is_light_state_dict(state_dict: Any) -> bool:
    return isinstance(state_dict, dict) and isinstance(state_dict.get(STATESTORE_KEY), dict)


def resolve(base: Optional[str], ref: str) -> str:
    """``ref`` (a statestore checkpoint path a light state dict names) against ``base`` (the
    folder of the framework checkpoint that holds it) unless absolute or a URL."""
    if "://" in ref or os.path.isabs(ref) or base is None:
        return ref
    return os.path.join(base, ref)


def load_into(optimizer: Any, path: str) -> None:
    """Load the statestore checkpoint at ``path`` into the store of ``optimizer`` (which
    exists: torch's order). The store's ``load_checkpoint`` then updates the attached
    optimizer's step counts and hyperparameters (docs/api.md, ``load_checkpoint``)."""
    store = store_of(optimizer)
    if "://" not in path and not os.path.isdir(path):
        raise CheckpointNotFoundError(f"statestore checkpoint {path!r} not found (the "
                                      f"framework's checkpoint names it for the optimizer's "
                                      f"states)")
    store.load_checkpoint(path)

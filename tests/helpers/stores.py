"""The backends under test, over the backend registry (``helpers/registry.py``), which every
parametrized suite reads: the conformance, optimizer and resume suites (``BACKENDS``, the
``backend``/``store`` fixtures of ``tests/conftest.py``), the checkpoint and CLI suites
(``helpers.ckpt``), the fault suites (``helpers.faults``).

``BACKENDS`` lists ``(name, factory)``; ``factory(tmp_path)`` returns a fresh, open store.
**A new backend joins every suite by adding ONE line to ``registry.REGISTRY``** (e.g.
``Backend("nvme", lambda d, **o: ss.NVMeStore(d, **o), disk=True)``); nothing else needs to
change.
"""
from __future__ import annotations

import os
import time
from typing import Callable, List, Tuple

import torch

import statestore as ss
from helpers.registry import BY_NAME, REGISTRY

Factory = Callable[["os.PathLike"], ss.StateStore]

#: ``(name, factory)`` of every line of the registry (``helpers/registry.py``);
#: ``factory(tmp_path)`` returns a fresh, open store.
#: ``tmp`` may be None for the resident lines, which keep no files.
BACKENDS: List[Tuple[str, Factory]] = [
    (b.name, lambda tmp, b=b: b.make(None if tmp is None else str(tmp / b.name)))
    for b in REGISTRY]
CUDA_BACKENDS: List[Tuple[str, Factory]] = [(n, f) for n, f in BACKENDS if BY_NAME[n].cuda]

BACKEND_NAMES = [name for name, _ in BACKENDS]
CUDA_BACKEND_NAMES = [name for name, _ in CUDA_BACKENDS]
_FACTORIES = dict(BACKENDS)


def cuda_usable() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:
        return False


def wait_for_prefetch(store: ss.StateStore, timeout: float = 30.0) -> None:
    """Wait (polling, for at most ``timeout`` s) until the reads of the next step's prefetch
    have arrived on every tier of ``store``; stores without a prefetch return at once. Tests
    that need the prefetch in RAM before backward call ``sync()``, ``pump()`` and this."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pending = [t._access.pending for t in getattr(store, "tiers", [store])]
        if all(p is None or p.pipeline.ready() for p in pending):
            return
        time.sleep(0.01)


def make_store(name: str, tmp_path) -> ss.StateStore:
    """A fresh store of backend ``name`` under ``tmp_path``."""
    return _FACTORIES[name](tmp_path)


class TiedNet(torch.nn.Module):
    """Embedding tied to the output layer (its gradient is final last, as GPT-2's), a
    hidden layer, and a bias-free layer used only on some steps (``use_extra``)."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(300, 48)
        self.hid = torch.nn.Linear(48, 80)
        self.out = torch.nn.Linear(80, 48)
        self.extra = torch.nn.Linear(48, 48, bias=False)
        self.to(dtype)

    def forward(self, ids, use_extra=True):
        x = self.emb(ids)
        if use_extra:
            x = x + self.extra(x)
        return self.out(torch.tanh(self.hid(x))) @ self.emb.weight.t()

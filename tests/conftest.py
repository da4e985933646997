"""Shared fixtures: the backend registry every conformance and optimizer test runs over.

``BACKENDS`` lists ``(name, factory)``; ``factory(tmp_path)`` returns a fresh, open store.
**A new backend joins every suite by adding ONE line to BACKENDS** (e.g.
``("nvme", lambda tmp: ss.NVMeStore(str(tmp / "nvme")))``); nothing else needs to change.
"""
from __future__ import annotations

import os
import sys
import time
import warnings
from typing import Callable, List, Tuple

import pytest
import torch

import statestore as ss

sys.path.insert(0, os.path.dirname(__file__))
from _simstore import SimDiskStore  # noqa: E402


def _pinned():
    # Without CUDA the store falls back to pageable memory with one RuntimeWarning: expected.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return ss.PinnedCPUStore()


#: Small budget for the simulated disk store: large states are cut into many units and the
#: ring wraps, so read-ahead, write-behind and back-pressure are exercised.
SIM_BUDGET = 256 * 1024

Factory = Callable[["os.PathLike"], ss.StateStore]

BACKENDS: List[Tuple[str, Factory]] = [
    ("device-cpu", lambda tmp: ss.DeviceStore("cpu")),
    ("pinned", lambda tmp: _pinned()),
    ("file", lambda tmp: ss.FileStore(str(tmp / "filestore"))),
    ("simdisk", lambda tmp: SimDiskStore(budget_bytes=SIM_BUDGET, write_delay=0.0005)),
    # ---- one line per further backend, e.g.:
    # ("mystore", lambda tmp: ss.MyStore(str(tmp / "mystore"))),
]
# Backends that land separately (statestore exports them only when importable): still
# one line each. Budgets are kept small so tests stay fast and exercise chunking.
if hasattr(ss, "NVMeStore"):
    BACKENDS.append(("nvme", lambda tmp: ss.NVMeStore(str(tmp / "nvme"), budget_bytes=1 << 20)))
# TensorNVMe (built by `make setup`): NVMeStore(dir, engine="tensornvme") is a TensorNVMeStore.
# `make test` sets STATESTORE_REQUIRE_TENSORNVME=1, and then its absence fails the run
# (tests/test_tensornvme.py) instead of leaving this line out.
if hasattr(ss, "TensorNVMeStore") and ss.io.probe_engine("tensornvme") is None:
    BACKENDS.append(("tensornvme", lambda tmp: ss.NVMeStore(str(tmp / "tnvme"), engine="tensornvme",
                                                            budget_bytes=1 << 20)))
if hasattr(ss, "TieredStore"):
    BACKENDS.append(("tiered", lambda tmp: ss.TieredStore(
        [(ss.DeviceStore("cpu"), 0.5), (SimDiskStore(budget_bytes=SIM_BUDGET), 0.5)])))
    # ColossalAI's two-tier case over a real NVMeStore (direct I/O on the test's disk)
    BACKENDS.append(("tiered-nvme", lambda tmp: ss.TieredStore.from_fraction(
        0.5, str(tmp / "tiered"), budget_bytes=1 << 20)))

#: Lines that need a CUDA device. Their tests are marked ``cuda`` (``pytest -m cuda``, run by
#: ``make gpu-test``) and skip where CUDA is absent (``STATESTORE_REQUIRE_CUDA=1``: fail instead).
CUDA_BACKENDS: List[Tuple[str, Factory]] = [
    ("device-cuda", lambda tmp: ss.DeviceStore("cuda")),
    ("pinned-locked", lambda tmp: _page_locked()),
]
BACKENDS += CUDA_BACKENDS

BACKEND_NAMES = [name for name, _ in BACKENDS]
CUDA_BACKEND_NAMES = [name for name, _ in CUDA_BACKENDS]
_FACTORIES = dict(BACKENDS)


def cuda_usable() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:
        return False


def _page_locked():
    """A PinnedCPUStore whose memory is page-locked for real (never the pageable fallback)."""
    s = ss.PinnedCPUStore()
    if not s.stats().get("pinned"):
        s.close()
        pytest.fail("PinnedCPUStore fell back to pageable memory although CUDA is available")
    return s


def pytest_collection_modifyitems(config, items):
    """Tests over a CUDA line of BACKENDS get the ``cuda`` mark; ``cuda`` tests skip without
    CUDA (fail with STATESTORE_REQUIRE_CUDA=1, as ``make gpu-test`` sets)."""
    cuda_names = set(CUDA_BACKEND_NAMES)
    have = cuda_usable()
    require = os.environ.get("STATESTORE_REQUIRE_CUDA", "") not in ("", "0")
    if require and not have:
        pytest.exit("STATESTORE_REQUIRE_CUDA=1 but torch.cuda.is_available() is False "
                    f"(torch {torch.__version__}, CUDA {torch.version.cuda})", returncode=1)
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if any(isinstance(v, str) and v in cuda_names for v in params.values()):
            item.add_marker(pytest.mark.cuda)
        if item.get_closest_marker("cuda") is not None and not have:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


def wait_for_prefetch(store: ss.StateStore, timeout: float = 30.0) -> None:
    """Wait (polling, for at most ``timeout`` s) until the reads of the next step's prefetch
    have arrived on every tier of ``store``; stores without a prefetch return at once. Tests
    that need the prefetch in RAM before backward call ``sync()``, ``pump()`` and this."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pending = [getattr(t, "_prefetched", None) for t in getattr(store, "tiers", [store])]
        if all(p is None or p[2].ready() for p in pending):
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


@pytest.fixture(params=BACKEND_NAMES)
def backend(request):
    """The name of the backend under test (one test per entry of BACKENDS)."""
    return request.param


@pytest.fixture
def store(backend, tmp_path):
    """A fresh store of every backend in BACKENDS; closed after the test."""
    s = make_store(backend, tmp_path)
    try:
        yield s
    finally:
        try:
            s.close()
        except ss.StateStoreError:
            pass  # a test that injected a failure may leave one to surface here


@pytest.fixture
def store_factory(backend, tmp_path):
    """Makes further stores of the backend under test (each in its own directory); closes
    them all after the test."""
    made = []

    def make():
        d = tmp_path / f"s{len(made)}"
        d.mkdir()
        s = make_store(backend, d)
        made.append(s)
        return s
    yield make
    for s in made:
        try:
            s.close()
        except ss.StateStoreError:
            pass

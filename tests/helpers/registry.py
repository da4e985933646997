"""The backend registry every parametrized suite reads: one :class:`Backend` line per store.

**A new backend joins every suite by adding ONE line to REGISTRY**: the conformance, optimizer
and resume suites (``helpers.stores.BACKENDS``) run on every line; the checkpoint and CLI suites
(``helpers.ckpt.STORE_KINDS``) on every line that needs no CUDA; the fault suites
(``helpers.faults.STORE_KINDS``) on the lines that keep their states in statestore's state files
(``disk``), and the fault-injection suites (``test_faults.ENGINE_STORES``) on each I/O engine a
line runs on (``engines``).

This module imports only torch and statestore (and ``helpers.simstore``), so that the processes the
checkpoint and fault suites start (``helpers.ckpt``' zygote, ``helpers.faults``' workers) build
their stores from the same lines.
"""
from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import statestore as ss

from helpers.simstore import SimDiskStore  # noqa: E402

#: Small budget for the simulated disk store: large states are cut into many units and the
#: ring wraps, so read-ahead, write-behind and back-pressure are exercised.
SIM_BUDGET = 256 * 1024
#: Small budgets for real disk stores, so tests stay fast and exercise chunking.
DISK_BUDGET = 1 << 20
#: ``engines`` of a line that runs on every native I/O engine available
EVERY_ENGINE = ("*",)


@dataclass(frozen=True)
class Backend:
    """One backend under test.

    Attributes:
        name: the test id.
        make: ``make(directory, **options)``: a fresh, open store whose files (if any) live
            in ``directory`` (created by the store; None: a temporary directory). Options a store takes: ``budget_bytes``
            (every line but the resident ones, which ignore it) and ``engine`` (lines with
            ``engines``).
        cuda: needs a CUDA device (its tests are marked ``cuda``).
        disk: keeps its states in statestore's state files under ``directory`` (the fault
            suites, which truncate, fill and damage those files, run on it).
        engines: the I/O engines it runs on, for the fault-injection suites
            (:data:`EVERY_ENGINE`: each native engine); empty: none to inject into.
    """

    name: str
    make: Callable[..., ss.StateStore]
    cuda: bool = False
    disk: bool = False
    engines: Tuple[str, ...] = ()


def _pinned(directory, **options):
    # Without CUDA the store falls back to pageable memory with one RuntimeWarning: expected.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return ss.PinnedCPUStore()


def _page_locked(directory, **options):
    """A PinnedCPUStore whose memory is page-locked for real (never the pageable fallback)."""
    import pytest
    s = ss.PinnedCPUStore()
    if not s.stats().get("pinned"):
        s.close()
        pytest.fail("PinnedCPUStore fell back to pageable memory although CUDA is available")
    return s


def _budget(options: Dict, default: int) -> Dict:
    return {"budget_bytes": default, **options}


REGISTRY: List[Backend] = [
    Backend("device-cpu", lambda d, **o: ss.DeviceStore("cpu")),
    Backend("pinned", _pinned),
    Backend("file", lambda d, **o: ss.FileStore(d, **o), disk=True),
    Backend("simdisk", lambda d, **o: SimDiskStore(write_delay=0.0005, **_budget(o, SIM_BUDGET))),
    # ---- one line per further backend, e.g.:
    # Backend("mystore", lambda d, **o: ss.MyStore(d, **o), disk=True),
]
# Backends that land separately (statestore exports them only when importable): still one
# line each.
if hasattr(ss, "NVMeStore"):
    REGISTRY.append(Backend("nvme", lambda d, **o: ss.NVMeStore(d, **_budget(o, DISK_BUDGET)),
                            disk=True, engines=EVERY_ENGINE))
# TensorNVMe (built by `make setup`): TensorNVMeStore, a store of its own.
# `make test` sets STATESTORE_REQUIRE_TENSORNVME=1, and then its absence fails the run
# (tests/stores/test_tensornvme.py) instead of leaving this line out.
if hasattr(ss, "TensorNVMeStore") and ss.io.probe_engine("tensornvme") is None:
    REGISTRY.append(Backend("tensornvme", lambda d, **o: ss.TensorNVMeStore(
        d, **_budget(o, DISK_BUDGET)),
        engines=("tensornvme",)))      # its own file format, not statestore's state files
if hasattr(ss, "TieredStore"):
    REGISTRY.append(Backend("tiered", lambda d, **o: ss.TieredStore(
        [(ss.DeviceStore("cpu"), 0.5), (SimDiskStore(**_budget(o, SIM_BUDGET)), 0.5)])))
    # ColossalAI's two-tier case over a real NVMeStore (direct I/O on the test's disk)
    REGISTRY.append(Backend("tiered-nvme", lambda d, **o: ss.TieredStore.from_fraction(
        0.5, d, **_budget(o, DISK_BUDGET)), disk=True, engines=EVERY_ENGINE))
# Lines that need a CUDA device. Their tests are marked ``cuda`` (``pytest -m cuda``, run by
# ``make gpu-test``) and skip where CUDA is absent (``STATESTORE_REQUIRE_CUDA=1``: fail instead).
REGISTRY += [
    Backend("device-cuda", lambda d, **o: ss.DeviceStore("cuda"), cuda=True),
    Backend("pinned-locked", _page_locked, cuda=True),
]

BY_NAME: Dict[str, Backend] = {b.name: b for b in REGISTRY}


def make(name: str, directory, **options) -> ss.StateStore:
    """A fresh store of backend ``name`` keeping its files (if any) in ``directory``."""
    try:
        backend = BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown store kind {name!r}") from None
    return backend.make(None if directory is None else str(directory), **options)


def names(*, cuda: bool = True, disk: bool = False) -> List[str]:
    """The names of the lines a suite runs on: without the CUDA lines where ``cuda`` is
    False, only the ``disk`` lines where ``disk`` is True."""
    return [b.name for b in REGISTRY if (cuda or not b.cuda) and (b.disk or not disk)]


def engine_lines(native: List[str]) -> List[Tuple[str, str]]:
    """``(name, engine)`` for each disk line with engines: each of ``native`` (the native
    engines available) for :data:`EVERY_ENGINE` lines, else its own engines."""
    return [(b.name, e) for b in REGISTRY if b.engines
            for e in (native if b.engines == EVERY_ENGINE else b.engines)]

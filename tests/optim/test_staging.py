"""The staging path (``statestore/optim/_staging.py``, docs/gpu.md) run on the CPU.

On a GPU it moves the gradients of CUDA parameters into page-locked buffers on a side stream
during backward and uploads updated parameters asynchronously. Here the same code runs with
CPU parameters through ``DeferredLane``, which performs each copy only when the code waits for
it: a missing wait, a staged gradient used after it changed, or an upload that never runs gives
wrong parameters, and every test compares bit for bit (``torch.equal``) against the optimizer's
ordinary path. The CUDA run of the same path is in ``tests/optim/test_gpu.py``.
"""
from __future__ import annotations

import pytest
import torch

import statestore as ss
from statestore.optim import CPUAdam, HybridAdam

from helpers.stores import BACKEND_NAMES, CUDA_BACKEND_NAMES, TiedNet, make_store
from helpers import deferred_lane
from helpers.deferred_lane import DeferredLane

CPU_BACKENDS = [b for b in BACKEND_NAMES if b not in CUDA_BACKEND_NAMES]


def _backward(model, step, scale=1.0):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(300, (4, 12), generator=g)
    logits = model(ids, use_extra=(step != 2)).float()     # step 2: `extra` gets no gradient
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 300), ids.reshape(-1))
    (loss * scale).backward()


class _Lanes:
    """A lane factory keeping the lanes it made."""

    def __init__(self, **kw):
        self.made, self.kw = [], kw

    def __call__(self, device):
        lane = DeferredLane(device, **self.kw)
        self.made.append(lane)
        return lane

    def total(self, attr):
        return sum(getattr(lane, attr) for lane in self.made)


def _train(store, lanes=None, dtype=torch.float32, steps=4, between=None, backwards=1,
           step_kw=None, opt_cls=HybridAdam, **kw):
    model = TiedNet(dtype)
    opt = opt_cls(model.named_parameters(), lr=1e-2, weight_decay=0.1, state_store=store, **kw)
    path = deferred_lane.install(opt, lanes) if lanes is not None else None
    for step in range(steps):
        for _ in range(backwards):
            _backward(model, step)
        if between is not None:
            between(step, model, opt)
        opt.step(**(step_kw or {}))
        opt.zero_grad()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    states = {str(k): store.get(k).clone() for k in store.keys()}
    return weights, states, opt, path


def _same(a, b):
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _pair(backend, tmp_path, read="early", **kw):
    lanes = _Lanes(read=read)
    want = _train(make_store(backend, tmp_path / "a"), **kw)
    got = _train(make_store(backend, tmp_path / "b"), lanes, **kw)
    _same(got[0], want[0])
    _same(got[1], want[1])
    assert got[2]._steps == want[2]._steps
    for r in (want, got):
        r[2].state_store.close()
    return lanes, got


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bit_identical_to_the_ordinary_path(backend, dtype, tmp_path):
    lanes, got = _pair(backend, tmp_path, dtype=dtype)
    path = got[3]
    assert lanes.total("copies") > 0 and not any(l.queue for l in lanes.made)
    nparams = len(list(TiedNet().parameters()))
    # every update went through the staging buffers: one upload at least per parameter-step
    assert lanes.total("queued") >= 4 * nparams
    assert path.stats()["staged_params"] == nparams


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("amsgrad", [False, True])
def test_dtypes_and_amsgrad(dtype, amsgrad, tmp_path):
    _pair("device-cpu", tmp_path, dtype=dtype, amsgrad=amsgrad, adamw_mode=not amsgrad)


@pytest.mark.parametrize("backend", ["device-cpu", "simdisk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_copies_that_read_late(backend, dtype, tmp_path):
    """Copies reading their source only when they complete: a staging buffer the kernel
    rewrote before its upload ran would be uploaded with the wrong values."""
    _pair(backend, tmp_path, read="late", dtype=dtype)
    _pair(backend, tmp_path / "clip", read="late", dtype=dtype, between=lambda s, m, o:
          torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05))


def test_gradients_are_staged_during_backward(tmp_path):
    """The hook queues each gradient's copy as backward produces it, before step()."""
    lanes = _Lanes()
    seen = []

    def between(step, model, opt):
        seen.append((lanes.total("queued"), lanes.total("copies")))

    _train(ss.DeviceStore("cpu"), lanes, between=between, steps=3)
    nparams = len(list(TiedNet().parameters()))
    (q0, c0), (q1, c1) = seen[0], seen[1]
    assert q0 >= nparams - 1 and c0 == 0       # step 0: `extra` included, nothing waited yet
    # between two backward passes: the uploads of the step before, then this backward's copies
    assert q1 - q0 >= 2 * nparams - 1


@pytest.mark.parametrize("what", ["clip", "accumulate", "div_scale", "set_grad", "edit_param"])
def test_gradients_changed_after_the_hook(what, tmp_path):
    """A gradient (or fp32 parameter) staged by the hook and changed before step() is staged
    again: clipping in place, two backward passes, loss scaling, a new gradient tensor, the
    weights edited between backward and step()."""
    kw = {}
    if what == "clip":
        kw["between"] = lambda s, m, o: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
    elif what == "accumulate":
        kw["backwards"] = 2
    elif what == "div_scale":
        kw["step_kw"] = dict(div_scale=4.0)
    elif what == "set_grad":
        def between(s, m, o):
            for p in m.parameters():
                if p.grad is not None:
                    p.grad = p.grad * 0.5
        kw["between"] = between
    else:
        def between(s, m, o):
            with torch.no_grad():
                m.hid.weight.mul_(0.9)
        kw["between"] = between
    _pair("device-cpu", tmp_path, **kw)
    _pair("simdisk", tmp_path / "sim", dtype=torch.bfloat16, **kw)


def test_sliced_units(tmp_path):
    """A parameter cut into several pipeline units: each slice is staged, computed and
    uploaded on its own, the whole is bit-identical."""
    from helpers.simstore import SimDiskStore

    def run(lanes):
        torch.manual_seed(3)
        p = torch.nn.Parameter(torch.randn(150_000))
        q = torch.nn.Parameter(torch.randn(1000).to(torch.bfloat16))
        store = SimDiskStore(budget_bytes=256 * 1024)
        opt = HybridAdam([p, q], lr=1e-2, state_store=store, amsgrad=True)
        if lanes is not None:
            deferred_lane.install(opt, lanes)
        g = torch.Generator().manual_seed(5)
        for _ in range(3):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = torch.randn(q.shape, generator=g).to(torch.bfloat16)
            opt.step()
        out = (p.detach().clone(), q.detach().clone(),
               {str(k): store.get(k).clone() for k in store.keys()})
        store.close()
        return out

    lanes = _Lanes()
    want, got = run(None), run(lanes)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    _same(got[2], want[2])
    # 150k fp32 elements with 4 states do not fit one unit of a 256 KiB ring
    uploads = lanes.total("queued") - 3 * 2 * 2     # minus each step's staging copies
    assert uploads > 3 * 2


def test_skip_nonfinite(tmp_path):
    def between(step, model, opt):
        if step == 1:
            model.hid.weight.grad[0, 0] = float("inf")
    lanes, got = _pair("device-cpu", tmp_path, between=between, skip_nonfinite=True)
    assert got[2]._steps["hid.weight"] == 3


def test_update_in_backward(tmp_path):
    _pair("simdisk", tmp_path, update_in_backward=True)
    _pair("device-cpu", tmp_path / "r", update_in_backward=True, dtype=torch.bfloat16)


def test_a_missing_wait_is_caught(tmp_path):
    """The comparison can fail: with a lane whose waits do nothing (copies run only at the
    end of step()), the kernel reads staging buffers before their copies and the parameters
    come out wrong."""
    want = _train(ss.DeviceStore("cpu"), steps=2)
    got = _train(ss.DeviceStore("cpu"), _Lanes(lax=True), steps=2)
    assert any(not torch.equal(got[0][k], want[0][k]) for k in want[0])


def test_staging_is_accounted_and_released(tmp_path):
    lanes = _Lanes()
    _, _, opt, path = _train(ss.DeviceStore("cpu"), lanes, dtype=torch.bfloat16, steps=1)
    need = sum(2 * p.numel() * p.element_size() for p in opt._params)
    st = path.stats()
    assert need <= st["staging_pinned_bytes"] <= need + 2 * 64 * len(opt._params)
    assert st["staging_pinned_bytes"] == lanes.total("allocated")
    opt.close()
    assert opt._staging is None and all(l.closed for l in lanes.made)


def test_cpu_parameters_take_the_ordinary_path():
    """Without CUDA parameters no staging path is made (and no hook registered)."""
    p = torch.nn.Parameter(torch.randn(10))
    for cls in (CPUAdam, HybridAdam):
        opt = cls([p], state_store=ss.DeviceStore("cpu"))
        assert opt._staging is None


class _Collected:
    """What a ``pytest --collect-only`` run in this process collected, and why it stopped."""

    def __init__(self):
        self.ids, self.stopped = [], ""

    def pytest_collection_finish(self, session):
        self.ids = [item.nodeid for item in session.items]

    def pytest_keyboard_interrupt(self, excinfo):      # pytest.exit lands here too
        self.stopped = str(excinfo.value)


def _collect(*args) -> tuple:
    """``pytest -q --collect-only ARGS`` run in this process from the repository's root (as
    ``make gpu-test`` runs it): its exit status and the :class:`_Collected`. In-process: a
    new interpreter would import torch and collect again, seconds for one list of ids."""
    got = _Collected()
    rc = pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
                      "--collect-only", *args], plugins=[got])
    return rc, got


def test_make_gpu_test_selects_the_cuda_lines(monkeypatch):
    """``pytest -m cuda`` (what make gpu-test runs) collects the conformance suite's CUDA lines
    and no CPU line; with STATESTORE_REQUIRE_CUDA=1 and no CUDA it stops instead of skipping."""
    import os
    from helpers import paths
    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.chdir(paths.ROOT)
    monkeypatch.delenv("STATESTORE_REQUIRE_CUDA", raising=False)
    rc, got = _collect("-m", "cuda", os.path.join(paths.TESTS, "stores", "test_store_conformance.py"))
    ids = got.ids
    assert rc == 0 and ids, (rc, got.stopped)
    assert any("[device-cuda" in i for i in ids) and any("[pinned-locked" in i for i in ids)
    assert all("device-cuda" in i or "pinned-locked" in i for i in ids), ids[:5]
    if not torch.cuda.is_available():
        monkeypatch.setenv("STATESTORE_REQUIRE_CUDA", "1")
        rc, got = _collect("-m", "cuda", os.path.join(here, "test_gpu.py"))
        assert rc != 0 and "STATESTORE_REQUIRE_CUDA=1" in got.stopped, (rc, got.stopped)


def test_staging_stats_is_the_optimizers_public_report(tmp_path):
    """``opt.staging_stats()`` (docs/gpu.md) reports the staging path's figures, and zeros
    while no parameter takes the path; the path's hooks are removed by ``close()``."""
    lanes = _Lanes()
    _, _, opt, path = _train(ss.DeviceStore("cpu"), lanes, dtype=torch.bfloat16, steps=1)
    st = opt.staging_stats()
    assert st == path.stats() and st["staged_params"] == len(opt.param_groups[0]["params"])
    assert st["staging_pinned_bytes"] > 0
    assert len(path._hooks) == st["staged_params"]
    opt.close()
    assert len(path._hooks) == 0
    assert opt.staging_stats() == {"staged_params": 0, "staging_pinned_bytes": 0,
                                   "staging_pageable_bytes": 0}

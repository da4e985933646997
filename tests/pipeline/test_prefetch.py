"""Prefetch: a disk store starts reading the optimizer's next step at the end of a step and
while backward runs; any other use of the store in between cancels it, never serving stale
values. Every interleaving below must give the bits of the same training on a DeviceStore."""
from __future__ import annotations

import pytest
import torch

import statestore as ss
from statestore import Slice, StateKey
from statestore.optim import CPUAdam

from helpers.stores import BACKEND_NAMES, make_store

DISK = [n for n in BACKEND_NAMES if n in ("nvme", "simdisk", "tiered", "tiered-nvme")]


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 32))


def _backward(model, step, only_first=False):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 64, generator=g)
    model.zero_grad(set_to_none=True)
    out = model[0](x) if only_first else model(x)
    out.square().mean().backward()


def _states(store):
    return {str(k): store.get(k).clone() for k in store.keys()}


def _run(store, between=None, steps=5):
    model = _model()
    opt = CPUAdam(model.named_parameters(), lr=1e-2, weight_decay=0.1, state_store=store)
    for step in range(steps):
        _backward(model, step, only_first=(step == 3))
        opt.step()
        if between is not None:
            between(step, store, opt)
    return {k: v.clone() for k, v in model.state_dict().items()}, _states(store)


@pytest.fixture(scope="module")
def reference():
    return _run(ss.DeviceStore("cpu"))


def _same(got, want):
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("backend", DISK)
def test_next_step_uses_the_prefetch_and_backward_pumps_it(backend, tmp_path, reference):
    store = make_store(backend, tmp_path)
    try:
        model = _model()
        opt = CPUAdam(model.named_parameters(), lr=1e-2, weight_decay=0.1, state_store=store)
        pumped = []
        real_pump = store.pump
        store.pump = lambda: (pumped.append(1), real_pump())[1]
        used = 0
        for step in range(5):
            _backward(model, step, only_first=(step == 3))
            pipes = _prefetched_pipes(store)
            if step:
                assert pipes, "a step leaves a prefetch for the next one"
                assert len(pumped) >= 2, "gradient hooks pump the prefetch during backward"
                store.sync()                       # the last writes are done: nothing to
                real_pump()                        # wait for, so pumping starts the reads
                assert all(p._next_submit > 0 for p in pipes)
            pumped.clear()
            opt.step()
            # used (fully consumed), or cancelled when the units changed (step 3, and the
            # step after it)
            used += sum(p._next_yield == len(p._units) and p._closed for p in pipes)
        assert used >= 2
        _same({k: v for k, v in model.state_dict().items()}, reference[0])
        _same(_states(store), reference[1])
    finally:
        store.close()


def _prefetched_pipes(store):
    stores = store.tiers if isinstance(store, ss.TieredStore) else [store]
    return [s._access.pending.pipeline for s in stores if s._access.pending is not None]


def _put_same(step, store, opt):
    k = StateKey("0.weight", "exp_avg")
    store.put(k, store.get(k))                    # a write between steps: same value


def _save(step, store, opt, path=[None]):
    store.save_checkpoint(str(_save.dir / f"ck{step}"), progress=False)


def _get(step, store, opt):
    store.get(StateKey("2.bias", "exp_avg_sq"))


def _state_dict(step, store, opt):
    opt.state_dict()


def _pipeline_read(step, store, opt):
    k = StateKey("0.weight", "exp_avg")
    with store.pipeline([[Slice(k, 0, 10)]], mode="r") as pipe:
        for _ in pipe:
            pass


@pytest.mark.parametrize("backend", DISK)
@pytest.mark.parametrize("between", [_put_same, _save, _get, _state_dict, _pipeline_read],
                         ids=lambda f: f.__name__.strip("_"))
def test_store_use_between_steps_cancels_the_prefetch(backend, between, tmp_path, reference):
    _save.dir = tmp_path
    store = make_store(backend, tmp_path)
    try:
        _same_run = _run(store, between)
        _same(_same_run[0], reference[0])
        _same(_same_run[1], reference[1])
    finally:
        store.close()


@pytest.mark.parametrize("backend", DISK)
def test_a_changed_state_between_steps_is_read_fresh(backend, tmp_path):
    """A prefetched read of a state that then changes must not survive: the step sees the
    new value (the same as a DeviceStore given the same change)."""
    results = []
    for make in (lambda: ss.DeviceStore("cpu"), lambda: make_store(backend, tmp_path)):
        store = make()
        try:
            def bump(step, store, opt):       # a put with no read before it
                k = StateKey("0.weight", "exp_avg")
                store.put(k, torch.full(store.spec(k).shape, 0.25 * (step + 1)))
            results.append(_run(store, bump, steps=3))
        finally:
            store.close()
    _same(results[1][0], results[0][0])
    _same(results[1][1], results[0][1])


@pytest.mark.parametrize("backend", DISK)
def test_close_with_a_prefetch_pending(backend, tmp_path):
    store = make_store(backend, tmp_path)
    model = _model()
    opt = CPUAdam(model.parameters(), state_store=store)
    _backward(model, 0)
    opt.step()
    assert _prefetched_pipes(store)
    store.close()
    assert not _prefetched_pipes(store)

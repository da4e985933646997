"""NVMeStore's pipeline units checked and laid out once per store layout
(``statestore/_unit_cache.py``, ``NVMeStore.layout_version``), and the per-unit (not per
state) bookkeeping of writes of small states (``statestore/_inflight.py``): a planned
HybridAdam step over many small tensors must keep the general step's bits whatever the
units, backward's updates, loads and failing writes do."""
from __future__ import annotations

import errno

import pytest
import torch
from torch import nn

import statestore as ss
from statestore._types import Slice, StateKey
from statestore._unit_cache import compile_units
from statestore.optim import HybridAdam

#: many small parameters (packed into shared blocks), a few larger ones, an empty one
SIZES = [3, 17, 64, 256, 1000, 5000, 0] * 6
#: a budget that cuts a step into many units
BUDGET = 1 << 14


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(n, generator=g)) for n in SIZES]


def _grads(ps, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * 0.1


def _twins(tmp_path, **kw):
    """(params, optimizer) planned and general (stepped with STATESTORE_STEP_PLAN=0)."""
    out = []
    for name in ("plan", "general"):
        ps = _params()
        store = ss.NVMeStore(str(tmp_path / name), budget_bytes=BUDGET)
        out.append((ps, HybridAdam(ps, lr=1e-2, weight_decay=0.1, state_store=store, **kw)))
    return out


def _general(monkeypatch, fn, *a):
    with monkeypatch.context() as m:
        m.setenv("STATESTORE_STEP_PLAN", "0")
        return fn(*a)


def _assert_same(a, b):
    (pa, oa), (pb, ob) = a, b
    for x, y in zip(pa, pb):
        assert torch.equal(x, y)
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k, v in sa[i].items():
            assert torch.equal(v, sb[i][k]) if isinstance(v, torch.Tensor) else v == sb[i][k]


def _close(*pairs):
    for _, opt in pairs:
        opt.state_store.close()


def test_many_small_states_in_many_units_keep_the_general_bits(tmp_path, monkeypatch):
    a, b = _twins(tmp_path)
    for step in range(5):
        _grads(a[0], step)
        _grads(b[0], step)
        a[1].step()
        _general(monkeypatch, b[1].step)
    prog = a[1]._remembered
    assert prog is not None and prog.units is not None and len(prog.units[1]) > 4
    store = a[1].state_store
    # the planned units were compiled once: a pipeline over them finds them in the cache
    first = compile_units(store, prog.units[1])
    assert compile_units(store, prog.units[1])[0] is first[0]
    _assert_same(a, b)
    _close(a, b)


def test_update_in_backward_keeps_the_general_bits(tmp_path, monkeypatch):
    a, b = _twins(tmp_path)
    a[1].update_in_backward = True
    for step in range(4):
        for ps, opt in (a, b):
            g = torch.Generator().manual_seed(200 + step)
            loss = sum((p * torch.randn(p.shape, generator=g)).sum() for p in ps)
            loss.backward()
            if opt is a[1]:
                opt.step()
            else:
                _general(monkeypatch, opt.step)
            opt.zero_grad()
    _assert_same(a, b)
    _close(a, b)


def test_a_load_changes_the_layout_and_the_steps_after_it_keep_the_general_bits(
        tmp_path, monkeypatch):
    a, b = _twins(tmp_path)
    for step in range(6):
        if step == 3:               # back to the checkpoint of step 2, both
            for name, (_, opt) in zip(("plan", "general"), (a, b)):
                before = opt.state_store.layout_version
                with pytest.warns(ss.ResumeWarning):
                    opt.state_store.load_checkpoint(str(tmp_path / f"ck-{name}"),
                                                    progress=False)
                assert opt.state_store.layout_version != before
        _grads(a[0], step)
        _grads(b[0], step)
        a[1].step()
        _general(monkeypatch, b[1].step)
        if step == 2:
            for name, (_, opt) in zip(("plan", "general"), (a, b)):
                opt.state_store.save_checkpoint(str(tmp_path / f"ck-{name}"), progress=False)
    _assert_same(a, b)
    _close(a, b)


def test_a_failing_write_surfaces_at_the_call_that_depends_on_it(tmp_path, monkeypatch):
    """Planned steps write behind: a write that fails raises at a later call into the store
    (the next step or sync), and the states it lost are refused from then on."""
    a, b = _twins(tmp_path)
    for step in range(3):
        _grads(a[0], step)
        a[1].step()
    store = a[1].state_store
    assert a[1]._remembered is not None
    store.engine._inject_fault_for_testing(op="write", count=1 << 20, err=errno.EIO)
    _grads(a[0], 3)
    with pytest.raises(ss.StateStoreIOError):
        a[1].step()
        store.sync()
    store.engine._inject_fault_for_testing(op="write", count=0)
    for _ in range(8):      # the other failed writes of that step, each raised once
        try:
            store.sync()
            break
        except ss.StateStoreIOError:
            pass
    lost = [k for k in store.keys() if store.in_flight.is_damaged(k)]
    assert lost
    with pytest.raises(ss.StateStoreIOError, match="lost an update"):
        store.get(lost[0])
    _close(a, b)


def test_layout_version_moves_with_a_load_not_with_a_save_or_values(tmp_path):
    # create/delete/clear/close: tests/optim/test_step_plan.py, over every slab store and NVMe
    store = ss.NVMeStore(str(tmp_path / "nv"), budget_bytes=BUDGET)
    store.create("a/x", (3,))
    v = store.layout_version
    store.save_checkpoint(str(tmp_path / "ck"), progress=False)
    store.put("a/x", torch.zeros(3))            # copy-on-write: same places
    store.sync()
    assert store.layout_version == v
    store.load_checkpoint(str(tmp_path / "ck"), progress=False)
    assert store.layout_version > v
    store.close()


def test_units_are_checked_again_when_they_or_the_layout_change(tmp_path):
    store = ss.NVMeStore(str(tmp_path / "nv"), budget_bytes=BUDGET)
    store.create_many([(f"p{i}/m", (16,), torch.float32, None) for i in range(8)])
    units = [[Slice(StateKey(f"p{i}", "m"), 0, 16) for i in range(j, j + 4)] for j in (0, 4)]
    with store.pipeline(units) as pipe:
        for ts in pipe:
            for t in ts:
                t.add_(1)
    units[1][0] = Slice(StateKey("p4", "m"), 0, 17)      # changed in place: out of range
    with pytest.raises(ss.StateStoreValueError, match="out of range"):
        store.pipeline(units)
    units[1][0] = Slice(StateKey("p4", "m"), 0, 16)
    store.delete("p5/m")                                  # the same units, a new layout
    with pytest.raises(ss.StateKeyError):
        store.pipeline(units)
    store.create("p5/m", (16,))
    with store.pipeline(units, mode="r") as pipe:
        got = [t.clone() for ts in pipe for t in ts]
    assert [float(t[0]) for t in got] == [1.0] * 5 + [0.0] + [1.0] * 2
    store.close()


def test_the_views_a_ring_keeps_stay_within_their_share_of_the_budget(tmp_path, monkeypatch):
    """A unit's tensor views are kept by the ring for its next pass at the same offset, but
    never more of them than ``budget_bytes // RING_BYTES_PER_VIEW`` (a view is a tensor
    object of about 300 bytes: RAM beside the ring's), and never for units no longer used."""
    from statestore import _unit_cache
    monkeypatch.setattr(_unit_cache, "RING_BYTES_PER_VIEW", 256)
    ps = [nn.Parameter(torch.randn(16)) for _ in range(400)]
    store = ss.NVMeStore(str(tmp_path / "nv"), budget_bytes=BUDGET)
    opt = HybridAdam(ps, lr=1e-2, state_store=store)
    for step in range(4):
        _grads(ps, step)
        opt.step()
    ring = store.in_flight.ring
    kept = sum(len(v) for slots in ring.views.values() for _, v in slots)
    assert 0 < kept <= BUDGET // 256
    assert all(len(slots) <= _unit_cache.VIEW_SLOTS for slots in ring.views.values())
    store.delete(list(store.keys()))        # a new layout: the old units' views go with them
    opt.state_store.in_flight.units.clear()
    import gc
    gc.collect()
    assert sum(len(s) for s in ring.views.values()) == 0
    store.close()

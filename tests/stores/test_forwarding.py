"""Read-after-write forwarding (docs/nvme.md, "A read after a pending write"): a pipeline unit
whose states' last write moved that very unit is copied from the write's ring bytes instead
of waiting for the write and reading the disk. Training keeps its bits with and without it,
a later write never overtakes the one a read was served from, and that write's error
surfaces at the call that hands the unit back."""
from __future__ import annotations

import errno
import threading

import pytest
import torch
from torch import nn

import statestore as ss
from statestore._ring import RingArena
from statestore._types import Slice, StateKey
from statestore.optim import HybridAdam

SIZES = [3, 17, 64, 256, 1000, 5000, 0]


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [nn.Parameter(torch.randn(n, generator=g)) for n in SIZES]
    ps.append(nn.Parameter(torch.randn(300, generator=g).to(torch.bfloat16)))  # fp32 master
    return ps


def _loss(ps, step):
    g = torch.Generator().manual_seed(100 + step)
    return sum((p.float() * torch.randn(p.shape, generator=g)).sum() for p in ps)


def _train(store, steps, **kw):
    ps = _params()
    opt = HybridAdam(ps, lr=1e-2, weight_decay=0.1, state_store=store, **kw)
    for step in range(steps):
        _loss(ps, step).backward()          # update_in_backward: the hooks update here
        opt.step()
        opt.zero_grad()
    return ps, opt


@pytest.mark.parametrize("budget", [None, 1 << 15])
@pytest.mark.parametrize("moments,in_backward", [("fp32", False), ("bf16", False),
                                                 ("int8", False), ("fp32", True),
                                                 ("int8", True)])
def test_training_keeps_its_bits_with_and_without_forwarding(tmp_path, monkeypatch, budget,
                                                             moments, in_backward):
    kw = dict(moment_dtype=moments, update_in_backward=in_backward)
    got = {}
    for forward in ("1", "0"):
        monkeypatch.setenv("STATESTORE_FORWARD", forward)
        store = ss.NVMeStore(str(tmp_path / forward), budget_bytes=budget)
        assert store.in_flight.forwarding is (forward == "1")
        with store:
            ps, opt = _train(store, 6, **kw)
            got[forward] = (ps, opt.state_dict()["state"], store.in_flight.bytes_forwarded)
    (pa, sa, fa), (pb, sb, fb) = got["1"], got["0"]
    assert fb == 0
    if budget is None and not in_backward:      # one unit a step, steps back to back
        assert fa > 0
    for x, y in zip(pa, pb):
        assert torch.equal(x, y)
    assert sa.keys() == sb.keys()
    for i in sa:
        for k, v in sa[i].items():
            assert torch.equal(v, sb[i][k]) if isinstance(v, torch.Tensor) else v == sb[i][k]


def _units(store, n=4):
    keys = [StateKey(f"p{i}", "exp_avg") for i in range(n)]
    store.create_many([(k, (300 * (i + 1),), torch.float32, None) for i, k in enumerate(keys)])
    return keys, [[Slice(k, 0, 300 * (i + 1)) for i, k in enumerate(keys)]]


def test_a_read_after_a_write_is_served_from_the_ring_until_sync(tmp_path):
    with ss.NVMeStore(str(tmp_path)) as store:
        keys, units = _units(store)
        with store.pipeline(units, mode="w", wait=False) as pipe:
            for ts in pipe:
                for i, t in enumerate(ts):
                    t.copy_(torch.arange(t.numel(), dtype=torch.float32) + i)
        fl = store.in_flight
        read_before = fl.bytes_read
        with store.pipeline(units, mode="r") as pipe:       # pending, or just completed
            got = [t.clone() for ts in pipe for t in ts]
        assert fl.bytes_forwarded > 0 and fl.bytes_read == read_before
        for i, t in enumerate(got):
            assert torch.equal(t, torch.arange(t.numel(), dtype=torch.float32) + i)
        store.sync()            # read from the disk from now on
        forwarded = fl.bytes_forwarded
        with store.pipeline(units, mode="r") as pipe:
            again = [t.clone() for ts in pipe for t in ts]
        assert fl.bytes_forwarded == forwarded and fl.bytes_read > read_before
        assert all(torch.equal(a, b) for a, b in zip(got, again))
        # another unit's write in between: read from the disk
        with store.pipeline([[Slice(keys[0], 0, 300)]], mode="w", wait=False) as pipe:
            for (t,) in pipe:
                t.fill_(7.0)
        with store.pipeline(units, mode="r") as pipe:
            third = [t.clone() for ts in pipe for t in ts]
        assert fl.bytes_forwarded == forwarded
        assert torch.equal(third[0], torch.full((300,), 7.0))
        assert all(torch.equal(a, b) for a, b in zip(got[1:], third[1:]))


class _Gate:
    """A write future held back: not done until someone waits for it (``result()``), then
    the real write's outcome, or ``err``. Records the order of events in ``log``."""

    def __init__(self, real, log, err=None):
        self.real, self.log, self.err, self.waited = real, log, err, False

    def done(self):
        return self.waited

    def result(self, timeout=None):
        if not self.waited:
            self.waited = True
            self.log.append("first write waited for")
        n = self.real.result()
        if self.err is not None:
            raise OSError(self.err, "injected", "gate")
        return n

    def exception(self, timeout=None):
        try:
            self.result()
        except BaseException as e:      # noqa: BLE001 - a future's exception
            return e
        return None


def _gate_next_write(monkeypatch, store, log, err=None):
    """The store's next write is held by a :class:`_Gate`; later writes are logged."""
    eng = store.engine
    real_write = eng.write
    gates = []

    def write(*a, **kw):
        fut = real_write(*a, **kw)
        if not gates:
            gates.append(_Gate(fut, log, err))
            return gates[0]
        log.append("later write submitted")
        return fut
    monkeypatch.setattr(eng, "write", write)
    return gates


def _stepped(tmp_path, steps=2):
    store = ss.NVMeStore(str(tmp_path))
    ps = [nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(n)))
          for n in (64, 256, 1000)]
    opt = HybridAdam(ps, lr=1e-2, state_store=store)
    for step in range(steps):
        _loss(ps, step).backward()
        opt.step()
        opt.zero_grad()
    store.sync()
    return store, ps, opt


def test_a_later_write_waits_for_the_write_a_read_was_served_from(tmp_path, monkeypatch):
    store, ps, opt = _stepped(tmp_path)
    ref_store, ref_ps, ref_opt = _stepped(tmp_path / "ref")
    log = []
    _gate_next_write(monkeypatch, store, log)
    for step in (2, 3):
        for p, o in ((ps, opt), (ref_ps, ref_opt)):
            _loss(p, step).backward()
            o.step()
            o.zero_grad()
    # step 3 read step 2's states from the held write's bytes; its own write came after it
    assert store.in_flight.bytes_forwarded > 0
    assert log[:2] == ["first write waited for", "later write submitted"], log
    store.sync()
    for a, b in zip(ps, ref_ps):
        assert torch.equal(a, b)
    for k in store.keys():
        assert torch.equal(store.get(k), ref_store.get(k))
    store.close()
    ref_store.close()


def test_a_failed_write_a_read_was_served_from_fails_the_step_that_used_it(tmp_path,
                                                                         monkeypatch):
    store, ps, opt = _stepped(tmp_path)
    log = []
    gates = _gate_next_write(monkeypatch, store, log, err=errno.EIO)
    _loss(ps, 2).backward()
    opt.step()                              # its write is held, then fails
    opt.zero_grad()
    forwarded = store.in_flight.bytes_forwarded
    _loss(ps, 3).backward()
    with pytest.raises(ss.StateStoreIOError) as ei:
        opt.step()                          # served from that write: it raises its error
    assert ei.value.errno == errno.EIO and "write of state" in str(ei.value)
    assert store.in_flight.bytes_forwarded > forwarded and gates[0].waited
    # the unit's new values were written after the failed write, and the step raised
    assert log[:2] == ["first write waited for", "later write submitted"], log
    with pytest.raises(ss.StateStoreError):
        opt.step()                          # the optimizer refuses: reload a checkpoint
    with pytest.raises(ss.StateStoreIOError, match="lost an update"):
        store.get(next(iter(store.keys())))
    store.close()


def test_the_ring_tells_whether_a_released_regions_bytes_are_intact():
    ring = RingArena(torch.zeros(16 * 4096, dtype=torch.uint8), 4096)
    a = ring.try_alloc(4 * 4096)
    ring.keep(a.region)
    assert not ring.intact(a.region)            # still live
    ring.release(a.region)
    assert ring.intact(a.region)
    b = ring.try_alloc(4 * 4096)                # the ring is empty: placed after it
    assert b.offset == 4 * 4096 and ring.intact(a.region)
    c = ring.try_alloc(4 * 4096, at_start=True)     # the start is free: wraps to it
    assert c.offset == 0 and not ring.intact(a.region)
    ring.release(b.region)
    ring.release(c.region)
    d = ring.try_alloc(4 * 4096)
    ring.keep(d.region)
    ring.release(d.region)
    ring.try_alloc(13 * 4096)                   # no room beside it: over it
    assert not ring.intact(d.region)


def test_a_get_after_a_put_is_served_from_the_ring_and_raises_the_puts_error(tmp_path,
                                                                           monkeypatch):
    with ss.NVMeStore(str(tmp_path)) as store:
        keys, _ = _units(store, 2)
        value = torch.randn(300)
        store.put(keys[0], value)
        assert torch.equal(store.get(keys[0]), value)
        assert store.in_flight.bytes_forwarded > 0
        log = []
        _gate_next_write(monkeypatch, store, log, err=errno.EIO)
        store.put(keys[0], value + 1)       # held, then fails
        forwarded = store.in_flight.bytes_forwarded
        with pytest.raises(ss.StateStoreIOError) as ei:
            store.get(keys[0])              # served from it: raises its error
        assert ei.value.errno == errno.EIO
        assert store.in_flight.bytes_forwarded > forwarded
        with pytest.raises(ss.StateStoreIOError, match="lost an update"):
            store.get(keys[0])

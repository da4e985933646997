"""Backend conformance suite: the same checks on every store of ``helpers.stores.BACKENDS``.

A new backend passes this suite by adding one line to ``BACKENDS``. Checks specific to
non-resident stores (ring buffer, read-ahead, write-behind, background errors, the budget) run
on the ``SimDiskStore`` test double at the end of the file, and on any non-resident backend of
the registry where noted.

Everything here is exact: stores move bytes, so values are compared with ``torch.equal``.
"""
from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch

import statestore as ss
from statestore import Slice, StateKey
from statestore.errors import (BudgetError, StateKeyError, StateStoreClosedError,
                               StateStoreError, StateStoreIOError, StateStoreValueError)

from helpers.gc_scope import new_objects_only
from helpers.simstore import SimDiskStore

K = StateKey
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32,
          torch.int64, torch.uint8]
SIZES = [0, 1, 7, 4097, (1 << 20) + 3]


def _rand(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    if dtype == torch.uint8:
        return torch.randint(0, 255, shape, generator=g, dtype=torch.int64).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=torch.int64).to(dtype)


def _elems(store, dtype, k=1):
    """A chunk length (elements) whose byte offsets meet the store's alignment."""
    item = torch.empty((), dtype=dtype).element_size()
    return max(1, store.alignment // item) * k


# ============================================================================== catalogue
class TestCatalogue:
    def test_empty(self, store):
        assert len(store) == 0 and store.keys() == []
        st = store.stats()
        assert st["nbytes"] == 0 and st["ntensors"] == 0

    def test_create_get_zeros(self, store):
        store.create(K("w", "exp_avg"), (3, 5))
        assert K("w", "exp_avg") in store
        assert ("w", "exp_avg") in store and "w/exp_avg" in store   # key forms
        assert "w/exp_avg_sq" not in store
        assert store.spec("w/exp_avg") == ss.StateSpec((3, 5), torch.float32)
        t = store.get("w/exp_avg")
        assert t.shape == (3, 5) and t.dtype == torch.float32
        assert torch.equal(t.cpu(), torch.zeros(3, 5))

    def test_create_with_init_and_put(self, store):
        init = _rand((4, 6), torch.float32)
        store.create("p/m", (4, 6), torch.float32, init)
        assert torch.equal(store.get("p/m").cpu(), init)
        new = _rand((4, 6), torch.float32, seed=1)
        store.put("p/m", new)
        assert torch.equal(store.get("p/m").cpu(), new)

    def test_put_converts_dtype(self, store):
        store.create("p/m", (5,), torch.float32)
        store.put("p/m", torch.arange(5, dtype=torch.float64))
        assert torch.equal(store.get("p/m").cpu(), torch.arange(5, dtype=torch.float32))

    def test_create_many_order_keys_len(self, store):
        entries = [(K(str(i), "exp_avg"), (i + 1,), torch.float32, None) for i in range(5)]
        entries.append((K("x", "master"), (2, 2), torch.float32, torch.ones(2, 2)))
        store.create_many(entries)
        assert store.keys() == [e[0] for e in entries]
        assert len(store) == 6
        assert torch.equal(store.get("x/master").cpu(), torch.ones(2, 2))
        for i in range(5):
            assert torch.equal(store.get(K(str(i), "exp_avg")).cpu(), torch.zeros(i + 1))

    def test_create_many_empty_is_noop(self, store):
        store.create_many([])
        assert len(store) == 0

    def test_delete_and_clear(self, store):
        store.create_many([(K("a", "m"), (3,), torch.float32, torch.ones(3)),
                           (K("b", "m"), (3,), torch.float32, torch.full((3,), 2.0)),
                           (K("c", "m"), (3,), torch.float32, None)])
        store.delete("a/m")
        assert "a/m" not in store and len(store) == 2
        assert torch.equal(store.get("b/m").cpu(), torch.full((3,), 2.0))   # neighbours intact
        store.delete([K("b", "m")])
        assert store.keys() == [K("c", "m")]
        # a deleted key can be created again, zero-filled
        store.create("a/m", (4,))
        assert torch.equal(store.get("a/m").cpu(), torch.zeros(4))
        store.clear()
        assert len(store) == 0 and store.keys() == []
        assert store.stats()["nbytes"] == 0
        store.create("a/m", (2,))       # usable after clear
        assert len(store) == 1

    def test_stats_counts(self, store):
        store.create("a/m", (7,), torch.float32)
        store.create("b/m", (3, 3), torch.float16)
        store.create("c/m", (0,), torch.float64)
        st = store.stats()
        assert st["ntensors"] == 3
        assert st["nbytes"] == 7 * 4 + 9 * 2 + 0
        store.delete("a/m")
        st = store.stats()
        assert st["ntensors"] == 2 and st["nbytes"] == 18
        if not store.resident:
            store.get("b/m")
            st = store.stats()
            assert st["bytes_read"] >= 18 and st["budget_bytes"] == store.budget_bytes

    def test_create_many_mixed_dtypes(self, store):
        # regression: FileStore once packed these without padding (misaligned views)
        vals = {K("h", "m"): _rand((3,), torch.float16), K("f", "m"): _rand((5,), torch.float32),
                K("d", "m"): _rand((1,), torch.float64), K("i", "m"): _rand((7,), torch.uint8)}
        store.create_many([(k, tuple(v.shape), v.dtype, v) for k, v in vals.items()])
        for k, v in vals.items():
            assert torch.equal(store.get(k).cpu(), v)

    def test_views_64_byte_aligned(self, store):
        # _slab.py promises 64-byte aligned views to the SIMD kernels
        if not store.resident:
            pytest.skip("views are a resident-store property")
        store.create_many([(K(str(i), "m"), (3 + i,), torch.float32, None) for i in range(4)])
        assert [store.get(K(str(i), "m")).data_ptr() % 64 for i in range(4)] == [0] * 4

    def test_scalar_and_multidim_shapes(self, store):
        store.create_many([(K("s", "m"), (), torch.float32, torch.tensor(3.5)),
                           (K("t", "m"), (2, 3, 4), torch.float32, _rand((2, 3, 4), torch.float32))])
        assert store.get("s/m").shape == ()
        assert store.get("s/m").item() == 3.5
        assert torch.equal(store.get("t/m").cpu(), _rand((2, 3, 4), torch.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_dtypes_and_sizes_roundtrip(store, dtype, n):
    if n == SIZES[-1] and dtype not in (torch.float32, torch.bfloat16):
        pytest.skip("the largest size once per float width is enough")
    val = _rand((n,), dtype, seed=n)
    store.create("p/s", (n,), dtype)
    assert store.spec("p/s").dtype == dtype
    assert torch.equal(store.get("p/s").cpu(), torch.zeros(n, dtype=dtype))
    store.put("p/s", val)
    got = store.get("p/s").cpu()
    assert got.dtype == dtype and torch.equal(got, val)
    store.create("q/s", (n,), dtype, val)
    assert torch.equal(store.get("q/s").cpu(), val)
    assert store.stats()["nbytes"] == 2 * n * val.element_size()


# ============================================================================== pipeline
def _two_states(store, n=5000, dtype=torch.float32):
    a, b = _rand((n,), dtype, 1), _rand((n,), dtype, 2)
    store.create_many([(K("a", "m"), (n,), dtype, a), (K("b", "m"), (n,), dtype, b)])
    return a, b


class TestPipeline:
    @pytest.mark.parametrize("wait", [True, False])
    def test_rw_multi_slice_units_chunked(self, store, wait):
        n = 5000
        a, b = _two_states(store, n)
        step = 1000 if store.resident else _elems(store, torch.float32)
        ranges = [(s, min(s + step, n)) for s in range(0, n, step)]
        units = [[Slice(K("a", "m"), s, e), Slice(K("b", "m"), s, e)] for s, e in ranges]
        seen = []
        with store.pipeline(units, mode="rw", wait=wait) as pipe:
            for (s, e), (ta, tb) in zip(ranges, pipe):
                assert ta.dim() == 1 and ta.numel() == e - s and tb.numel() == e - s
                assert torch.equal(ta.cpu(), a[s:e]) and torch.equal(tb.cpu(), b[s:e])
                ta.add_(1)
                tb.mul_(2)
                seen.append((s, e))
        assert seen == ranges
        assert torch.equal(store.get("a/m").cpu(), a + 1)
        assert torch.equal(store.get("b/m").cpu(), b * 2)

    def test_r_mode_reads(self, store):
        a, b = _two_states(store)
        with store.pipeline([[Slice(K("b", "m"), 0, 5000)], [Slice(K("a", "m"), 0, 5000)]],
                            mode="r") as pipe:
            got = [t.cpu().clone() for (t,) in pipe]
        assert torch.equal(got[0], b) and torch.equal(got[1], a)

    def test_w_mode_writes(self, store):
        n = 3000
        store.create_many([(K("a", "m"), (n,), torch.float32, None),
                           (K("b", "m"), (n,), torch.float16, None)])
        step = 2048     # 8 KiB of float32, 4 KiB of float16: aligned for every store
        ranges = [(s, min(s + step, n)) for s in range(0, n, step)]
        units = [[Slice(K("a", "m"), s, e), Slice(K("b", "m"), s, e)] for s, e in ranges]
        with store.pipeline(units, mode="w") as pipe:
            for (s, e), (ta, tb) in zip(ranges, pipe):
                ta.copy_(torch.arange(s, e, dtype=torch.float32))
                tb.fill_(3)
        assert torch.equal(store.get("a/m").cpu(), torch.arange(n, dtype=torch.float32))
        assert torch.equal(store.get("b/m").cpu(), torch.full((n,), 3, dtype=torch.float16))

    def test_empty_pipeline_and_empty_slice(self, store):
        with store.pipeline([], mode="rw") as pipe:
            assert list(pipe) == []
        store.create("z/m", (0,))
        with store.pipeline([[Slice(K("z", "m"), 0, 0)]], mode="rw") as pipe:
            (t,), = list(pipe)
            assert t.numel() == 0

    def test_bad_mode_and_slices(self, store):
        store.create("a/m", (10,))
        with pytest.raises(StateStoreValueError, match="mode"):
            store.pipeline([], mode="x")
        with pytest.raises(StateStoreValueError, match="a/m"):
            store.pipeline([[Slice(K("a", "m"), 0, 11)]])
        with pytest.raises(StateStoreValueError, match="a/m"):
            store.pipeline([[Slice(K("a", "m"), 5, 4)]])
        with pytest.raises(StateKeyError, match="nope/m"):
            store.pipeline([[Slice(K("nope", "m"), 0, 1)]])
        with pytest.raises(StateStoreValueError):
            store.pipeline([[(K("a", "m"), 0, 1)]])

    def test_exception_in_body_keeps_store_usable(self, store):
        a, _ = _two_states(store, 100)
        with pytest.raises(ZeroDivisionError):
            with store.pipeline([[Slice(K("a", "m"), 0, 100)]], mode="rw") as pipe:
                for (t,) in pipe:
                    raise ZeroDivisionError
        assert torch.equal(store.get("b/m").cpu(), _rand((100,), torch.float32, 2))
        store.put("a/m", torch.ones(100))
        assert torch.equal(store.get("a/m").cpu(), torch.ones(100))

    @pytest.mark.parametrize("end", ["cancel", "close"])
    def test_a_pipeline_cut_short_never_ends_quietly(self, store, end):
        # a pass that stops early must not look whole: a step iterating a cancelled pipeline
        # would otherwise end as if made, its step counts advanced and nothing updated
        n = 5000
        _two_states(store, n)
        step = 1000 if store.resident else _elems(store, torch.float32)
        units = [[Slice(K("a", "m"), s, min(s + step, n))] for s in range(0, n, step)]
        pipe = store.pipeline(units, mode="rw")
        next(pipe)
        getattr(pipe, end)()
        with pytest.raises(StateStoreClosedError,
                           match=f"{len(units) - 1} of its {len(units)} units not handed out"):
            next(pipe)
        whole = store.pipeline(units, mode="r")
        assert len(list(whole)) == len(units)
        with pytest.raises(StopIteration):      # a pass that ended at its last unit
            next(whole)

    def test_resident_views_no_copy(self, store):
        if not store.resident:
            pytest.skip("views are a resident-store property")
        a, _ = _two_states(store, 100)
        live = store.get("a/m")
        assert store.get("a/m").data_ptr() == live.data_ptr()
        with store.pipeline([[Slice(K("a", "m"), 10, 50), Slice(K("b", "m"), 0, 100)]],
                            mode="rw") as pipe:
            for ta, tb in pipe:
                assert ta.data_ptr() == live.data_ptr() + 10 * 4
                assert tb.data_ptr() == store.get("b/m").data_ptr()
                ta.fill_(7)             # the live tensor changes at once
                assert torch.equal(live[10:50].cpu(), torch.full((40,), 7.0))
        live.fill_(1)                   # get() is a view: writing to it writes the store
        assert torch.equal(store.get("a/m").cpu(), torch.ones(100))
        assert store.get("a/m").device == store.device

    def test_non_resident_r_mode_does_not_write(self, store):
        if store.resident:
            pytest.skip("resident 'r' pipelines hand out live views")
        a, _ = _two_states(store, 2048)
        with store.pipeline([[Slice(K("a", "m"), 0, 2048)]], mode="r") as pipe:
            for (t,) in pipe:
                t.fill_(-1)
        assert torch.equal(store.get("a/m"), a)

    def test_non_resident_get_is_a_copy(self, store):
        if store.resident:
            pytest.skip("resident get() is a view")
        a, _ = _two_states(store, 100)
        t = store.get("a/m")
        t.fill_(0)
        assert torch.equal(store.get("a/m"), a)

    def test_unaligned_slice_rejected_by_non_resident(self, store):
        if store.resident or store.alignment <= 4:
            pytest.skip("alignment applies to non-resident stores")
        store.create("a/m", (5000,))
        with pytest.raises(StateStoreValueError, match="a/m"):
            store.pipeline([[Slice(K("a", "m"), 3, 100)]])


# ============================================================================== lifetime
class TestLifetime:
    def test_context_manager_closes(self, store_factory):
        s = store_factory()
        with s as same:
            assert same is s
            s.create("a/m", (3,))
        assert s.closed

    def test_close_idempotent_and_closed_ops_raise(self, store_factory):
        s = store_factory()
        s.create("a/m", (3,))
        s.close()
        s.close()
        assert s.closed
        for op in (lambda: s.create("b/m", (1,)),
                   lambda: s.create_many([(K("b", "m"), (1,), torch.float32, None)]),
                   lambda: s.get("a/m"),
                   lambda: s.put("a/m", torch.zeros(3)),
                   lambda: s.delete("a/m"),
                   lambda: s.pipeline([]),
                   lambda: s.__enter__()):
            with pytest.raises(StateStoreClosedError):
                op()
        assert issubclass(StateStoreClosedError, StateStoreError)

    def test_clear_on_closed_store_raises(self, store_factory):
        s = store_factory()
        s.create("a/m", (3,))
        s.close()
        with pytest.raises(StateStoreClosedError):
            s.clear()

    def test_exit_with_exception_still_closes(self, store_factory):
        s = store_factory()
        with pytest.raises(RuntimeError, match="boom"):
            with s:
                s.create("a/m", (3,))
                raise RuntimeError("boom")
        assert s.closed


# ============================================================================== errors
def test_a_store_is_always_truthy(store):
    """``if store:`` means "a store was given": an empty store is truthy too (``__len__``
    alone would make it falsy), and ``len`` still counts states."""
    assert len(store) == 0 and bool(store) is True
    store.create("w/exp_avg", (3,), torch.float32)
    assert len(store) == 1 and bool(store) is True


def test_unknown_key(store):
    store.create("a/m", (2,))
    for op in (lambda: store.get("b/m"), lambda: store.put("b/m", torch.zeros(2)),
               lambda: store.spec("b/m"), lambda: store.delete("b/m")):
        with pytest.raises(StateKeyError, match="b/m"):
            op()
    with pytest.raises(KeyError):       # also a KeyError, for callers catching the built-in
        store.get("a/v")
    assert store.keys() == [K("a", "m")]   # a failed delete leaves everything in place


def test_duplicate_key(store):
    store.create("a/m", (2,))
    with pytest.raises(StateKeyError, match="a/m"):
        store.create("a/m", (2,))
    with pytest.raises(StateKeyError, match="c/m"):
        store.create_many([(K("c", "m"), (1,), torch.float32, None),
                           (K("c", "m"), (1,), torch.float32, None)])
    assert len(store) == 1     # nothing created by the failing call


# (what is passed, what the error names)
BAD_CREATE = [
    pytest.param(dict(key="a/m", shape=(-1, 2)), "a/m", id="negative-dim"),
    pytest.param(dict(key="a/m", shape=None), "a/m", id="shape-none"),
    pytest.param(dict(key="a/m", shape="xy"), "a/m", id="shape-not-ints"),
    pytest.param(dict(key="a/m", shape=(2,), dtype=torch.complex64), "a/m", id="bad-dtype"),
    pytest.param(dict(key="a/m", shape=(2,), dtype="float32"), "a/m", id="dtype-not-dtype"),
    pytest.param(dict(key="a/m", shape=(2,), init=torch.zeros(3)), "a/m", id="init-shape"),
    pytest.param(dict(key="a/m", shape=(2,), init=[0.0, 1.0]), "a/m", id="init-not-tensor"),
    pytest.param(dict(key="noslash", shape=(2,)), "noslash", id="key-no-slash"),
    pytest.param(dict(key=123, shape=(2,)), "123", id="key-int"),
    pytest.param(dict(key=("a", 1), shape=(2,)), "a", id="key-bad-tuple"),
]


@pytest.mark.parametrize("kwargs,culprit", BAD_CREATE)
def test_bad_create(store, kwargs, culprit):
    with pytest.raises(StateStoreValueError, match=culprit):
        store.create(**kwargs)
    assert len(store) == 0


def test_bad_put(store):
    store.create("a/m", (2, 3))
    with pytest.raises(StateStoreValueError, match=r"a/m.*\(3, 2\)"):
        store.put("a/m", torch.zeros(3, 2))
    with pytest.raises(StateStoreValueError, match="a/m"):
        store.put("a/m", [[0.0] * 3] * 2)
    assert torch.equal(store.get("a/m").cpu(), torch.zeros(2, 3))


def test_bad_create_many_entry(store):
    with pytest.raises(StateStoreValueError, match="key, shape, dtype, init"):
        store.create_many([("a/m", (2,))])


def test_errors_subclass_builtins():
    assert issubclass(StateStoreValueError, ValueError)
    assert issubclass(StateKeyError, KeyError)
    assert issubclass(StateStoreIOError, OSError)
    assert issubclass(BudgetError, StateStoreError)


# ============================================================================== non-resident
# Pipeline machinery of non-resident stores, on the SimDiskStore test double.
MiB = 1 << 20


@pytest.fixture
def sim():
    s = SimDiskStore(budget_bytes=64 * 1024, write_delay=0.0005, read_delay=0.0002)
    yield s
    try:
        s.close()
    except StateStoreError:
        pass


def test_sim_budget_smaller_than_states(sim):
    n = MiB // 4        # 1 MiB states, 64 KiB budget
    a, b = _rand((n,), torch.float32, 1), _rand((n,), torch.float32, 2)
    sim.create_many([(K("a", "m"), (n,), torch.float32, a), (K("b", "m"), (n,), torch.float32, b)])
    step = 2048         # 8 KiB per slice, 16 KiB per unit: several units in flight
    units = [[Slice(K("a", "m"), s, s + step), Slice(K("b", "m"), s, s + step)]
             for s in range(0, n, step)]
    with sim.pipeline(units, mode="rw") as pipe:
        for ta, tb in pipe:
            ta.add_(tb)
    assert torch.equal(sim.get("a/m"), a + b)
    assert torch.equal(sim.get("b/m"), b)
    # every byte went through the budget's ring buffer, which is exactly the budget
    assert sim.out_of_budget == []
    assert sim.stats()["buffer_bytes"] == 64 * 1024
    assert all(e - s == 64 * 1024 for s, e in sim.buffer_ranges)
    assert sim.stats()["bytes_written"] >= 2 * MiB


def test_sim_unit_bigger_than_budget(sim):
    sim.create("a/m", (MiB // 4,))
    with pytest.raises(BudgetError, match="budget"):
        with sim.pipeline([[Slice(K("a", "m"), 0, MiB // 4)]], mode="r") as pipe:
            list(pipe)
    assert torch.equal(sim.get("a/m"), torch.zeros(MiB // 4))   # still usable


def test_sim_read_ahead(sim):
    n = 8 * 1024
    sim.create_many([(K(str(i), "m"), (n,), torch.float32, None) for i in range(4)])
    sim.io_log.clear()
    with sim.pipeline([[Slice(K(str(i), "m"), 0, n)] for i in range(4)], mode="r") as pipe:
        next(pipe)
        # 32 KiB units, 64 KiB ring: the second unit is read while the first is handed out
        reads = [e for e in sim.io_log if e[0] == "read"]
        assert len(reads) == 2
        list(pipe)


def test_sim_background_write_error_surfaces_at_next_call():
    # the write sleeps long enough to be still in flight when the pipeline closes (a failed
    # write that has already finished is raised by close() itself, which is the next call)
    sim = SimDiskStore(budget_bytes=64 * 1024, write_delay=0.05)
    n = 2048
    sim.create_many([(K("a", "m"), (n,), torch.float32, None),
                     (K("b", "m"), (n,), torch.float32, None)])
    sim.fail_writes(key=K("a", "m"))
    with sim.pipeline([[Slice(K("a", "m"), 0, n)]], mode="rw", wait=False) as pipe:
        for (t,) in pipe:
            t.fill_(1)
    # the failed write is in the background; the next call into the store reports it
    time.sleep(0.3)
    with pytest.raises(StateStoreIOError, match="a/m") as ei:
        sim.get("b/m")
    assert "write" in str(ei.value)
    # reported once; the store keeps working
    assert torch.equal(sim.get("b/m"), torch.zeros(n))
    sim.close()


def test_sim_write_error_raised_by_pipeline_close_with_wait(sim):
    sim.create("a/m", (2048,))
    sim.fail_writes(key=K("a", "m"))
    with pytest.raises(StateStoreIOError, match="a/m"):
        with sim.pipeline([[Slice(K("a", "m"), 0, 2048)]], mode="w") as pipe:
            for (t,) in pipe:
                t.fill_(1)


def test_sim_write_error_raised_by_sync_and_close():
    s = SimDiskStore(budget_bytes=64 * 1024, write_delay=0.01)
    s.create("a/m", (2048,))
    s.fail_writes(key=K("a", "m"))
    with s.pipeline([[Slice(K("a", "m"), 0, 2048)]], mode="w", wait=False) as pipe:
        for (t,) in pipe:
            t.fill_(1)
    with pytest.raises(StateStoreIOError, match="a/m"):
        s.close()
    assert s.closed and s.closed_backend    # released even though an error was raised


def test_sim_read_error_names_state(sim):
    sim.create("a/m", (2048,))
    sim.fail_reads(key=K("a", "m"))
    with pytest.raises(StateStoreIOError, match="a/m"):
        sim.get("a/m")
    assert torch.equal(sim.get("a/m"), torch.zeros(2048))


def test_sim_write_behind_then_reread_sees_new_data():
    # slow writes, fast reads, several workers: without the pending-write wait, a read
    # submitted after a write would overtake it and return stale bytes
    s = SimDiskStore(budget_bytes=64 * 1024, write_delay=0.02, workers=4)
    try:
        n = 2048
        s.create_many([(K(str(i), "m"), (n,), torch.float32, None) for i in range(3)])
        for rnd in range(1, 4):
            with s.pipeline([[Slice(K(str(i), "m"), 0, n)] for i in range(3)], mode="rw",
                            wait=False) as pipe:
                for (t,) in pipe:
                    t.add_(1)
            # writes still pending: read them straight back through a new pipeline
            with s.pipeline([[Slice(K(str(i), "m"), 0, n)] for i in range(3)], mode="r") as pipe:
                for (t,) in pipe:
                    assert torch.equal(t, torch.full((n,), float(rnd)))
        # write ordering per slice: the last write wins
        assert torch.equal(s.get("0/m"), torch.full((n,), 3.0))
        assert torch.frombuffer(bytearray(s.raw("2/m")), dtype=torch.float32).eq(3.0).all()
    finally:
        s.close()


def test_sim_interleaved_writes_of_same_state_keep_order():
    s = SimDiskStore(budget_bytes=64 * 1024, write_delay=0.005, workers=4)
    try:
        s.create("a/m", (1024,))
        for v in range(1, 6):   # five pipelines writing the same slice, none waiting
            with s.pipeline([[Slice(K("a", "m"), 0, 1024)]], mode="w", wait=False) as pipe:
                for (t,) in pipe:
                    t.fill_(v)
        s.sync()
        assert torch.equal(s.get("a/m"), torch.full((1024,), 5.0))
    finally:
        s.close()


def test_sim_many_units_wrap_ring_and_back_pressure():
    s = SimDiskStore(budget_bytes=64 * 1024, write_delay=0.001, read_delay=0.001)
    try:
        n = 1024 * 40
        v = _rand((n,), torch.float32, 3)
        s.create("a/m", (n,), torch.float32, v)
        # units of 1, 2 and 3 pages: ring regions of varying sizes wrap many times
        bounds, pos, k = [], 0, 0
        while pos < n:
            e = min(n, pos + 1024 * (1 + k % 3))
            bounds.append((pos, e))
            pos, k = e, k + 1
        with s.pipeline([[Slice(K("a", "m"), a, b)] for a, b in bounds], mode="rw") as pipe:
            for (a, b), (t,) in zip(bounds, pipe):
                assert torch.equal(t, v[a:b] + 0)
                t.neg_()
        assert torch.equal(s.get("a/m"), -v)
        assert s.out_of_budget == []
    finally:
        s.close()


def test_sim_delete_waits_for_pending_writes(sim):
    sim.create_many([(K("a", "m"), (2048,), torch.float32, None),
                     (K("b", "m"), (2048,), torch.float32, None)])
    with sim.pipeline([[Slice(K("a", "m"), 0, 2048)], [Slice(K("b", "m"), 0, 2048)]],
                      mode="w", wait=False) as pipe:
        for (t,) in pipe:
            t.fill_(4)
    sim.delete("a/m")
    assert torch.equal(sim.get("b/m"), torch.full((2048,), 4.0))


def test_sim_checks_budget_argument():
    for bad in (0, -1, 1.5, True, "1"):
        with pytest.raises(StateStoreValueError, match="budget_bytes"):
            SimDiskStore(budget_bytes=bad)


def test_sim_unit_bytes_is_quarter_budget(sim):
    assert sim.unit_bytes == 16 * 1024
    assert ss.DeviceStore("cpu").unit_bytes is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["device-cpu", "pinned", "file"])
def test_large_states_of_a_slab_are_not_a_power_of_two_apart(backend, dtype, tmp_path):
    """A resident store's slab puts a parameter's states one after another; states of 1 MiB
    or more start 64 KiB further on, so exp_avg and exp_avg_sq of a 2^k-byte parameter are
    neither exactly 2^k bytes apart nor 2^k + 4 KiB (the update's two moment streams then
    contend: fp32 moments 2^k apart, and bf16 moments 2^k + 4 KiB apart, the old stagger, ran
    1.2-1.35x slower at 1 thread: docs/kernels.md, "Speed")."""
    from helpers.stores import make_store
    store = make_store(backend, tmp_path)
    try:
        size = torch.tensor([], dtype=dtype).element_size()
        n = (4 << 20) // size                       # 4 MiB per state
        keys = [StateKey("w", "exp_avg"), StateKey("w", "exp_avg_sq"), StateKey("b", "exp_avg")]
        store.create_many([(keys[0], (n,), dtype, None),
                           (keys[1], (n,), dtype, None),
                           (keys[2], (16,), dtype, None)])
        a, b = (store.get(k).data_ptr() for k in keys[:2])
        beyond = abs(b - a) - (4 << 20)
        assert beyond > 0 and beyond % (64 << 10) == 0, (a, b)
        assert store.stats()["nbytes"] == 8 << 20 | 16 * size
    finally:
        store.close()


def test_pinned_slabs_are_unregistered_before_their_memory_is_freed(monkeypatch):
    """The CUDA driver keeps a host registration by address until cudaHostUnregister: memory
    freed while registered (a store dropped without close) made the next registration at the
    reused address fail (error 712 on an H200). A driver double checks the order here."""
    import gc
    registered = {}

    class Driver:
        def cudaHostRegister(self, ptr, n, flags):
            if any(a < ptr + n and ptr < a + b for a, b in registered.items()):
                return 712
            registered[ptr] = n
            return 0

        def cudaHostUnregister(self, ptr):
            return 0 if registered.pop(ptr, None) is not None else 713

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Driver())
    with new_objects_only():
        for i in range(16):
            st = ss.PinnedCPUStore()
            st.create_many([(f"{j}/m", (50 + 300 * j,), torch.float32, None) for j in range(3)])
            st.create("x/s", (), torch.float32, torch.tensor(2.0))
            view = st.get("1/m")
            assert st.stats()["pinned_bytes"] >= 4 * (50 + 350 + 650) and len(registered) >= 2
            if i % 2:
                st.close()
            del st
            gc.collect()
            view.fill_(1.0)                 # a view outliving its store keeps its pages mapped
            del view
    assert registered == {}

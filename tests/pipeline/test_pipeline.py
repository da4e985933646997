"""Unit tests of the pipeline's building blocks: ``RingArena`` (the RAM budget's ring of host
buffers) and ``plan_units`` (how optimizers cut parameters into pipeline units).

The pipeline as a whole is exercised through stores in test_store_conformance.py.
"""
from __future__ import annotations

import random

import pytest
import torch

from statestore import StateKey
from statestore.errors import BudgetError, StateStoreValueError
from statestore.pipeline import RingArena, plan_units


def arena(capacity=1024, align=64):
    return RingArena(torch.zeros(capacity, dtype=torch.uint8), align)


# ============================================================================== RingArena
def test_arena_rejects_bad_buffer():
    with pytest.raises(StateStoreValueError):
        RingArena(torch.zeros(16, dtype=torch.float32), 4)
    with pytest.raises(StateStoreValueError):
        RingArena(torch.zeros(4, 4, dtype=torch.uint8), 4)


def test_arena_rounds_to_alignment_and_fills():
    a = arena()
    off1, h1 = a.try_alloc(1)
    off2, h2 = a.try_alloc(65)
    assert (off1, off2) == (0, 64)
    assert a.used == 64 + 128
    assert a.try_alloc(0)[0] == 192           # even an empty request takes one block
    assert a.try_alloc(1024 - 256)[0] == 256  # exactly full
    assert a.try_alloc(1) is None
    assert a.used == 1024


def test_arena_too_big_raises_budget_error():
    with pytest.raises(BudgetError, match="1088 bytes exceeds the RAM budget of 1024"):
        arena().try_alloc(1025)


def test_arena_fifo_reuse_after_out_of_order_release():
    a = arena(capacity=256)
    _, h0 = a.try_alloc(64)
    _, h1 = a.try_alloc(64)
    _, h2 = a.try_alloc(128)
    assert a.try_alloc(64) is None
    a.release(h1)                       # a younger region: no space until h0 goes too
    assert a.try_alloc(64) is None
    a.release(h0)
    off, h3 = a.try_alloc(128)          # wraps to the start
    assert off == 0
    assert a.try_alloc(64) is None
    a.release(h2)
    assert a.try_alloc(128)[0] == 128


def test_arena_wrap_leaves_tail_unused():
    a = arena(capacity=256)
    _, h0 = a.try_alloc(128)
    _, h1 = a.try_alloc(64)             # [128, 192)
    a.release(h0)
    off, _ = a.try_alloc(128)           # does not fit in [192, 256): wraps to 0
    assert off == 0
    assert a.try_alloc(64) is None      # [192, 256) stays unused this lap
    a.release(h1)


def test_arena_regions_never_overlap_random():
    rng = random.Random(0)
    a = arena(capacity=4096, align=64)
    live = []                           # (start, end, handle)
    for _ in range(3000):
        if live and (rng.random() < 0.45 or len(live) > 20):
            s, e, h = live.pop(rng.randrange(len(live)))
            a.release(h)
            continue
        n = rng.randrange(1, 1500)
        got = a.try_alloc(n)
        if got is None:
            assert live, "an empty ring must satisfy any request within capacity"
            continue
        off, h = got
        end = off + -(-n // 64) * 64
        assert off % 64 == 0 and end <= 4096
        for s, e, _ in live:
            assert end <= s or off >= e, "overlapping regions"
        live.append((off, end, h))
        assert a.used >= sum(e - s for s, e, _ in live)


def test_arena_view():
    a = arena()
    off, _ = a.try_alloc(100)
    v = a.view(off, 100)
    assert v.numel() == 100 and v.data_ptr() == a.buffer.data_ptr() + off


# ============================================================================== plan_units
def keys(n, states=2):
    return [[StateKey(str(i), f"s{j}") for j in range(states)] for i in range(n)]


def covered(units, numels):
    got = {i: [] for i in range(len(numels))}
    for u in units:
        for i, a, b in u:
            got[i].append((a, b))
    for i, n in enumerate(numels):
        rs = sorted(got[i])
        assert rs[0][0] == 0 and rs[-1][1] == n
        for (a, b), (c, d) in zip(rs, rs[1:]):
            assert b == c, f"group {i}: gap or overlap at {b}/{c}"


def test_plan_none_is_one_unit():
    assert plan_units(keys(3), [5, 0, 7], 4, None) == [[(0, 0, 5), (1, 0, 0), (2, 0, 7)]]
    assert plan_units([], [], 4, None) == []


def test_plan_splits_large_group_at_aligned_points():
    # 2 states x 4 bytes = 8 bytes per element; 8 KiB units -> 1024 elements, aligned to 256
    units = plan_units(keys(1), [5000], 4, 8192, align_elems=256)
    assert [u for u in units] == [[(0, 0, 1024)], [(0, 1024, 2048)], [(0, 2048, 3072)],
                                  [(0, 3072, 4096)], [(0, 4096, 5000)]]


def test_plan_packs_small_groups():
    units = plan_units(keys(10), [10] * 10, 4, 8 * 25)     # 2.5 groups' bytes per unit
    assert [len(u) for u in units] == [2, 2, 2, 2, 2]
    covered(units, [10] * 10)


def test_plan_empty_group_kept():
    units = plan_units(keys(2), [0, 3], 4, 1024)
    assert units == [[(0, 0, 0), (1, 0, 3)]]


@pytest.mark.parametrize("seed", range(5))
def test_plan_random_cover_and_bound(seed):
    rng = random.Random(seed)
    n = rng.randrange(1, 40)
    numels = [rng.choice([0, 1, 7, 100, 1000, 5000, 20000]) for _ in range(n)]
    states = [rng.choice([2, 3, 4]) for _ in range(n)]
    groups = [[StateKey(str(i), f"s{j}") for j in range(states[i])] for i in range(n)]
    max_b = rng.choice([4096, 16384, 65536])
    units = plan_units(groups, numels, 4, max_b, align_elems=64)
    covered(units, numels)
    for u in units:
        assert sum((b - a) * 4 * states[i] for i, a, b in u) <= max_b
        for i, a, b in u:
            assert a % 64 == 0


def test_plan_counts_ring_footprint_of_small_slices():
    # the ring rounds every slice up to the store's alignment; a unit's footprint, so
    # rounded, stays within max_unit_bytes (else small parameters overflow the budget)
    units = plan_units(keys(10), [7] * 10, 4, 16384, align_elems=1024, slice_round=4096)
    covered(units, [7] * 10)
    for u in units:
        assert sum(2 * 4096 for _ in u) <= 16384
    assert len(units) == 5


def test_put_writes_behind_and_a_failed_write_surfaces_at_the_next_call():
    """put() returns once the value is copied into the ring (consecutive puts keep the disk
    busy); a write that fails later is raised by the next call (sync here), and the state
    is refused until replaced, as for a step's write-behind."""
    from helpers.simstore import SimDiskStore
    from statestore.errors import StateStoreIOError
    with SimDiskStore(budget_bytes=1 << 20, write_delay=0.01) as store:
        k = StateKey("a", "m")
        store.create(k, (50_000,), torch.float32, torch.zeros(50_000))
        store.sync()
        value = torch.arange(50_000, dtype=torch.float32)
        store.put(k, value)
        value.zero_()                         # the caller's tensor is free once put returns
        assert torch.equal(store.get(k), torch.arange(50_000, dtype=torch.float32))
        store.fail_writes(key=k)
        store.put(k, torch.ones(50_000))
        with pytest.raises(StateStoreIOError, match="a/m"):
            store.sync()
        with pytest.raises(StateStoreIOError, match="lost an update"):
            store.get(k)
        store.put(k, torch.full((50_000,), 3.0))
        assert torch.equal(store.get(k), torch.full((50_000,), 3.0))

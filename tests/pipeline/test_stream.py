"""``store.stream()`` (whole states chunk by chunk through one pipeline), the two store bases
and the pipeline protocol, on every store of ``helpers.stores.BACKENDS``."""
from __future__ import annotations

import warnings

import pytest
import torch

import statestore as ss
from statestore import Slice, StateKey
from statestore.errors import StateKeyError, StateStoreValueError
from statestore.pipeline import StatePipeline

from helpers.simstore import SimDiskStore

K = StateKey


def _fill(store, sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    vals = {K(f"p{i}", "exp_avg"): torch.randn(n, generator=g) for i, n in enumerate(sizes)}
    store.create_many([(k, v.shape, v.dtype, v) for k, v in vals.items()])
    return vals


def test_read_covers_every_state_in_order(store):
    vals = _fill(store, [10_000, 0, 3, 70_000])
    got = {k: torch.empty_like(v) for k, v in vals.items()}
    seen = []
    with store.stream(list(vals), "r", chunk_bytes=8192) as chunks:
        for sl, t in chunks:
            assert t.dim() == 1 and t.numel() == sl.numel and t.device == store.device
            assert sl.numel * 4 <= 8192
            got[sl.key][sl.start:sl.stop].copy_(t.cpu())
            seen.append(sl)
    assert [s.key for s in seen] == sorted((s.key for s in seen), key=list(vals).index)
    for k, v in vals.items():                      # contiguous, from 0 to the end
        spans = [(s.start, s.stop) for s in seen if s.key == k]
        assert spans[0][0] == 0 and spans[-1][1] == v.numel()
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert torch.equal(got[k], v)
    assert [(s.start, s.stop) for s in seen if s.key == K("p1", "exp_avg")] == [(0, 0)]


def test_write_replaces_whole_states(store):
    vals = _fill(store, [5000, 20_000])
    new = {k: v * 2 + 1 for k, v in vals.items()}
    with store.stream(list(vals), "w") as chunks:
        for sl, t in chunks:
            t.copy_(new[sl.key][sl.start:sl.stop].to(t.device))
    for k, v in new.items():
        assert torch.equal(store.get(k).cpu(), v)


def test_rw_updates_in_place(store):
    vals = _fill(store, [9000])
    with store.stream(list(vals), "rw", chunk_bytes=4096) as chunks:
        for _, t in chunks:
            t.add_(1.0)
    (k, v), = vals.items()
    assert torch.equal(store.get(k).cpu(), v + 1.0)


def test_single_key_and_key_forms(store):
    vals = _fill(store, [100])
    (k, v), = vals.items()
    for key in (k, str(k), [tuple(k)]):     # a key, or an iterable of keys (as delete())
        with store.stream(key) as chunks:
            (sl, t), = list(chunks)
        assert sl == Slice(k, 0, 100) and torch.equal(t.cpu(), v)


def test_error_inside_write_stream_keeps_previous_values(store):
    vals = _fill(store, [20_000])
    (k, v), = vals.items()
    with pytest.raises(RuntimeError, match="caller failed"):
        with store.stream([k], "w", chunk_bytes=16384) as chunks:
            for i, (sl, t) in enumerate(chunks):
                if i == 1:
                    raise RuntimeError("caller failed")
                t.fill_(7.0)
    got = store.get(k).cpu()
    # the chunk in hand was not written back (a resident store's live view is the state)
    if not store.resident:
        assert torch.equal(got[4096:], v[4096:])
    store.sync()
    assert store.stats()["ntensors"] == 1


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_bad_chunk_bytes(store, bad):
    _fill(store, [10])
    with pytest.raises(StateStoreValueError, match="chunk_bytes"):
        store.stream([K("p0", "exp_avg")], chunk_bytes=bad)


def test_bad_mode_and_unknown_key(store):
    _fill(store, [10])
    with pytest.raises(StateStoreValueError, match="mode"):
        store.stream([K("p0", "exp_avg")], mode="x")
    with pytest.raises(StateKeyError):
        store.stream([K("nope", "exp_avg")])
    with pytest.raises(StateStoreValueError):
        store.stream([42])


def test_pipelines_implement_the_protocol(store):
    _fill(store, [10])
    with store.pipeline([[Slice(K("p0", "exp_avg"), 0, 10)]], mode="r") as pipe:
        assert isinstance(pipe, StatePipeline)
        t = pipe.wait_next()
        assert t is not None and t[0].numel() == 10
        assert pipe.wait_next() is None


def test_bases_declare_their_primitives():
    with pytest.raises(TypeError):
        ss.StateStore()

    class NoView(ss.ResidentStore):
        def _allocate(self, entries):
            pass

        def _free(self, keys):
            pass

    class NoWrite(ss.StreamingStore):
        def _allocate(self, entries):
            pass

        def _free(self, keys):
            pass

        def _submit_read(self, s, out):
            pass

    for cls in (NoView, NoWrite):
        with pytest.raises(TypeError, match="abstract"):
            cls()
    assert ss.ResidentStore.resident and not ss.StreamingStore.resident
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # pinned memory without CUDA: one warning
        stores = [ss.DeviceStore("cpu"), ss.PinnedCPUStore()]
    for s in stores:
        assert isinstance(s, ss.ResidentStore) and s.resident
        s.close()


def test_stream_on_a_store_subclassing_statestore_directly():
    """A store that subclasses StateStore with ``resident = False`` (as the SimDiskStore
    double does) streams through the ring like a StreamingStore."""
    st = SimDiskStore(budget_bytes=64 << 10)
    vals = _fill(st, [50_000, 7])
    got = {}
    with st.stream(list(vals), "r") as chunks:
        for sl, t in chunks:
            got.setdefault(sl.key, []).append(t.clone())
            assert t.numel() * 4 <= 32 << 10
    for k, v in vals.items():
        assert torch.equal(torch.cat(got[k]), v)
    assert st.out_of_budget == []
    st.close()

"""Many small states on NVMeStore (docs/nvme.md, "Small states"): states under 4 KiB share
4 KiB blocks of the store's files and move by extents of whole blocks, so a parameter of 16
elements costs 64 bytes of disk and a share of one request, not 4 KiB and a request each;
training, checkpoints (stock safetensors) and old checkpoints stay exact."""
from __future__ import annotations

import os
import random

import pytest
import torch
from safetensors import safe_open

import statestore as ss
from statestore import Slice
from statestore.backends import nvme as nvme_mod
from statestore.checkpoint import read_manifest, verify_checkpoint
from statestore.optim import CPUAdam

from helpers import paths


def _params(n, seed=0, sizes=(16, 3, 16, 700, 16, 5000)):
    g = torch.Generator().manual_seed(seed)
    return [(f"p{i}", torch.nn.Parameter(torch.randn(sizes[i % len(sizes)], generator=g)))
            for i in range(n)]


def _train(opt, named, start, n, skip=lambda i, step: False):
    for step in range(start, start + n):
        g = torch.Generator().manual_seed(1000 + step)
        for i, (_, p) in enumerate(named):
            grad = torch.randn(p.shape, generator=g)
            p.grad = None if skip(i, step) else grad
        opt.step()


def test_small_states_share_blocks_and_requests(tmp_path):
    """2000 parameters of 16 elements: 4000 states in 63 blocks of 4 KiB (16 MiB before,
    a block each), and a step moves them in a few requests (8000 before: one read and one
    write per state)."""
    named = _params(2000, sizes=(16,))
    with ss.NVMeStore(str(tmp_path / "s")) as store:
        opt = CPUAdam(named, lr=1e-2, state_store=store)
        _train(opt, named, 0, 1)
        store.sync()
        assert store.stats()["disk_bytes"] < 1 << 20      # header included
        before = store.engine.stats()["requests"]
        store.cancel_prefetch()
        _train(opt, named, 1, 1)
        store.sync()
        assert store.engine.stats()["requests"] - before < 40
        ck = str(tmp_path / "ck")
        store.save_checkpoint(ck, progress=False)
        size = sum(os.path.getsize(os.path.join(ck, f)) for f in os.listdir(ck))
        assert size < 1 << 20, size
        # a stock reader takes each tensor from the linked shard
        row = next(r for r in read_manifest(ck).rows if r.key == "p7/exp_avg_sq")
        with safe_open(os.path.join(ck, row.file), framework="pt") as f:
            assert torch.equal(f.get_tensor("p7/exp_avg_sq"), store.get("p7/exp_avg_sq"))


@pytest.mark.parametrize("budget", [64 << 10, 1 << 20])
def test_training_with_packed_states_is_exact(tmp_path, budget):
    """Mixed sizes over several units (a small budget cuts blocks between units), some
    parameters without a gradient on some steps (their blocks are read-modified-written),
    saves (copy-on-write of packed blocks), loads linked and copied: bit for bit a
    DeviceStore run."""
    named, ref = _params(300), _params(300)
    store = ss.NVMeStore(str(tmp_path / "s"), budget_bytes=budget)
    opt = CPUAdam(named, lr=1e-2, state_store=store)
    ref_opt = CPUAdam(ref, lr=1e-2, state_store=ss.DeviceStore("cpu"))
    skip = lambda i, step: (i * 7 + step) % 5 == 0       # noqa: E731
    for step in range(6):
        _train(opt, named, step, 1, skip)
        _train(ref_opt, ref, step, 1, skip)
        if step in (1, 3):
            store.save_checkpoint(str(tmp_path / f"c{step}"), progress=False)
            assert verify_checkpoint(str(tmp_path / f"c{step}"), progress=False) == []
    for (n, p), (_, q) in zip(named, ref):
        assert torch.equal(p, q), n
    ck = str(tmp_path / "end")
    store.save_checkpoint(ck, progress=False)
    for k in ref_opt.state_store.keys():
        assert torch.equal(store.get(k), ref_opt.state_store.get(k)), k
    store.close()
    for link in (True, False):
        with ss.NVMeStore(str(tmp_path / f"l{link}"), budget_bytes=budget) as again:
            again.load_checkpoint(ck, progress=False, link=link)
            cont = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in named]
            opt2 = CPUAdam(cont, lr=1e-2, state_store=again)
            _train(opt2, cont, 6, 2, skip)
            if link:
                _train(ref_opt, ref, 6, 2, skip)
            for (n, p), (_, q) in zip(cont, ref):
                assert torch.equal(p, q), (link, n)


def test_random_pipelines_puts_and_saves_agree_with_a_reference(tmp_path):
    """Units made of random subsets of small and large states, in modes rw and w, puts,
    gets, partial slices and linked saves in between, against plain tensors."""
    rnd = random.Random(0)
    sizes = [1, 3, 16, 100, 1000, 1023, 1024, 1025, 5000]
    ref = {f"p{i}/m": torch.zeros(rnd.choice(sizes)) for i in range(120)}
    keys = list(ref)
    with ss.NVMeStore(str(tmp_path / "s"), budget_bytes=256 << 10) as st:
        st.create_many([(k, v.shape, torch.float32, None) for k, v in ref.items()])
        for it in range(12):
            for k in rnd.sample(keys, 10):
                ref[k] = torch.randn(ref[k].numel())
                st.put(k, ref[k])
            ks = rnd.sample(keys, 40)
            units = [[Slice(k, 0, ref[k].numel()) for k in ks[j:j + 6]] for j in range(0, 40, 6)]
            mode = rnd.choice(["rw", "w"])
            with st.pipeline(units, mode=mode, wait=rnd.random() < .5) as pipe:
                for u, ts in zip(units, pipe):
                    for s, t in zip(u, ts):
                        k = str(s.key)
                        if mode == "rw":
                            assert torch.equal(t, ref[k]), (it, k)
                            ref[k] = ref[k] + 1.0
                            t.add_(1.0)
                        else:
                            ref[k] = torch.full((s.numel,), float(it))
                            t.fill_(float(it))
            k = rnd.choice([k for k in keys if 2 <= ref[k].numel() <= 1024])
            with st.pipeline([[Slice(k, 0, ref[k].numel() // 2)]], mode="w") as pipe:
                for (t,) in pipe:                   # half of a small state
                    t.fill_(-1.0)
            ref[k][:ref[k].numel() // 2] = -1.0
            if it % 4 == 1:
                ck = str(tmp_path / f"ck{it}")
                st.save_checkpoint(ck, progress=False)
                assert verify_checkpoint(ck, progress=False) == []
            for k in rnd.sample(keys, 20):
                assert torch.equal(st.get(k), ref[k]), (it, k)
        for k in keys:
            assert torch.equal(st.get(k), ref[k]), k


def test_checkpoints_of_unpacked_stores_still_load(tmp_path, monkeypatch):
    """A linked checkpoint of a store that gave every small state its own 4 KiB block (the
    layout before packing) loads, linked and copied, and trains on exactly."""
    named, ref = _params(40), _params(40)
    old = nvme_mod.layout
    monkeypatch.setattr(nvme_mod, "layout", lambda *a, pack=None, **k: old(*a, **k))
    store = ss.NVMeStore(str(tmp_path / "old"))
    opt = CPUAdam(named, lr=1e-2, state_store=store)
    _train(opt, named, 0, 2)
    ck = str(tmp_path / "ck")
    store.save_checkpoint(ck, progress=False)
    assert all(r.offset % 4096 == 0 for r in read_manifest(ck).rows)
    store.close()
    monkeypatch.undo()
    ref_opt = CPUAdam(ref, lr=1e-2, state_store=ss.DeviceStore("cpu"))
    _train(ref_opt, ref, 0, 4)
    for link in (True, False):
        with ss.NVMeStore(str(tmp_path / f"new{link}")) as again:
            again.load_checkpoint(ck, progress=False, link=link)
            if link:
                assert any(os.stat(f).st_nlink > 1 for f in again.files())
            cont = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in named]
            opt2 = CPUAdam(cont, lr=1e-2, state_store=again)
            _train(opt2, cont, 2, 2)
            for (n, p), (_, q) in zip(cont, ref):
                assert torch.equal(p, q), (link, n)


def test_a_tampered_packed_state_is_refused(tmp_path):
    """Item 5 for packed states: an altered float in a linked shard's shared block."""
    named = _params(64, sizes=(16,))
    with ss.NVMeStore(str(tmp_path / "s")) as store:
        opt = CPUAdam(named, lr=1e-2, state_store=store)
        _train(opt, named, 0, 2)
        ck = str(tmp_path / "ck")
        store.save_checkpoint(ck, progress=False)
        row = next(r for r in read_manifest(ck).rows if r.key == "p9/exp_avg")
        with open(os.path.join(ck, row.file), "r+b") as f:
            f.seek(row.offset + 8)
            f.write(torch.tensor([7.0]).numpy().tobytes())
        with pytest.raises(ss.CheckpointCorruptError, match="'p9/exp_avg'"):
            _train(opt, named, 2, 1)
        with pytest.raises(ss.CheckpointCorruptError):
            store.get("p9/exp_avg")
        assert torch.isfinite(store.get("p10/exp_avg")).all()


def test_a_checkpoint_written_before_packing_loads(tmp_path):
    """tests/data/checkpoint-before-packing: a linked checkpoint written by an NVMeStore of
    commit 236e501 (before packing: each state under 4 KiB in a 4 KiB block of its own,
    small and large states interleaved): CPUAdam, lr=1e-2, parameters e0..e4 of 16, 16, 5,
    1100 and 300 elements, two steps. Loaded linked and copied, every state reads as the
    stock reader reads it from the shard, and a step on it matches one on a DeviceStore."""
    import shutil
    ck = str(tmp_path / "ck")
    shutil.copytree(os.path.join(paths.DATA,
                                 "checkpoint-before-packing"), ck)
    rows = read_manifest(ck).rows
    assert [r.offset % 4096 for r in rows] == [0] * 10
    shard = os.path.join(ck, rows[0].file)
    with safe_open(shard, framework="pt") as f:
        want = {r.key: f.get_tensor(r.key) for r in rows}
    sizes = (16, 16, 5, 1100, 300)

    def step(store):
        named = [(f"e{i}.w", torch.nn.Parameter(torch.ones(n))) for i, n in enumerate(sizes)]
        opt = CPUAdam(named, lr=1e-2, state_store=store)
        for i, (_, p) in enumerate(named):
            p.grad = torch.full((sizes[i],), 0.5)
        opt.step()
        return [p.detach().clone() for _, p in named]

    with ss.DeviceStore("cpu") as dev:
        dev.load_checkpoint(ck, progress=False)
        expected = step(dev)
    for link in (True, False):
        with ss.NVMeStore(str(tmp_path / f"s{link}")) as store:
            store.load_checkpoint(ck, progress=False, link=link)
            assert any(os.stat(f).st_nlink > 1 for f in store.files()) == link
            for k, v in want.items():
                assert torch.equal(store.get(k), v), (link, k)
            got = step(store)
            assert all(torch.equal(a, b) for a, b in zip(got, expected)), link
            store.sync()
    assert verify_checkpoint(ck, progress=False) == []

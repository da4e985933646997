"""Checkpoints that hard-link an NVMeStore's own files (``save_checkpoint(link=True)``, the
default): the checkpoint must stay byte-for-byte unchanged whatever the store does next
(copy-on-write of frozen files), be exact, and fall back to copying where a link cannot be
made or would break a promise (another filesystem, ``shard_bytes`` smaller than the file,
a state file removed under the store)."""
from __future__ import annotations

import hashlib
import os
import threading
import time

import pytest
import torch
from safetensors import safe_open

import statestore as ss
from statestore import Slice
from statestore.checkpoint import read_manifest, verify_checkpoint
from statestore.optim import CPUAdam

BUDGET = 64 << 10       # small: states of a few KiB span several pipeline units


def _store(kind, tmp_path, **kw):
    if kind == "nvme":
        return ss.NVMeStore(str(tmp_path / "store"), budget_bytes=BUDGET, **kw)
    return ss.TieredStore.from_fraction(0.5, str(tmp_path / "store"), budget_bytes=BUDGET, **kw)


def _digests(path):
    return {n: hashlib.sha256(open(os.path.join(path, n), "rb").read()).hexdigest()
            for n in sorted(os.listdir(path))}


def _nvme_files(store):
    if isinstance(store, ss.TieredStore):
        return [f for t in store.tiers if isinstance(t, ss.NVMeStore) for f in t.files()]
    return store.files()


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"emb": (257, 33), "w1": (96, 80), "b1": (96,), "w2": (7, 96), "b2": (7,),
              "frozen": (40, 40)}
    return [(n, torch.nn.Parameter(torch.randn(s, generator=g))) for n, s in shapes.items()]


def _grads(named, step, skip=()):
    g = torch.Generator().manual_seed(1000 + step)
    for n, p in named:
        p.grad = None if n in skip else torch.randn(p.shape, generator=g)


def _train(opt, named, start, n, skip=()):
    for step in range(start, start + n):
        _grads(named, step, skip)
        opt.step()


def _states(store):
    return {str(k): store.get(k).clone() for k in store.keys()}


def _ckpt_states(path):
    m = read_manifest(path)
    out = {}
    for r in m.rows:
        with safe_open(os.path.join(path, r["file"]), "pt") as f:
            out[r["key"]] = f.get_tensor(r["key"])
    return out


@pytest.mark.parametrize("kind", ["nvme", "tiered"])
def test_linked_checkpoint_is_immutable_and_exact(kind, tmp_path):
    named = _params()
    store = _store(kind, tmp_path)
    opt = CPUAdam(named, lr=1e-2, weight_decay=0.01, state_store=store)
    _train(opt, named, 0, 3)
    ck = str(tmp_path / "ck")
    before_files = _nvme_files(store)
    at_save = _states(store)
    store.save_checkpoint(ck)
    digests = _digests(ck)
    shards = [n for n in os.listdir(ck) if n.startswith("shard-")]
    # The NVMe files became shards: same inode, no bytes copied.
    store_inodes = {os.stat(f).st_ino for f in before_files}
    assert store_inodes & {os.stat(os.path.join(ck, n)).st_ino for n in shards}
    assert verify_checkpoint(ck) == []
    assert {k: v for k, v in _ckpt_states(ck).items()}.keys() == at_save.keys()
    for k, v in _ckpt_states(ck).items():
        assert torch.equal(v, at_save[k]), k
    # Training on writes new files; the checkpoint's bytes never change.
    _train(opt, named, 3, 4)
    store.sync()
    assert _digests(ck) == digests
    assert not set(_nvme_files(store)) & set(before_files)
    assert all(not os.path.exists(f) for f in before_files)     # the store's names are gone
    final = {n: p.detach().clone() for n, p in named}
    store.close()
    assert _digests(ck) == digests and verify_checkpoint(ck) == []
    # Exact: resume from the linked checkpoint in another store and train the same steps.
    for target in ("nvme", "device"):
        named2 = _params(seed=5)
        weights = _params()
        opt_w = CPUAdam(weights, lr=1e-2, weight_decay=0.01, state_store=ss.DeviceStore("cpu"))
        _train(opt_w, weights, 0, 3)                 # parameters as they were at the save
        for (_, p2), (_, pw) in zip(named2, weights):
            p2.data.copy_(pw.data)
        s2 = (ss.NVMeStore(str(tmp_path / f"resume-{target}"), budget_bytes=BUDGET)
              if target == "nvme" else ss.DeviceStore("cpu"))
        s2.load_checkpoint(ck)
        opt2 = CPUAdam(named2, lr=1e-2, weight_decay=0.01, state_store=s2)
        _train(opt2, named2, 3, 4)
        for n, p in named2:
            assert torch.equal(p, final[n]), (target, n)
        s2.close()


def test_untouched_states_and_second_save(tmp_path):
    """A parameter without gradients after a save keeps its states in the frozen file; the next
    save moves them (each linked file must hold every state of its header); both checkpoints
    stay exact and unchanged. A save right after a save re-links without reading again."""
    named = _params()
    store = _store("nvme", tmp_path)
    opt = CPUAdam(named, lr=1e-2, state_store=store)
    _train(opt, named, 0, 2)
    ck1, ck2, ck3 = (str(tmp_path / n) for n in ("ck1", "ck2", "ck3"))
    store.save_checkpoint(ck1)
    d1 = _digests(ck1)
    _train(opt, named, 2, 2, skip={"frozen"})
    s2 = _states(store)
    store.save_checkpoint(ck2)
    assert _digests(ck1) == d1
    read_before = store.stats()["bytes_read"]
    store.save_checkpoint(ck3)                   # nothing changed: checksums are remembered
    assert store.stats()["bytes_read"] == read_before
    d2, d3 = _digests(ck2), _digests(ck3)
    for ck in (ck2, ck3):
        assert verify_checkpoint(ck) == []
        got = _ckpt_states(ck)
        assert got.keys() == s2.keys()
        for k in s2:
            assert torch.equal(got[k], s2[k]), k
        # Every tensor a shard's header names (apart from padding) holds its current value.
        for n in os.listdir(ck):
            if n.startswith("shard-"):
                with safe_open(os.path.join(ck, n), "pt") as f:
                    for k in f.keys():
                        if not k.startswith("__pad__/"):
                            assert torch.equal(f.get_tensor(k), s2[k]), (n, k)
    _train(opt, named, 4, 2)
    store.sync()
    assert _digests(ck1) == d1 and _digests(ck2) == d2 and _digests(ck3) == d3
    store.close()


def test_partial_writes_of_a_frozen_state(tmp_path):
    """Pipelines that write part of a frozen state (aligned units, an unaligned tail, a read
    straddling written and unwritten ranges) see the right values; the checkpoint is unchanged."""
    store = ss.NVMeStore(str(tmp_path / "store"), budget_bytes=BUDGET)
    n = 10_000                                   # 40000 bytes: ~10 blocks
    a = torch.arange(n, dtype=torch.float32)
    store.create_many([("p/exp_avg", (n,), torch.float32, a), ("q/exp_avg", (100,), torch.float32,
                                                                 torch.ones(100))])
    ck = str(tmp_path / "ck")
    store.save_checkpoint(ck)
    digests = _digests(ck)
    # An aligned unit of the first 2048 elements, written without reading.
    with store.pipeline([[Slice("p/exp_avg", 0, 2048)]], mode="w") as pipe:
        for (t,) in pipe:
            t.fill_(-1)
    expect = a.clone()
    expect[:2048] = -1
    # A read straddling the written and the unwritten part.
    with store.pipeline([[Slice("p/exp_avg", 1024, 4096)]], mode="r") as pipe:
        for (t,) in pipe:
            assert torch.equal(t, expect[1024:4096])
    assert torch.equal(store.get("p/exp_avg"), expect)
    # A slice ending inside a block that holds later elements (read-modify-write).
    with store.pipeline([[Slice("p/exp_avg", 4096, 5000)]], mode="rw") as pipe:
        for (t,) in pipe:
            t.mul_(2)
    expect[4096:5000] *= 2
    assert torch.equal(store.get("p/exp_avg"), expect)
    assert torch.equal(store.get("q/exp_avg"), torch.ones(100))
    store.sync()
    assert _digests(ck) == digests and verify_checkpoint(ck) == []
    got = _ckpt_states(ck)
    assert torch.equal(got["p/exp_avg"], a) and torch.equal(got["q/exp_avg"], torch.ones(100))
    path, off, nbytes = store.location("p/exp_avg")
    with safe_open(path, "pt") as f:
        assert torch.equal(f.get_tensor("p/exp_avg"), expect)
    store.delete(["q/exp_avg"])
    assert _digests(ck) == digests
    store.close()
    assert verify_checkpoint(ck) == []


def test_keep_files_holds_current_values_after_close(tmp_path):
    store = ss.NVMeStore(str(tmp_path / "store"), budget_bytes=BUDGET, keep_files=True)
    n = 5000
    store.create_many([("p/exp_avg", (n,), torch.float32, torch.zeros(n))])
    store.save_checkpoint(str(tmp_path / "ck"))
    with store.pipeline([[Slice("p/exp_avg", 0, 1024)]], mode="w") as pipe:
        for (t,) in pipe:
            t.fill_(3)
    store.close()
    files = [n for n in os.listdir(tmp_path / "store") if n.startswith("states-")]
    assert len(files) == 1
    with safe_open(str(tmp_path / "store" / files[0]), "pt") as f:
        got = f.get_tensor("p/exp_avg")
    expect = torch.zeros(n)
    expect[:1024] = 3
    assert torch.equal(got, expect)


def _is_copy(store, ck):
    inodes = {os.stat(f).st_ino for f in _nvme_files(store)}
    shards = [os.path.join(ck, n) for n in os.listdir(ck) if n.startswith("shard-")]
    return shards and all(os.stat(s).st_ino not in inodes for s in shards)


def test_copies_where_a_link_would_not_do(tmp_path):
    named = _params()
    store = _store("nvme", tmp_path)
    opt = CPUAdam(named, lr=1e-2, state_store=store)
    _train(opt, named, 0, 2)
    expect = _states(store)
    cases = {"nolink": dict(link=False), "small-shards": dict(shard_bytes=4096)}
    if os.path.isdir("/dev/shm") and os.stat("/dev/shm").st_dev != os.stat(tmp_path).st_dev:
        cases["other-fs"] = dict(path=None)
    for name, kw in cases.items():
        if "path" in kw:
            import tempfile
            ck = tempfile.mkdtemp(dir="/dev/shm")
            kw = {}
        else:
            ck = str(tmp_path / name)
        store.save_checkpoint(ck, **kw)
        assert _is_copy(store, ck), name
        assert verify_checkpoint(ck) == []
        got = _ckpt_states(ck)
        assert got.keys() == expect.keys()
        assert all(torch.equal(got[k], expect[k]) for k in expect), name
        if name == "small-shards":
            sizes = [os.path.getsize(os.path.join(ck, n)) for n in os.listdir(ck)
                     if n.startswith("shard-")]
            assert len(sizes) > 3
        if name == "other-fs":
            import shutil
            shutil.rmtree(ck)
    with pytest.raises(ss.StateStoreValueError, match="link"):
        store.save_checkpoint(str(tmp_path / "bad"), link="yes")
    store.close()


def test_removed_state_file_is_copied_not_linked(tmp_path):
    """A state file removed under the open store cannot be linked by name: the save copies
    its states from the open file (the documented way to keep them)."""
    store = ss.NVMeStore(str(tmp_path / "store"), budget_bytes=BUDGET)
    store.create_many([("p/exp_avg", (3000,), torch.float32, torch.full((3000,), 7.0))])
    (path,) = store.files()
    os.unlink(path)
    with pytest.raises(ss.StateStoreIOError):
        store.get("p/exp_avg")                   # reported once
    ck = str(tmp_path / "ck")
    store.save_checkpoint(ck)
    assert verify_checkpoint(ck) == []
    assert torch.equal(_ckpt_states(ck)["p/exp_avg"], torch.full((3000,), 7.0))
    store.close()


def test_saves_hash_what_steps_wrote_and_remember_what_puts_hashed(tmp_path):
    """An optimizer pass writes without hashing (nothing beside the step's compute): the first
    linked save after a step reads each state back once to checksum it, on this thread, and
    a save right after reads nothing. A state put from its first to its last element is
    hashed as it is written, so a save reads nothing for it; a state written out of order is
    read back. Either way the checksums are right (verify_checkpoint) and the states exact."""
    named = _params()
    store = _store("nvme", tmp_path)
    opt = CPUAdam(named, lr=1e-2, state_store=store)
    threads = set(threading.enumerate())
    _train(opt, named, 0, 2)
    store.sync()
    assert not [t for t in set(threading.enumerate()) - threads if t.name.startswith("ss-hash")]
    total = sum(store.spec(k).nbytes for k in store.keys())
    before = store.stats()["bytes_read"]
    ck = str(tmp_path / "ck")
    store.save_checkpoint(ck)
    read = store.stats()["bytes_read"] - before
    assert total <= read < total + len(store.keys()) * 4096   # each state once (whole blocks)
    assert verify_checkpoint(ck) == []
    before = store.stats()["bytes_read"]
    store.save_checkpoint(str(tmp_path / "ck1"))
    assert store.stats()["bytes_read"] == before
    assert verify_checkpoint(str(tmp_path / "ck1")) == []
    # Puts in order: hashed as written, saved without reading.
    k = ss.StateKey("emb", "exp_avg")
    for key in store.keys():
        store.put(key, torch.randn(store.spec(key).shape))
    before = store.stats()["bytes_read"]
    ck2 = str(tmp_path / "ck2")
    store.save_checkpoint(ck2)
    assert store.stats()["bytes_read"] == before
    assert verify_checkpoint(ck2) == []
    # Out of order: the second half of a state, then its first half.
    n = store.spec(k).numel
    half = 4096
    with store.pipeline([[Slice(k, half, n)], [Slice(k, 0, half)]], mode="w") as pipe:
        for (t,) in pipe:
            t.fill_(3.0)
    expect = _states(store)
    before = store.stats()["bytes_read"]
    ck3 = str(tmp_path / "ck3")
    store.save_checkpoint(ck3)
    read = store.stats()["bytes_read"] - before
    assert store.spec(k).nbytes <= read < 2 * store.spec(k).nbytes
    assert verify_checkpoint(ck3) == []
    got = _ckpt_states(ck3)
    assert all(torch.equal(got[key], expect[key]) for key in expect)
    for path in (ck, ck2):
        assert verify_checkpoint(path) == []
    store.close()


def test_background_checksums_follow_the_last_write(tmp_path, monkeypatch):
    """Checksums are computed on a worker thread while writes go on. Slowed down here, so
    that a state's first block is rewritten while the checksum of its previous, in-order
    write is still being finished: the checkpoint must not carry that stale checksum (the
    state is read back to hash it), and states written in order keep theirs."""
    from statestore.backends._nvme_digests import WriteDigests
    slow_chunk = WriteDigests._hash_chunk

    def slow(self, *args):
        time.sleep(0.05)
        return slow_chunk(self, *args)

    monkeypatch.setattr(WriteDigests, "_hash_chunk", slow)
    # a ring large enough that no write waits for ring space (nor for an earlier hashing)
    store = ss.NVMeStore(str(tmp_path / "store"), budget_bytes=4 << 20)
    n = 5000
    a, b = ss.StateKey("a", "exp_avg"), ss.StateKey("b", "exp_avg")
    store.create_many([(a, (n,), torch.float32, None), (b, (n,), torch.float32, None)])
    g = torch.Generator().manual_seed(0)

    def write(units):
        # mode "w" reads nothing; a write waits only for pending writes of its own blocks
        with store.pipeline([[u] for u in units], mode="w", wait=False) as pipe:
            for (t,) in pipe:
                t.copy_(torch.randn(t.shape, generator=g))

    write([Slice(a, 0, 4096), Slice(a, 4096, n)])
    write([Slice(b, 0, 4096), Slice(b, 4096, n)])     # in order: its checksum is due ...
    write([Slice(b, 0, 4096)])                         # ... when its first block changes
    expect = _states(store)
    before = store.stats()["bytes_read"]
    ck = str(tmp_path / "ck")
    store.save_checkpoint(ck)
    read = store.stats()["bytes_read"] - before
    assert store.spec(b).nbytes <= read < store.spec(a).nbytes + store.spec(b).nbytes
    assert verify_checkpoint(ck) == []
    got = _ckpt_states(ck)
    assert all(torch.equal(got[key], expect[key]) for key in expect)
    store.close()


def _tamper(ckpt, key, value=1234.5):
    """Overwrite the first float of tensor ``key`` in place, through the checkpoint's name
    (the inode the store shares)."""
    row = next(r for r in read_manifest(ckpt).rows if r.key == key)
    with open(os.path.join(ckpt, row.file), "r+b") as f:
        f.seek(row.offset)
        f.write(torch.tensor([value]).numpy().tobytes())


@pytest.mark.parametrize("how", ["saved", "loaded", "get", "materialized"])
def test_tampered_linked_shard_is_never_trained_on(tmp_path, how):
    """A float overwritten in place in a linked checkpoint's shard reached the store (its
    copy-on-write source), trained on, and the next save verified clean. Now the read from
    the shared file is checked against the checksum recorded when it froze, and refused."""
    named = _params()
    store = _store("nvme", tmp_path)
    opt = CPUAdam(named, lr=1e-2, state_store=store)
    _train(opt, named, 0, 2)
    ckpt = str(tmp_path / "ckpt")
    store.save_checkpoint(ckpt)
    if how == "loaded":         # a linked load adopts the shard as the store's file
        store.close()
        named = _params()
        store = _store("nvme", tmp_path / "again")
        store.load_checkpoint(ckpt)
        assert any(os.stat(f).st_nlink > 1 for f in store.files())
        opt = CPUAdam(named, lr=1e-2, state_store=store)
    _tamper(ckpt, "w1/exp_avg_sq")
    with pytest.raises(ss.CheckpointCorruptError, match="checksum mismatch in tensor 'w1/exp_avg_sq'"):
        if how == "get":
            store.get("w1/exp_avg_sq")
        elif how == "materialized":     # half written since: location() copies the rest
            with store.pipeline([[Slice("w1/exp_avg_sq", 0, 1024)]], mode="w") as pipe:
                for (t,) in pipe:
                    t.fill_(1.0)
            store.location("w1/exp_avg_sq")
        else:
            _train(opt, named, 2, 1)
    # a state that was not altered still reads, and the error repeats for the altered one
    assert torch.isfinite(store.get("b1/exp_avg")).all()
    with pytest.raises(ss.CheckpointCorruptError):
        store.get("w1/exp_avg_sq")
    store.close()


def test_untampered_reads_after_save_pass_and_match(tmp_path):
    """No false alarm: the first step after a save reads every state from the frozen files
    (checked), across several pipeline units per state (BUDGET is small), and equals a run
    that never saved."""
    named, ref = _params(), _params()
    store, other = _store("nvme", tmp_path), ss.DeviceStore("cpu")
    opt = CPUAdam(named, lr=1e-2, state_store=store)
    ref_opt = CPUAdam(ref, lr=1e-2, state_store=other)
    for i in range(3):
        _train(opt, named, i, 1, skip=("frozen",) if i else ())
        _train(ref_opt, ref, i, 1, skip=("frozen",) if i else ())
        store.save_checkpoint(str(tmp_path / f"c{i}"))
    for (n, p), (_, q) in zip(named, ref):
        assert torch.equal(p, q), n
    for k in other.keys():
        assert torch.equal(store.get(k), other.get(k)), k
    store.close()

"""Reliability under an operator's bad day (issue 18; issue 20, item 2): a full disk after a
linked save, disk space checked up front, the manifest's metadata under checksum, racing
saves to one path, stores and optimizers dropped without ``close()``, hostile manifests and
shards, and ``verify`` over every byte of a shard. Each test fails on the code before its fix.
"""
from __future__ import annotations

import errno
import os
import sys

import pytest
import torch

import statestore as ss
from statestore.checkpoint import verify_checkpoint

from helpers import faults as F  # noqa: E402
from helpers import forked


# ------------------------------------------------------------ 18.1 / 20.2: disk space
@pytest.mark.parametrize("kind,fs", [("nvme", "tmpfs"), ("tiered-nvme", "tmpfs"), ("nvme", "ext4")])
def test_full_disk_after_linked_save(kind, fs, tmp_path, zygote):
    """After a linked save the disk fills (a private tmpfs, or an ext4 loop mount, made for
    real): the next step fails before it changes anything, naming bytes needed and free, and
    succeeds once space is freed; a linked save whose copy-on-write will not fit is refused
    up front, writing nothing. (Before: ENOSPC half-way through the step, after parameters
    were updated, and every later step refused.)"""
    r = zygote.job("disk_full_after_linked_save", tmp_path, kind=kind, root=str(tmp_path), fs=fs)
    if "skip" in r:
        pytest.skip(f"cannot mount a private {fs} here: {r['skip']}")
    assert r["linked"], "the save did not link the store's files"
    err = r["step_error"]
    assert err is not None and "StateStoreIOError" in err["mro"] and err["errno"] == errno.ENOSPC, err
    assert "needs" in err["message"] and "free" in err["message"], err["message"]
    assert r["params_unchanged"] and r["files_unchanged"]
    assert r["retry_error"] is None, r["retry_error"]
    assert r["differences"] == [] and r["ck_verify"] == [] and r["ck_differences"] == []
    err = r["save_error"]
    assert err is not None and "StateStoreIOError" in err["mro"] and err["errno"] == errno.ENOSPC, err
    assert "needs" in err["message"] and "free" in err["message"], err["message"]
    assert not any(n.startswith(("shard-", "manifest")) for n in r["ck2_listing"]), r["ck2_listing"]
    assert r["ck2_verify"] == [] and r["ck2_differences"] == [] and r["final_differences"] == []


def _train(opt, named, start, n):
    F.train(opt, named, start, n)


def test_failed_linked_save_leaves_the_store_as_it_was(tmp_path, monkeypatch):
    """A linked save that fails after linking (here: ENOSPC writing its manifest) leaves no
    file frozen: the next step writes the store's files in place, as without the save."""
    from statestore.checkpoint import writer
    store = ss.NVMeStore(str(tmp_path / "s"), budget_bytes=F.NVME_BUDGET)
    named = F.make_params()
    opt = F.make_opt(named, store)
    _train(opt, named, 0, 2)
    files = store.files()

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(writer.pq, "write_table", full)
    with pytest.raises(ss.StateStoreIOError) as ei:
        store.save_checkpoint(str(tmp_path / "ck"), progress=False)
    assert ei.value.errno == errno.ENOSPC and ".manifest.parquet." in str(ei.value)
    monkeypatch.undo()
    _train(opt, named, 2, 2)
    assert store.files() == files                  # no copy-on-write successor was made
    assert F.differences(F.snapshot(named, store), F.reference(4)) == []
    store.save_checkpoint(str(tmp_path / "ck"), progress=False)
    assert verify_checkpoint(str(tmp_path / "ck"), progress=False) == []
    store.close()


def test_creating_states_checks_space_up_front(tmp_path, monkeypatch):
    """States that do not fit the filesystem are refused before any file is created, with
    the bytes needed and free (issue 20, item 2); with room, the same call succeeds."""
    import statestore.backends._space as S
    d = tmp_path / "s"
    store = ss.NVMeStore(str(d))
    monkeypatch.setattr(S, "free_bytes", lambda path: 12345)
    with pytest.raises(ss.StateStoreIOError) as ei:
        store.create_many([(f"p{i}/exp_avg", (1 << 20,), torch.float32, None) for i in range(3)])
    msg = str(ei.value)
    assert ei.value.errno == errno.ENOSPC and "needs" in msg and "12345 bytes" in msg, msg
    assert str(d) in msg and F.state_files(str(d)) == [] and len(store) == 0
    monkeypatch.undo()
    store.create_many([(f"p{i}/exp_avg", (1 << 20,), torch.float32, None) for i in range(3)])
    assert len(store) == 3
    store.close()


# ------------------------------------------------------------ 18.3: racing saves
def _content(store):
    return {str(k): store.get(k).clone() for k in store.keys()}


def _ckpt_content(ck):
    with ss.DeviceStore("cpu") as s:
        s.load_checkpoint(ck, progress=False)
        return {str(k): s.get(k).clone() for k in s.keys()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", ["device-cpu", "nvme"])
def test_racing_saves_from_threads(kind, tmp_path):
    """Two threads save two stores to one path at once, round after round: each save either
    succeeds or fails loudly (StateStoreIOError EBUSY, nothing written), and the path always
    holds one complete checkpoint: the last successful save's."""
    import threading
    ck = str(tmp_path / "ck")
    stores = []
    for i in range(2):
        s = F.make_store(kind, str(tmp_path / f"s{i}"))
        s.create_many([(f"p{j}/exp_avg", (3000 + 500 * j,), torch.float32,
                        torch.full((3000 + 500 * j,), float(10 * i + j))) for j in range(6)])
        stores.append(s)
    contents = [_content(s) for s in stores]
    outcomes = {"ok": 0, "busy": 0}
    for rnd in range(15):
        barrier = threading.Barrier(2)
        results = [None, None]

        def run(i):
            barrier.wait()
            try:
                stores[i].save_checkpoint(ck, progress=False)
                results[i] = "ok"
            except ss.StateStoreIOError as e:
                results[i] = e
        ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        for r in results:
            if r == "ok":
                outcomes["ok"] += 1
            else:
                assert r.errno == errno.EBUSY and "another save" in str(r), r
                outcomes["busy"] += 1
        assert verify_checkpoint(ck, progress=False) == [], (rnd, results)
        got = _ckpt_content(ck)
        winners = [i for i in range(2) if results[i] == "ok"]
        assert winners, results
        assert any(_same(got, contents[i]) for i in winners), (rnd, results)
        assert not [n for n in os.listdir(ck) if n.startswith(".")], os.listdir(ck)
    for s in stores:
        s.close()


_PROC_SAVER = r"""
import sys, errno, torch, statestore as ss
ck, i, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with ss.DeviceStore("cpu") as s:
    s.create_many([(f"p{j}/exp_avg", (20000,), torch.float32, torch.full((20000,), float(10 * i + j)))
                   for j in range(8)])
    ok = busy = 0
    for _ in range(rounds):
        try:
            s.save_checkpoint(ck, progress=False)
            ok += 1
        except ss.StateStoreIOError as e:
            assert e.errno == errno.EBUSY, e
            busy += 1
    print(ok, busy)
"""


def test_racing_saves_from_processes(tmp_path):
    """Two processes save to one path 30 times each, at the same time: the path ends up
    holding one complete checkpoint (one of theirs), every failure is a loud EBUSY."""
    ck = str(tmp_path / "ck")
    procs = [forked.start(_PROC_SAVER, ck, i, 30) for i in range(2)]
    for r in [p.result(timeout=300) for p in procs]:
        assert r.returncode == 0, r.stderr
    assert verify_checkpoint(ck, progress=False) == []
    got = _ckpt_content(ck)
    vals = {float(t[0]) for t in got.values()}
    assert vals in ({0.0, 1, 2, 3, 4, 5, 6, 7}, {10.0, 11, 12, 13, 14, 15, 16, 17}), vals


# ------------------------------------------------------------ 18.2: the manifest's checksum
def _manifest_view(m):
    rows = [{k: v for k, v in r.items() if k not in ("spec", "state_key")} for r in m.rows]
    return rows, m.metadata, m.info


@pytest.mark.slow
def test_every_bit_flip_in_the_manifest_is_detected_or_harmless(tmp_path):
    """A bit flipped anywhere in the manifest (one per byte, the bit position cycling) is
    either refused by read_manifest (so by load and verify) or changes nothing a reader
    decodes: rows, optimizer metadata (step counts, hyperparameters) and format fields are
    then exactly the original's. Before the manifest had its own checksum, about 30 flips in
    the schema's key-value metadata changed step counts or dropped the metadata silently."""
    from statestore.checkpoint import read_manifest
    from statestore.optim import CPUAdam
    ck = str(tmp_path / "ck")
    m = torch.nn.Linear(4, 3)
    with ss.DeviceStore("cpu") as s:
        opt = CPUAdam(m.named_parameters(), lr=1e-3, state_store=s)
        for _ in range(3):
            m(torch.randn(2, 4)).sum().backward()
            opt.step()
        s.save_checkpoint(ck, progress=False)
    mpath = os.path.join(ck, "manifest.parquet")
    with open(mpath, "rb") as f:
        raw = f.read()
    want = _manifest_view(read_manifest(ck))
    assert want[1]["steps"] == {"weight": 3, "bias": 3}
    detected = harmless = 0
    silent = []
    for i in range(len(raw)):
        bad = bytearray(raw)
        bad[i] ^= 1 << (i % 8)
        with open(mpath, "wb") as f:
            f.write(bad)
        try:
            got = read_manifest(ck)
        except ss.CheckpointError:
            detected += 1
            continue
        if _manifest_view(got) == want:
            harmless += 1
        else:
            silent.append(i)
    assert silent == [], f"{len(silent)} flips changed what is loaded undetected, at {silent[:10]}"
    assert detected > len(raw) // 3
    with open(mpath, "wb") as f:
        f.write(raw)
    assert verify_checkpoint(ck, progress=False) == []


def test_manifest_checksum_is_checked_by_load_and_verify(tmp_path):
    """Step counts changed in the metadata (a well-formed manifest, rewritten by hand): load
    and verify refuse it, naming the manifest."""
    import json
    import pyarrow.parquet as pq
    ck = str(tmp_path / "ck")
    with ss.DeviceStore("cpu") as s:
        s.create("w/exp_avg", (10,))
        s.save_checkpoint(ck, progress=False, metadata={"steps": {"w": 3}})
    mpath = os.path.join(ck, "manifest.parquet")
    table = pq.read_table(mpath)
    meta = dict(table.schema.metadata)
    meta[b"statestore.metadata"] = json.dumps({"steps": {"w": 0}}).encode()
    pq.write_table(table.replace_schema_metadata(meta), mpath)
    problems = verify_checkpoint(ck, progress=False)
    assert len(problems) == 1 and "manifest checksum mismatch" in problems[0], problems
    with ss.DeviceStore("cpu") as s, pytest.raises(ss.CheckpointCorruptError, match="manifest.parquet"):
        s.load_checkpoint(ck, progress=False)


# ------------------------------------------------------------ 18.4: dropped objects
def _vm_locked() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmLck:"):
                return int(line.split()[1])
    return 0


def test_dropped_optimizers_and_stores_release_everything(tmp_path):
    """Five HybridAdam(nvme_offload_fraction=1.0) and five NVMeStores dropped without close():
    once unreachable, their engine threads (Python and native), file descriptors, page-locked
    rings and files are gone. (Before: each kept an fd, the reaper threads and its mlocked
    ring for the life of the process.)"""
    import gc
    from statestore.optim import HybridAdam
    gc.collect()
    leaks = F.Leaks(str(tmp_path / "off"), str(tmp_path / "st"))
    locked = _vm_locked()
    for i in range(5):
        model = torch.nn.Linear(256, 256)
        opt = HybridAdam(model.parameters(), nvme_offload_fraction=1.0,
                         nvme_offload_dir=str(tmp_path / "off"))
        model(torch.randn(2, 256)).sum().backward()
        opt.step()
        store = ss.NVMeStore(str(tmp_path / "st"), budget_bytes=1 << 20)
        store.create("w/exp_avg", (70000,))
        store.put("w/exp_avg", torch.ones(70000))
        store.get("w/exp_avg")
        del model, opt, store
    gc.collect()
    assert leaks.problems() == []
    assert _vm_locked() <= locked, (locked, _vm_locked())


# ------------------------------------------------------------ 18.5: hostile files
def _small_checkpoint(tmp_path, kind="device-cpu"):
    ck = str(tmp_path / "ck")
    with F.make_store(kind, str(tmp_path / "s")) as s:
        s.create_many([("w/exp_avg", (3000,), torch.float32, torch.arange(3000.0)),
                       ("b/exp_avg", (100,), torch.float32, torch.ones(100))])
        s.save_checkpoint(ck, progress=False)
    return ck


def _shard(ck):
    return os.path.join(ck, next(n for n in sorted(os.listdir(ck)) if n.startswith("shard-")))


def _in_thread(fn, timeout=60):
    import threading
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return t.is_alive(), out


@pytest.mark.parametrize("which", ["manifest", "shard"])
def test_fifo_in_a_checkpoint_is_refused_not_waited_on(which, tmp_path):
    from statestore.checkpoint import read_manifest
    ck = _small_checkpoint(tmp_path)
    path = os.path.join(ck, "manifest.parquet") if which == "manifest" else _shard(ck)
    os.unlink(path)
    os.mkfifo(path)
    try:
        for call in (lambda: verify_checkpoint(ck, progress=False),
                     lambda: ss.DeviceStore("cpu").load_checkpoint(ck, progress=False)):
            hung, out = _in_thread(call)
            assert not hung, f"{which} as a FIFO: the reader blocked"
            if "error" in out:
                assert isinstance(out["error"], ss.CheckpointCorruptError), out["error"]
                msg = str(out["error"])
            else:
                assert out["value"], "verify found nothing wrong"
                msg = out["value"][0]
            assert "FIFO" in msg and path in msg, msg
    finally:
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)   # releases a blocked reader, if any
        os.close(fd)


_ZERO_MANIFEST = r"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
import statestore as ss
from statestore.checkpoint import read_manifest
try:
    read_manifest(sys.argv[1])
except ss.CheckpointCorruptError as e:
    print("refused:", e)
"""


def test_manifest_symlinked_to_dev_zero_is_refused(tmp_path):
    """Before: read until memory ran out. Run in a child with an address-space limit."""
    ck = _small_checkpoint(tmp_path)
    mpath = os.path.join(ck, "manifest.parquet")
    os.unlink(mpath)
    os.symlink("/dev/zero", mpath)
    r = forked.run(_ZERO_MANIFEST, ck, timeout=120)
    assert r.returncode == 0 and "refused:" in r.stdout, (r.returncode, r.stderr[-2000:])
    assert "symlink" in r.stdout and "outside the checkpoint directory" in r.stdout, r.stdout


def test_huge_manifest_is_refused_before_reading(tmp_path):
    from statestore.checkpoint.shard_check import MAX_MANIFEST_BYTES
    from statestore.checkpoint import read_manifest
    ck = _small_checkpoint(tmp_path)
    mpath = os.path.join(ck, "manifest.parquet")
    os.truncate(mpath, MAX_MANIFEST_BYTES + 1)          # sparse: costs no disk
    with pytest.raises(ss.CheckpointCorruptError, match="refused"):
        read_manifest(ck)


def test_shard_symlinked_out_of_the_checkpoint_is_refused(tmp_path):
    ck = _small_checkpoint(tmp_path)
    shard = _shard(ck)
    outside = str(tmp_path / "elsewhere.safetensors")
    os.rename(shard, outside)
    os.symlink(outside, shard)
    problems = verify_checkpoint(ck, progress=False)
    assert problems and "outside the checkpoint directory" in problems[0], problems
    with ss.DeviceStore("cpu") as s, pytest.raises(ss.CheckpointCorruptError, match="symlink"):
        s.load_checkpoint(ck, progress=False)
    # A symlink that stays inside the checkpoint directory is followed.
    os.unlink(shard)
    inside = os.path.join(ck, "moved.safetensors")
    os.rename(outside, inside)
    os.symlink(inside, shard)
    assert verify_checkpoint(ck, progress=False) == []


# ------------------------------------------------------------ 18.6: whole shard files
def _linked_checkpoint(tmp_path):
    """An NVMeStore's linked checkpoint (shards with pads), the store closed: the shards are
    the checkpoint's alone."""
    import json
    import struct
    ck = _small_checkpoint(tmp_path, kind="nvme")
    shard = _shard(ck)
    with open(shard, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    pads = sorted((8 + n + h["data_offsets"][0], h["data_offsets"][1] - h["data_offsets"][0])
                  for k, h in header.items() if k.startswith("__pad__/"))
    pads = [p for p in pads if p[1] > 0]
    assert pads, "expected pads in a linked shard"
    return ck, shard, pads


def _refused(ck, what):
    problems = verify_checkpoint(ck, progress=False)
    assert problems, f"{what}: verify found nothing"
    with ss.DeviceStore("cpu") as s:
        with pytest.raises(ss.CheckpointCorruptError):
            s.load_checkpoint(ck, progress=False)
    return problems


def test_flipped_pad_byte_fails_verify_and_load(tmp_path):
    ck, shard, pads = _linked_checkpoint(tmp_path)
    assert verify_checkpoint(ck, progress=False) == []
    off, n = pads[0]
    with open(shard, "r+b") as f:
        f.seek(off + n // 2)
        f.write(b"\x01")
    problems = _refused(ck, "a flipped pad byte")
    assert "not zero" in problems[0], problems


def test_shard_truncated_into_its_last_pad_fails_verify_and_load(tmp_path):
    ck, shard, pads = _linked_checkpoint(tmp_path)
    off, n = pads[-1]
    assert off + n == os.path.getsize(shard), "the last pad ends the file"
    os.truncate(shard, off + n - 1)
    problems = _refused(ck, "truncated into the last pad")
    assert "truncated" in problems[0], problems


@pytest.mark.parametrize("kind", ["nvme", "device-cpu"])
def test_shard_extended_by_a_block_fails_verify_and_load(kind, tmp_path):
    ck = _small_checkpoint(tmp_path, kind=kind)
    shard = _shard(ck)
    with open(shard, "ab") as f:
        f.write(bytes(4096))
    problems = _refused(ck, "extended by 4 KiB")
    assert "extended" in problems[0], problems


def test_linked_shards_keep_zero_pads_whatever_the_ring_held(tmp_path):
    """An NVMeStore writes whole 4 KiB blocks from its ring; the bytes past a state's end are
    its file's pad and must be written as zeros, not as whatever the ring held before (else
    a linked checkpoint of it fails verify)."""
    from statestore import Slice
    store = ss.NVMeStore(str(tmp_path / "s"), budget_bytes=1 << 20)
    store.create("junk/exp_avg", (300000,), torch.uint8)
    store.put("junk/exp_avg", torch.full((300000,), 255, dtype=torch.uint8))
    store.get("junk/exp_avg")
    store.create_many([(f"p{i}/exp_avg", (1001 + i,), torch.float32, None) for i in range(4)])
    for i in range(4):
        store.put(f"p{i}/exp_avg", torch.full((1001 + i,), float(i)))
    with store.pipeline([[Slice(ss.StateKey(f"p{i}", "exp_avg"), 0, 1001 + i)] for i in range(4)],
                        mode="rw") as pipe:
        for (t,) in pipe:
            t.mul_(3)
    ck = str(tmp_path / "ck")
    store.save_checkpoint(ck, progress=False)
    assert verify_checkpoint(ck, progress=False) == []
    store.close()


_KILLED_HOLDING_BAR_LOCK = r"""
import os, signal, sys, threading, torch, statestore as ss
from statestore.checkpoint.filesystem import progress
bar_type = type(progress(1, "x", False))
bar_type.get_lock()                      # made before the fork, as in a forkserver
pid = os.fork()
if pid == 0:                             # a sibling killed while it creates a bar
    bar_type.get_lock().acquire()
    os.kill(os.getpid(), signal.SIGKILL)
os.waitpid(pid, 0)
done = threading.Event()
def save():
    with ss.DeviceStore("cpu") as s:
        s.create("w/exp_avg", (10,))
        s.save_checkpoint(sys.argv[1], progress=False)
    done.set()
threading.Thread(target=save, daemon=True).start()
print("saved" if done.wait(60) else "hung")
os._exit(0)
"""


def test_a_process_killed_inside_a_progress_bar_does_not_hang_its_siblings(tmp_path):
    """tqdm's default lock is a semaphore shared by forked processes: a trainer SIGKILLed while
    creating a save's progress bar left it held, and every later trainer forked from the same
    parent hung at its next save (benchmarks/soak.py stalled so). The bars now lock within
    their process only."""
    import subprocess
    r = subprocess.run([sys.executable, "-c", _KILLED_HOLDING_BAR_LOCK, str(tmp_path / "ck")],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.stdout.strip() == "saved", (r.stdout, r.stderr[-2000:])

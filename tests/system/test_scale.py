"""Training past RAM (docs/scale.md): gradients released during backward
(``release_grads``), ``state_dict()`` of disk stores as mapped snapshots of the store's
files, checkpoints loaded by linking their shards, and peak RSS of every phase bounded by the
parameters, the gradients and the store's budget (a 50M-parameter model in a subprocess)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import statestore as ss
from statestore.optim import HybridAdam

from helpers import paths, warm
from helpers.stores import BACKEND_NAMES, make_store



class _Stack(torch.nn.Module):
    """Layers whose gradients backward finishes one after another."""

    def __init__(self, dtype, n=6, d=96):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(n))
        self.to(dtype)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _batch(step, dtype, d=96):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, d, generator=g).to(dtype)


def _train(store, dtype, steps=4, seen=None, n=6, d=96, **kw):
    model = _Stack(dtype, n=n, d=d)
    opt = HybridAdam(model.named_parameters(), lr=1e-2, weight_decay=0.1, state_store=store,
                     **kw)
    for step in range(steps):
        model(_batch(step, dtype, d)).float().pow(2).mean().backward()
        if seen is not None:
            seen.append(sum(p.grad is not None for p in model.parameters()))
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}, \
        {str(k): store.get(k).clone() for k in store.keys()}, dict(opt._steps)


# ------------------------------------------------------------------ release_grads
@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_release_grads_is_bit_identical_and_frees_gradients(backend, dtype, tmp_path):
    want = _train(make_store(backend, tmp_path / "a"), dtype)
    seen = []
    got = _train(make_store(backend, tmp_path / "b"), dtype, seen=seen,
                 update_in_backward=True, release_grads=True)
    for a, b in zip(got, want):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == b[k] if isinstance(a[k], int) else torch.equal(a[k], b[k]), k
    # the first step keeps every gradient (nothing planned yet); later backwards release
    # every one they apply: all of them on resident stores (their states are always there),
    # on disk stores those whose states arrived in time (the rest stay within the budget)
    assert seen[0] == 12
    probe = make_store(backend, tmp_path / "c")
    resident = probe.resident
    probe.close()
    if resident:
        assert all(n == 0 for n in seen[1:]), seen


def test_release_grads_waits_for_the_disk_instead_of_holding_gradients(tmp_path):
    """A disk store with a tiny budget: gradients beyond it make backward wait for the
    states, so at most the budget's worth (plus one layer) is held at any time."""
    store = ss.NVMeStore(str(tmp_path / "s"), budget_bytes=64 << 10)
    model = _Stack(torch.float32, n=8, d=128)
    opt = HybridAdam(model.named_parameters(), lr=1e-2, state_store=store,
                     update_in_backward=True, release_grads=True)
    held = []

    def count(_):
        held.append(sum(p.grad.numel() * 4 for p in model.parameters() if p.grad is not None))
    hooks = [p.register_post_accumulate_grad_hook(count) for p in model.parameters()]
    for step in range(3):
        held.clear()
        model(torch.randn(8, 128, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    layer = 128 * 128 * 4 + 128 * 4
    assert max(held) <= (64 << 10) + 2 * layer, held
    for h in hooks:
        h.remove()
    store.close()


_BUDGETED = {"nvme": lambda d, b: ss.NVMeStore(str(d), budget_bytes=b),
             "device-cpu": lambda d, b: ss.DeviceStore("cpu", budget_bytes=b),
             "file": lambda d, b: ss.FileStore(str(d), budget_bytes=b)}


@pytest.mark.parametrize("backend", sorted(_BUDGETED))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_release_grads_bounds_the_first_step_too(backend, dtype, tmp_path):
    """No plan exists in the first step (nor in the first after a resume): with a budget
    smaller than the model's gradients, backward applies the gradients it holds beyond the
    budget then and there (creating their states), so the first step holds about a budget
    of them, not all; parameters and states equal those of update_in_backward=False."""
    budget, d, n = 32 << 10, 128, 16
    layer = (d * d + d) * dtype.itemsize
    make = _BUDGETED[backend]
    want = _train(make(tmp_path / "a", budget), dtype, steps=3, n=n, d=d)
    store = make(tmp_path / "b", budget)
    held = []
    seen = []
    model = _Stack(dtype, n=n, d=d)

    def count(_):
        held[-1] = max(held[-1], sum(p.grad.numel() * p.grad.element_size()
                                     for p in model.parameters() if p.grad is not None))
    hooks = [p.register_post_accumulate_grad_hook(count) for p in model.parameters()]
    opt = HybridAdam(model.named_parameters(), lr=1e-2, weight_decay=0.1, state_store=store,
                     update_in_backward=True, release_grads=True)
    for step in range(3):
        held.append(0)
        model(_batch(step, dtype, d)).float().pow(2).mean().backward()
        seen.append(sum(p.grad is not None for p in model.parameters()))
        opt.step()
        opt.zero_grad()
    for h in hooks:
        h.remove()
    total = sum(p.numel() * dtype.itemsize for p in model.parameters())
    assert total > 4 * (budget + 2 * layer)
    assert held[0] <= budget + 2 * layer, (held, total)
    assert seen[0] < 2 * n, seen           # the first backward released most of its gradients
    got = {k: v.clone() for k, v in model.state_dict().items()}
    assert got.keys() == want[0].keys()
    for k in got:
        assert torch.equal(got[k], want[0][k]), k
    states = {str(k): store.get(k).clone() for k in store.keys()}
    assert states.keys() == want[1].keys()
    for k in states:
        assert torch.equal(states[k], want[1][k]), k
    assert dict(opt._steps) == want[2]
    store.close()


@pytest.mark.parametrize("kw,exc", [({"release_grads": True}, ValueError),
                                    ({"update_in_backward": True, "release_grads": 1}, TypeError)])
def test_release_grads_arguments(kw, exc):
    with pytest.raises(exc, match="release_grads"):
        HybridAdam([torch.nn.Parameter(torch.zeros(3))], **kw)


# ------------------------------------------------------------------ resume by linking
def _saved(tmp_path, dtype=torch.bfloat16):
    """An NVMeStore trained 3 steps and saved (linked) at tmp_path/'ckpt'; returns the
    model weights at the save and the state values."""
    store = ss.NVMeStore(str(tmp_path / "a"))
    model = _Stack(dtype)
    opt = HybridAdam(model.named_parameters(), lr=1e-2, state_store=store)
    for step in range(3):
        model(_batch(step, dtype)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    store.save_checkpoint(str(tmp_path / "ckpt"))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    states = {k: store.get(k).clone() for k in store.keys()}
    # the reference goes on training: two more steps
    for step in range(3, 5):
        model(_batch(step, dtype)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    final = {k: v.clone() for k, v in model.state_dict().items()}
    store.close()
    return weights, states, final


def _resume_steps(store, weights):
    """A bf16 model with ``weights`` trained for steps 3 and 4 over ``store``'s loaded states."""
    model = _Stack(torch.bfloat16)
    model.load_state_dict(weights)
    opt = HybridAdam(model.named_parameters(), lr=1e-2, state_store=store)
    for step in range(3, 5):
        model(_batch(step, torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model


def _inodes(d):
    return {os.stat(os.path.join(d, f)).st_ino for f in os.listdir(d) if f.endswith(".safetensors")}


def test_load_links_the_shards_and_resumes_bit_exact(tmp_path):
    weights, states, final = _saved(tmp_path)
    ckpt = str(tmp_path / "ckpt")
    before = {f: open(os.path.join(ckpt, f), "rb").read() for f in os.listdir(ckpt)}
    store = ss.NVMeStore(str(tmp_path / "b"))
    store.load_checkpoint(ckpt)
    assert _inodes(str(tmp_path / "b")) == _inodes(ckpt)       # linked, not copied
    assert store.stats()["bytes_written"] == 0
    for k, v in states.items():
        assert torch.equal(store.get(k), v), k
    model = _resume_steps(store, weights)
    for k, v in final.items():
        assert torch.equal(model.state_dict()[k], v), k
    # copy-on-write: training after the load never wrote into the checkpoint's files
    store.sync()
    assert not _inodes(str(tmp_path / "b")) & _inodes(ckpt)
    assert {f: open(os.path.join(ckpt, f), "rb").read() for f in os.listdir(ckpt)} == before
    assert ss.checkpoint.verify_checkpoint(ckpt) == []
    # a linked save of the resumed store, and one more load of the first checkpoint
    store.save_checkpoint(str(tmp_path / "ckpt2"))
    store.close()
    with ss.NVMeStore(str(tmp_path / "c")) as again:
        again.load_checkpoint(ckpt)
        for k, v in states.items():
            assert torch.equal(again.get(k), v), k


def test_load_without_link_copies(tmp_path):
    _, states, _ = _saved(tmp_path, torch.float32)
    ckpt = str(tmp_path / "ckpt")
    with ss.NVMeStore(str(tmp_path / "b")) as store:
        store.load_checkpoint(ckpt, link=False)
        assert not _inodes(str(tmp_path / "b")) & _inodes(ckpt)
        for k, v in states.items():
            assert torch.equal(store.get(k), v), k
    with pytest.raises(ss.StateStoreValueError, match="link"):
        ss.NVMeStore(str(tmp_path / "c")).load_checkpoint(ckpt, link=1)


def test_a_damaged_linked_shard_is_refused_and_the_store_left_empty(tmp_path):
    _saved(tmp_path, torch.float32)
    ckpt = str(tmp_path / "ckpt")
    shard = sorted(f for f in os.listdir(ckpt) if f.endswith(".safetensors"))[0]
    m = ss.checkpoint.read_manifest(ckpt)
    row = next(r for r in m.rows if r["file"] == shard and r["nbytes"])
    with open(os.path.join(ckpt, shard), "r+b") as f:
        f.seek(row["offset"] + 4)
        b = f.read(1)
        f.seek(row["offset"] + 4)
        f.write(bytes([b[0] ^ 0xFF]))
    with ss.NVMeStore(str(tmp_path / "b")) as store:
        with pytest.raises(ss.CheckpointCorruptError, match="checksum mismatch"):
            store.load_checkpoint(ckpt)
        assert len(store) == 0
        assert not [f for f in os.listdir(str(tmp_path / "b")) if f.endswith(".safetensors")]


# ------------------------------------------------------------------ peak RSS of every phase
BUDGET_MIB = 32
LAYERS = 12             # x Linear(2048, 2048) in bf16: 50M parameters, 576 MiB of states
SLACK = 32 << 20        # the interpreter's and the checkpoint's small buffers


@pytest.mark.serial
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's "
                    "/proc/self/clear_refs to reset the peak RSS")
def test_peak_rss_of_every_phase_is_bounded_whatever_the_states_size(tmp_path):
    """50M bf16 parameters (576 MiB of fp32 states on disk, 18 times the budget): no phase
    may hold a copy of the whole model or of its states. Each phase's peak RSS over the RSS
    before it (model and gradients built) stays within the store's budget plus a fixed slack; with
    ``release_grads``, a backward + step within the budget, two layers' gradients and the
    slack (not the model's gradients). Catches the fp32 copy of every parameter that the
    first step made for the masters (+192 MiB), ``state_dict()``'s temporary copy of every
    state (+576 MiB) and every gradient kept with ``release_grads`` (96 MiB of them, over that
    phase's bound of 80 MiB: the reason for 12 layers, not fewer; with the gradients kept the
    phase measured 112 MiB). Measured with 16 layers (MiB): first step 34, save_checkpoint 42
    (a fixed cost: the same with 10 layers and a 16 MiB budget), load + step 35, backward +
    step with release_grads 56."""
    r = subprocess.run([sys.executable, "-m", "helpers.rss_worker", str(tmp_path), str(BUDGET_MIB),
                        str(LAYERS)], capture_output=True, text=True, env=paths.env(), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    budget = BUDGET_MIB << 20
    assert got["state_dict_bytes"] == 3 * 2 * got["param_bytes"]     # master, exp_avg, exp_avg_sq
    over = {}
    for phase in ("first step", "save_checkpoint", "state_dict()",
                  "load_checkpoint + optimizer + step"):
        if got[phase] > budget + SLACK:
            over[phase] = got[phase]
    # release_grads: the ring is in the RSS before the phase (the previous step grew it); the
    # phase holds at most the budget of gradients waiting for their states, the one that
    # crossed it and the one backward makes next. Deterministic because the optimizer fixes
    # glibc's mmap threshold (statestore/_malloc.py): with malloc's dynamic threshold freed
    # gradients stayed resident, and runs measured 80 to 127 MiB for 56.7 MiB live.
    if got["backward + step, release_grads"] > (budget + 2 * got["layer_bytes"] + SLACK):
        over["backward + step, release_grads"] = got["backward + step, release_grads"]
    assert not over, (f"peak RSS over the built model (MiB): "
                      f"{ {k: round(v / 2**20) for k, v in over.items()} }; the bound is the budget "
                      f"({BUDGET_MIB} MiB) + {SLACK >> 20} MiB (+ two layers' gradients with "
                      f"release_grads); all phases: "
                      f"{ {k: round(v / 2**20) for k, v in got.items()} }")


# ------------------------------------------------------------------ the benchmark and the example
# Each mode is a whole run of the benchmark (three processes or four: the first forked from a
# process that imported torch, helpers/warm.py, and the others from it, ``--fork``): the
# states-on-disk run, int8 moments (with offload) and the rerun reference (with offload). int8 moments without
# offload are the store's path of tests/*/test_moments_*.py, and the reference mode is the
# same comparison with or without offload.
@pytest.mark.slow
@pytest.mark.parametrize("mode", [
    [],
    ["--offload-params", "--moments", "int8"],
    ["--offload-params", "--reference", "rerun"],
], ids=["states-on-disk", "offload-int8", "offload-rerun"])
def test_largest_model_benchmark_runs_end_to_end_at_a_tiny_size(mode, tmp_path):
    """Train, checkpoint, kill, resume in a fresh process, compare bit for bit, with the
    states on disk or (``--offload-params``) the parameters too (figures are not checked:
    timing never decides a test)."""
    root = paths.ROOT
    r = warm.run_script(os.path.join(root, "benchmarks", "largest_model.py"),
                        ["--size", "tiny", "--dir", str(tmp_path), "--steps", "2",
                         "--check-steps", "1", "--probe-gib", "0.0625", "--kill-after", "0",
                         "--no-compute-probe", "--threads", "1", "--fork"] + mode, timeout=600)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    assert "bit-identical to the uninterrupted run: True" in r.stdout, r.stdout[-2000:]
    assert "weights at load == weights at save: True" in r.stdout
    assert "| resume | load_checkpoint |" in r.stdout
    if "--offload-params" in mode:
        assert "on NVMeStore (offload_parameters" in r.stdout
        assert "phases over the bound: none" in r.stdout, r.stdout[-3000:]
    assert not [d for d in os.listdir(tmp_path) if d.startswith(("run-", "params-", "ckpt"))]


def test_the_example_trains_saves_and_resumes(tmp_path):
    root = paths.ROOT
    args = ["--size", "tiny", "--dir", str(tmp_path), "--steps", "1", "--seq", "8"]
    for extra in ([], ["--resume"]):      # each a new process (forked from a warm one)
        r = warm.run_script(os.path.join(root, "examples", "largest_model.py"), args + extra,
                            timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed at step 1" in r.stdout


def test_state_dict_of_a_disk_store_is_a_snapshot_training_never_changes(tmp_path):
    """state_dict() maps the store's frozen files; no name but the store's own is left on
    them, and the store must still never write them (not thaw them as it does a file whose
    checkpoint was removed)."""
    store = ss.NVMeStore(str(tmp_path / "s"))
    model = _Stack(torch.bfloat16)
    opt = HybridAdam(model.named_parameters(), lr=1e-2, state_store=store)

    def train(steps):
        for step in steps:
            model(_batch(step, torch.bfloat16)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    train(range(2))
    sd = opt.state_dict()
    want = {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()}
    assert not [f for f in os.listdir(str(tmp_path / "s")) if f.startswith(".state_dict")]
    train(range(2, 5))
    store.sync()
    for i, st in sd["state"].items():
        for k, v in st.items():
            assert torch.equal(v, want[i][k]), (i, k)
    now = opt.state_dict()
    assert not torch.equal(now["state"][0]["exp_avg"], want[0]["exp_avg"])
    store.close()


def test_a_linked_load_whose_checkpoint_is_removed_trains_in_place(tmp_path):
    """The store's link is then the file's only name: it is thawed (reopened for writing)
    and the step writes into it instead of copying it; results stay bit-exact."""
    weights, _, final = _saved(tmp_path)
    ckpt = str(tmp_path / "ckpt")
    store = ss.NVMeStore(str(tmp_path / "b"))
    store.load_checkpoint(ckpt)
    before = _inodes(str(tmp_path / "b"))
    import shutil
    shutil.rmtree(ckpt)
    model = _resume_steps(store, weights)
    store.sync()
    for k, v in final.items():
        assert torch.equal(model.state_dict()[k], v), k
    assert _inodes(str(tmp_path / "b")) == before        # written in place
    store.close()

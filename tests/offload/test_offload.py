"""Parameter offload (``statestore.offload_parameters``): training with every parameter kept
in a store is bit for bit the training without, on every store, for fp32 and bf16 parameters,
tied and frozen parameters, activation checkpointing, with and without update_in_backward;
one checkpoint holds the parameters (a stock safetensors model file) with the optimizer's
states and resumes bit for bit in a fresh process; memory stays within the documented bound."""
from __future__ import annotations

import os
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import statestore as ss
from statestore.offload import PARAM_STATE
from statestore.optim import HybridAdam

from helpers import forked
from helpers import registry
from helpers.stores import BACKEND_NAMES, make_store, wait_for_prefetch

VOCAB = 97
DISK = ("simdisk", "nvme", "tiered", "tiered-nvme")


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Net(nn.Module):
    """Embedding tied to the output (``tie="module"``: a Linear sharing the weight, as
    transformers ties; ``"functional"``: ``x @ emb.weight.t()`` in this module's forward),
    residual blocks, optionally checkpointed, optionally the first block frozen."""

    def __init__(self, tie="module", dtype=torch.float32, ckpt=None, frozen=False, d=32,
                 layers=2):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.tie, self.ckpt = tie, ckpt
        if tie == "module":
            self.head = nn.Linear(d, VOCAB, bias=False)
            self.head.weight = self.emb.weight
        if frozen:
            self.blocks[0].requires_grad_(False)
        self.to(dtype)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            if self.ckpt:
                x = checkpoint(b, x, use_reentrant=(self.ckpt == "reentrant"))
            else:
                x = b(x)
        x = self.norm(x)
        return self.head(x) if self.tie == "module" else x @ self.emb.weight.t()


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(VOCAB, (4, 12), generator=g)


def _loss(model, step):
    ids = _batch(step)
    logits = model(ids).float()
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids.reshape(-1))


def _store(backend, path):
    path.mkdir(parents=True, exist_ok=True)
    return make_store(backend, path)


def _train(backend, tmp, offload, steps=3, uib=False, release=False, opt_budget=None, **kw):
    model = Net(**kw)
    handle = ss.offload_parameters(model, _store(backend, tmp / "p"), prefetch=2) if offload else None
    if opt_budget is None:
        opt_store = _store(backend, tmp / "o")
    else:   # smaller than the gradients: the first step applies them during backward too
        opt_store = registry.make(backend, tmp / "o", budget_bytes=opt_budget)
    opt = HybridAdam(model.named_parameters(), lr=1e-2, weight_decay=0.1, state_store=opt_store,
                     update_in_backward=uib, release_grads=release)
    for step in range(steps):
        _loss(model, step).backward()
        opt.step()
        opt.zero_grad()
    if handle is not None:
        handle.close()
        handle.store.close()
    out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt_store.close()
    return out, model


CONFIGS = {
    "fp32": dict(),
    "bf16": dict(dtype=torch.bfloat16),
    "tied-functional": dict(tie="functional"),
    "frozen": dict(frozen=True),
    "ckpt": dict(ckpt="nonreentrant"),
    "ckpt-reentrant": dict(ckpt="reentrant"),
    "uib": dict(uib=True),
    "uib-bf16-ckpt": dict(uib=True, dtype=torch.bfloat16, ckpt="nonreentrant"),
    "uib-release-small-budget": dict(uib=True, release=True, opt_budget=16 << 10, d=64,
                                     layers=4),
    "uib-release-bf16-frozen": dict(uib=True, release=True, opt_budget=16 << 10,
                                    dtype=torch.bfloat16, frozen=True, d=64, layers=4),
}


#: Stores that run every configuration: resident memory, the simulated disk whose small
#: budget wraps its ring (read-ahead, write-behind, back-pressure) and the real NVMeStore.
#: Every other line of the registry runs the plain configuration and the most demanding one
#: (update in backward, released gradients, an optimizer budget below the gradients): the
#: configurations change what the model and the hooks do, which is the same on every store.
EVERY_CONFIG = ("device-cpu", "simdisk", "nvme")
TRAINING_CASES = [(b, c) for b in BACKEND_NAMES for c in CONFIGS
                  if b in EVERY_CONFIG or c in ("fp32", "uib-release-small-budget")]


@pytest.mark.parametrize("backend,config", TRAINING_CASES)
def test_training_bit_exact(backend, config, tmp_path):
    cfg = CONFIGS[config]
    ref, _ = _train(backend, tmp_path / "ref", False, **cfg)
    got, _ = _train(backend, tmp_path / "off", True, **cfg)
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


def test_parameters_stay_the_same_objects_and_are_released(backend, tmp_path):
    model = Net()
    before = {n: p for n, p in model.named_parameters()}
    values = {n: p.detach().clone() for n, p in before.items()}
    store = _store(backend, tmp_path / "p")
    with ss.offload_parameters(model, store, prefetch=1) as handle:
        assert {n: p for n, p in model.named_parameters()}.keys() == before.keys()
        for n, p in model.named_parameters():
            assert p is before[n]
            assert p.shape == values[n].shape and p.dtype == values[n].dtype
            # the handle is found through a side table: the parameter carries nothing of
            # statestore's (a copy of the model is not offloaded)
            assert not [a for a in vars(p) if "statestore" in a], vars(p)
            assert p.data.untyped_storage().nbytes() <= p.element_size()   # released
            assert torch.equal(store.get((n, PARAM_STATE)).cpu(), values[n])   # kept in the store
        assert ("head.weight", PARAM_STATE) not in store      # tied: stored once
        _loss(model, 0).backward()
        for n, p in model.named_parameters():
            assert p.grad is not None and p.grad.shape == p.shape
            assert p.data.untyped_storage().nbytes() <= p.element_size()   # released again
        assert handle.stats()["materialized"] == 0
    for n, p in model.named_parameters():
        assert p is before[n]
        assert torch.equal(p.detach(), values[n])              # back in memory
    assert len(store) == 0
    store.close()


@pytest.mark.parametrize("backend", DISK)
@pytest.mark.parametrize("uib", [False, True])
def test_read_ahead_serves_steady_state(backend, uib, tmp_path):
    """From the second iteration on, every module's parameters come from the read-ahead
    (the recorded order), none from a synchronous read; with update_in_backward, the
    optimizer's updates need none either (each parameter is kept from its gradient to its
    update)."""
    model = Net(ckpt="nonreentrant")
    store = _store(backend, tmp_path / "p")
    opt_store = _store(backend, tmp_path / "o")
    with ss.offload_parameters(model, store, prefetch=2) as handle:
        opt = HybridAdam(model.named_parameters(), lr=1e-2, state_store=opt_store,
                         update_in_backward=uib)
        for step in range(3):
            if uib:
                # the optimizer's states in RAM before backward, so that every update happens
                # during backward whatever the machine's load (a state still on its way
                # defers that update to step(), and its parameter is read again then)
                opt_store.sync()
                opt_store.pump()
                wait_for_prefetch(opt_store)
            before = handle.stats()["sync_reads"]
            _loss(model, step).backward()
            after_backward = handle.stats()["sync_reads"]
            opt.step()
            opt.zero_grad()
            after_step = handle.stats()["sync_reads"]
            assert handle.stats()["materialized"] == 0
        assert after_backward == before     # third iteration: forward and backward read ahead
        if uib:
            assert after_step == before
        assert handle.stats()["reads"] > 0
    store.close()
    opt_store.close()


def test_foreign_optimizer_bit_exact(tmp_path):
    """torch.optim.AdamW over offloaded parameters (every parameter materialized around its
    step) trains as without offload."""
    def run(offload):
        model = Net()
        handle = ss.offload_parameters(model, _store("nvme", tmp_path / f"p{offload}")) \
            if offload else None
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(3):
            _loss(model, step).backward()
            opt.step()
            opt.zero_grad()
        if handle:
            handle.close()
        return {k: v.clone() for k, v in model.state_dict().items()}
    a, b = run(False), run(True)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_bad_arguments(tmp_path):
    model = Net()
    store = ss.DeviceStore("cpu")
    with pytest.raises(ss.StateStoreValueError, match="prefetch"):
        ss.offload_parameters(model, store, prefetch=-1)
    with pytest.raises(ss.StateStoreValueError, match="StateStore"):
        ss.offload_parameters(model, "not a store")
    with pytest.raises(ss.StateStoreValueError, match="Module"):
        ss.offload_parameters(object(), store)
    with pytest.raises(ss.StateStoreValueError, match="device"):
        ss.offload_parameters(model, store, device="meta")
    h = ss.offload_parameters(model, store)
    with pytest.raises(ss.StateStoreValueError, match="already offloaded"):
        ss.offload_parameters(model, ss.DeviceStore("cpu"))
    h.close()
    other = Net()
    store.create(("emb.weight", PARAM_STATE), (1,))
    with pytest.raises(ss.StateKeyError, match="store of its own"):
        ss.offload_parameters(other, store)
    assert all(p.data.untyped_storage().nbytes() > 8 for p in other.parameters())  # untouched
    with pytest.raises(ss.StateStoreError, match="closed"):
        h.save_checkpoint(str(tmp_path / "c"))


def test_meta_model_built_into_the_store(tmp_path):
    """A model created on the meta device gets its memory one module at a time."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    store = _store("nvme", tmp_path / "p")
    torch.manual_seed(1)
    with ss.offload_parameters(model, store) as h:
        out = model(torch.randn(3, 8))
        assert out.shape == (3, 4) and torch.isfinite(out).all()
        assert h.stats()["materialized"] == 0
    torch.manual_seed(1)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    store.close()


# ------------------------------------------------------------------ checkpoints
def _steps(model, opt, steps):
    for step in steps:
        _loss(model, step).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("backend", ["device-cpu", "file", "nvme", "simdisk"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_checkpoint_holds_parameters_and_states(backend, dtype, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    model = Net(dtype=dt)
    store, opt_store = _store(backend, tmp_path / "p"), _store(backend, tmp_path / "o")
    handle = ss.offload_parameters(model, store)
    opt = HybridAdam(model.named_parameters(), lr=1e-2, state_store=opt_store)
    _steps(model, opt, range(2))
    ck = str(tmp_path / "ck")
    handle.save_checkpoint(ck, opt_store)
    expect = handle.state_dict()
    # a stock safetensors model file under the model's own names, tied weights included
    sd = load_file(os.path.join(ck, "model.safetensors"))
    assert sd.keys() == expect.keys() and "head.weight" in sd
    assert all(torch.equal(sd[k], expect[k]) for k in sd)
    with safe_open(os.path.join(ck, "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    fresh = Net(dtype=dt)
    fresh.load_state_dict(sd)
    assert all(torch.equal(a, expect[k]) for k, a in fresh.state_dict().items())
    # the optimizer's states are the store's checkpoint, as store.save_checkpoint writes it
    restored = ss.DeviceStore("cpu")
    restored.load_checkpoint(ck)
    assert sorted(map(str, restored.keys())) == sorted(map(str, opt_store.keys()))
    # training on after the save leaves the checkpoint as it was
    _steps(model, opt, [5])
    assert all(torch.equal(load_file(os.path.join(ck, "model.safetensors"))[k], sd[k]) for k in sd)
    # a second save replaces the first; one model file remains
    handle.save_checkpoint(ck, opt_store)
    files = sorted(n for n in os.listdir(ck) if n.startswith("model"))
    assert len(files) == 2 and "model.safetensors" in files
    handle.close()
    for s in (store, opt_store, restored):
        s.close()


def test_corrupt_model_file_is_named(tmp_path):
    model = Net()
    store = _store("device-cpu", tmp_path / "p")
    handle = ss.offload_parameters(model, store)
    ck = str(tmp_path / "ck")
    handle.save_checkpoint(ck)
    manifest = ss.DeviceStore("cpu")
    manifest.load_checkpoint(ck)
    name = manifest.loaded_metadata["offload"]["model_file"]
    path = os.path.join(ck, name)
    with open(path, "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(b"\x7f" * 8)
    before = handle.state_dict()
    with pytest.raises(ss.CheckpointCorruptError, match="head.weight"):
        handle.load_checkpoint(ck)
    after = handle.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)     # nothing changed
    with pytest.raises(ss.CheckpointError, match="no model parameters"):
        empty = ss.DeviceStore("cpu")
        empty.save_checkpoint(str(tmp_path / "plain"))
        handle.load_checkpoint(str(tmp_path / "plain"))
    handle.close()


_RESUME = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    import statestore as ss
    from statestore.optim import HybridAdam
    from test_offload import Net, _steps, _store
    import pathlib
    backend, ck, out, dtype, uib = sys.argv[1:6]
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    tmp = pathlib.Path(out + ".d")
    model = Net(dtype=dt)                       # fresh weights: the checkpoint replaces them
    store, opt_store = _store(backend, tmp / "p"), _store(backend, tmp / "o")
    handle = ss.offload_parameters(model, store)
    handle.load_checkpoint(ck, opt_store)
    opt = HybridAdam(model.named_parameters(), lr=1e-2, state_store=opt_store,
                     update_in_backward=uib == "1")
    _steps(model, opt, range(3, 6))
    handle.close()
    torch.save({{k: v.clone() for k, v in model.state_dict().items()}}, out)
""")


@pytest.mark.parametrize("backend,dtype,uib", [("nvme", "bf16", "1"), ("file", "fp32", "0"),
                                               ("device-cpu", "bf16", "0")])
def test_resume_in_fresh_process_bit_exact(backend, dtype, uib, tmp_path):
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32

    def run(steps, save=None):
        model = Net(dtype=dt)
        store = _store(backend, tmp_path / f"p{save is None}")
        opt_store = _store(backend, tmp_path / f"o{save is None}")
        handle = ss.offload_parameters(model, store)
        opt = HybridAdam(model.named_parameters(), lr=1e-2, state_store=opt_store,
                         update_in_backward=uib == "1")
        _steps(model, opt, steps)
        if save:
            handle.save_checkpoint(save, opt_store)
        handle.close()
        return {k: v.clone() for k, v in model.state_dict().items()}

    ck = str(tmp_path / "ck")
    run(range(3), save=ck)
    ref = run(range(6))
    out = str(tmp_path / "resumed.pt")
    # a new process (forked from a server that imported torch only: it never saw the store)
    r = forked.run(_RESUME.format(tests=os.path.dirname(__file__)), backend, ck, out, dtype, uib)
    assert r.returncode == 0, r.stderr[-3000:]
    got = torch.load(out)
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


def test_transformers_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    store = _store("nvme", tmp_path / "p")
    opt_store = _store("nvme", tmp_path / "o")
    handle = ss.offload_parameters(model, store)
    opt = HybridAdam(model.named_parameters(), lr=1e-2, state_store=opt_store)
    ids = torch.randint(128, (2, 10), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    ck = str(tmp_path / "ck")
    handle.save_checkpoint(ck, opt_store)
    expect = handle.state_dict()
    handle.close()
    loaded = transformers.LlamaForCausalLM.from_pretrained(ck)
    got = loaded.state_dict()
    for k, v in expect.items():
        if k in got:
            assert torch.equal(got[k], v), k
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    store.close()
    opt_store.close()


def test_model_state_dict_and_load_state_dict(tmp_path):
    model = Net(dtype=torch.bfloat16)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    store = _store("nvme", tmp_path / "p")
    with ss.offload_parameters(model, store) as handle:
        sd = model.state_dict()
        assert sd.keys() == ref.keys()
        assert all(torch.equal(sd[k], ref[k]) for k in ref)
        new = {k: torch.randn_like(v.float()).to(v.dtype) for k, v in ref.items()}
        new["head.weight"] = new["emb.weight"]
        model.load_state_dict(new)
        assert handle.stats()["materialized"] == 0
        got = handle.state_dict()
        assert all(torch.equal(got[k], new[k]) for k in new)
        assert torch.equal(store.get(("blocks.1.fc1.weight", PARAM_STATE)), new["blocks.1.fc1.weight"])
    assert all(torch.equal(v, new[k]) for k, v in model.state_dict().items())
    store.close()


def test_optimizer_on_the_parameters_disk_store_is_refused(tmp_path):
    model = Net()
    store = _store("nvme", tmp_path / "p")
    with ss.offload_parameters(model, store):
        opt = HybridAdam(model.named_parameters(), state_store=store)
        _loss(model, 0).backward()
        with pytest.raises(ss.StateStoreValueError, match="store of their own"):
            opt.step()
    store.close()
    model = Net()
    store = _store("nvme", tmp_path / "q")
    opt = HybridAdam(model.named_parameters(), state_store=store)
    with ss.offload_parameters(model, store):
        _loss(model, 0).backward()
        with pytest.raises(ss.StateStoreValueError, match="store of their own"):
            opt.step()
    store.close()


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["pinned", "nvme", "device-cpu"])
@pytest.mark.parametrize("uib", [False, True])
def test_cuda_compute_bit_exact(backend, uib, tmp_path):
    """Modules compute on the GPU, parameters live in a host store (fetched to pinned memory,
    copied on a side stream): the same training as the model on the GPU without offload."""
    def run(offload):
        model = Net(dtype=torch.bfloat16).cuda()
        handle = ss.offload_parameters(model, _store(backend, tmp_path / f"p{offload}"),
                                       device="cuda") if offload else None
        opt = HybridAdam(model.named_parameters(), lr=1e-2, update_in_backward=uib,
                         state_store=ss.DeviceStore("cuda"))
        for step in range(3):
            ids = _batch(step).cuda()
            logits = model(ids).float()
            nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids.reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
        if handle:
            for p in model.parameters():
                assert p.device.type == "cuda"
            handle.close()
        return {k: v.cpu() for k, v in model.state_dict().items()}
    a, b = run(False), run(True)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_failed_forward_and_backward_leave_the_handle_usable(tmp_path):
    model = Net()
    store = _store("nvme", tmp_path / "p")
    with ss.offload_parameters(model, store) as handle:
        with pytest.raises(IndexError):
            model(torch.full((2, 3), VOCAB + 5))          # out-of-range ids: forward raises
        assert handle.stats()["materialized"] == 0

        def boom(g):
            raise RuntimeError("boom")
        loss = _loss(model, 0)
        h = loss.register_hook(boom)
        with pytest.raises(RuntimeError, match="boom"):
            loss.backward()
        h.remove()
        _loss(model, 1).backward()                         # trains on afterwards
        assert handle.stats()["materialized"] == 0
        assert all(p.grad is not None for p in model.parameters())
    store.close()


@pytest.mark.parametrize("backend", ["device-cpu", "pinned", "file"])
def test_one_resident_store_for_parameters_and_states(backend, tmp_path):
    """A resident store may hold the parameters and the optimizer's states together: one
    store.save_checkpoint(path) then holds both, and a store loaded from it gives the
    parameters back to a new handle (the stored values replace the model's)."""
    ref, _ = _train("device-cpu", tmp_path / "ref", False, steps=4, dtype=torch.bfloat16)

    def run(store, steps, model):
        opt = HybridAdam(model.named_parameters(), lr=1e-2, weight_decay=0.1, state_store=store)
        _steps(model, opt, steps)

    model = Net(dtype=torch.bfloat16)
    store = _store(backend, tmp_path / "s")
    handle = ss.offload_parameters(model, store)
    run(store, range(2), model)
    ck = str(tmp_path / "ck")
    store.save_checkpoint(ck)
    handle.close()
    store.close()
    fresh = Net(dtype=torch.bfloat16)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    store2 = _store(backend, tmp_path / "s2")
    store2.load_checkpoint(ck)
    handle2 = ss.offload_parameters(fresh, store2)
    run(store2, range(2, 4), fresh)
    handle2.close()
    got = fresh.state_dict()
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    store2.close()


# ---------------------------------------------------------------- the working set in backward
class LaggingSGD:
    """SGD that updates each parameter during backward, through the seam statestore's
    optimizers use (``update_begin``/``update_end``), ``lag`` gradients after it arrives, as
    an optimizer whose states come late from its store (HybridAdam with update_in_backward:
    when they come depends on its store's reads and write-behind); the rest at ``step()``.
    Deterministic: the lag is a count, not a time."""

    def __init__(self, params, lr=0.1, lag=16):
        from statestore.offload._seam import update_begin, update_end
        self._begin, self._end = update_begin, update_end
        self.params, self.lr, self.lag, self.queue = list(params), lr, lag, []
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._arrived)

    def _arrived(self, p):
        self.queue.append(p)
        if len(self.queue) > self.lag:
            self._apply(self.queue.pop(0))

    def _apply(self, p):
        token = self._begin([(p, 0, p.numel())])
        with torch.no_grad():
            p.add_(p.grad, alpha=-self.lr)
        self._end(token)

    def step(self):
        while self.queue:
            self._apply(self.queue.pop(0))

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def _alive(handle) -> int:
    """Bytes of distinct parameter storages the handle keeps: materialized, and updated but
    not yet written back."""
    ra = handle._ra
    st = {}
    for t in list(ra.data.values()) + list(ra._dirty.values()):
        st[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(st.values())


def _lagging_run(tmp_path, offload, layers=16, d=256, steps=3, lag=24, budget=1 << 20):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(d, d) for _ in range(layers)])
    handle = ss.offload_parameters(model, ss.NVMeStore(str(tmp_path / "p"), budget_bytes=budget),
                                   prefetch=1) if offload else None
    opt = LaggingSGD(model.parameters(), lag=0)      # the first step: every update in
    seen = []                                       # backward (the handle learns which)
    if handle is not None:
        for m in model:
            m.register_full_backward_hook(lambda *a: seen.append(_alive(handle)))
    for step in range(steps):
        x = torch.randn(4, d, generator=torch.Generator().manual_seed(step))
        model(x.requires_grad_()).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        opt.lag = lag
    out = [p.detach().clone() for p in model.parameters()] if handle is None else None
    if handle is not None:
        handle.close()
        out = [p.detach().clone() for p in model.parameters()]
        handle.store.close()
    return out, seen


def test_backward_working_set_stays_within_budget_and_prefetch(tmp_path):
    """Parameters kept for an optimizer that updates them during backward, late, stay within
    the bound: at each layer's backward, the parameter storage the handle keeps (materialized,
    or updated and not yet written back) is at most the store's budget plus the prefetch
    window and the module computing, in every step. On the code of 2026-11-28 the handle
    kept every parameter from its gradient to its late update (here 3.3 MiB against a bound
    of 1.5; issue 47: 7 of 12 layers, 3x the budget). Training stays bit for bit."""
    budget, d, prefetch = 1 << 20, 256, 1
    module = (d * d + d) * 4
    ref, _ = _lagging_run(tmp_path / "ref", offload=False)
    got, seen = _lagging_run(tmp_path / "off", offload=True, budget=budget)
    assert len(seen) == 3 * 16
    bound = budget + (prefetch + 1) * module
    assert max(seen) <= bound, [s >> 10 for s in seen]
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


def test_backward_working_set_with_hybrid_adam_update_in_backward(tmp_path):
    """The case of issue 47, scaled down (bf16 Linear(1024, 1024) layers, a 4 MiB budget):
    bf16 Linear(512, 512) layers offloaded to an NVMeStore of a 1 MiB budget, prefetch=1, HybridAdam(update_in_backward=True) on another NVMeStore: the
    kept parameter storage stays within budget + prefetch window at every layer's backward of
    every step, whatever when the optimizer's states arrive (the cap does not depend on it)."""
    torch.manual_seed(0)
    layers, d, budget, prefetch = 8, 512, 1 << 20, 1
    model = nn.Sequential(*[nn.Linear(d, d) for _ in range(layers)]).to(torch.bfloat16)
    store = ss.NVMeStore(str(tmp_path / "p"), budget_bytes=budget)
    opt_store = ss.NVMeStore(str(tmp_path / "s"))
    seen = []
    with ss.offload_parameters(model, store, prefetch=prefetch) as handle:
        opt = HybridAdam(model.named_parameters(), lr=1e-3, state_store=opt_store,
                         update_in_backward=True)
        for m in model:
            m.register_full_backward_hook(lambda *a: seen.append(_alive(handle)))
        for step in range(3):
            x = torch.randn(4, d, dtype=torch.bfloat16,
                            generator=torch.Generator().manual_seed(step))
            model(x.requires_grad_()).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    store.close()
    opt_store.close()
    module = (d * d + d) * 2
    assert len(seen) == 3 * layers
    assert max(seen) <= budget + (prefetch + 1) * module, [s >> 20 for s in seen]

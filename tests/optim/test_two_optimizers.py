"""Two optimizers in one training, as Muon's users run it: ``StoreOptimizer(Muon)`` for the
matrices and ``HybridAdam`` for the rest, each on its own store (two checkpoints) or both on
one store (one checkpoint holding both), resumed bit for bit in either order."""
from __future__ import annotations

import pytest
import torch

import statestore as ss
from statestore.optim import HybridAdam, StoreOptimizer

STEPS, MORE = 3, 2


# torch's own step and ours on one thread each (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Tanh(), torch.nn.Linear(48, 48),
                               torch.nn.Tanh(), torch.nn.Linear(48, 4))


def _split(model):
    named = list(model.named_parameters())
    return [(n, p) for n, p in named if p.ndim == 2], [(n, p) for n, p in named if p.ndim != 2]


def _build(model, muon_store, adam_store, lr=0.02):
    matrices, rest = _split(model)
    return (StoreOptimizer(torch.optim.Muon, matrices, state_store=muon_store, lr=lr),
            HybridAdam(rest, lr=1e-2, weight_decay=0.01, state_store=adam_store))


def _train(model, opts, first, last):
    for s in range(first, last):
        g = torch.Generator().manual_seed(s)
        for o in opts:
            o.zero_grad()
        model(torch.randn(8, 16, generator=g)).square().mean().backward()
        for o in opts:
            o.step()


def _uninterrupted():
    model = _model()
    matrices, rest = _split(model)
    opts = (torch.optim.Muon([p for _, p in matrices], lr=0.02),
            HybridAdam(rest, lr=1e-2, weight_decay=0.01))
    _train(model, opts, 0, STEPS + MORE)
    return model


def _same(a, b):
    bad = [n for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters())
           if not torch.equal(p, q)]
    assert not bad, bad


@pytest.mark.parametrize("shared", [True, False], ids=["one-store", "two-stores"])
@pytest.mark.parametrize("torch_order", [False, True], ids=["load-then-build", "torch-order"])
def test_muon_and_hybrid_adam_resume_bit_for_bit(shared, torch_order, tmp_path):
    want = _uninterrupted()
    model = _model()
    stores = [ss.NVMeStore(str(tmp_path / "a0"), budget_bytes=1 << 20)]
    stores.append(stores[0] if shared else ss.DeviceStore("cpu"))
    _train(model, _build(model, *stores), 0, STEPS)
    ckpts = [str(tmp_path / "ckpt")] if shared else [str(tmp_path / "muon"),
                                                     str(tmp_path / "adam")]
    for s, c in zip(stores, ckpts):
        s.save_checkpoint(c)
    if shared:
        meta = stores[0].metadata()
        assert meta["optimizer"] == "StoreOptimizer+HybridAdam"
        assert [p["optimizer"] for p in meta["optimizers"]] == ["StoreOptimizer", "HybridAdam"]
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    for s in set(stores):
        s.close()

    model = _model(seed=5)
    model.load_state_dict(weights)
    stores = [ss.DeviceStore("cpu")]
    stores.append(stores[0] if shared else ss.NVMeStore(str(tmp_path / "b1")))
    with pytest.warns(ss.ResumeWarning, match="lr 9.0 -> 0.02"):     # Muon's, given here
        if torch_order:
            opts = _build(model, *stores, lr=9.0)
        for s, c in zip(stores if not shared else stores[:1], ckpts):
            s.load_checkpoint(c)
        if not torch_order:
            opts = _build(model, *stores, lr=9.0)
    assert opts[0].param_groups[0]["lr"] == 0.02        # from the checkpoint
    _train(model, opts, STEPS, STEPS + MORE)
    _same(want, model)


def test_a_checkpoint_keeps_the_part_of_an_optimizer_not_built_yet(tmp_path):
    """Loaded, then only Muon built and the store saved again: the second checkpoint still
    holds Adam's part, and both resume from it."""
    want = _uninterrupted()
    model = _model()
    store = ss.DeviceStore("cpu")
    _train(model, _build(model, store, store), 0, STEPS)
    store.save_checkpoint(str(tmp_path / "c1"))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    other = ss.DeviceStore("cpu")
    other.load_checkpoint(str(tmp_path / "c1"))
    StoreOptimizer(torch.optim.Muon, _split(model)[0], state_store=other, lr=0.02)
    other.save_checkpoint(str(tmp_path / "c2"))
    assert len(other.metadata()["optimizers"]) == 2

    model = _model(seed=5)
    model.load_state_dict(weights)
    last = ss.DeviceStore("cpu")
    last.load_checkpoint(str(tmp_path / "c2"))
    opts = _build(model, last, last)
    _train(model, opts, STEPS, STEPS + MORE)
    _same(want, model)


def test_numbered_parameters_of_two_optimizers_on_one_store_are_refused():
    model = _model()
    store = ss.DeviceStore("cpu")
    matrices, rest = _split(model)
    muon = StoreOptimizer(torch.optim.Muon, [p for _, p in matrices], state_store=store)
    with pytest.raises(ss.StateStoreValueError, match="distinct parameter keys"):
        HybridAdam([p for _, p in rest], state_store=store)
    assert muon.state_store is store

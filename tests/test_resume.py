"""Resuming real training loops (issue 17): torch-style ``load_state_dict`` then ``step()`` on
disk stores, hyperparameters and step counts in both resume orders, ``optimizer.state`` for
torch and DCP tooling, ``add_param_group`` before a save, ``torch.compile`` of the step, and the
messages of the cases that used to be silent or misleading.

Every resume is compared with ``torch.equal`` against the same training never interrupted.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

import statestore as ss
from statestore.optim import CPUAdam, HybridAdam

sys.path.insert(0, os.path.dirname(__file__))
from conftest import BACKEND_NAMES, make_store  # noqa: E402


def _two_linears(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))


def _grads(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


# ------------------------------------------------------------------ 1. load_state_dict, step
DISK_OPTS = {
    "nvme": lambda params, tmp: CPUAdam(params, lr=1e-3,
                                        state_store=ss.NVMeStore(str(tmp / "nvme"))),
    "offload-1.0": lambda params, tmp: HybridAdam(params, lr=1e-3, nvme_offload_fraction=1.0,
                                                  nvme_offload_dir=str(tmp / "off")),
    "offload-0.5": lambda params, tmp: HybridAdam(params, lr=1e-3, nvme_offload_fraction=0.5,
                                                  nvme_offload_dir=str(tmp / "off")),
}


@pytest.mark.parametrize("kind", list(DISK_OPTS))
def test_load_state_dict_then_step_on_disk_stores(kind, tmp_path):
    """The ring of host buffers was sized at the first put (one parameter's states) and never
    grew while writes were pending: the first step after load_state_dict raised BudgetError
    blaming budget_bytes (256 MiB) on every retry."""
    ref_model = _two_linears()
    ref = CPUAdam(ref_model.parameters(), lr=1e-3)           # DeviceStore: never interrupted
    for i in range(3):
        _grads(ref_model, i)
        ref.step()
    saved_model = _two_linears()
    first = CPUAdam(saved_model.parameters(), lr=1e-3)
    _grads(saved_model, 0)
    first.step()
    sd = first.state_dict()
    sd = {"state": {k: {n: t.clone() for n, t in v.items()} for k, v in sd["state"].items()},
          "param_groups": sd["param_groups"]}

    model = _two_linears()
    with torch.no_grad():
        for p, q in zip(model.parameters(), saved_model.parameters()):
            p.copy_(q)
    opt = DISK_OPTS[kind](list(model.parameters()), tmp_path)
    store = opt.state_store
    try:
        opt.load_state_dict(sd)
        for i in (1, 2):
            _grads(model, i)
            opt.step()
        for p, q in zip(model.parameters(), ref_model.parameters()):
            assert torch.equal(p, q)
        st = opt.state_dict()["state"]
        for k, v in ref.state_dict()["state"].items():
            assert torch.equal(st[k]["exp_avg_sq"], v["exp_avg_sq"])
            assert st[k]["step"].item() == 3
    finally:
        opt.close()
        if kind == "nvme":
            store.close()


def test_budget_error_names_the_real_limit(tmp_path):
    """A unit larger than budget_bytes is refused naming budget_bytes; a unit that fits the
    budget but not a ring another pipeline still holds names the ring, not the budget."""
    with ss.NVMeStore(str(tmp_path / "n"), budget_bytes=1 << 20) as store:
        store.create("a/x", (1 << 19,), torch.float32)       # 2 MiB: over the budget whole
        with pytest.raises(ss.BudgetError, match=r"budget of 1048576 bytes"):
            with store.pipeline([[ss.Slice(ss.StateKey("a", "x"), 0, 1 << 19)]], mode="r"):
                pass
    with ss.NVMeStore(str(tmp_path / "m"), budget_bytes=64 << 20) as store:
        store.create("a/x", (1 << 10,), torch.float32)
        with store.pipeline([[ss.Slice(ss.StateKey("a", "x"), 0, 1 << 10)]], mode="r") as small:
            next(small)                                      # ring sized for 4 KiB of states
            store.create("b/x", (1 << 20,), torch.float32)
            # a second pipeline while the first holds a buffer: the ring cannot grow
            with pytest.raises(ss.BudgetError, match=r"ring .*budget_bytes is 67108864"):
                with store.pipeline([[ss.Slice(ss.StateKey("b", "x"), 0, 1 << 20)]], mode="r"):
                    pass
        got = store.get("b/x")                               # and grows once it is free
        assert got.shape == (1 << 20,)

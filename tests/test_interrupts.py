"""Failures at a step's edges (issue 29, items 1, 2, 3, 4, 7): an exception or Ctrl-C raised by
the model during backward with ``update_in_backward``, Ctrl-C at sampled points inside a step
and inside the pipeline's code during saves and loads, a load that fails into a store a live
optimizer uses, and ``div_scale`` inf/nan. After each, the optimizer is consistent (every
parameter at one step, its states that step's) or refuses every call saying how to recover,
and the store can be reloaded from the last checkpoint in the same process
(``docs/reliability.md``, "Exceptions and Ctrl-C"). Each test fails on the code before its
fix."""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

import statestore as ss
from statestore.optim import CPUAdam

sys.path.insert(0, os.path.dirname(__file__))
import fault_helpers as F  # noqa: E402


def _store(kind, tmp_path):
    if kind == "nvme":
        return ss.NVMeStore(str(tmp_path / "s"), budget_bytes=F.NVME_BUDGET)
    return ss.DeviceStore("cpu")


# ------------------------------------------------------------ item 7: div_scale inf / nan
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, torch.tensor(math.nan)],
                         ids=["inf", "-inf", "nan", "nan-tensor"])
def test_non_finite_div_scale_is_refused_and_changes_nothing(bad, tmp_path):
    """inf and nan are refused before anything changes (nan is not "no scaling"); the same
    step then made without it equals an uninterrupted run."""
    named = F.make_params()
    with ss.DeviceStore("cpu") as store:
        opt = F.make_opt(named, store)
        F.train(opt, named, 0, 2)
        before = F.snapshot(named, store)
        F.set_grads(named, 2)
        with pytest.raises(ss.StateStoreValueError, match="div_scale must be a finite"):
            opt.step(div_scale=bad)
        assert F.differences(F.snapshot(named, store), before) == []
        assert set(opt._steps.values()) == {2}
        opt.step()
        opt.zero_grad()
        assert F.differences(F.snapshot(named, store), F.reference(3)) == []
        store.save_checkpoint(str(tmp_path / "ck"), progress=False)


def test_div_scale_with_update_in_backward_changes_nothing():
    """update_in_backward refuses div_scale before it touches anything: backward's updates
    stay, and step() without it finishes the same step (before: the refusal left the
    optimizer refusing every later call)."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
    ref_a, ref_b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
    ref_a.load_state_dict(a.state_dict())
    ref_b.load_state_dict(b.state_dict())
    opt = CPUAdam(list(a.parameters()) + list(b.parameters()), update_in_backward=True)
    ref = CPUAdam(list(ref_a.parameters()) + list(ref_b.parameters()))
    x = torch.randn(3, 64)
    for i in range(3):
        b(a(x * (i + 1))).sum().backward()
        ref_b(ref_a(x * (i + 1))).sum().backward()
        if i == 2:
            with pytest.raises(ss.StateStoreValueError, match="div_scale"):
                opt.step(div_scale=4.0)
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    for p, q in zip(list(a.parameters()) + list(b.parameters()),
                    list(ref_a.parameters()) + list(ref_b.parameters())):
        assert torch.equal(p, q)
    assert set(opt._steps.values()) == {3}

"""The optimizer's one step-count rollback rule (statestore/optim/_table.py): a step that fails
before changing any parameter or state puts every step count back exactly as it was (a
parameter without one has none again), on the plain path and on the update-in-backward path
alike; the step can then be made again."""
from __future__ import annotations

import pytest
import torch

import statestore as ss
import statestore.optim.adam as adam_mod
from statestore.optim import CPUAdam
from statestore.optim._table import ParamTable


def test_advance_and_rollback_restore_exactly():
    t = ParamTable()
    t.steps.update({"a": 3})
    undo = t.advance_steps(["a", "b"])
    assert t.steps == {"a": 4, "b": 1}
    t.rollback_steps(undo)
    assert t.steps == {"a": 3}


@pytest.mark.parametrize("update_in_backward", [False, True])
def test_a_step_failing_before_any_change_leaves_no_step_count(update_in_backward, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    with ss.DeviceStore("cpu") as store:
        opt = CPUAdam(model.named_parameters(), lr=1e-2, state_store=store,
                      update_in_backward=update_in_backward)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        real = adam_mod.UnitTensors

        def refuse(*a, **kw):           # fails before the kernel touches anything
            raise ss.StateStoreValueError("refused for the test")
        monkeypatch.setattr(adam_mod, "UnitTensors", refuse)
        model(torch.randn(2, 4)).sum().backward()
        with pytest.raises(ss.StateStoreValueError, match="refused for the test"):
            opt.step()
        assert len(opt.state) == 0 and opt.state_dict()["state"] == {}
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        monkeypatch.setattr(adam_mod, "UnitTensors", real)
        opt.step()                      # the same step, made again
        assert {int(s["step"]) for s in opt.state_dict()["state"].values()} == {1}

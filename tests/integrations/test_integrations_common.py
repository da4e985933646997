"""statestore.integrations without any framework: lazy imports with an install hint, finding
the statestore optimizer through wrappers, light state dicts."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch

import statestore as ss
from statestore.integrations import find_store_optimizer, light_state_dict, store_of
from statestore.optim import CPUAdam


@pytest.mark.parametrize("module,framework", [("transformers", "transformers"),
                                              ("accelerate", "accelerate"),
                                              ("lightning", "lightning")])
def test_missing_framework_says_how_to_install(monkeypatch, module, framework):
    monkeypatch.setitem(sys.modules, framework, None)         # import framework -> ImportError
    monkeypatch.delitem(sys.modules, f"statestore.integrations.{module}", raising=False)
    with pytest.raises(ImportError, match=f"pip install {framework}"):
        importlib.import_module(f"statestore.integrations.{module}")


def test_integrations_package_imports_no_framework():
    """Importing statestore.integrations imports no framework (each module does, on demand)."""
    code = ("import sys, statestore.integrations; "
            "print([m for m in ('transformers', 'accelerate', 'lightning') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_find_store_optimizer_and_store_of():
    p = torch.nn.Parameter(torch.zeros(3))
    with ss.DeviceStore("cpu") as store:
        opt = CPUAdam([p], state_store=store)

        class Wrapper(torch.optim.Optimizer):            # as accelerate's AcceleratedOptimizer
            def __init__(self, inner):
                self.optimizer = inner
        w = Wrapper(opt)
        assert find_store_optimizer(w) is opt and store_of(w) is store
        assert find_store_optimizer(torch.optim.SGD([p], lr=1)) is None
        with pytest.raises(ss.StateStoreValueError, match="not a statestore optimizer"):
            store_of(torch.optim.SGD([p], lr=1))
        with pytest.raises(ss.StateStoreValueError, match="state_store"):
            store_of(CPUAdam([torch.nn.Parameter(torch.zeros(2))]))
        light = light_state_dict(opt, "statestore")
        assert light["state"] == {} and light["statestore"]["checkpoint"] == "statestore"
        assert light["param_groups"][0]["params"] == [0]

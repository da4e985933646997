"""StoreOptimizer's own keyword arguments: ``skip_nonfinite`` (a step with inf or nan
gradients changes nothing, for every class and store) and ``state_dtype="bf16"`` (floating
states kept as bf16, stochastically rounded, computed in fp32, resumed bit for bit)."""
from __future__ import annotations

import pytest
import torch

import statestore as ss
from statestore.optim import StoreOptimizer

O = torch.optim
#: (id, class, kwargs) compared bit for bit with torch's class (foreach=False)
CASES = [
    ("sgd", O.SGD, dict(lr=0.1, momentum=0.9)),
    ("rmsprop", O.RMSprop, dict(lr=0.01)),
    ("adamw", O.AdamW, dict(lr=0.01)),
]
STORES = ["device", "nvme"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _store(kind, tmp_path, name="s"):
    if kind == "device":
        return ss.DeviceStore("cpu")
    # a small budget: parameters are cut into several units
    return ss.NVMeStore(str(tmp_path / name), budget_bytes=64 << 10)


def _model(seed=1):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(20, 300), torch.nn.Tanh(),
                               torch.nn.Linear(300, 3))


def _backward(model, step, poison=False):
    g = torch.Generator().manual_seed(100 + step)
    model(torch.randn(8, 20, generator=g)).square().mean().backward()
    if poison:
        next(model.parameters()).grad.view(-1)[7] = float("nan")
        list(model.parameters())[-1].grad[0] = float("inf")


def _train(model, opt, first, last, poisoned=()):
    for s in range(first, last):
        opt.zero_grad()
        _backward(model, s, s in poisoned)
        opt.step()


def _same(a, b):
    for (n, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x, y), n


def _states(opt):
    return {i: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in e.items()}
            for i, e in opt.state_dict()["state"].items()}


# ------------------------------------------------------------------ skip_nonfinite
@pytest.mark.parametrize("store_kind", STORES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_skip_nonfinite_changes_nothing(case, store_kind, tmp_path):
    """Steps 1 and 3 have a nan and an inf gradient: they change no parameter, state or
    step count; the run equals torch's over the other steps, bit for bit."""
    _, cls, kw = case
    want = _model()
    _train(want, cls(want.parameters(), foreach=False, **kw), 0, 3)
    model = _model()
    opt = StoreOptimizer(cls, model.named_parameters(), state_store=_store(store_kind, tmp_path),
                         skip_nonfinite=True, **kw)
    for s, poison in ((0, False), (1, True), (1, False), (2, False), (3, True), (3, True)):
        before_p = [p.detach().clone() for p in model.parameters()]
        before_s = _states(opt)
        opt.zero_grad()
        _backward(model, s, poison)
        opt.step()
        if poison:
            for x, y in zip(before_p, model.parameters()):
                assert torch.equal(x, y)
            after = _states(opt)
            assert after.keys() == before_s.keys()
            for i in after:
                for k in after[i]:
                    assert torch.equal(torch.as_tensor(after[i][k]),
                                       torch.as_tensor(before_s[i][k])), (i, k)
    _same(want, model)
    assert all(opt.step_count(p) == 3 for p in model.parameters())


def test_skip_nonfinite_on_first_step_creates_no_state():
    """A first step with a nan gradient is skipped before any state exists."""
    model = _model()
    opt = StoreOptimizer(O.AdamW, model.parameters(), state_store=ss.DeviceStore("cpu"),
                         skip_nonfinite=True, lr=0.01)
    _backward(model, 0, poison=True)
    opt.step()
    assert len(opt.state_store) == 0 and opt.state_dict()["state"] == {}


def test_without_skip_nonfinite_nan_goes_through():
    """The default is torch's behaviour: a nan gradient reaches the parameters."""
    model = _model()
    opt = StoreOptimizer(O.SGD, model.parameters(), state_store=ss.DeviceStore("cpu"), lr=0.1)
    _backward(model, 0, poison=True)
    opt.step()
    assert torch.isnan(next(model.parameters())).any()

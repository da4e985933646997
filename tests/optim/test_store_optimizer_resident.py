"""StoreOptimizer's step over resident stores remembered between steps
(``statestore/optim/_resident.py``): small parameters of an element-wise class updated by one
call over their concatenation, states handed as views of the store. Bit for bit with
``cls(..., foreach=False)`` at every step, and every change the plan depends on (a parameter
without a gradient, a step count or state edited through ``optimizer.state``, a load, a
parameter's data replaced, ``add_param_group``, a hyperparameter crossing zero, a closed
store) takes the general step, which gives the same bits."""
from __future__ import annotations

import pytest
import torch

import statestore as ss
from statestore.optim import StoreOptimizer

O = torch.optim


# torch's own step and ours on one thread each (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


SHAPES = [(7,), (16, 16), (33,), (3, 5), (1,), (64,), (300,)]


def _params(seed=5, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _grads(step, params, skip=()):
    g = torch.Generator().manual_seed(900 + step)
    for i, p in enumerate(params):
        p.grad = None if i in skip else torch.randn(p.shape, generator=g)


def _pair(cls, kw, store=None):
    want, got = _params(), _params()
    ref = cls(want, foreach=False, **kw)
    opt = StoreOptimizer(cls, [(f"w{i}", p) for i, p in enumerate(got)],
                         state_store=store if store is not None else ss.DeviceStore("cpu"),
                         **kw)
    return want, ref, got, opt


def _same(want, got):
    bad = [i for i, (a, b) in enumerate(zip(want, got)) if not torch.equal(a, b)]
    assert not bad, f"parameters {bad} differ from torch's"


def _step_both(s, want, ref, got, opt, skip=()):
    _grads(s, want, skip)
    _grads(s, got, skip)
    ref.step()
    opt.step()


CASES = [
    (O.AdamW, dict(lr=0.01, weight_decay=0.1)),
    (O.Adam, dict(lr=0.01, amsgrad=True)),
    (O.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1, nesterov=False)),
    (O.Adagrad, dict(lr=0.1, initial_accumulator_value=0.1)),
    (O.RMSprop, dict(lr=0.01, centered=True, momentum=0.5)),
    (O.Rprop, dict(lr=0.01)),
    (O.Adamax, dict(lr=0.01)),
    (O.RAdam, dict(lr=0.01, decoupled_weight_decay=True, weight_decay=0.1)),
    (O.NAdam, dict(lr=0.01, momentum_decay=0.004)),     # a scalar state: mu_product
    (O.ASGD, dict(lr=0.01, t0=2)),                      # scalars: eta, mu
]


@pytest.mark.filterwarnings("ignore:PinnedCPUStore")
@pytest.mark.parametrize("cls,kw", CASES, ids=[c.__name__ for c, _ in CASES])
@pytest.mark.parametrize("store", ["device", "pinned"])
def test_the_remembered_step_is_the_class_step(cls, kw, store):
    """Steps 2.. run by the plan (asserted), bit for bit with torch at every step; the states
    are torch's too."""
    want, ref, got, opt = _pair(cls, kw, ss.DeviceStore("cpu") if store == "device"
                                else ss.PinnedCPUStore())
    for s in range(4):
        _step_both(s, want, ref, got, opt)
        assert opt._remembered is not None        # built after the first step
        _same(want, got)
    sd, rsd = opt.state_dict(), ref.state_dict()
    for i, st in rsd["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(sd["state"][i][k])), (i, k)


def test_changes_take_the_general_step_with_the_same_bits(tmp_path):
    """Each change the plan depends on, between steps of AdamW: still torch's bits."""
    kw = dict(lr=0.01, weight_decay=0.1)
    want, ref, got, opt = _pair(O.AdamW, kw)
    sched = [O.lr_scheduler.StepLR(o, step_size=1, gamma=0.7) for o in (ref, opt)]
    s = 0

    def step(skip=()):
        nonlocal s
        _step_both(s, want, ref, got, opt, skip)
        for sc in sched:
            sc.step()
        s += 1
        _same(want, got)
    step()
    step()
    assert opt._remembered is not None
    step(skip=(2,))                     # a parameter without a gradient: not stepped
    step()
    step()
    # a step count edited through optimizer.state (a middle parameter of a batch)
    for o, ps in ((ref, want), (opt, got)):
        o.state[ps[3]]["step"] = torch.tensor(9.0) if o is ref else 9
    step()
    step()
    # the parameter's data replaced from outside
    for ps in (want, got):
        ps[1].data = ps[1].data.clone()
    step()
    step()
    # a checkpoint saved and loaded back into the same store (torch's order)
    opt.state_store.save_checkpoint(str(tmp_path / "c"))
    saved = {k: v.clone() for k, v in ref.state_dict()["state"][0].items()}
    with pytest.warns(ss.ResumeWarning):
        opt.state_store.load_checkpoint(str(tmp_path / "c"))
    assert opt._remembered is None and torch.equal(saved["exp_avg"], opt.state[got[0]]["exp_avg"])
    step()
    step()
    # a new group
    extra = [torch.nn.Parameter(torch.ones(5)) for _ in range(2)]
    ref.add_param_group({"params": [extra[0]], "lr": 0.05})
    opt.add_param_group({"params": [("x", extra[1])], "lr": 0.05})
    want.append(extra[0])
    got.append(extra[1])
    step()
    step()
    assert opt._remembered is not None


def test_a_hyperparameter_crossing_zero_and_a_closed_store():
    """SGD whose momentum goes 0.9 -> 0 -> 0.9 (a structure change: no plan reused across
    it), then the store closed: the general step's StateStoreClosedError."""
    kw = dict(lr=0.1, momentum=0.9)
    want, ref, got, opt = _pair(O.SGD, kw)
    for s in range(6):
        if s in (2, 4):
            for o in (ref, opt):
                o.param_groups[0]["momentum"] = 0.0 if s == 2 else 0.9
        _step_both(s, want, ref, got, opt)
        _same(want, got)
    opt.state_store.close()
    with pytest.raises(ss.StateStoreClosedError):
        _step_both(6, want, ref, got, opt)


def test_a_state_deleted_and_created_again_on_the_store_takes_the_general_step():
    """A state deleted and created again directly on the store between two steps (same count
    of states, new memory): the remembered step must not write into the old tensor."""
    kw = dict(lr=0.1, momentum=0.9)
    want, ref, got, opt = _pair(O.SGD, kw)
    for s in range(3):
        _step_both(s, want, ref, got, opt)
    store, key = opt.state_store, ("w1", "momentum_buffer")
    saved = store.get(key).clone()
    store.delete([key])
    store.create(key, saved.shape, saved.dtype, saved)
    for s in range(3, 6):
        _step_both(s, want, ref, got, opt)
        _same(want, got)
    assert torch.equal(store.get(key), ref.state[want[1]]["momentum_buffer"])


def test_frozen_and_unsuited_parameters():
    """A parameter that never gets a gradient stays out of the plan; a bf16 parameter (never
    joined) or one above the size joined updates take keeps the general step."""
    want, ref, got, opt = _pair(O.AdamW, dict(lr=0.01))
    for s in range(4):
        _step_both(s, want, ref, got, opt, skip=(0,))
        _same(want, got)
    assert opt._remembered is not None and len(opt.state) == len(got) - 1
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    q = torch.nn.Parameter(torch.ones(3))
    opt = StoreOptimizer(O.SGD, [("b", p), ("f", q)], lr=0.1, momentum=0.9)
    for _ in range(3):
        p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
        opt.step()
    assert opt._remembered is None


def test_scalar_states_that_differ_are_not_joined():
    """NAdam's mu_product of one parameter set apart through optimizer.state (as in torch):
    the parameters' scalars no longer agree, so that one is updated alone (the general step)
    until they agree again; bit for bit with torch."""
    want, ref, got, opt = _pair(O.NAdam, dict(lr=0.01))
    for s in range(5):
        if s == 2:
            ref.state[want[4]]["mu_product"] = torch.tensor(0.5)
            opt.state[got[4]]["mu_product"] = torch.tensor(0.5)
        _step_both(s, want, ref, got, opt)
        _same(want, got)
        assert torch.equal(ref.state[want[4]]["mu_product"], opt.state[got[4]]["mu_product"])


def test_a_closure_runs_before_the_remembered_step():
    """step(closure): the closure's backward makes the gradients the plan's step takes."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    models = [torch.nn.Linear(8, 3) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    ref = O.Adam(models[0].parameters(), lr=0.01, foreach=False)
    opt = StoreOptimizer(O.Adam, models[1].named_parameters(), lr=0.01)
    for m, o in ((models[0], ref), (models[1], opt)):
        def closure(m=m, o=o):
            o.zero_grad()
            loss = m(x).square().mean()
            loss.backward()
            return loss
        losses = [o.step(closure) for _ in range(4)]
        assert all(isinstance(v, torch.Tensor) for v in losses)
    assert opt._remembered is not None
    _same(list(models[0].parameters()), list(models[1].parameters()))

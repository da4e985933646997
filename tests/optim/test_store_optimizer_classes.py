"""StoreOptimizer with classes that do what torch's pattern allows but the unit update must
follow (issue 47): ``p.data = ...`` in the class's step, states the class creates lazily
when a hyperparameter changes mid-training, LR schedules over many steps (the probes of the
class's states stay bounded), and a state named ``"step"`` that is not a step count."""
from __future__ import annotations

import pytest
import torch

import statestore as ss
from statestore.optim import StoreOptimizer, store_optimizer

O = torch.optim


# torch's own step and ours on one thread each (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


class DataSGD(torch.optim.Optimizer):
    """Momentum SGD as many hand-written optimizers write it: the new value assigned to
    ``p.data`` (and the momentum to its state), not updated in place."""

    def __init__(self, params, lr=0.1, momentum=0.9):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["m"] = torch.zeros_like(p)
                m = state["m"]
                m.data = m.data * group["momentum"] + p.grad
                p.data = p.data - group["lr"] * m


def _grads(step, params):
    g = torch.Generator().manual_seed(50 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


def _run(opt, params, steps, first=0, before=None):
    for s in range(first, steps):
        if before is not None:
            before(s, opt)
        for p, g in zip(params, _grads(s, params)):
            p.grad = g
        opt.step()


def _params(seed=3, shapes=((64, 1024), (3000,), (7,))):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


@pytest.mark.parametrize("joined", [True, False])
@pytest.mark.parametrize("where", ["nvme-cut", "device-cpu"])
def test_data_assigned_by_the_class_reaches_the_parameter(where, joined, tmp_path,
                                                         monkeypatch):
    """Issue 47 item 4: on NVMeStore(budget_bytes=64 KiB) with elementwise=True the class is
    handed ranges of the 256 KiB parameter; its ``p.data = ...`` (and ``m.data = ...``) must
    reach the parameter (and the store) as they do in RAM: bit for bit with DataSGD in RAM.
    ``joined``: small ranges updated together (one call over their concatenation), or each
    as its own parameter."""
    if not joined:
        monkeypatch.setattr(store_optimizer, "_JOIN_ELEMS", 0, raising=False)
    want = _params()
    ref = DataSGD(want)
    _run(ref, want, 3)
    got = _params()
    store = ss.NVMeStore(str(tmp_path), budget_bytes=64 << 10) if where == "nvme-cut" \
        else ss.DeviceStore("cpu")
    opt = StoreOptimizer(DataSGD, [(f"w{i}", p) for i, p in enumerate(got)],
                         state_store=store, elementwise=True)
    _run(opt, got, 3)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
        assert torch.equal(ref.state[a]["m"], opt.state[b]["m"])
    store.close()


class ShapeChangingSGD(torch.optim.SGD):
    """Assigns ``p.data`` a tensor of another shape: what StoreOptimizer cannot write back."""

    @torch.no_grad()
    def step(self, closure=None):
        for p in self.param_groups[0]["params"]:
            p.data = torch.zeros(p.numel() + 1, device=p.device)


@pytest.mark.parametrize("joined", [True, False])
def test_data_of_another_shape_is_refused_naming_the_class(joined, tmp_path, monkeypatch):
    if not joined:
        monkeypatch.setattr(store_optimizer, "_JOIN_ELEMS", 0, raising=False)
    p = torch.nn.Parameter(torch.zeros(64, 1024))
    store = ss.NVMeStore(str(tmp_path), budget_bytes=64 << 10)
    opt = StoreOptimizer(ShapeChangingSGD, [("w", p)], state_store=store, elementwise=True,
                         lr=0.1)
    p.grad = torch.ones_like(p)
    with pytest.raises(ss.StateStoreError, match=r"ShapeChangingSGD replaced the data of "
                                                 r"parameter 'w' \(p.data = ...\)"):
        opt.step()
    store.close()


def _momentum_on_at(step, value=0.9):
    def before(s, opt):
        if s == step:
            opt.param_groups[0]["momentum"] = value
    return before


@pytest.mark.parametrize("joined", [True, False])
@pytest.mark.parametrize("store_name", ["device-cpu", "nvme-cut"])
def test_momentum_turned_on_mid_training_starts_from_the_gradient(store_name, joined, tmp_path,
                                                                   monkeypatch):
    """Issue 47 item 5: SGD with dampening whose momentum turns on at step 2 (a param_groups
    edit): torch starts momentum_buffer from clone(grad), never from zeros; bit for bit with
    torch's SGD(foreach=False) at every step, and the buffer in the store equals torch's."""
    if not joined:
        monkeypatch.setattr(store_optimizer, "_JOIN_ELEMS", 0, raising=False)
    kw = dict(lr=0.1, momentum=0.0, dampening=0.5, weight_decay=0.01)
    want = _params()
    ref = O.SGD(want, foreach=False, **kw)
    _run(ref, want, 5, before=_momentum_on_at(2))
    got = _params()
    store = ss.NVMeStore(str(tmp_path), budget_bytes=64 << 10) if store_name == "nvme-cut" \
        else ss.DeviceStore("cpu")
    opt = StoreOptimizer(O.SGD, [(f"w{i}", p) for i, p in enumerate(got)], state_store=store,
                         **kw)
    _run(opt, got, 5, before=_momentum_on_at(2))
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    for a, b in zip(want, got):
        assert torch.equal(ref.state[a]["momentum_buffer"], opt.state[b]["momentum_buffer"])
    store.close()


def test_momentum_turned_on_after_a_resume(tmp_path):
    """The same across a checkpoint: saved while momentum was 0 (no momentum_buffer), resumed,
    momentum on: the buffer starts from the gradient."""
    kw = dict(lr=0.1, momentum=0.0, dampening=0.5)
    want = _params()
    _run(O.SGD(want, foreach=False, **kw), want, 4, before=_momentum_on_at(2))
    got = _params()
    store = ss.DeviceStore("cpu")
    opt = StoreOptimizer(O.SGD, [(f"w{i}", p) for i, p in enumerate(got)], state_store=store,
                         **kw)
    _run(opt, got, 2)
    store.save_checkpoint(str(tmp_path / "c"))
    other = ss.DeviceStore("cpu")
    other.load_checkpoint(str(tmp_path / "c"))
    opt = StoreOptimizer(O.SGD, [(f"w{i}", p) for i, p in enumerate(got)], state_store=other,
                         **kw)
    _run(opt, got, 4, first=2, before=_momentum_on_at(2))
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def test_an_lr_schedule_keeps_the_probes_bounded():
    """Issue 47 item 8: 8 parameters of 8 shapes, SGD with momentum under CosineAnnealingLR
    (and a momentum schedule crossing zero): the probes of the class's states do not grow
    with the steps (one per shape and structure of the hyperparameters, not per lr value),
    nor do the plans' caches; bit for bit with torch all along."""
    shapes = [(i + 1, 3) for i in range(8)]
    want, got = _params(shapes=shapes), _params(shapes=shapes)
    ref = O.SGD(want, lr=0.1, momentum=0.9, foreach=False)
    opt = StoreOptimizer(O.SGD, [(f"w{i}", p) for i, p in enumerate(got)],
                         state_store=ss.DeviceStore("cpu"), lr=0.1, momentum=0.9)
    scheds = [O.lr_scheduler.CosineAnnealingLR(o, T_max=7) for o in (ref, opt)]

    def run(first, last):
        for s in range(first, last):
            for ps in (want, got):
                for p, g in zip(ps, _grads(s, ps)):
                    p.grad = g
            ref.step()
            opt.step()
            for sched in scheds:
                sched.step()
    run(0, 20)
    probes, plans = opt._layout.probe_count(), len(opt._unit_plans)
    assert probes <= 3 * len(shapes)        # lr > 0, lr == 0 (the cosine's end), before initial_lr
    run(20, 200)
    assert opt._layout.probe_count() == probes and len(opt._unit_plans) <= plans
    for a, b in zip(want, got):
        assert torch.equal(a, b)


class StepShapedState(torch.optim.Optimizer):
    """Keeps a state named "step" shaped like the parameter (a per-element count)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros_like(p)
                state["step"].add_(p.grad.ne(0).to(p.dtype))
                p.sub_(group["lr"] * p.grad / state["step"].clamp(min=1))


class ListStep(torch.optim.SGD):
    """Keeps "step" as a list."""

    @torch.no_grad()
    def step(self, closure=None):
        for p in self.param_groups[0]["params"]:
            self.state[p]["step"] = [0]


@pytest.mark.parametrize("cls,what", [(StepShapedState, r"a tensor of shape \(4, 5\)"),
                                      (ListStep, "a list")])
def test_a_state_named_step_that_is_not_a_count_is_refused_up_front(cls, what):
    """Issue 47 item 10: refused at construction (StateStoreError naming the class, the
    parameter and the fix), not a raw RuntimeError in the middle of a step."""
    p = torch.nn.Parameter(torch.ones(4, 5))
    with pytest.raises(ss.StateStoreError, match=rf"{cls.__name__}\): the class keeps a state "
                                                 rf"named 'step' that is {what} for parameter "
                                                 rf"'w'.*give it another name"):
        StoreOptimizer(cls, [("w", p)], state_store=ss.DeviceStore("cpu"), lr=0.1)


def test_the_structure_of_a_group_follows_every_change():
    """The structure a probe is keyed by is remembered across steps only while the group holds
    the same immutable values: a float replaced, a list changed in place, a key removed and
    another added are all seen."""
    opt = StoreOptimizer(O.SGD, [("w", torch.nn.Parameter(torch.ones(3)))],
                         state_store=ss.DeviceStore("cpu"), lr=0.1, momentum=0.9)
    layout, group = opt._layout, opt.param_groups[0]
    first = layout.structure_of(group)
    assert layout.structure_of(group) == first
    group["momentum"] = 0.0
    zero = layout.structure_of(group)
    assert zero != first
    group["momentum"] = 0.5                 # another value, the same structure
    assert layout.structure_of(group) == first
    group["extra"] = [1.0]
    with_list = layout.structure_of(group)
    group["extra"][0] = 0.0                 # in place
    assert layout.structure_of(group) != with_list
    del group["extra"]
    group["other"] = None
    assert layout.structure_of(group) != first

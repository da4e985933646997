"""StoreOptimizer: torch's optimizers with their states in a store compute what
``optimizer_cls(..., foreach=False)`` computes, bit for bit, at every step and after every
resume (both orders, across stores), through torch's state_dict both ways, on every store of the
registry; LBFGS and SparseAdam are refused; a Lion written here (outside torch) works."""
from __future__ import annotations

import math

import pytest
import torch

import statestore as ss
from helpers.stores import BACKENDS
from statestore.optim import CPUAdam, StateLayout, StateStoreOptimizer, StoreOptimizer

O = torch.optim
#: (id, class, kwargs): every torch optimizer with tensor states, in its configurations
#: that keep more states (momentum, centered, amsgrad, nesterov)
CASES = [
    ("sgd", O.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    ("sgd-nesterov", O.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    ("sgd-plain", O.SGD, dict(lr=0.1)),
    ("adagrad", O.Adagrad, dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1)),
    ("rmsprop", O.RMSprop, dict(lr=0.01, centered=True, momentum=0.9, weight_decay=0.01)),
    ("adam-amsgrad", O.Adam, dict(lr=0.01, amsgrad=True, weight_decay=0.01)),
    ("adamw", O.AdamW, dict(lr=0.01)),
    ("nadam", O.NAdam, dict(lr=0.01, decoupled_weight_decay=True, weight_decay=0.1)),
    ("radam", O.RAdam, dict(lr=0.01)),
    ("adamax", O.Adamax, dict(lr=0.01)),
    ("adadelta", O.Adadelta, dict(lr=1.0, weight_decay=0.01)),
    ("asgd", O.ASGD, dict(lr=0.01, t0=2)),
    ("rprop", O.Rprop, dict(lr=0.01)),
    ("adafactor", O.Adafactor, dict(lr=0.01, weight_decay=0.01)),
    ("muon", O.Muon, dict(lr=0.02)),
]
BY_ID = {c[0]: c for c in CASES}
STEPS = 3


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: these tiny models' kernels take 20x longer on a loaded machine
    when two threads contend for its cores (the comparisons are within one thread count)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _model(dtype=torch.float32, seed=1):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(40, 600), torch.nn.Tanh(),
                               torch.nn.Linear(600, 3)).to(dtype)


def _named(model, cls):
    named = list(model.named_parameters())
    return [(n, p) for n, p in named if p.ndim == 2] if cls is O.Muon else named


def _batch(step, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 40, generator=g).to(dtype)


def _train(model, opt, first, last, sched=None):
    for s in range(first, last):
        opt.zero_grad()
        model(_batch(s, next(model.parameters()).dtype)).float().square().mean().backward()
        opt.step()
        if sched is not None:
            sched.step()


def _reference(cls, kw, dtype=torch.float32, steps=STEPS):
    """torch's own optimizer: the model after ``steps`` steps and its state_dict."""
    model = _model(dtype)
    opt = cls([p for _, p in _named(model, cls)],
              **kw, **({} if cls is O.Muon else {"foreach": False}))
    _train(model, opt, 0, steps)
    return model, opt


def _same(a, b):
    bad = [n for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters())
           if not torch.equal(p, q)]
    assert not bad, f"parameters differ from torch's: {bad}"


def _same_states(want: dict, got: dict):
    assert want["state"].keys() == got["state"].keys()
    for i, st in want["state"].items():
        assert st.keys() == got["state"][i].keys(), (i, st.keys(), got["state"][i].keys())
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(got["state"][i][k])), (i, k)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
@pytest.mark.parametrize("store_name", ["device-cpu", "simdisk"])
def test_every_torch_optimizer_bit_for_bit(case, store_name, tmp_path):
    """On a resident store (one unit) and a disk store of 256 KiB (element-wise classes cut
    the 24k-element matrix into units; Adafactor and Muon keep it whole)."""
    _, cls, kw = BY_ID[case]
    want, ref = _reference(cls, kw)
    model = _model()
    store = dict(BACKENDS)[store_name](tmp_path)
    opt = StoreOptimizer(cls, _named(model, cls), state_store=store, **kw)
    _train(model, opt, 0, STEPS)
    _same(want, model)
    sd = opt.state_dict()
    _same_states(ref.state_dict(), sd)
    assert sd["param_groups"][0]["lr"] == kw["lr"]
    store.close()


@pytest.mark.parametrize("case", ["sgd", "adam-amsgrad", "nadam", "adafactor", "muon"])
def test_bf16_parameters_bit_for_bit(case, tmp_path):
    """fp16/bf16 parameters are never cut (ATen rounds their vectorized and scalar loops
    differently): still exact on a store whose units cut fp32 ones."""
    _, cls, kw = BY_ID[case]
    want, _ = _reference(cls, kw, torch.bfloat16)
    model = _model(torch.bfloat16)
    store = dict(BACKENDS)["simdisk"](tmp_path)
    _train(model, StoreOptimizer(cls, _named(model, cls), state_store=store, **kw), 0, STEPS)
    _same(want, model)
    assert store.spec(ss.StateKey(_named(model, cls)[0][0], {
        "sgd": "momentum_buffer", "adam-amsgrad": "exp_avg", "nadam": "exp_avg",
        "adafactor": "row_var", "muon": "momentum_buffer"}[case])).dtype == torch.bfloat16
    store.close()


def _scheduler(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


@pytest.mark.parametrize("store_name", [n for n, _ in BACKENDS])
def test_resume_on_every_store(store_name, tmp_path):
    """save_checkpoint / load_checkpoint on each store of the registry, in torch's order
    (optimizer and scheduler built, then the load, then the scheduler's state), for NAdam
    (cut units and a per-parameter scalar): bit for bit with torch's uninterrupted run."""
    make = dict(BACKENDS)[store_name]
    _, cls, kw = BY_ID["nadam"]
    want = _model()
    ref = cls(want.parameters(), foreach=False, **kw)
    _train(want, ref, 0, STEPS + 2, _scheduler(ref))
    model = _model()
    store = make(tmp_path / "a")
    opt = StoreOptimizer(cls, model.named_parameters(), state_store=store, **kw)
    sched = _scheduler(opt)
    _train(model, opt, 0, STEPS, sched)
    store.save_checkpoint(str(tmp_path / "ckpt"))
    saved_sched, weights = sched.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    store.close()
    model = _model(seed=7)
    model.load_state_dict(weights)
    store = make(tmp_path / "b")
    opt = StoreOptimizer(cls, model.named_parameters(), state_store=store, **dict(kw, lr=1.0))
    sched = _scheduler(opt)
    with pytest.warns(ss.ResumeWarning, match="lr 1.0 -> 0.01"):
        store.load_checkpoint(str(tmp_path / "ckpt"))     # takes the step counts and lrs back
    sched.load_state_dict(saved_sched)
    assert opt.param_groups[0]["initial_lr"] == kw["lr"]
    _train(model, opt, STEPS, STEPS + 2, sched)
    _same(want, model)
    store.close()


def test_resume_across_stores_in_the_constructors_order(tmp_path):
    """Adafactor (whole units, row/column states) saved from an NVMeStore, loaded into a
    DeviceStore before the optimizer is built: bit for bit."""
    _, cls, kw = BY_ID["adafactor"]
    want, _ = _reference(cls, kw, steps=STEPS + 2)
    model = _model()
    store = ss.NVMeStore(str(tmp_path / "a"), budget_bytes=1 << 20)
    _train(model, StoreOptimizer(cls, model.named_parameters(), state_store=store, **kw), 0,
           STEPS)
    store.save_checkpoint(str(tmp_path / "ckpt"))
    store.close()
    store = ss.DeviceStore("cpu")
    store.load_checkpoint(str(tmp_path / "ckpt"))
    with pytest.warns(ss.ResumeWarning, match="lr 1.0 -> 0.01"):
        opt = StoreOptimizer(cls, model.named_parameters(), state_store=store, **dict(kw, lr=1.0))
    assert opt.param_groups[0]["lr"] == kw["lr"]
    _train(model, opt, STEPS, STEPS + 2)
    _same(want, model)


@pytest.mark.parametrize("case", ["sgd", "asgd", "nadam", "adafactor", "muon"])
def test_state_dict_both_ways_with_the_torch_class(case):
    """Ours -> optimizer_cls.load_state_dict -> on, and optimizer_cls -> ours -> on, equal
    torch's uninterrupted run (SGD keeps no "step"; ASGD and NAdam keep scalars)."""
    _, cls, kw = BY_ID[case]
    extra = {} if cls is O.Muon else {"foreach": False}
    want, _ = _reference(cls, kw, steps=STEPS + 2)
    a = _model()
    opt = StoreOptimizer(cls, _named(a, cls), state_store=ss.DeviceStore("cpu"), **kw)
    _train(a, opt, 0, STEPS)
    torch_opt = cls([p for _, p in _named(a, cls)], **extra, **dict(kw, lr=5.0))
    torch_opt.load_state_dict(opt.state_dict())
    _train(a, torch_opt, STEPS, STEPS + 2)
    _same(want, a)

    b = _model()
    torch_opt = cls([p for _, p in _named(b, cls)], **extra, **kw)
    _train(b, torch_opt, 0, STEPS)
    opt = StoreOptimizer(cls, _named(b, cls), state_store=ss.NVMeStore(None), **dict(kw, lr=5.))
    opt.load_state_dict(torch_opt.state_dict())
    assert opt.param_groups[0]["lr"] == kw["lr"]
    _train(b, opt, STEPS, STEPS + 2)
    _same(want, b)
    opt.state_store.close()


def test_optimizer_state_and_metadata():
    model = _model()
    store = ss.DeviceStore("cpu")
    opt = StoreOptimizer(O.SGD, model.named_parameters(), state_store=store, lr=0.1,
                         momentum=0.9)
    assert len(opt.state) == 0
    _train(model, opt, 0, 2)
    p = model[0].weight
    assert set(opt.state[p]) == {"momentum_buffer"} and not opt.keeps_step
    assert torch.equal(opt.state[p]["momentum_buffer"],
                       store.get(ss.StateKey("0.weight", "momentum_buffer")))
    meta = store.metadata()
    assert meta["optimizer"] == "StoreOptimizer"
    assert meta["optimizer_class"] == "torch.optim.SGD"
    assert meta["param_groups"][0]["momentum"] == 0.9 and meta["steps"]["0.weight"] == 2
    opt2 = StoreOptimizer(O.Adafactor, _model().named_parameters(),
                          state_store=ss.DeviceStore("cpu"), lr=0.01)
    assert opt2.state_store.metadata()["param_groups"][0]["eps"] == [None, 1e-3]
    assert isinstance(opt, StateStoreOptimizer) and "torch.optim.SGD" in repr(opt)


def test_a_checkpoint_of_another_class_is_refused(tmp_path):
    model = _model()
    store = ss.DeviceStore("cpu")
    _train(model, StoreOptimizer(O.Adam, model.named_parameters(), state_store=store), 0, 1)
    store.save_checkpoint(str(tmp_path / "c"))
    for build in (lambda s: StoreOptimizer(O.AdamW, model.named_parameters(), state_store=s),
                  lambda s: CPUAdam(model.named_parameters(), state_store=s)):
        other = ss.DeviceStore("cpu")
        other.load_checkpoint(str(tmp_path / "c"))
        with pytest.raises(ss.CheckpointMismatchError, match="StoreOptimizer.torch.optim.Adam"):
            build(other)


@pytest.mark.parametrize("cls,kw,error,match", [
    (O.LBFGS, {}, ss.StateStoreValueError, "does not support LBFGS"),
    (O.SparseAdam, {}, ss.StateStoreValueError, "does not support SparseAdam"),
    (O.Adam, {"foreach": True}, ss.StateStoreValueError, "foreach=True"),
    (O.Adam, {"fused": True}, ss.StateStoreValueError, "fused=True"),
    (O.Adam, {"lr": -1.0}, ValueError, "Invalid learning rate: -1.0"),
    (O.Muon, {"elementwise": True}, ss.StateStoreError, "whole tensor"),
    (CPUAdam, {}, TypeError, "already keeps its states in a store"),
    ("Adam", {}, TypeError, "must be a torch.optim.Optimizer subclass"),
])
def test_refused(cls, kw, error, match):
    with pytest.raises(error, match=match):
        StoreOptimizer(cls, [torch.nn.Parameter(torch.zeros(3, 3))], **kw)


def test_muon_refuses_non_matrices_as_torch_does():
    with pytest.raises(ValueError, match="Muon only supports 2D parameters"):
        StoreOptimizer(O.Muon, _model().parameters())


def test_a_whole_parameter_over_the_budget_is_named(tmp_path):
    model = torch.nn.Linear(600, 600, bias=False)
    store = ss.NVMeStore(str(tmp_path), budget_bytes=1 << 20)      # Muon: 1.44 MB of states
    opt = StoreOptimizer(O.Muon, model.named_parameters(), state_store=store)
    model(torch.randn(2, 600)).sum().backward()
    with pytest.raises(ss.BudgetError, match=r"parameter 'weight'.*budget_bytes >= 144\d{4}"):
        opt.step()
    assert len(opt.state) == 0          # nothing changed: the step can be made again
    store.close()


class Lion(torch.optim.Optimizer):
    """A small Lion (Chen et al. 2023) in torch's pattern, written here: sign of the
    interpolated momentum, decoupled weight decay, one state."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(m.mul(b1).add(p.grad, alpha=1 - b1).sign_(), alpha=-group["lr"])
                m.lerp_(p.grad, 1 - b2)


@pytest.mark.parametrize("elementwise", [None, True])
def test_a_lion_outside_torch(elementwise, tmp_path):
    """Whole parameters by default; cut into units with ``elementwise=True``."""
    kw = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    want = _model()
    _train(want, Lion(want.parameters(), **kw), 0, STEPS)
    model = _model()
    store = dict(BACKENDS)["simdisk"](tmp_path)
    opt = StoreOptimizer(Lion, model.named_parameters(), state_store=store,
                         elementwise=elementwise, **kw)
    units = opt._plan(store, [(opt.param_groups[0], list(model.parameters()))])[0]
    assert any(s.start > 0 for u in units for s in u) == bool(elementwise)     # cut or not
    _train(model, opt, 0, STEPS)
    _same(want, model)
    assert store.metadata()["optimizer_class"].endswith("test_store_optimizer.Lion")
    store.close()


class StoreLion(StateStoreOptimizer):
    """docs/extending.md's "Adding an optimizer" example, as written there."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *,
                 state_store=None, process_group=None):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay),
                         StateLayout(["exp_avg"], dtype=torch.float32),
                         state_store=state_store, process_group=process_group)

    def _update_unit(self, tensors, group, entries, grads, grad_scale, dev):
        (b1, b2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
        for (p, a, b, names), m in zip(entries, tensors):     # one state per entry
            w = p.detach().view(-1)[a:b]        # (_dtensor.local(p) for DTensors)
            g = grads[p].view(-1)[a:b] / grad_scale
            self._touch()                       # about to change the parameter and state
            w.mul_(1 - lr * wd).add_(m.mul(b1).add(g, alpha=1 - b1).sign_(), alpha=-lr)
            m.lerp_(g, 1 - b2)


def test_adding_an_optimizer_is_one_class(tmp_path):
    """The documented example, cut into units on a disk store, resumed from a checkpoint:
    the same bits as the Lion above in RAM."""
    kw = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    want = _model()
    _train(want, Lion(want.parameters(), **kw), 0, STEPS + 2)
    model = _model()
    store = dict(BACKENDS)["simdisk"](tmp_path)
    _train(model, StoreLion(model.named_parameters(), state_store=store, **kw), 0, STEPS)
    store.save_checkpoint(str(tmp_path / "ckpt"))
    other = ss.DeviceStore("cpu")
    other.load_checkpoint(str(tmp_path / "ckpt"))
    opt = StoreLion(model.named_parameters(), state_store=other, **kw)
    assert other.metadata()["optimizer"] == "StoreLion" and opt.step_count(model[0].weight) == 3
    _train(model, opt, STEPS, STEPS + 2)
    _same(want, model)
    store.close()


class BackwardLion(StoreLion):
    """StoreLion handing the base ``update_in_backward`` and ``release_grads``: written once
    in the base, every class on it has them."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *,
                 state_store=None, update_in_backward=False, release_grads=False):
        StateStoreOptimizer.__init__(
            self, params, dict(lr=lr, betas=betas, weight_decay=weight_decay),
            StateLayout(["exp_avg"], dtype=torch.float32), state_store=state_store,
            update_in_backward=update_in_backward, release_grads=release_grads)


@pytest.mark.parametrize("store_kind", ["device", "nvme"])
def test_a_class_on_the_base_updates_in_backward(store_kind, tmp_path):
    """A class written on the base alone gets ``update_in_backward`` (and
    ``release_grads``): parameters updated during backward from the second step, the same
    bits as the Lion in RAM."""
    kw = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    want = _model()
    _train(want, Lion(want.parameters(), **kw), 0, STEPS + 1)
    model = _model()
    store = ss.DeviceStore("cpu") if store_kind == "device" else \
        ss.NVMeStore(str(tmp_path / "s"), budget_bytes=64 << 10)
    opt = BackwardLion(model.named_parameters(), state_store=store, update_in_backward=True,
                       release_grads=True, **kw)
    assert opt.update_in_backward and opt.release_grads
    _train(model, opt, 0, 1)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    model(_batch(1)).float().square().mean().backward()
    if store_kind == "device":          # applied and released during backward
        assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        assert all(p.grad is None for p in model.parameters())
    opt.step()
    _train(model, opt, 2, STEPS + 1)
    _same(want, model)
    store.close()


def test_convert_reads_a_checkpoint_by_the_layout_of_the_class_that_wrote_it(tmp_path):
    """``statestore convert`` takes the layout from the optimizer the metadata names: a
    class that does not say how (StoreLion, no ``saved_layout``) is refused by name, where
    Adam's layout used to be assumed (Adam's groups for a Lion's states)."""
    from statestore.__main__ import to_torch_state_dict
    model = _model()
    store = ss.DeviceStore("cpu")
    _train(model, StoreLion(model.named_parameters(), state_store=store), 0, 1)
    store.save_checkpoint(str(tmp_path / "lion"))
    with pytest.raises(ss.CheckpointError, match="StoreLion.*saved_layout"):
        to_torch_state_dict(str(tmp_path / "lion"))
    store.close()


def test_unit_counts_follow_the_budget():
    """NAdam's 24k-element matrix in units of the disk store's unit_bytes; its scalar
    mu_product rides in the first of them only."""
    model = _model()
    store = ss.NVMeStore(None, budget_bytes=1 << 20)
    opt = StoreOptimizer(O.NAdam, model.named_parameters(), state_store=store)
    units, meta = opt._plan(store, [(opt.param_groups[0], list(model.parameters()))])
    per_elem = 8        # exp_avg, exp_avg_sq
    assert len(units) >= math.ceil(600 * 40 * per_elem / store.unit_bytes)
    scalars = [(s.key.param, meta[i][1]) for i, u in enumerate(units) for s in u
               if s.key.state == "mu_product"]
    assert sorted(k for k, _ in scalars) == sorted(n for n, _ in model.named_parameters())
    for key, entries in scalars:        # in the unit that starts the parameter
        assert any(opt._keys[p] == key and a == 0 for p, a, _, _ in entries)
    store.close()


def test_sharded_over_a_process_group_and_resumed_in_one_process(tmp_path):
    """process_group= sharding: 2 ranks (gloo) train StoreOptimizer(Adafactor) on NVMe stores
    and save one checkpoint collectively; it equals torch's Adafactor in one process, and the
    checkpoint resumes in one process, bit for bit."""
    from safetensors.torch import load_file

    from helpers import dist_worker as W
    from helpers.ranks import run_ranks
    k, n = 2, 4
    run_ranks(W.store_optimizer_sharded, 2, str(tmp_path), k, n)     # the join bounded
    want = W.make_model()
    W.train(want, O.Adafactor(want.parameters(), lr=1e-2, foreach=False), 0, n)
    got = load_file(str(tmp_path / "at_n.safetensors"))
    assert all(torch.equal(got[name], v) for name, v in want.state_dict().items())
    model = W.make_model()
    model.load_state_dict(load_file(str(tmp_path / "at_k.safetensors")))
    store = ss.DeviceStore("cpu")
    store.load_checkpoint(str(tmp_path / "ckpt"))
    W.train(model, StoreOptimizer(O.Adafactor, model.named_parameters(), lr=1e-2,
                                  state_store=store), k, n)
    assert all(torch.equal(model.state_dict()[name], v) for name, v in want.state_dict().items())


def test_parameters_offloaded_too(tmp_path):
    """offload_parameters: each unit's parameters are fetched for the class's update and
    written back after (the base's seam), bit for bit."""
    _, cls, kw = BY_ID["nadam"]
    want, _ = _reference(cls, kw)
    model = _model()
    params, states = ss.NVMeStore(str(tmp_path / "p"), budget_bytes=1 << 20), \
        ss.NVMeStore(str(tmp_path / "s"), budget_bytes=1 << 20)
    with ss.offload_parameters(model, params, prefetch=1):
        _train(model, StoreOptimizer(cls, model.named_parameters(), state_store=states, **kw),
               0, STEPS)
    _same(want, model)
    params.close()
    states.close()


class _FailsOnce(torch.optim.SGD):
    """SGD whose step raises once, after updating its first parameter (a fault mid-step)."""
    armed = False

    @torch.no_grad()
    def step(self, closure=None):
        if not type(self).armed:
            return super().step(closure)
        type(self).armed = False
        p = self.param_groups[0]["params"][0]
        p.add_(1.0)
        raise RuntimeError("fault after the first parameter")


def test_a_step_failing_part_way_refuses_until_reloaded(tmp_path):
    """DESIGN's "After a failure": a fault after the class changed a parameter leaves the
    optimizer refusing step(), state_dict() and saves; the last checkpoint reloads into a new
    one, which trains on exactly."""
    want, _ = _reference(O.SGD, dict(lr=0.1, momentum=0.9), steps=STEPS + 1)
    model = _model()
    store = ss.DeviceStore("cpu")
    opt = StoreOptimizer(_FailsOnce, model.named_parameters(), state_store=store, lr=0.1,
                         momentum=0.9)
    _train(model, opt, 0, STEPS)
    store.save_checkpoint(str(tmp_path / "ckpt"))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    _FailsOnce.armed = True
    with pytest.raises(RuntimeError, match="fault after the first parameter"):
        _train(model, opt, STEPS, STEPS + 1)
    for call in (opt.step, opt.state_dict, lambda: store.save_checkpoint(str(tmp_path / "x"))):
        with pytest.raises(ss.StateStoreError, match="failed part-way"):
            call()
    store.load_checkpoint(str(tmp_path / "ckpt"))
    model.load_state_dict(weights)
    _train(model, StoreOptimizer(_FailsOnce, model.named_parameters(), state_store=store,
                                 lr=0.1, momentum=0.9), STEPS, STEPS + 1)
    _same(want, model)


def test_convert_to_torch_loads_into_the_class(tmp_path):
    """``statestore convert --to torch`` of a StoreOptimizer checkpoint: optimizer_cls loads
    it (SGD's entries without "step", Adafactor's with one) and trains on exactly."""
    from statestore.__main__ import to_torch_state_dict
    for case in ("sgd", "adafactor"):
        _, cls, kw = BY_ID[case]
        want, _ = _reference(cls, kw, steps=STEPS + 1)
        model = _model()
        store = ss.DeviceStore("cpu")
        _train(model, StoreOptimizer(cls, model.named_parameters(), state_store=store, **kw),
               0, STEPS)
        store.save_checkpoint(str(tmp_path / case))
        sd = to_torch_state_dict(str(tmp_path / case))
        assert ("step" in sd["state"][0]) == (case == "adafactor")
        opt = cls(model.parameters(), foreach=False, **kw)
        opt.load_state_dict(sd)
        _train(model, opt, STEPS, STEPS + 1)
        _same(want, model)

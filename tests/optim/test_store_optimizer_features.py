"""StoreOptimizer's own keyword arguments: ``skip_nonfinite`` (a step with inf or nan
gradients changes nothing, for every class and store), ``state_dtype="bf16"`` (floating
states kept as bf16, stochastically rounded, computed in fp32, resumed bit for bit) and
``update_in_backward``/``release_grads`` (each parameter updated from its gradient hook: the
class's own bits, HybridAdam's refusals)."""
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
    return ss.NVMeStore(str(tmp_path / name), budget_bytes=32 << 10)


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


# ------------------------------------------------------------------ state_dtype="bf16"
def _emulated(cls, kw, steps, keys):
    """torch's class (foreach=False) whose floating states are rounded as state_dtype="bf16"
    rounds them after each step, kept in fp32 between steps: what the store's bf16 states
    hand back."""
    from statestore.optim._rounding import round_into, seed_of
    model = _model()
    opt = cls(model.parameters(), foreach=False, **kw)
    for s in range(steps):
        opt.zero_grad()
        _backward(model, s)
        opt.step()
        for key, p in zip(keys, model.parameters()):
            for name, v in opt.state[p].items():
                if name != "step" and isinstance(v, torch.Tensor) and v.dtype == torch.float32:
                    low = torch.empty(v.shape, dtype=torch.bfloat16)
                    round_into(low, v, seed_of(key, name, s + 1), 0)
                    v.copy_(low)
    return model


#: and three states a parameter (slices of 2-byte states cut on the disk's alignment), a
#: per-parameter scalar state (NAdam's mu_product)
BF16_CASES = CASES + [("adam-amsgrad", O.Adam, dict(lr=0.01, amsgrad=True)),
                      ("nadam", O.NAdam, dict(lr=0.01))]


@pytest.mark.parametrize("store_kind", STORES)
@pytest.mark.parametrize("case", BF16_CASES, ids=[c[0] for c in BF16_CASES])
def test_bf16_states_are_torchs_step_rounded(case, store_kind, tmp_path):
    """Each step is the class's own fp32 step over the states read from bf16, its result
    stochastically rounded: bit for bit what torch's class computes with its states so
    rounded after each step, however the store cuts the parameters into units."""
    _, cls, kw = case
    model = _model()
    store = _store(store_kind, tmp_path)
    opt = StoreOptimizer(cls, model.named_parameters(), state_store=store, state_dtype="bf16",
                         **kw)
    _train(model, opt, 0, 4)
    keys = [n for n, _ in model.named_parameters()]
    _same(_emulated(cls, kw, 4, keys), model)
    assert {store.spec(k).dtype for k in store.keys()} == {torch.bfloat16}
    for entry in opt.state_dict()["state"].values():   # torch's format: the class's dtypes
        assert all(v.dtype == torch.float32 for v in entry.values()
                   if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("store_kind", STORES)
def test_bf16_adamw_halves_the_states_and_trains_as_fp32(store_kind, tmp_path):
    """AdamW's states in bf16 take at most 0.56x the bytes of fp32 ones, and 6 steps stay
    within bf16 rounding of the fp32 run (each update off by a few bf16 steps of lr)."""
    runs = {}
    for dt in ("fp32", "bf16"):
        model = _model()
        store = _store(store_kind, tmp_path, dt)
        opt = StoreOptimizer(O.AdamW, model.named_parameters(), state_store=store,
                             state_dtype=dt, lr=0.01)
        _train(model, opt, 0, 6)
        store.sync()
        runs[dt] = model, store.stats()["nbytes"]
    assert runs["bf16"][1] <= 0.56 * runs["fp32"][1]
    for x, y in zip(runs["fp32"][0].parameters(), runs["bf16"][0].parameters()):
        assert not torch.equal(x, y) or x.numel() < 10
        assert (x - y).abs().max().item() <= 6 * 0.01 * 2 ** -6


@pytest.mark.parametrize("store_kind", STORES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bf16_resumes_bit_for_bit(case, store_kind, tmp_path):
    """save_checkpoint after 3 steps, load_checkpoint into a new store and optimizer, 2 more
    steps: bit for bit the uninterrupted bf16 run."""
    _, cls, kw = case
    want = _model()
    _train(want, StoreOptimizer(cls, want.named_parameters(), state_store=ss.DeviceStore("cpu"),
                                state_dtype="bf16", **kw), 0, 5)
    model = _model()
    store = _store(store_kind, tmp_path, "a")
    opt = StoreOptimizer(cls, model.named_parameters(), state_store=store, state_dtype="bf16",
                         **kw)
    _train(model, opt, 0, 3)
    store.save_checkpoint(str(tmp_path / "ckpt"))
    store.close()
    store = _store(store_kind, tmp_path, "b")
    opt = StoreOptimizer(cls, model.named_parameters(), state_store=store, state_dtype="bf16",
                         **kw)
    store.load_checkpoint(str(tmp_path / "ckpt"))
    _train(model, opt, 3, 5)
    _same(want, model)
    store.close()


def test_bf16_checkpoint_refused_by_fp32_optimizer(tmp_path):
    """A checkpoint of bf16 states does not silently resume an fp32 optimizer."""
    model = _model()
    store = ss.DeviceStore("cpu")
    _train(model, StoreOptimizer(O.AdamW, model.named_parameters(), state_store=store,
                                 state_dtype="bf16", lr=0.01), 0, 1)
    store.save_checkpoint(str(tmp_path / "ckpt"))
    store = ss.DeviceStore("cpu")
    opt = StoreOptimizer(O.AdamW, model.named_parameters(), state_store=store, lr=0.01)
    with pytest.raises(ss.StateStoreError, match="state_dtype='bf16'"):
        store.load_checkpoint(str(tmp_path / "ckpt"))
    with pytest.raises(ss.StateStoreError, match="load_checkpoint into its store failed"):
        opt.state_dict()


def test_bf16_state_dict_both_ways():
    """state_dict() of a bf16 optimizer loads into torch's AdamW (fp32 states, exact); an
    fp32 state_dict loaded into a bf16 optimizer is rounded to nearest."""
    a = _model()
    torch_opt = O.AdamW(a.parameters(), lr=0.01, foreach=False)
    _train(a, torch_opt, 0, 2)
    b = _model()
    opt = StoreOptimizer(O.AdamW, b.named_parameters(), state_store=ss.DeviceStore("cpu"),
                         state_dtype="bf16", lr=0.01)
    opt.load_state_dict(torch_opt.state_dict())
    got = opt.state_dict()["state"]
    for i, entry in torch_opt.state_dict()["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert got[i][name].dtype == torch.float32
            assert torch.equal(got[i][name], entry[name].to(torch.bfloat16).float())
    back = O.AdamW(b.parameters(), lr=0.01, foreach=False)
    back.load_state_dict(opt.state_dict())
    assert torch.equal(back.state_dict()["state"][0]["exp_avg"], got[0]["exp_avg"])


@pytest.mark.parametrize("bad", ["fp16", "bfloat16", torch.bfloat16, None])
def test_bad_state_dtype_is_refused(bad):
    with pytest.raises(ss.StateStoreValueError, match="state_dtype"):
        StoreOptimizer(O.AdamW, _model().parameters(), state_dtype=bad, lr=0.01)


# ------------------------------------------------------------------ update_in_backward
UBW_CASES = CASES + [("nadam", O.NAdam, dict(lr=0.01)),
                     ("sgd-dampening", O.SGD, dict(lr=0.1, momentum=0.9, dampening=0.3)),
                     ("muon", O.Muon, dict(lr=0.02))]


def _torch_run(cls, kw, steps):
    model = _model()
    params = [p for p in model.parameters() if cls is not O.Muon or p.ndim == 2]
    opt = cls(params, **kw, **({} if cls is O.Muon else {"foreach": False}))
    _train(model, opt, 0, steps)
    return model


def _named(model, cls):
    return [(n, p) for n, p in model.named_parameters() if cls is not O.Muon or p.ndim == 2]


@pytest.mark.parametrize("release", [False, True])
@pytest.mark.parametrize("store_kind", STORES)
@pytest.mark.parametrize("case", UBW_CASES, ids=[c[0] for c in UBW_CASES])
def test_update_in_backward_is_torchs_step(case, store_kind, release, tmp_path):
    """Bit for bit torch's class (foreach=False), with parameters updated during backward
    from the second step on (each parameter's first update by the class itself: SGD's
    dampening, NAdam's mu_product); release_grads frees each gradient once applied."""
    _, cls, kw = case
    want = _torch_run(cls, kw, 4)
    model = _model()
    opt = StoreOptimizer(cls, _named(model, cls), state_store=_store(store_kind, tmp_path),
                         update_in_backward=True, release_grads=release, **kw)
    for s in range(4):
        opt.zero_grad()
        before = [p.detach().clone() for _, p in _named(model, cls)]
        _backward(model, s)
        # the plan made by the first step() updates them during backward (on disk, those
        # whose states have arrived: backward never waits for the disk)
        if s > 0 and store_kind == "device":
            assert all(not torch.equal(b, p) for b, (_, p) in zip(before, _named(model, cls)))
            if release:
                assert all(p.grad is None for _, p in _named(model, cls))
        opt.step()
    _same(want, model)


def test_update_in_backward_with_bf16_states_is_the_step_after_backward(tmp_path):
    """update_in_backward with state_dtype="bf16": the same bits as step() after backward."""
    runs = []
    for ubw in (False, True):
        model = _model()
        opt = StoreOptimizer(O.AdamW, model.named_parameters(), state_store=_store(
            "nvme", tmp_path, str(ubw)), state_dtype="bf16", update_in_backward=ubw, lr=0.01)
        _train(model, opt, 0, 4)
        runs.append(model)
    _same(*runs)


def test_update_in_backward_follows_a_state_turned_on():
    """SGD's momentum leaving 0 between steps: the plan made without momentum_buffer is not
    used by backward; the class makes the buffer in step() (clone(grad)), as torch's."""
    want = _model()
    ref = O.SGD(want.parameters(), lr=0.1, momentum=0.0, foreach=False)
    model = _model()
    opt = StoreOptimizer(O.SGD, model.named_parameters(), state_store=ss.DeviceStore("cpu"),
                         update_in_backward=True, lr=0.1, momentum=0.0)
    for s in range(5):
        for o in (ref, opt):
            o.param_groups[0]["momentum"] = 0.9 if s >= 2 else 0.0
        _train(want, ref, s, s + 1)
        _train(model, opt, s, s + 1)
    _same(want, model)


def test_update_in_backward_resumes_bit_for_bit(tmp_path):
    """save_checkpoint between steps, load into a new store and optimizer: bit for bit."""
    want = _torch_run(O.RMSprop, dict(lr=0.01), 5)
    model = _model()
    store = _store("nvme", tmp_path, "a")
    opt = StoreOptimizer(O.RMSprop, model.named_parameters(), state_store=store,
                         update_in_backward=True, lr=0.01)
    _train(model, opt, 0, 3)
    store.save_checkpoint(str(tmp_path / "ckpt"))
    store.close()
    store = _store("nvme", tmp_path, "b")
    opt = StoreOptimizer(O.RMSprop, model.named_parameters(), state_store=store,
                         update_in_backward=True, lr=0.01)
    store.load_checkpoint(str(tmp_path / "ckpt"))
    _train(model, opt, 3, 5)
    _same(want, model)
    store.close()


@pytest.mark.parametrize("misuse", ["clip", "accumulate"])
def test_update_in_backward_refuses_what_hybridadam_refuses(misuse):
    """Clipping or accumulating: refused at the first step() with nothing changed, made
    with update_in_backward switched off; later, after backward updated some parameters,
    step() finishes the others and says so (every parameter made the step once)."""
    def misuse_after(model, s):
        if misuse == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-2)
        else:
            _backward(model, s + 50)
    word = "changed after backward" if misuse == "clip" else "second gradient before step"
    model = _model()
    opt = StoreOptimizer(O.AdamW, model.named_parameters(), state_store=ss.DeviceStore("cpu"),
                         update_in_backward=True, lr=0.01)
    _backward(model, 0)
    misuse_after(model, 0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ss.StateStoreError, match=f"{word}.*Nothing was updated"):
        opt.step()
    for b, p in zip(before, model.parameters()):
        assert torch.equal(b, p)
    opt.update_in_backward = False
    opt.step()
    opt.update_in_backward = True
    opt.zero_grad()
    _backward(model, 1)
    opt.step()                          # plans: backward updates from the next step on
    opt.zero_grad()
    _backward(model, 2)
    misuse_after(model, 2)
    with pytest.raises(ss.StateStoreError, match=word):
        opt.step()
    assert {opt.step_count(p) for p in model.parameters()} == {3}


@pytest.mark.parametrize("kw,exc,match", [
    ({"update_in_backward": 1}, TypeError, "update_in_backward must be a bool"),
    ({"release_grads": True}, ValueError, "release_grads=True needs update_in_backward"),
    ({"update_in_backward": True, "skip_nonfinite": True}, ValueError, "skip_nonfinite"),
    ({"update_in_backward": True, "process_group": object()}, ValueError, "process_group"),
])
def test_update_in_backward_bad_arguments(kw, exc, match):
    with pytest.raises(exc, match=match):
        StoreOptimizer(O.SGD, _model().parameters(), lr=0.1, **kw)


@pytest.mark.parametrize("case", [UBW_CASES[3], UBW_CASES[4]], ids=["nadam", "sgd-dampening"])
def test_release_grads_first_step_over_budget(case, tmp_path):
    """release_grads with more gradient bytes than the disk store's budget at the first
    backward (no plan yet): each parameter's first update is made during that backward (by
    the class itself: SGD's clone(grad) with dampening, NAdam's mu_product) and its gradient
    freed; bit for bit torch's."""
    _, cls, kw = case
    want = _torch_run(cls, kw, 3)
    model = _model()
    opt = StoreOptimizer(cls, model.named_parameters(), state_store=ss.NVMeStore(
        str(tmp_path / "s"), budget_bytes=16 << 10), update_in_backward=True,
        release_grads=True, **kw)
    _backward(model, 0)
    assert all(p.grad is None for p in model.parameters())
    opt.step()
    _train(model, opt, 1, 3)
    _same(want, model)


@pytest.mark.parametrize("store_kind", STORES)
def test_a_failed_backward_ends_its_step(store_kind, tmp_path):
    """A backward that raises after some gradients were produced (and, with a plan, applied):
    those parameters made the step, the others did not (torch's step with only their
    gradients); step() after it and the next steps are bit for bit torch's."""
    def run(opt, model):
        _train(model, opt, 0, 2)
        opt.zero_grad()
        g = torch.Generator().manual_seed(102)
        h = model[1](model[0](torch.randn(8, 20, generator=g)))
        h.register_hook(lambda _: (_ for _ in ()).throw(RuntimeError("model failed")))
        with pytest.raises(RuntimeError, match="model failed"):
            model[2](h).square().mean().backward()
        opt.step()
        _train(model, opt, 3, 5)
        return model
    ref_model = _model()
    run(O.AdamW(ref_model.parameters(), lr=0.01, foreach=False), ref_model)
    model = _model()
    opt = StoreOptimizer(O.AdamW, model.named_parameters(), state_store=_store(
        store_kind, tmp_path), update_in_backward=True, lr=0.01)
    run(opt, model)
    _same(ref_model, model)
    assert [opt.step_count(p) for p in model.parameters()] == [4, 4, 5, 5]

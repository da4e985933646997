"""The compiled step of CPUAdam/HybridAdam (``statestore/optim/_units.py``, ``StepProgram``;
``csrc/adam/adam_ops.cpp``, ``StepPlan``): a step over resident stores that repeats the
previous one is made by one native call. It must give the bits of the general step (run
beside it with ``STATESTORE_STEP_PLAN=0``), notice everything it depends on changing (and
then step the general way, changing nothing first), and do the same Python work whatever
the number of parameters."""
from __future__ import annotations

import functools
import sys

import pytest
import torch
from torch import nn

import statestore as ss
from statestore.optim import CPUAdam, HybridAdam
from statestore.optim import _units
from statestore.optim import adam as adam_mod

SIZES = [1, 7, 17, 256, 1000, 3, 0, 4099]       # SIMD tails, an empty parameter


def _stores():
    # nvme: a budget that cuts the largest parameter into several pipeline units
    return {"device": lambda tmp: ss.DeviceStore("cpu"),
            "pinned": lambda tmp: ss.PinnedCPUStore(),
            "file": lambda tmp: ss.FileStore(str(tmp / "fs")),
            "nvme": lambda tmp: ss.NVMeStore(str(tmp / "nv"), budget_bytes=1 << 16)}


def _params(dtype=torch.float32, sizes=SIZES, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in sizes]


def _grads(ps, step, skip=(), dtype=None):
    g = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(ps):
        x = torch.randn(p.shape, generator=g) * 0.1
        p.grad = None if i in skip else x.to(dtype or p.dtype)


class _Runs:
    """Counts the steps the compiled program made (``n``) and keeps the outcomes of the
    resident programs' native calls."""

    def __init__(self, monkeypatch):
        self.n, self.outcomes = 0, []
        real, real_step = _units.StepProgram.run, adam_mod._StoreAdam._run_remembered

        def run(prog, *a, **kw):
            out = real(prog, *a, **kw)
            self.outcomes.append(out)
            return out

        def planned_step(opt, *a, **kw):
            out = real_step(opt, *a, **kw)
            self.n += out
            return out
        monkeypatch.setattr(_units.StepProgram, "run", run)
        monkeypatch.setattr(adam_mod._StoreAdam, "_run_remembered", planned_step)


def _twins(make_store, tmp_path, monkeypatch, cls=HybridAdam, pdtype=torch.float32, **kw):
    """The same optimizer twice: (planned, general), the general one run with
    STATESTORE_STEP_PLAN=0 around each of its calls."""
    out = []
    for name in ("plan", "general"):
        (tmp_path / name).mkdir()
        ps = _params(pdtype)
        out.append((ps, cls(ps, lr=1e-2, weight_decay=0.1, state_store=make_store(tmp_path / name),
                            **kw)))
    return out


def _general(monkeypatch, fn, *a, **kw):
    with monkeypatch.context() as m:
        m.setenv("STATESTORE_STEP_PLAN", "0")
        return fn(*a, **kw)


def _assert_same(a, b):
    (pa, oa), (pb, ob) = a, b
    for x, y in zip(pa, pb):
        assert torch.equal(x, y)
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        for k, v in sa["state"][i].items():
            w = sb["state"][i][k]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (i, k)


@pytest.mark.parametrize("store", sorted(_stores()))
@pytest.mark.parametrize("kw", [{}, {"amsgrad": True}, {"moment_dtype": "bf16"},
                                {"moment_dtype": "int8"}, {"pdtype": torch.bfloat16},
                                {"pdtype": torch.float16, "moment_dtype": "bf16"},
                                {"adamw_mode": False, "maximize": True}],
                         ids=["fp32", "amsgrad", "bf16m", "int8m", "bf16p", "fp16p-bf16m",
                              "l2-max"])
def test_planned_steps_are_the_general_steps_bit_for_bit(store, kw, tmp_path, monkeypatch):
    runs = _Runs(monkeypatch)
    a, b = _twins(_stores()[store], tmp_path, monkeypatch, **kw)
    for step in range(5):
        _grads(a[0], step)
        _grads(b[0], step)
        a[1].step()
        _general(monkeypatch, b[1].step)
    assert runs.n == 4           # every step but the first (which compiles)
    _assert_same(a, b)


def test_the_dispatcher_route_gives_the_same_bits(tmp_path, monkeypatch):
    """The route CUDA plans take (the ``statestore::adam_`` op through the dispatcher, a call
    per group), run on the CPU."""
    from statestore import _C_adam
    monkeypatch.setattr(_C_adam, "StepPlan", functools.partial(_C_adam.StepPlan, dispatch=True))
    runs = _Runs(monkeypatch)
    for kw in ({}, {"moment_dtype": "int8", "amsgrad": True}, {"pdtype": torch.bfloat16}):
        d = tmp_path / str(len(kw))
        d.mkdir()
        a, b = _twins(_stores()["device"], d, monkeypatch, **kw)
        for step in range(3):
            _grads(a[0], step)
            _grads(b[0], step)
            a[1].step()
            _general(monkeypatch, b[1].step)
        _assert_same(a, b)
    assert runs.n == 6


def _change_grad_none(ps, opt, step):
    _grads(ps, step, skip=(2,))


def _change_grad_dtype(ps, opt, step):
    for p in ps:
        if hasattr(p, "grad_dtype"):
            p.grad_dtype = None         # torch checks a gradient's dtype against it
    _grads(ps, step, dtype=torch.bfloat16)


def _change_grad_layout(ps, opt, step):
    _grads(ps, step)
    wide = torch.zeros(2 * ps[7].numel())
    wide[::2] = ps[7].grad
    ps[7].grad = wide[::2]          # the same values, not contiguous


def _change_lr_and_betas(ps, opt, step):
    _grads(ps, step)
    opt.param_groups[0]["lr"] = torch.tensor(3e-3)
    opt.param_groups[0]["betas"] = (0.8, 0.99)


def _change_amsgrad(ps, opt, step):
    _grads(ps, step)
    opt.param_groups[0]["amsgrad"] = True


def _change_param_data(ps, opt, step):
    _grads(ps, step)
    with torch.no_grad():
        ps[3].data = ps[3].data.clone() + 1


def _change_groups(ps, opt, step):
    _grads(ps, step)
    extra = nn.Parameter(torch.ones(5))
    extra.grad = torch.full((5,), 0.5)
    ps.append(extra)
    opt.add_param_group({"params": [extra], "lr": 2e-2})


def _change_params_list(ps, opt, step):
    _grads(ps, step)
    group = opt.param_groups[0]["params"]
    group[0], group[1] = group[1], group[0]


def _change_store_reloaded(ps, opt, step, ck):
    opt.state_store.save_checkpoint(ck, progress=False)
    opt.state_store.load_checkpoint(ck, progress=False)
    _grads(ps, step)


def _change_state_dict_loaded(ps, opt, step):
    opt.load_state_dict(opt.state_dict())
    _grads(ps, step)


CHANGES = {"grad-none": _change_grad_none, "grad-dtype": _change_grad_dtype,
           "grad-layout": _change_grad_layout, "lr-betas": _change_lr_and_betas,
           "amsgrad": _change_amsgrad, "param-data": _change_param_data,
           "add-group": _change_groups, "params-list": _change_params_list,
           "reload": _change_store_reloaded, "load-state-dict": _change_state_dict_loaded}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_change_replans_and_steps_as_the_general_way(change, tmp_path, monkeypatch):
    """Steps 0-2, then a change of something a plan depends on before step 3, and steps 3-5:
    the planned optimizer (stale plan, general step, a new plan) matches the general one bit
    for bit, and plans again afterwards (lr and betas are read each step: no re-plan)."""
    runs = _Runs(monkeypatch)
    a, b = _twins(_stores()["device"], tmp_path, monkeypatch)
    fn = CHANGES[change]
    if change == "reload":
        fn = functools.partial(fn, ck=str(tmp_path / "ck"))
    for step in range(6):
        for (ps, opt), plan in ((a, True), (b, False)):
            if step == 3:
                (fn if plan else functools.partial(_general, monkeypatch, fn))(ps, opt, step)
            elif step == 4 and change in ("grad-none", "grad-dtype", "grad-layout"):
                fn(ps, opt, step)      # the changed form again: a plan of its own
            else:
                _grads(ps, step)
            if plan:
                opt.step()
            else:
                _general(monkeypatch, opt.step)
    _assert_same(a, b)
    # steps 1, 2 planned; step 3 stale unless only lr/betas changed (a non-contiguous
    # gradient is made contiguous for the kernel: not planned)
    assert runs.n >= (5 if change == "lr-betas" else 2 if change == "grad-layout" else 3), \
        runs.n


def test_skip_nonfinite_skips_a_planned_step_whole(tmp_path, monkeypatch):
    runs = _Runs(monkeypatch)
    a, b = _twins(_stores()["device"], tmp_path, monkeypatch, skip_nonfinite=True)
    for step in range(4):
        for (ps, opt), plan in ((a, True), (b, False)):
            _grads(ps, step)
            if step == 2:
                ps[4].grad[5] = float("inf")
            if plan:
                opt.step()
            else:
                _general(monkeypatch, opt.step)
    _assert_same(a, b)
    assert a[1].step_count(a[0][0]) == 3 and runs.n == 3
    assert runs.outcomes == [_units.PLAN_OK, _units.PLAN_SKIPPED, _units.PLAN_OK]


def test_a_failure_after_the_counts_advanced_makes_the_optimizer_refuse(tmp_path, monkeypatch):
    ps = _params()
    opt = CPUAdam(ps, lr=1e-2, state_store=ss.DeviceStore("cpu"))
    for step in range(2):
        _grads(ps, step)
        opt.step()
    real = _units.StepProgram.run

    def fails(prog, *a, **kw):
        real(prog, *a, **kw)
        raise RuntimeError("the kernel failed")
    monkeypatch.setattr(_units.StepProgram, "run", fails)
    _grads(ps, 2)
    with pytest.raises(RuntimeError, match="the kernel failed"):
        opt.step()
    monkeypatch.undo()
    with pytest.raises(ss.StateStoreError, match="failed part-way"):
        opt.step()


def test_a_streaming_store_is_planned_unit_by_unit(tmp_path, monkeypatch):
    """NVMe: the planned step runs the store's pipeline over the planned units (several
    for the largest parameter) and gives the general bits."""
    calls = []
    a, b = _twins(_stores()["nvme"], tmp_path, monkeypatch)
    for step in range(4):
        _grads(a[0], step)
        _grads(b[0], step)
        a[1].step()
        _general(monkeypatch, b[1].step)
        prog = a[1]._remembered
        calls.append(prog is not None and prog.units is not None and len(prog.units[1]))
    _assert_same(a, b)
    assert calls[-1] and calls[-1] > 1, calls
    for (_, opt) in (a, b):
        opt.state_store.close()
def _python_calls(n_params: int) -> int:
    ps = _params(sizes=[16] * n_params)
    opt = CPUAdam(ps, lr=1e-2, state_store=ss.DeviceStore("cpu"))
    for step in range(3):
        _grads(ps, step)
        opt.step()
    _grads(ps, 3)
    calls = [0]

    def prof(frame, event, arg):
        calls[0] += event in ("call", "c_call")
    sys.setprofile(prof)
    try:
        opt.step()
    finally:
        sys.setprofile(None)
    assert opt.step_count(ps[0]) == 4
    return calls[0]


def test_a_planned_steps_python_work_does_not_grow_with_the_parameters():
    assert _python_calls(5) == _python_calls(300)


def test_layout_version_changes_with_the_states(tmp_path):
    for name, make in _stores().items():
        store = make(tmp_path / name)
        v = [store.layout_version]
        store.create("a/x", (3,))
        v.append(store.layout_version)
        store.put("a/x", torch.ones(3))
        assert store.layout_version == v[-1]        # values change, not the layout
        store.delete("a/x")
        v.append(store.layout_version)
        store.create("a/x", (3,))
        store.clear()
        v.append(store.layout_version)
        store.close()
        v.append(store.layout_version)
        assert all(x < y for x, y in zip(v, v[1:])), v


@pytest.mark.parametrize("after_units", [0, 1])
def test_a_read_failing_in_a_planned_streaming_step(after_units, tmp_path, monkeypatch):
    """NVMe, planned: a read failing before any unit changed raises and rolls the step
    counts back (the same step then succeeds and matches the general way); failing after a
    unit changed, the optimizer refuses to go on (its parameters hold two steps)."""
    import errno
    a, b = _twins(_stores()["nvme"], tmp_path, monkeypatch)
    for step in range(3):
        _grads(a[0], step)
        _grads(b[0], step)
        a[1].step()
        _general(monkeypatch, b[1].step)
    ps, opt = a
    assert opt._remembered is not None and opt._remembered.units is not None
    opt.state_store.cancel_prefetch()           # every read of the step comes after this
    engine, touched = opt.state_store.engine, [0]
    real = adam_mod._StoreAdam._touch

    def touch(self):
        if touched[0] == after_units:
            engine._inject_fault_for_testing(op="read", count=1000, err=errno.EIO)
        touched[0] += 1
        real(self)
    if after_units == 0:
        engine._inject_fault_for_testing(op="read", count=1000, err=errno.EIO)
    else:
        monkeypatch.setattr(adam_mod._StoreAdam, "_touch", touch)
    before = {k: opt.step_count(p) for k, p in enumerate(ps)}
    _grads(ps, 3)
    with pytest.raises(ss.StateStoreIOError):
        opt.step()
    engine._inject_fault_for_testing(op="read", count=0)
    monkeypatch.setattr(adam_mod._StoreAdam, "_touch", real)
    if after_units:
        with pytest.raises(ss.StateStoreError, match="failed part-way"):
            opt.step()
    else:
        assert {k: opt.step_count(p) for k, p in enumerate(ps)} == before
        opt.step()
        _grads(b[0], 3)
        _general(monkeypatch, b[1].step)
        _assert_same(a, b)
    for (_, o) in (a, b):
        o.state_store.close()


@pytest.mark.cuda
@pytest.mark.parametrize("kw", [{}, {"amsgrad": True}, {"moment_dtype": "int8"},
                                {"pdtype": torch.bfloat16}], ids=["fp32", "amsgrad", "int8m",
                                                                   "bf16p"])
def test_cuda_planned_steps_are_the_general_steps_bit_for_bit(kw, tmp_path, monkeypatch):
    """DeviceStore("cuda"): the plan's one table and one launch for every tensor of every
    group give the bits of the general way's launch per group (two groups here)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    runs = _Runs(monkeypatch)
    out = []
    for name in ("plan", "general"):
        ps = [nn.Parameter(p.detach().cuda()) for p in _params(kw.get("pdtype", torch.float32))]
        groups = [{"params": ps[:4]}, {"params": ps[4:], "lr": 3e-3, "weight_decay": 0.0}]
        opt = HybridAdam(groups, lr=1e-2, weight_decay=0.1, state_store=ss.DeviceStore("cuda"),
                         **{k: v for k, v in kw.items() if k != "pdtype"})
        out.append((ps, opt))
    for step in range(4):
        for (ps, opt), plan in zip(out, (True, False)):
            g = torch.Generator().manual_seed(100 + step)
            for p in ps:
                p.grad = (torch.randn(p.shape, generator=g) * 0.1).to(p.dtype).cuda()
            if plan:
                opt.step()
            else:
                _general(monkeypatch, opt.step)
    torch.cuda.synchronize()
    assert runs.n == 3
    _assert_same(out[0], out[1])

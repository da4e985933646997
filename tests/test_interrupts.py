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
import interrupt_helpers as I  # noqa: E402


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


# ------------------------------------------------------------ the contract after a failure
def _finish(opt, named, store, tmp_path, ck, final=6):
    """What must hold after an exception or Ctrl-C: either the optimizer refuses every call
    with the recovery message, and loading the last checkpoint ``ck`` into the same store
    (with its weights) and a new optimizer trains on exactly; or every parameter is at one
    step with its states that step's, and training goes on exactly (parameters left behind
    take that step's gradients). Either way ``final`` steps equal an uninterrupted run, and
    the store saves, verifies and loads into itself. Returns the problems found."""
    from statestore.checkpoint import verify_checkpoint
    problems = []
    if I.failed(opt):
        problems += I.refuses_everything(opt, store, str(tmp_path))
        named, opt, step = F.resume(store, ck)
    else:
        counts = {n: opt._steps.get(n, 0) for n, _ in named}
        problems += I.per_param_differences(named, store, counts, F.reference)
        step = max(counts.values())
        behind = [n for n, c in counts.items() if c < step]
        if behind:
            if any(counts[n] != step - 1 for n in behind):
                problems.append(f"step counts {counts}: more than one step apart")
            F.set_grads(named, step - 1)
            for n, p in named:
                if n not in behind:
                    p.grad = None
            opt.step()
            opt.zero_grad()
    F.train(opt, named, step, final - step)
    problems += F.differences(F.snapshot(named, store), F.reference(final))
    ck2 = str(tmp_path / "ck-after")
    store.save_checkpoint(ck2, progress=False)
    problems += [f"verify: {p}" for p in verify_checkpoint(ck2, progress=False)]
    store.load_checkpoint(ck2, progress=False)
    problems += F.differences(F.snapshot(named, store), F.reference(final), "state:")
    return problems


def _stepped_store(kind, tmp_path, steps=3, ck_at=2):
    store = _store(kind, tmp_path)
    named = F.make_params()
    opt = F.make_opt(named, store)
    F.train(opt, named, 0, ck_at)
    ck = str(tmp_path / "ck")
    F.save(store, named, ck, ck_at)
    F.train(opt, named, ck_at, steps - ck_at)
    return store, named, opt, ck


STEP_CODE = I.sources("optim/adam.py", "optim/_table.py", "optim/_units.py", "pipeline.py",
                      "_ring.py", "_inflight.py")


def _ctrl_c_in_step(kind, tmp_path, files, at, second_after=None):
    d = tmp_path / f"at-{at}"
    d.mkdir()
    store, named, opt, ck = _stepped_store(kind, d)
    F.set_grads(named, 3)
    r = I.interrupt(opt.step, files, at, second_after)
    if r.error is not None and not isinstance(r.error, KeyboardInterrupt):
        raise AssertionError(f"{r}: {r.error!r}") from r.error
    opt.zero_grad()
    try:
        problems = _finish(opt, named, store, d, ck)
    except Exception as e:
        problems = [f"after the interrupt: {type(e).__name__}: {e}"]
    store.close()
    return r, problems


def _lines(kind, tmp_path, files):
    """Line events of one step in ``files``."""
    d = tmp_path / "count"
    d.mkdir()
    store, named, opt, _ = _stepped_store(kind, d)
    F.set_grads(named, 3)
    n = I.interrupt(opt.step, files, None).lines
    store.close()
    return n


@pytest.mark.parametrize("kind", ["device"])
def test_ctrl_c_at_sampled_lines_of_a_step(kind, tmp_path):
    """Ctrl-C at sampled lines of step() (the optimizer's and the pipeline's code, one or two
    interrupts 10 ms apart): the optimizer is consistent or refuses with the recovery
    message, and training goes on (or resumes from the checkpoint) exactly."""
    total = _lines(kind, tmp_path, STEP_CODE)
    bad = []
    for i, at in enumerate(I.sample(total, 10, seed=29)):
        r, problems = _ctrl_c_in_step(kind, tmp_path, STEP_CODE, at,
                                      second_after=0.01 if i % 2 else None)
        if problems:
            bad.append(f"{r}: {problems[:4]}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("kind", ["device", "nvme"])
def test_ctrl_c_inside_the_step_count_advance(kind, tmp_path):
    """Ctrl-C at every line of the step counts' bookkeeping (ParamTable): never some counts
    advanced with the states not (before: counts {2: 901, 3: 99} saved, and a wrong bias
    correction next step)."""
    files = I.sources("optim/_table.py")
    total = _lines(kind, tmp_path, files)
    bad = []
    for at in range(1, total + 1):
        r, problems = _ctrl_c_in_step(kind, tmp_path, files, at)
        if problems:
            bad.append(f"{r}: {problems[:4]}")
    assert not bad, "\n".join(bad)

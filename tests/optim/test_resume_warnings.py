"""ResumeWarning: a checkpoint applied to a live optimizer says what it replaced that the
caller had set (the states of an optimizer that had stepped, a constructor hyperparameter),
and says nothing on the normal resume paths."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import statestore as ss
from statestore.optim import CPUAdam


def _param():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(8))
    w.grad = torch.randn(8)
    return w


@pytest.fixture()
def ckpt(tmp_path):
    w = _param()
    with ss.DeviceStore("cpu") as store:
        opt = CPUAdam([("w", w)], lr=1e-3, weight_decay=0.01, state_store=store)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
        opt.step()
        sched.step()            # the saved lr is 5e-4, its initial_lr 1e-3
        store.save_checkpoint(str(tmp_path / "c"))
    return str(tmp_path / "c"), w


def test_normal_resume_paths_say_nothing(ckpt):
    path, w = ckpt
    with warnings.catch_warnings():
        warnings.simplefilter("error", ss.ResumeWarning)
        with ss.DeviceStore("cpu") as store:        # load, then build with the same values
            store.load_checkpoint(path)
            opt = CPUAdam([("w", w)], lr=1e-3, weight_decay=0.01, state_store=store)
            assert opt.param_groups[0]["lr"] == 5e-4
        with ss.DeviceStore("cpu") as store:        # torch's order, with the scheduler
            opt = CPUAdam([("w", w)], lr=1e-3, weight_decay=0.01, state_store=store)
            torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
            store.load_checkpoint(path)
            assert opt.param_groups[0]["lr"] == 5e-4


def test_a_replaced_constructor_hyperparameter_warns(ckpt):
    path, w = ckpt
    with ss.DeviceStore("cpu") as store:
        store.load_checkpoint(path)
        with pytest.warns(ss.ResumeWarning, match=r"build the optimizer with the values it was "
                          r"saved with.*param group 0: lr 0\.003 -> 0\.001, weight_decay 0\.0 "
                          r"-> 0\.01") as rec:
            opt = CPUAdam([("w", w)], lr=3e-3, state_store=store)
        assert rec[0].filename == __file__          # attributed to the caller's line
        assert opt.param_groups[0]["weight_decay"] == 0.01      # the checkpoint's, applied
    with ss.DeviceStore("cpu") as store:            # torch's order
        opt = CPUAdam([("w", w)], lr=1e-3, betas=(0.8, 0.99), weight_decay=0.01,
                      state_store=store)
        with pytest.warns(ss.ResumeWarning, match=r"betas \(0\.8, 0\.99\) -> \(0\.9, 0\.999\)"):
            store.load_checkpoint(path)


def test_loading_under_an_optimizer_that_has_stepped_warns(ckpt):
    path, w = ckpt
    with ss.DeviceStore("cpu") as store:
        opt = CPUAdam([("w", w)], lr=1e-3, weight_decay=0.01, state_store=store)
        opt.step()
        opt.step()
        with pytest.warns(ss.ResumeWarning, match=r"had already stepped \(1 parameter\(s\), up "
                          r"to step 2\).*load before the first step"):
            store.load_checkpoint(path)
        assert opt.state[w]["step"] == 1                # the checkpoint's


def _first_step(path, w, *, scheduler, torch_order):
    """One resumed step from ``ckpt`` (saved at lr 5e-4 under LambdaLR(0.5 ** s)); returns
    the lr it ran at and the ResumeWarnings it raised."""
    with ss.DeviceStore("cpu") as store, warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always", ss.ResumeWarning)
        if not torch_order:
            store.load_checkpoint(path)
        opt = CPUAdam([("w", w)], lr=1e-3, weight_decay=0.01, state_store=store)
        if scheduler:
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
        if torch_order:
            store.load_checkpoint(path)
        if scheduler:
            sched.load_state_dict({**sched.state_dict(), "last_epoch": 1, "_step_count": 2})
        lr = opt.param_groups[0]["lr"]
        opt.step()
        return lr, [r for r in rec if issubclass(r.category, ss.ResumeWarning)]


def test_a_scheduler_built_after_a_load_first_resume_warns_at_the_first_step(ckpt):
    path, w = ckpt
    # load first, then the scheduler: it resets the lr to initial_lr * 0.5 ** 0 (torch's
    # optimizers do the same); the first step says so, naming torch's order
    lr, rec = _first_step(path, w, scheduler=True, torch_order=False)
    assert lr == 1e-3
    assert len(rec) == 1, [str(r.message) for r in rec]
    msg = str(rec[0].message)
    assert "resume in torch's order" in msg and "the checkpoint's lr 0.0005, now 0.001" in msg
    assert rec[0].filename == __file__
    # torch's order keeps the checkpoint's lr and says nothing; so does load-first without
    # a scheduler (the checkpoint's lr is used)
    for torch_order, scheduler in ((True, True), (False, False)):
        lr, rec = _first_step(path, w, scheduler=scheduler, torch_order=torch_order)
        assert lr == 5e-4 and rec == [], (torch_order, scheduler)

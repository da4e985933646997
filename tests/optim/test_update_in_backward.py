"""``update_in_backward=True``: parameters are updated from gradient hooks during backward,
``step()`` finishes the rest. The result must be bit-identical to the usual step after
backward on every store, and misuse (a gradient changed after it was applied, a second
backward before ``step()``, ``div_scale``) must raise instead of training on silently."""
from __future__ import annotations


import pytest
import torch

import statestore as ss
from statestore.optim import CPUAdam, HybridAdam

from helpers.stores import BACKEND_NAMES, TiedNet, make_store, wait_for_prefetch
from helpers.simstore import SimDiskStore

RESIDENT = ("device-cpu", "pinned", "file")


def _backward(model, step):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(300, (4, 12), generator=g)
    logits = model(ids, use_extra=(step != 2)).float()   # step 2: `extra` gets no gradient
    torch.nn.functional.cross_entropy(logits.reshape(-1, 300), ids.reshape(-1)).backward()


def _train(store, in_backward, steps=5, dtype=torch.float32, between=None, **kw):
    model = TiedNet(dtype)
    opt = HybridAdam(model.named_parameters(), lr=1e-2, weight_decay=0.1, state_store=store,
                     update_in_backward=in_backward, **kw)
    for step in range(steps):
        _backward(model, step)
        if between is not None:
            between(step, model, opt)
        opt.step()
        opt.zero_grad()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    states = {str(k): store.get(k).clone() for k in store.keys()}
    return weights, states, opt


def _same(a, b):
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_bit_identical_to_the_step_after_backward(backend, tmp_path):
    want = _train(make_store(backend, tmp_path / "a"), False)
    got = _train(make_store(backend, tmp_path / "b"), True)
    _same(got[0], want[0])
    _same(got[1], want[1])
    assert got[2]._steps == want[2]._steps
    for r in (want, got):
        r[2].state_store.close()


@pytest.mark.parametrize("backend", ["device-cpu", "nvme", "tiered"])
@pytest.mark.parametrize("dtype,kw", [(torch.bfloat16, {}), (torch.float32, {"amsgrad": True}),
                                      (torch.float32, {"adamw_mode": False})],
                         ids=["bf16-master", "amsgrad", "l2"])
def test_bit_identical_with_masters_amsgrad_and_l2(backend, dtype, kw, tmp_path):
    want = _train(make_store(backend, tmp_path / "a"), False, dtype=dtype, **kw)
    got = _train(make_store(backend, tmp_path / "b"), True, dtype=dtype, **kw)
    _same(got[0], want[0])
    _same(got[1], want[1])
    for r in (want, got):
        r[2].state_store.close()


@pytest.mark.parametrize("backend", ["device-cpu", "nvme", "tiered-nvme"])
def test_parameters_change_during_backward(backend, tmp_path):
    """From the second step on, backward itself updates the parameters (the first step
    learns the order in which backward finishes gradients)."""
    store = make_store(backend, tmp_path)
    model = TiedNet()
    opt = CPUAdam(model.named_parameters(), lr=1e-2, state_store=store, update_in_backward=True)
    try:
        for step in range(4):
            store.sync()                    # last step's writes are done, so pump()
            store.pump()                    # starts every prefetch read ...
            wait_for_prefetch(store)        # ... and they arrive
            before = {k: v.clone() for k, v in model.state_dict().items()}
            _backward(model, 0)
            changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
            if step == 0:
                assert changed == []
            else:
                assert changed, "nothing was updated during backward"
                if backend == "device-cpu":     # never waits for I/O: everything is done
                    assert sorted(changed) == sorted(before)
            opt.step()
            opt.zero_grad()
    finally:
        store.close()


def test_checkpoint_resume_is_bit_exact(tmp_path):
    """Save after a step, go on; a new store and optimizer loaded from the checkpoint and
    trained the same steps give the same bits."""
    ck = str(tmp_path / "ck")
    saved = {}
    store = ss.NVMeStore(str(tmp_path / "s1"), budget_bytes=1 << 20)
    model = TiedNet()
    opt = HybridAdam(model.named_parameters(), lr=1e-2, state_store=store, update_in_backward=True)
    for step in range(5):
        _backward(model, step)
        opt.step()
        opt.zero_grad()
        if step == 2:
            store.save_checkpoint(ck)
            saved = {k: v.clone() for k, v in model.state_dict().items()}
    want = {k: v.clone() for k, v in model.state_dict().items()}
    store.close()

    store2 = ss.NVMeStore(str(tmp_path / "s2"), budget_bytes=1 << 20)
    store2.load_checkpoint(ck)
    model2 = TiedNet()
    model2.load_state_dict(saved)
    opt2 = HybridAdam(model2.named_parameters(), lr=1e-2, state_store=store2,
                      update_in_backward=True)
    for step in range(3, 5):
        _backward(model2, step)
        opt2.step()
        opt2.zero_grad()
    _same({k: v for k, v in model2.state_dict().items()}, want)
    store2.close()


def test_a_gradient_changed_after_backward_raises(tmp_path):
    """Clipping that starts after backward already updated some parameters: step() updates
    the others from their current gradients (every parameter makes the step once), then
    raises; once the loop is fixed the next step works (it used to refuse every step)."""
    store = ss.DeviceStore("cpu")
    model = TiedNet()
    opt = CPUAdam(model.named_parameters(), lr=1e-2, state_store=store, update_in_backward=True)
    _backward(model, 0)
    opt.step()                                # step 0: nothing happens during backward
    opt.zero_grad()
    _backward(model, 1)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with pytest.raises(ss.StateStoreError, match="changed after backward.*next step"):
        opt.step()
    steps = {v["step"].item() for v in opt.state_dict()["state"].values()}
    assert steps == {2.0}                     # consistent: every parameter made step 2 once
    opt.zero_grad()
    _backward(model, 3)                       # the loop without clipping: steps work again
    opt.step()
    steps = {v["step"].item() for v in opt.state_dict()["state"].values()}
    assert steps == {3.0}


@pytest.mark.parametrize("how", ["data", "foreach_data"])
def test_changes_the_version_counter_misses_are_refused(how):
    """Changes that bump no version counter of the gradient (``grad.data.mul_()``, a foreach
    op on ``.data``; under FSDP2, foreach ops on DTensor gradients:
    ``tests/distributed/test_fsdp2_2d.py``) are refused as clipping is, after backward
    updated some parameters as before it did."""
    model = TiedNet()
    opt = CPUAdam(model.named_parameters(), lr=1e-2, update_in_backward=True)
    for step in range(3):
        _backward(model, step)
        if step == 0:
            opt.step()                  # plans the next steps: backward updates from then on
            opt.zero_grad()
            continue
        grads = [p.grad.data for p in model.parameters() if p.grad is not None]
        if step == 2:
            if how == "data":
                for g in grads:
                    g.mul_(0.5)
            else:
                torch._foreach_mul_(grads, 0.5)
            with pytest.raises(ss.StateStoreError, match="changed after backward"):
                opt.step()
        else:
            opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("misuse", ["clip", "accumulate"])
@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_misuse_is_refused_at_the_first_step_and_recoverable(backend, misuse, tmp_path):
    """A loop that clips or accumulates is refused at its first step() with nothing changed
    (backward is never interrupted); turning the mode off and calling step() again trains
    exactly as update_in_backward=False would have."""
    def after_backward(model, step):
        if misuse == "accumulate":
            _backward(model, step + 50)       # a second micro-batch
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-2)

    ref_w, _, _ = _train(make_store(backend, tmp_path / "a"), False, steps=4,
                         between=lambda step, m, o: after_backward(m, step))
    model = TiedNet()
    opt = HybridAdam(model.named_parameters(), lr=1e-2, weight_decay=0.1,
                     state_store=make_store(backend, tmp_path / "b"), update_in_backward=True)
    _backward(model, 0)
    after_backward(model, 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    word = "second gradient before step" if misuse == "accumulate" else "changed after backward"
    with pytest.raises(ss.StateStoreError, match=f"{word}.*Nothing was updated"):
        opt.step()
    _same(before, model.state_dict())
    assert len(opt.state) == 0
    opt.update_in_backward = False
    opt.step()
    opt.zero_grad()
    for step in range(1, 4):
        _backward(model, step)
        after_backward(model, step)
        opt.step()
        opt.zero_grad()
    _same(ref_w, model.state_dict())


def test_div_scale_is_refused():
    model = TiedNet()
    opt = CPUAdam(model.named_parameters(), lr=1e-2, update_in_backward=True)
    _backward(model, 0)
    with pytest.raises(ss.StateStoreValueError, match="div_scale"):
        opt.step(div_scale=2.0)


@pytest.mark.parametrize("kw,exc,match", [
    ({"update_in_backward": 1}, TypeError, "update_in_backward must be a bool"),
    ({"update_in_backward": True, "skip_nonfinite": True}, ValueError, "skip_nonfinite"),
    ({"update_in_backward": True, "process_group": object()}, ValueError, "process_group"),
])
def test_bad_arguments(kw, exc, match):
    with pytest.raises(exc, match=match):
        CPUAdam(TiedNet().parameters(), **kw)


def test_a_read_error_during_backward_surfaces_there_and_changes_nothing():
    """The step's first read fails: backward (or step(), when the read had not completed
    by the last gradient hook) raises the store's error, nothing was updated, and once the
    disk is back training goes on as if the failed step had never started."""
    store = SimDiskStore(budget_bytes=1 << 20)
    ref_store = SimDiskStore(budget_bytes=1 << 20)
    model, ref = TiedNet(), TiedNet()
    opt = CPUAdam(model.named_parameters(), lr=1e-2, state_store=store, update_in_backward=True)
    ref_opt = CPUAdam(ref.named_parameters(), lr=1e-2, state_store=ref_store)
    for m, o in ((model, opt), (ref, ref_opt)):
        _backward(m, 0)
        o.step()
        o.zero_grad()
    store.cancel_prefetch()
    store.fail_reads(once=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ss.StateStoreIOError):
        _backward(model, 1)     # raises here when the failed read completed in time ...
        opt.step()              # ... else here
    _same(model.state_dict(), before)
    opt.zero_grad()
    for step in (1, 2):
        for m, o in ((model, opt), (ref, ref_opt)):
            _backward(m, step)
            o.step()
            o.zero_grad()
    _same(model.state_dict(), ref.state_dict())
    store.close()
    ref_store.close()

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
import threading

import pytest
import torch

import statestore as ss
from statestore.optim import CPUAdam

from helpers import faults as F  # noqa: E402
from helpers import interrupts as I  # noqa: E402


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
    named, opt = F.trained(store, ck_at)
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


@pytest.mark.slow
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


# ------------------------------------------------------------ item 1: exceptions mid-backward
class _Boom(torch.autograd.Function):
    """Identity whose backward raises ``exc`` (the model failing part-way through backward:
    the layers above it have their gradients, those below never get them)."""

    @staticmethod
    def forward(ctx, x, exc):
        ctx.exc = exc
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ctx.exc("the model failed in backward")


class _Chain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Linear(32, 128)
        self.b = torch.nn.Linear(128, 128)
        self.c = torch.nn.Linear(128, 8)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)

    def forward(self, x, exc=None):
        h = self.a(x).relu()
        if exc is not None:
            h = _Boom.apply(h, exc)
        return self.c(self.b(h).relu())


def _backward(model, i, exc=None):
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(i))
    model(x, exc).pow(2).mean().backward()


def _optimizer(model, store, in_backward):
    return CPUAdam([{"params": list(model.a.named_parameters(prefix="a")), "lr": 1e-2},
                    {"params": list(model.b.named_parameters(prefix="b"))
                     + list(model.c.named_parameters(prefix="c")), "lr": 3e-3,
                     "weight_decay": 0.1}], state_store=store, update_in_backward=in_backward)


def _prefetched(store):
    """Let the next step's reads arrive, so that backward updates parameters."""
    from helpers.stores import wait_for_prefetch
    store.sync()
    store.pump()
    wait_for_prefetch(store)


def _state(model, store, opt):
    out = {f"param:{n}": p.detach().clone() for n, p in model.named_parameters()}
    out.update({f"state:{k}": store.get(k).clone() for k in store.keys()})
    return out, dict(opt._steps)


def _run(kind, tmp_path, in_backward, events, exc=RuntimeError):
    """Train ``_Chain`` through ``events``: an int i is a step on batch i; ("fail", i) a
    backward on batch i that raises ``exc`` part-way, caught; ("snap",) records the model's
    parameters; ("grads", i) a backward on
    batch i (no step); ("drop", names) drops the
    gradients of those parameters; "step" a step() with the gradients there are; "save" a
    checkpoint (verified); "zero" zero_grad(). Returns parameters, states and counts, and
    what the optimizer counted right after each failure."""
    from statestore.checkpoint import verify_checkpoint
    store = _store(kind, tmp_path)
    model = _Chain()
    opt = _optimizer(model, store, in_backward)
    after_fail = []
    for ev in events:
        if in_backward and not store.resident and (isinstance(ev, int) or ev[0] == "fail"):
            _prefetched(store)
        if isinstance(ev, int):
            _backward(model, ev)
            opt.step()
            opt.zero_grad()
        elif ev[0] == "fail":
            with pytest.raises(exc):
                _backward(model, ev[1], exc)
            after_fail.append(dict(opt._steps))
        elif ev[0] == "grads":
            _backward(model, ev[1])
        elif ev[0] == "drop":
            for n, p in model.named_parameters():
                if n in ev[1]:
                    p.grad = None
        elif ev == ("step",):
            opt.step()
            opt.zero_grad()
        elif ev == ("zero",):
            opt.zero_grad()
        elif ev == ("snap",):           # the model's parameters, before any other call
            after_fail.append(("snap", {n: p.detach().clone()
                                        for n, p in model.named_parameters()}))
        elif ev == ("save",):
            ck = str(tmp_path / "ck")
            store.save_checkpoint(ck, progress=False)
            assert verify_checkpoint(ck, progress=False) == []
            store.load_checkpoint(ck, progress=False)     # into the same store
            after_fail.append(("saved", F.states_of_checkpoint(ck)))
    out = _state(model, store, opt)
    store.close()
    return out, after_fail


def _assert_same(got, want):
    (gs, gc), (ws, wc) = got, want
    assert gc == wc
    assert gs.keys() == ws.keys()
    assert [k for k in ws if not torch.equal(gs[k], ws[k])] == []


def _as_if_only_early_had_gradients(tmp_path, counts, done, events):
    """The run update_in_backward=False gives when the failed step (after ``done`` steps)
    has gradients for the parameters backward updated before failing only."""
    behind = [n for n, c in counts.items() if c == done]
    return _run("device", tmp_path / "ref", False,
                list(range(done)) + [("grads", done), ("drop", behind), ("step",), ("snap",)]
                + events)


@pytest.mark.parametrize("kind", ["device", "nvme"])
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("then", ["retry", "save"])
def test_exception_mid_backward_ends_its_step(kind, exc, then, tmp_path):
    """The model raises (or Ctrl-C) in the middle of backward with update_in_backward: the
    parameters updated so far have made the step, the others have not, none is half
    updated; retrying the batch (or any later step) is a new step; a save right after
    verifies, loads back into the same store, and holds exactly that (before: the next
    step() blamed gradient accumulation, and on NVMe the save failed with 'pipeline deadlock
    (internal error)')."""
    after = [("save",)] if then == "save" else []
    got, seen = _run(kind, tmp_path / "got", True,
                     [0, 1, ("fail", 2), ("snap",)] + after + [("zero",), 2, 3], exc)
    counts = seen[0]
    assert set(counts.values()) <= {2, 3}, counts
    assert 3 in counts.values() or kind == "nvme", counts   # on disk: when the reads came
    want, ref_seen = _as_if_only_early_had_gradients(tmp_path, counts, 2, [2, 3])
    _assert_same(got, want)
    # as the exception reached the caller, no parameter was left half updated
    got_p, want_p = seen[1][1], ref_seen[0][1]
    assert [n for n in want_p if not torch.equal(got_p[n], want_p[n])] == []
    if then == "save":
        saved = seen[2][1]
        ref_ck, _ = _as_if_only_early_had_gradients(tmp_path / "ck", counts, 2, [])
        assert [k for k in saved if not torch.equal(saved[k], ref_ck[0][k])] == []


@pytest.mark.parametrize("kind", ["device", "nvme"])
def test_step_right_after_a_failed_backward_is_torchs_step(kind, tmp_path):
    """step() right after a failed backward updates what backward had not, from the
    gradients there are: what update_in_backward=False (torch's step) gives."""
    events = [0, 1, ("fail", 2), ("step",), 3]
    want, _ = _run("device", tmp_path / "ref", False, events)
    got, _ = _run(kind, tmp_path / "got", True, events)
    _assert_same(got, want)


BACKWARD_CODE = I.sources("optim/_in_backward.py", "optim/_backward_watch.py", "optim/adam.py",
                          "optim/_units.py", "optim/_table.py", "pipeline.py", "_ring.py",
                          "_inflight.py")


def _ctrl_c_in_backward(kind, tmp_path, at):
    """Steps 0 and 1, then a backward on batch 2 with SIGINT at its ``at``-th line in
    BACKWARD_CODE; then a new step 2 and step 3. Returns what was observed, the state
    reached and the counts right after the interrupt (None when it did not land)."""
    store = _store(kind, tmp_path)
    model = _Chain()
    opt = _optimizer(model, store, True)
    for i in range(2):
        if not store.resident:
            _prefetched(store)
        _backward(model, i)
        opt.step()
        opt.zero_grad()
    if not store.resident:
        _prefetched(store)
    r = I.interrupt(lambda: _backward(model, 2), BACKWARD_CODE, at)
    counts = dict(opt._steps)
    refused = I.failed(opt)
    if r.error is None:
        opt.step()
    opt.zero_grad()
    for i in (2, 3):
        _backward(model, i)
        opt.step()
        opt.zero_grad()
    out = _state(model, store, opt)
    store.close()
    return r, out, (counts if isinstance(r.error, KeyboardInterrupt) else None), refused


@pytest.mark.parametrize("kind", ["device", "nvme"])
def test_ctrl_c_at_sampled_lines_of_a_backward_that_updates(kind, tmp_path):
    """Ctrl-C at sampled lines of the optimizer's and the pipeline's code running in the
    gradient hooks of update_in_backward: the signal lands between hooks (deferred inside
    them), as a failure of backward: that step holds the parameters updated before it, the
    others did not step, the optimizer goes on (it never refuses) exactly as a run whose step
    had gradients for those parameters only."""
    total = _ctrl_c_in_backward(kind, tmp_path / "count", None)[0].lines
    bad, landed = [], 0
    for at in I.sample(total, 8, seed=1):
        d = tmp_path / f"at-{at}"
        r, got, counts, refused = _ctrl_c_in_backward(kind, d, at)
        if r.where is None:         # this run had fewer lines (disk stores poll the I/O)
            continue
        landed += 1
        if refused:
            bad.append(f"{r}: the optimizer refuses")
            continue
        if counts is None:
            bad.append(f"{r}: the interrupt did not reach the caller")
            continue
        want, _ = _as_if_only_early_had_gradients(d, counts, 2, [2, 3])
        if got[1] != want[1] or [k for k in want[0] if not torch.equal(got[0][k], want[0][k])]:
            bad.append(f"{r}: differs from the run with the early parameters' gradients only "
                       f"(counts {counts})")
    assert not bad, "\n".join(bad)
    assert landed >= 4


@pytest.mark.parametrize("kind", ["device", "nvme"])
def test_store_reads_and_reloads_right_after_a_failed_backward(kind, tmp_path):
    """Right after a backward that failed on another thread (as a CUDA backward runs: its
    read-ahead still holds the ring, nobody finished it yet), the store's other calls work:
    get() and load_checkpoint() of the last checkpoint into the same store (before, on NVMe:
    'pipeline deadlock (internal error)'); with the weights saved beside it, training then
    goes on exactly as if the failed step never happened."""
    store = _store(kind, tmp_path)
    model = _Chain()
    opt = _optimizer(model, store, True)
    for i in range(2):
        if not store.resident:
            _prefetched(store)
        _backward(model, i)
        opt.step()
        opt.zero_grad()
    ck = str(tmp_path / "ck")
    store.save_checkpoint(ck, progress=False)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    if not store.resident:
        _prefetched(store)
    errors = []

    def fail():
        try:
            _backward(model, 2, RuntimeError)
        except RuntimeError as e:
            errors.append(e)
    t = threading.Thread(target=fail)
    t.start()
    t.join(timeout=60)
    assert errors and not t.is_alive()
    assert opt._stepper.passes      # its read-ahead still holds the ring
    assert store.get("b.weight/exp_avg").shape == (128, 128)
    store.load_checkpoint(ck, progress=False)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
    opt.zero_grad()
    assert set(opt._steps.values()) == {2}
    for i in (2, 3):
        _backward(model, i)
        opt.step()
        opt.zero_grad()
    got = _state(model, store, opt)
    store.close()
    want, _ = _run("device", tmp_path / "ref", False, [0, 1, 2, 3])
    _assert_same(got, want)


# ------------------------------------------------------------ item 4: a failed load
def _flip_a_data_byte(ck):
    from statestore.checkpoint import read_manifest
    r = max(read_manifest(ck).rows, key=lambda r: r.nbytes)
    with open(os.path.join(ck, r.file), "r+b") as f:
        f.seek(r.offset + r.nbytes // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("kind", ["device", "nvme"])
@pytest.mark.parametrize("how", ["missing", "header", "checksum"])
def test_failed_load_into_a_live_optimizers_store(kind, how, tmp_path):
    """load_checkpoint failing into the store a live optimizer uses: refused before any
    tensor is read (no checkpoint, a damaged shard header), the store and optimizer stay as
    they were and training goes on exactly; failing later (a checksum mismatch) the store is
    empty and the optimizer refuses every call until a good load, after which it goes on
    exactly (before: the store was emptied in every case, the step counts reset, and the
    next step() silently restarted Adam from zero moments at step 1)."""
    store, named, opt, ck = _stepped_store(kind, tmp_path, steps=3, ck_at=2)
    bad = str(tmp_path / "bad")
    if how != "missing":
        store.save_checkpoint(bad, progress=False, link=False)
    if how == "header":
        from statestore.checkpoint import read_manifest
        shard = os.path.join(bad, read_manifest(bad).rows[0].file)
        with open(shard, "r+b") as f:
            f.seek(12)
            f.write(b"\x01")
    elif how == "checksum":
        _flip_a_data_byte(bad)
    before = F.snapshot(named, store)
    with pytest.raises(ss.StateStoreError):
        store.load_checkpoint(bad, progress=False)
    if how in ("missing", "header"):
        assert store.load_error is None
        assert F.differences(F.snapshot(named, store), before) == []
        F.train(opt, named, 3, 2)
        assert F.differences(F.snapshot(named, store), F.reference(5)) == []
        store.close()
        return
    assert len(store) == 0 and store.load_error is not None
    for call in (opt.step, opt.state_dict):
        with pytest.raises(ss.StateStoreError, match="load_checkpoint into its store failed"):
            call()
    assert set(opt._steps.values()) == {3}
    from safetensors.torch import load_file
    store.load_checkpoint(ck, progress=False)       # a good load: the same optimizer goes on
    weights = load_file(F.weights_path(ck, 2))
    with torch.no_grad():
        for n, p in named:
            p.copy_(weights[n])
    assert set(opt._steps.values()) == {2}
    F.train(opt, named, 2, 3)
    assert F.differences(F.snapshot(named, store), F.reference(5)) == []
    store.close()


# ------------------------------------------------------------ item 3: Ctrl-C in a save or a load
CHECKPOINT_CODE = I.sources("pipeline.py", "_ring.py", "_inflight.py", "_access.py", "_stream.py",
                            "_record.py", "store.py", "checkpoint/save.py", "checkpoint/writer.py",
                            "checkpoint/load.py", "checkpoint/stream.py",
                            "checkpoint/linked_load.py", "backends/nvme.py")


def _ctrl_c_in_checkpoint(tmp_path, what, at, second_after=None, link=True):
    """NVMe, 4 steps, the checkpoint of step 3 at ``ck``; then ``what`` ("save": step 4's
    save to ``ck``; "load": ``ck`` loaded into the store) with SIGINT at its ``at``-th line
    of CHECKPOINT_CODE. Afterwards the checkpoint at ``ck`` is step 3's or step 4's and
    verifies; the store reads every state; the optimizer steps on (or refuses saying how to
    recover, and recovers by loading ``ck``); the store saves, and loads into itself. Returns
    what was observed and the problems."""
    from statestore.checkpoint import verify_checkpoint
    d = tmp_path / f"{what}-{at}"
    d.mkdir(parents=True)
    store, named, opt, ck = _stepped_store("nvme", d, steps=4, ck_at=3)
    if what == "save":
        call = lambda: F.save(store, named, ck, 4, link=link)  # noqa: E731
    else:
        call = lambda: store.load_checkpoint(ck, progress=False, link=link)  # noqa: E731
    r = I.interrupt(call, CHECKPOINT_CODE, at, second_after)
    problems = []
    if r.error is not None and not isinstance(r.error, KeyboardInterrupt):
        problems.append(f"raised {r.error!r}")
    try:
        problems += [f"verify: {p}" for p in verify_checkpoint(ck, progress=False)]
        step = F.checkpoint_step(ck)
        problems += F.differences(F.states_of_checkpoint(ck), F.reference(step), "state:")
        for k in store.keys():
            store.get(k)
        if I.failed(opt) or opt._table.lost:
            problems += I.refuses_everything(opt, store, str(d))
            named, opt, step = F.resume(store, ck)
        else:       # as before the load (interrupted before it changed anything), or after
            counts = {n: opt._steps.get(n, 0) for n, _ in named}
            step = max(counts.values())
            if what == "save" and step != 4 or set(counts.values()) != {step}:
                problems.append(f"step counts {counts}")
            if what == "load" and step == 3:        # loaded: the weights go with it
                from safetensors.torch import load_file
                weights = load_file(F.weights_path(ck, 3))
                with torch.no_grad():
                    for n, p in named:
                        p.copy_(weights[n])
            problems += I.per_param_differences(named, store, counts, F.reference)
        F.train(opt, named, step, 6 - step)
        problems += F.differences(F.snapshot(named, store), F.reference(6))
        F.save(store, named, ck, 6, link=link)
        problems += [f"verify after: {p}" for p in verify_checkpoint(ck, progress=False)]
        store.load_checkpoint(ck, progress=False, link=link)
        problems += F.differences(F.snapshot(named, store), F.reference(6))
    except Exception as e:
        problems.append(f"after the interrupt: {type(e).__name__}: {e}")
    store.close()
    return r, problems


@pytest.mark.parametrize("what", ["save", "load"])
def test_ctrl_c_at_sampled_lines_of_a_save_or_load(what, tmp_path):
    """Ctrl-C (once, or twice 10 ms apart) at sampled lines of save_checkpoint and
    load_checkpoint on NVMe, the pipeline's clean-up included: the checkpoint is the previous
    or the new one and verifies, and get, step(), save_checkpoint and load_checkpoint into
    the same store all work (before: 2 to 5 of ~76 sampled lines wedged the store: every call
    failed with 'pipeline deadlock (internal error)')."""
    total = _ctrl_c_in_checkpoint(tmp_path / "count", what, None)[0].lines
    bad = []
    for i, at in enumerate(I.sample(total, 14, seed=3)):
        r, problems = _ctrl_c_in_checkpoint(tmp_path, what, at, 0.01 if i % 2 else None,
                                            link=bool(i % 3))
        if problems:
            bad.append(f"{r}: {problems[:3]}")
    assert not bad, "\n".join(bad)


def test_new_optimizer_on_a_store_emptied_after_a_failed_one(tmp_path, monkeypatch):
    """An optimizer whose step failed part-way refuses every call; once its store is emptied
    (store.clear(): no checkpoint to go back to yet) a new optimizer built on the store
    starts afresh and trains exactly (before: its constructor raised the old optimizer's
    refusal, and a store holding the mixed states still refuses to start a new one)."""
    import statestore.optim._units as units_mod
    monkeypatch.setenv("STATESTORE_STEP_PLAN", "0")     # the per-unit kernel calls fail
    store = ss.DeviceStore("cpu")
    named, opt = F.trained(store, 2)
    kernel, calls = units_mod.adam_step, [0]

    def second_unit_fails(*a, **kw):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("the kernel failed")
        return kernel(*a, **kw)

    monkeypatch.setattr(units_mod, "adam_step", second_unit_fails)
    F.set_grads(named, 2)
    with pytest.raises(RuntimeError, match="the kernel failed"):
        opt.step()
    monkeypatch.undo()
    assert I.failed(opt)
    with pytest.raises(ss.StateStoreError, match="failed part-way"):
        F.make_opt(F.make_params(), store)      # the mixed states are still there
    store.clear()
    named, opt = F.trained(store, 3)
    assert F.differences(F.snapshot(named, store), F.reference(3)) == []


def test_ctrl_c_at_the_commit_of_a_save_keeps_a_whole_checkpoint(tmp_path):
    """Ctrl-C at each of the last lines a save runs in its writer (the manifest's rename and
    what follows): the checkpoint at the path verifies and is the previous save or the new
    one (before: a Ctrl-C right after the manifest's rename had the failed save remove the
    shards the new manifest names, leaving neither checkpoint)."""
    from statestore.checkpoint import verify_checkpoint
    files = I.sources("checkpoint/writer.py", "checkpoint/filesystem.py")

    def stepped(sub):
        store = ss.DeviceStore("cpu")
        named, opt = F.trained(store, 2)
        ck = str(tmp_path / sub / "ck")
        store.save_checkpoint(ck, progress=False)
        F.train(opt, named, 2, 1)
        return store, ck

    store, ck = stepped("count")
    total = I.interrupt(lambda: store.save_checkpoint(ck, progress=False), files, None).lines
    bad = []
    for at in range(max(1, total - 50), total + 1):
        store, ck = stepped(f"at-{at}")
        r = I.interrupt(lambda: store.save_checkpoint(ck, progress=False), files, at)
        problems = verify_checkpoint(ck, progress=False)
        if not problems and F.checkpoint_step(ck) not in (2, 3):
            problems.append(f"step {F.checkpoint_step(ck)}")
        store.close()
        if problems:
            bad.append(f"{r}: {problems[:2]}")
    assert not bad, "\n".join(bad)


def test_ctrl_c_in_a_step_after_a_backward_that_updates(tmp_path):
    """update_in_backward: Ctrl-C at sampled lines of step() (the first ones, the last ones:
    the step's own bookkeeping), then the loop's zero_grad() and the next batches: the
    optimizer refuses with the recovery message, or trains on exactly (the parameters
    backward had updated made the step, the others did not). Before: zero_grad() kept the
    interrupted step open, and the next backward was refused as gradient accumulation."""
    import gc
    files = I.sources("optim/adam.py", "optim/_in_backward.py", "optim/_table.py",
                      "optim/_units.py")

    def stepped(d):
        store = _store("device", d)
        model = _Chain()
        opt = _optimizer(model, store, True)
        _backward(model, 0)
        opt.step()
        opt.zero_grad()
        _backward(model, 1)
        gc.collect()                # no optimizer of an earlier round finalized in the trace
        return store, model, opt

    total = I.interrupt(stepped(tmp_path / "count")[2].step, files, None).lines
    refs, bad = {}, []
    for at in [1, 2, 5] + list(range(total - 12, total + 1, 3)):
        store, model, opt = stepped(tmp_path / f"at-{at}")
        r = I.interrupt(opt.step, files, at)
        try:
            if I.failed(opt):
                bad += I.refuses_everything(opt, store, str(tmp_path / f"at-{at}"))
                continue
            opt.zero_grad()
            counts = {n: opt._steps.get(n, 0) for n, _ in model.named_parameters()}
            for i in (2, 3) if set(counts.values()) == {1} else (2,):
                _backward(model, i)
                opt.step()
                opt.zero_grad()
            key = tuple(sorted(counts.items()))
            if key not in refs:
                refs[key] = _as_if_only_early_had_gradients(tmp_path / f"ref-{at}", counts,
                                                            1, [2])[0] \
                    if set(counts.values()) != {1} else _run("device", tmp_path / "ref", False,
                                                             [0, 2, 3])[0]
            _assert_same(_state(model, store, opt), refs[key])
        except Exception as e:
            bad.append(f"{r}: {type(e).__name__}: {str(e)[:200]}")
    assert not bad, "\n".join(bad)


def test_ctrl_c_while_a_load_looks_for_the_manifest(tmp_path, monkeypatch):
    """A Ctrl-C while load_checkpoint looks for the manifest reaches the caller as
    KeyboardInterrupt, and the store is as it was (before: fsspec's local exists() swallowed
    it and the load said the checkpoint was missing; seen in the soak with SIGINT)."""
    store, named, opt, ck = _stepped_store("device", tmp_path, steps=3, ck_at=2)
    before = F.snapshot(named, store)
    real = os.stat

    def interrupted_stat(path, *a, **kw):
        if str(path).endswith("manifest.parquet"):
            raise KeyboardInterrupt
        return real(path, *a, **kw)

    monkeypatch.setattr(os, "stat", interrupted_stat)
    with pytest.raises(KeyboardInterrupt):
        store.load_checkpoint(ck, progress=False)
    monkeypatch.undo()
    assert F.differences(F.snapshot(named, store), before) == []
    store.load_checkpoint(ck, progress=False)
    assert set(opt._steps.values()) == {2}


def test_ctrl_c_while_the_manifest_is_written_stays_a_ctrl_c(tmp_path, monkeypatch):
    """A Ctrl-C landing in a call parquet's writer makes into the manifest's file object
    reaches the caller as KeyboardInterrupt, the previous checkpoint intact (before: pyarrow
    turned one in fsspec's `closed` into "ValueError: I/O operation on closed file", which
    ended a trainer of the 15-minute soak)."""
    from fsspec.implementations.local import LocalFileOpener
    from statestore.checkpoint import verify_checkpoint
    store, named, opt, ck = _stepped_store("device", tmp_path, steps=3, ck_at=2)
    real_closed, real_write = LocalFileOpener.closed, LocalFileOpener.write
    hits = []

    def first_call_interrupted(f):      # the first call into the manifest's file object
        if ".manifest.parquet." in str(f.path) and not hits:
            hits.append(f.path)
            raise KeyboardInterrupt

    def closed(self):
        first_call_interrupted(self)
        return real_closed.fget(self)

    def write(self, *a, **kw):
        first_call_interrupted(self)
        return real_write(self, *a, **kw)

    monkeypatch.setattr(LocalFileOpener, "closed", property(closed))
    monkeypatch.setattr(LocalFileOpener, "write", write)
    with pytest.raises(KeyboardInterrupt):
        store.save_checkpoint(ck, progress=False)
    monkeypatch.undo()
    assert hits and verify_checkpoint(ck, progress=False) == []
    assert F.checkpoint_step(ck) == 2
    store.save_checkpoint(ck, progress=False)
    assert F.checkpoint_step(ck) == 3


# ------------------------------------------ issue 47 item 7: Ctrl-C in a first step's creation
@pytest.mark.parametrize("kind,in_backward", [("device", False), ("device", True),
                                               ("nvme", True)],
                         ids=["device-step", "device-update_in_backward",
                              "nvme-update_in_backward"])
def test_ctrl_c_while_a_first_step_creates_the_states(kind, in_backward, tmp_path):
    """Ctrl-C at every line of the store's code during a first step(), which creates the
    states (a bf16 parameter's fp32 master from its value): the optimizer is consistent (every
    count 0, or every count 1) or refuses, and training on from there equals an uninterrupted
    run bit for bit. Before: a Ctrl-C after create_many made the states but before it wrote
    their initial values left the bf16 parameter's master zero with its count 0; the step
    made again took that zero as the master (the soak's open case, seed 2: the bf16 ``gate``
    and its states wrong from the step after)."""
    files = I.sources("store.py")

    def first_step(d):
        store = _store(kind, d)
        named = F.make_params()
        opt = F.make_opt(named, store)
        opt.update_in_backward = in_backward
        F.set_grads(named, 0)
        return store, named, opt

    store, _, opt = first_step(tmp_path / "count")
    total = I.interrupt(opt.step, files, None).lines
    store.close()
    bad = []
    # every line on a DeviceStore; on NVMe, the first 150 of about 1500 (the creation: the
    # rest is the pipeline's, which the sampled-line tests above cover)
    for at in range(1, total + 1) if kind == "device" else range(1, min(total, 150), 5):
        store, named, opt = first_step(tmp_path / f"at-{at}")
        r = I.interrupt(opt.step, files, at)
        try:
            opt.zero_grad()
            if I.failed(opt):
                bad += I.refuses_everything(opt, store, str(tmp_path / f"at-{at}"))
                continue
            counts = {opt._steps.get(n, 0) for n, _ in named}
            if len(counts) != 1:
                bad.append(f"{r}: counts {counts}")
                continue
            F.train(opt, named, counts.pop(), 2 - max(opt._steps.values(), default=0))
            problems = F.differences(F.snapshot(named, store), F.reference(2))
            if problems:
                bad.append(f"{r}: {problems[:4]}")
        except Exception as e:
            bad.append(f"{r}: {type(e).__name__}: {str(e)[:200]}")
        finally:
            store.close()
    assert not bad, "\n".join(bad)


def test_ctrl_c_while_a_first_step_creates_the_masters_of_offloaded_parameters():
    """The same for bf16 parameters kept by ``offload_parameters``: their masters are
    created, then written one at a time from the parameters' store. A Ctrl-C at any line of
    the store's and the planning code in the first step, then the step made again and one
    more: bit for bit the uninterrupted run (before: 80 of 686 lines left a zero master)."""
    files = I.sources("store.py", "optim/_plan.py")

    def setup():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        model = model.to(torch.bfloat16)
        handle = ss.offload_parameters(model, ss.DeviceStore("cpu"), prefetch=1)
        return model, handle, CPUAdam(model.named_parameters(), lr=1e-2,
                                      state_store=ss.DeviceStore("cpu"))

    def backward(model, i):
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(i))
        model(x.to(torch.bfloat16)).float().pow(2).sum().backward()

    def weights(model, handle):
        handle.close()
        return {k: v.clone() for k, v in model.state_dict().items()}

    model, handle, opt = setup()
    for i in range(2):
        backward(model, i)
        opt.step()
        opt.zero_grad()
    want = weights(model, handle)
    model, handle, opt = setup()
    backward(model, 0)
    total = I.interrupt(opt.step, files, None).lines
    handle.close()
    bad = []
    for at in range(1, total + 1, 10):
        model, handle, opt = setup()
        backward(model, 0)
        r = I.interrupt(opt.step, files, at)
        opt.zero_grad()
        if I.failed(opt):
            handle.close()
            continue
        counts = {opt._steps.get(n, 0) for n, _ in model.named_parameters()}
        for i in ((0, 1) if counts == {0} else (1,)):
            backward(model, i)
            opt.step()
            opt.zero_grad()
        got = weights(model, handle)
        if counts not in ({0}, {1}) or any(not torch.equal(got[k], want[k]) for k in want):
            bad.append(f"{r}: counts {counts}")
    assert not bad, "\n".join(bad)


def test_ctrl_c_as_a_save_drops_the_prefetch(tmp_path):
    """A Ctrl-C landing in the save's first pipeline as it drops the step's prefetch, just
    after taking it and before cancelling it, the exception kept: the store goes on (steps,
    saves and loads). Before, the prefetch's ring buffers stayed held by a pipeline only the
    exception's traceback reached, and the store's pipelines failed with BudgetError while it
    lived (test_ctrl_c_at_sampled_lines_of_a_save_or_load hit it now and then: its line
    counts vary with I/O timing)."""
    import inspect
    import signal as sig
    from statestore._access import PipelineAccess
    from statestore.checkpoint import verify_checkpoint

    src, first = inspect.getsourcelines(PipelineAccess.cancel_prefetch)
    line = first + next(i for i, t in enumerate(src) if "p.pipeline.cancel()" in t)
    path = inspect.getsourcefile(PipelineAccess)
    store, named, opt, ck = _stepped_store("nvme", tmp_path, steps=4, ck_at=3)
    assert store._access._prefetched is not None        # the step left its read-ahead

    def tracer(frame, event, arg):
        if frame.f_code.co_filename != path:
            return None

        def local(frame, event, arg):
            if event == "line" and frame.f_lineno == line:
                sys.settrace(None)
                sig.raise_signal(sig.SIGINT)
            return local
        return local

    old = sig.signal(sig.SIGINT, lambda s, f: (_ for _ in ()).throw(KeyboardInterrupt))
    try:
        sys.settrace(tracer)
        # the exception is kept (as a notebook or sys.last_value keeps it): its traceback
        # holds the frames, and so whatever a frame held
        with pytest.raises(KeyboardInterrupt) as held:
            F.save(store, named, ck, 4)
        sys.settrace(None)
    finally:
        sig.signal(sig.SIGINT, old)
    F.train(opt, named, 4, 2)
    assert F.differences(F.snapshot(named, store), F.reference(6)) == []
    F.save(store, named, ck, 6)
    assert verify_checkpoint(ck, progress=False) == []
    store.load_checkpoint(ck, progress=False)
    assert F.differences(F.snapshot(named, store), F.reference(6)) == []
    assert held.value.__traceback__ is not None
    store.close()


def test_a_ctrl_c_during_the_backward_watch_finalizer_reaches_the_caller():
    """A Ctrl-C while a dropped backward's finalizer runs (``_backward_watch._dropped``, a
    ``weakref.finalize`` callback: Python discards what a finalizer raises) is raised again
    once the finalizer has returned, in the code it interrupted; raised inside, it was lost
    (the 15-minute soak of 2026-11-28 lost 13, and two trainers went on without grad). In a
    process of its own: its SIGINT handler and deferral state are Python's defaults."""
    import subprocess

    from helpers import paths
    code = """
import os, signal, time, weakref
from statestore.optim import _backward_watch as W
def failed(sref, ran):          # the signal lands while the finalizer's work runs
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(100):
        pass
W._failed = failed
class Gone:
    pass
landed = "lost"
try:
    g = Gone()
    weakref.finalize(g, W._dropped, None, [False])
    del g                       # the finalizer runs here
    for _ in range(10000):      # the Ctrl-C lands in this loop
        time.sleep(0.0005)
except KeyboardInterrupt:
    landed = "caller"
print(landed)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=paths.env())
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "caller", r.stderr[-2000:]

def _ctrl_c_as_it_initializes(module: str) -> str:
    """Code that makes the import of the extension ``module`` take a Ctrl-C as it initializes,
    turned into ``ImportError`` as pybind11's init does (``real``: the loader to put back)."""
    return f"""
import os, signal, sys, _imp
assert {module!r} not in sys.modules
signal.signal(signal.SIGINT, signal.default_int_handler)
real = _imp.create_dynamic
def create_dynamic(spec, *args):
    if spec.name == {module!r}:
        try:
            os.kill(os.getpid(), signal.SIGINT)     # Ctrl-C as the module initializes
        except KeyboardInterrupt as e:              # what pybind11's init makes of it
            raise ImportError("initialization failed") from e
    return real(spec, *args)
_imp.create_dynamic = create_dynamic
"""


def test_a_ctrl_c_as_the_kernels_load_neither_is_lost_nor_changes_the_kernel():
    """A Ctrl-C while the compiled kernels' module initializes (the first step of a process
    imports it): pybind11 turns an exception raised in a module's init into
    ``ImportError("initialization failed")``, so the Ctrl-C was lost and the process took the
    kernels for missing and stepped with the vectorized torch reference for the rest of its
    life, whose rounding is not the compiled kernel's (the 15-minute soak of 2026-11-28,
    seed 1: a resumed trainer's every later step differed from the reference run by some
    bits, as did every checkpoint after). A retry cannot help (pybind11 then finds its types
    registered). The import runs with Ctrl-C deferred: the Ctrl-C reaches the caller after
    it, and the kernels are loaded. In a process of its own (the kernels not imported yet);
    the SIGINT is sent where the module's init runs, its KeyboardInterrupt turned into the
    ImportError as pybind11 does."""
    from helpers import forked
    code = _ctrl_c_as_it_initializes("statestore._C_adam") + """
from statestore.kernels import _dispatch, kernels_info
landed = "lost"
try:
    _dispatch.load_extension()
except KeyboardInterrupt:
    landed = "caller"
_imp.create_dynamic = real
print(landed, kernels_info()["cpu"], _dispatch._state["reason"])
"""
    r = forked.run(code, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[:2] == ["caller", "simd"], r.stdout + r.stderr[-2000:]


def test_a_ctrl_c_as_the_io_engine_loads_is_not_lost(tmp_path):
    """The same for the compiled I/O engine (`statestore._C_io`, imported with the package):
    a Ctrl-C as it initializes reaches the caller, and the process keeps the native engine
    instead of falling back to the thread engine for its life. A cold interpreter: every
    warm one has imported the package."""
    import subprocess
    code = _ctrl_c_as_it_initializes("statestore._C_io") + """
landed = "lost"
try:
    import statestore
except KeyboardInterrupt:
    landed = "caller"
_imp.create_dynamic = real
from statestore.io import _native
print(landed, _native.native is not None)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["caller", "True"], r.stdout + r.stderr[-2000:]


def test_a_closed_prefetch_is_never_handed_out(tmp_path):
    """A prefetch whose pipeline was closed while the store kept it: the next pipeline over
    its units reads afresh. Handed out, it yielded no unit, so a planned NVMe step ended as if
    made: every count advanced, no parameter or state updated, the optimizer not refusing
    (the signature of the two breaks of the fourth 15-minute soak, 2026-11-28)."""
    from statestore.optim import HybridAdam

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 4))

    ref_m, m = model(), model()
    ref = HybridAdam(ref_m.parameters(), lr=1e-2, state_store=ss.DeviceStore("cpu"))
    with ss.NVMeStore(str(tmp_path / "s"), budget_bytes=1 << 20) as store:
        opt = HybridAdam(m.parameters(), lr=1e-2, state_store=store)
        x = torch.randn(8, 16)
        for i in range(4):
            if i == 3:          # the prefetch of step 4, closed behind the store's back
                store._access._prefetched.pipeline.cancel()
            for net, o in ((ref_m, ref), (m, opt)):
                o.zero_grad()
                net(x).square().mean().backward()
                o.step()
        for a, b in zip(ref_m.parameters(), m.parameters()):
            assert torch.equal(a, b)
        assert set(opt._steps.values()) == {4}


def test_a_ctrl_c_as_a_prefetch_starts_leaves_no_ring_buffer_held(tmp_path, monkeypatch):
    """A Ctrl-C between a prefetch's pipeline starting its reads and the store keeping it (the
    15-minute soak of 2026-11-28, in a planned NVMe step): the pipeline is kept, so the next
    call cancels it; before, its ring buffers stayed held and every later call of the store
    failed with BudgetError."""
    import signal

    from statestore import _access
    from statestore._types import Slice

    real = _access.Prefetch

    def prefetch(*args):            # the Ctrl-C arrives as the pipeline is handed over
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(100):
            pass
        return real(*args)
    # Ctrl-C raises KeyboardInterrupt here, whatever an earlier test or the runner installed
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _prefetch_ctrl_c(tmp_path, monkeypatch, _access, Slice, prefetch, real)
    finally:
        signal.signal(signal.SIGINT, old)


def test_a_ctrl_c_as_a_prefetch_is_handed_out_leaves_no_ring_buffer_held(tmp_path):
    """A Ctrl-C as the store hands its prefetch to the step that asked (after the store let
    go of it, before the step has it: the fourth 15-minute soak's line-by-line sweep, 1 run in
    3): the prefetch is cancelled; before, its ring buffers stayed held by a pipeline no one
    could reach, and the store's next read failed with BudgetError."""
    import signal

    from statestore._types import Slice
    from statestore.pipeline import Pipeline

    class Interrupted(Pipeline):        # the Ctrl-C arrives as the hand-out sets `wait`
        def __setattr__(self, name, value):
            if name == "wait":
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(100):
                    pass
            super().__setattr__(name, value)

    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with ss.NVMeStore(str(tmp_path / "s"), budget_bytes=1 << 20) as store:
            n = 200_000                 # 800 KB: most of the 1 MiB ring
            store.create("w/m", (n,), torch.float32, torch.arange(n, dtype=torch.float32))
            store.sync()
            units = [[Slice("w/m", 0, n)]]
            store.prefetch(units, mode="rw")
            store._access._prefetched.pipeline.__class__ = Interrupted
            caught = False
            try:
                store.pipeline(units, mode="rw")
            except KeyboardInterrupt:   # handled while the exception (and its frames) lives on
                caught = True
                assert torch.equal(store.get("w/m"), torch.arange(n, dtype=torch.float32))
            assert caught
    finally:
        signal.signal(signal.SIGINT, old)


def _prefetch_ctrl_c(tmp_path, monkeypatch, _access, Slice, prefetch, real):
    with ss.NVMeStore(str(tmp_path / "s"), budget_bytes=1 << 20) as store:
        n = 200_000                 # 800 KB: most of the 1 MiB ring
        store.create("w/m", (n,), torch.float32, torch.arange(n, dtype=torch.float32))
        store.sync()
        monkeypatch.setattr(_access, "Prefetch", prefetch)
        caught = False
        try:
            store.prefetch([[Slice("w/m", 0, n)]], mode="rw")
        except KeyboardInterrupt:   # handled while the exception (and its frames) lives on
            caught = True
            monkeypatch.setattr(_access, "Prefetch", real)
            assert torch.equal(store.get("w/m"), torch.arange(n, dtype=torch.float32))
        assert caught


def _two_states_filling_the_ring(tmp_path):
    """An NVMe store of two 32 KiB states whose ring (64 KiB) one pipeline over both fills:
    (store, a, b, units)."""
    from statestore._types import Slice, StateKey
    n = 8 * 1024
    store = ss.NVMeStore(str(tmp_path), budget_bytes=64 * 1024)
    a, b = torch.randn(n), torch.randn(n)
    for key, value in (("a/exp_avg", a), ("b/exp_avg", b)):
        store.create(key, (n,))
        store.put(key, value)
    store.sync()                                    # the puts' ring buffers are free
    units = [[Slice(StateKey("a", "exp_avg"), 0, n)], [Slice(StateKey("b", "exp_avg"), 0, n)]]
    return store, a, b, units


def test_pipeline_interrupted_before_its_with_gives_its_buffers_back(tmp_path, monkeypatch):
    """A Ctrl-C between ``store.pipeline(...)`` returning and its ``with`` (raised at
    ``__enter__``'s first line: the soak of 2026-11-29, seed 2, in a planned NVMe step)
    leaves a pipeline whose reads started held by nothing but the exception's traceback,
    which the handler still has: a handler reading the store failed with BudgetError. The
    store's next pipeline takes an unused pipeline's buffers back, and the abandoned one
    refuses to be used."""
    from statestore.pipeline import Pipeline
    store, a, b, units = _two_states_filling_the_ring(tmp_path)

    def ctrl_c_at_first_line(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(Pipeline, "__enter__", ctrl_c_at_first_line)
    try:
        with store.pipeline(units, mode="rw"):
            pytest.fail("the with was entered")
    except KeyboardInterrupt:
        monkeypatch.undo()
        abandoned = sys.exc_info()[2].tb_next.tb_frame.f_locals["self"]
        assert not abandoned.closed
        assert torch.equal(store.get("a/exp_avg"), a)      # BudgetError before
    assert abandoned.closed
    with pytest.raises(ss.StateStoreClosedError, match="2 of its 2 units not handed out"):
        next(abandoned)
    with store.pipeline(units, mode="rw") as pipe:     # one in use keeps its buffers
        (first,) = next(pipe)
        with pytest.raises(ss.BudgetError, match="other pipelines of this store still open"):
            store.get("b/exp_avg")
        first.add_(1)
        for (t,) in pipe:
            t.add_(1)
    assert torch.equal(store.get("a/exp_avg"), a + 1) and torch.equal(store.get("b/exp_avg"), b + 1)
    store.close()


@pytest.mark.parametrize("where", ["step_failed", "__exit__"])
def test_ctrl_c_at_the_first_line_of_a_failed_steps_handling(tmp_path, monkeypatch, where):
    """A step fails before it changed anything, and a second Ctrl-C lands at the first line
    of its failure handling (``_Stepping.__exit__`` or ``ParamTable.step_failed``: the
    interpreter checks signals at a function's entry, before any of its code; the soak of
    2026-11-29, seed 0): the counts had advanced and nothing put them back, so the step made
    again used the next count. The next call finishes that handling first: the step made
    again is the first step of an optimizer never interrupted, bit for bit."""
    from statestore.optim import _table
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(64)) for _ in range(3)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    store = ss.NVMeStore(str(tmp_path))
    opt = CPUAdam(ps, lr=1e-2, weight_decay=0.01, state_store=store)
    ref_store = ss.NVMeStore(str(tmp_path / "ref"))
    ref_opt = CPUAdam(ref, lr=1e-2, weight_decay=0.01, state_store=ref_store)   # never cut
    for p, r in zip(ps, ref):
        p.grad = torch.randn(64)
        r.grad = p.grad.clone()
    real_pipeline = store.pipeline

    def failing_pipeline(*a, **k):                  # the step fails before any update
        monkeypatch.setattr(store, "pipeline", real_pipeline)
        raise KeyboardInterrupt

    target = _table.ParamTable if where == "step_failed" else _table._Stepping
    real = getattr(target, where)

    def ctrl_c_at_first_line(self, *a, **k):        # then its handling is cut at entry
        monkeypatch.setattr(target, where, real)
        raise KeyboardInterrupt

    monkeypatch.setattr(store, "pipeline", failing_pipeline)
    monkeypatch.setattr(target, where, ctrl_c_at_first_line)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    monkeypatch.undo()
    opt.step()                                      # the same step, made again
    ref_opt.step()
    for p, r in zip(ps, ref):
        assert torch.equal(p, r)
    assert float(opt.state_dict()["state"][0]["step"]) == 1
    store.close()
    ref_store.close()


def test_pipeline_interrupted_at_its_exit_gives_its_buffers_back(tmp_path, monkeypatch):
    """A Ctrl-C at the first line of a pipeline's ``__exit__`` (a second Ctrl-C as the first
    unwinds a step: the soak of 2026-11-29, seed 1) leaves it open, reachable from the
    exception's traceback only: the handler's load then failed with BudgetError. The store
    cancels a pipeline the exception unwound past (the unit in hand not written back, as
    ``__exit__`` would have); one a running frame still holds keeps its buffers."""
    from statestore.pipeline import StatePipeline
    store, a, b, units = _two_states_filling_the_ring(tmp_path)

    def step():
        with store.pipeline(units, mode="rw") as pipe:
            (t,) = next(pipe)
            t.add_(1)                               # not written back: the step fails
            raise KeyboardInterrupt

    def ctrl_c_at_first_line(self, *exc):
        raise KeyboardInterrupt

    monkeypatch.setattr(StatePipeline, "__exit__", ctrl_c_at_first_line)
    try:
        step()
    except KeyboardInterrupt:
        monkeypatch.undo()
        assert torch.equal(store.get("b/exp_avg"), b)      # BudgetError before
    assert torch.equal(store.get("a/exp_avg"), a)

    with store.pipeline(units, mode="rw") as pipe:     # a running frame holds this one
        (first,) = next(pipe)
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            with pytest.raises(ss.BudgetError, match="other pipelines of this store"):
                store.get("b/exp_avg")
        first.add_(2)
        for (t,) in pipe:
            t.add_(2)
    assert torch.equal(store.get("a/exp_avg"), a + 2)
    assert torch.equal(store.get("b/exp_avg"), b + 2)
    store.close()

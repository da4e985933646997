"""Training past RAM (docs/scale.md): gradients released during backward
(``release_grads``), ``state_dict()`` of disk stores as mapped snapshots of the store's
files, checkpoints loaded by linking their shards, and peak RSS of every phase bounded by the
parameters, the gradients and the store's budget (a ~100M-parameter model in a subprocess)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import statestore as ss
from statestore.optim import HybridAdam

from conftest import BACKEND_NAMES, make_store

HERE = os.path.dirname(os.path.abspath(__file__))


class _Stack(torch.nn.Module):
    """Layers whose gradients backward finishes one after another."""

    def __init__(self, dtype, n=6, d=96):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(n))
        self.to(dtype)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _batch(step, dtype):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 96, generator=g).to(dtype)


def _train(store, dtype, steps=4, seen=None, **kw):
    model = _Stack(dtype)
    opt = HybridAdam(model.named_parameters(), lr=1e-2, weight_decay=0.1, state_store=store,
                     **kw)
    for step in range(steps):
        model(_batch(step, dtype)).float().pow(2).mean().backward()
        if seen is not None:
            seen.append(sum(p.grad is not None for p in model.parameters()))
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}, \
        {str(k): store.get(k).clone() for k in store.keys()}, dict(opt._steps)


# ------------------------------------------------------------------ release_grads
@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_release_grads_is_bit_identical_and_frees_gradients(backend, dtype, tmp_path):
    want = _train(make_store(backend, tmp_path / "a"), dtype)
    seen = []
    got = _train(make_store(backend, tmp_path / "b"), dtype, seen=seen,
                 update_in_backward=True, release_grads=True)
    for a, b in zip(got, want):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == b[k] if isinstance(a[k], int) else torch.equal(a[k], b[k]), k
    # the first step keeps every gradient (nothing planned yet); later backwards release
    # every one they apply: all of them on resident stores (their states are always there),
    # on disk stores those whose states arrived in time (the rest stay within the budget)
    assert seen[0] == 12
    probe = make_store(backend, tmp_path / "c")
    resident = probe.resident
    probe.close()
    if resident:
        assert all(n == 0 for n in seen[1:]), seen


def test_release_grads_waits_for_the_disk_instead_of_holding_gradients(tmp_path):
    """A disk store with a tiny budget: gradients beyond it make backward wait for the
    states, so at most the budget's worth (plus one layer) is held at any time."""
    store = ss.NVMeStore(str(tmp_path / "s"), budget_bytes=64 << 10)
    model = _Stack(torch.float32, n=8, d=128)
    opt = HybridAdam(model.named_parameters(), lr=1e-2, state_store=store,
                     update_in_backward=True, release_grads=True)
    held = []

    def count(_):
        held.append(sum(p.grad.numel() * 4 for p in model.parameters() if p.grad is not None))
    hooks = [p.register_post_accumulate_grad_hook(count) for p in model.parameters()]
    for step in range(3):
        held.clear()
        model(torch.randn(8, 128, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    layer = 128 * 128 * 4 + 128 * 4
    assert max(held) <= (64 << 10) + 2 * layer, held
    for h in hooks:
        h.remove()
    store.close()


@pytest.mark.parametrize("kw,exc", [({"release_grads": True}, ValueError),
                                    ({"update_in_backward": True, "release_grads": 1}, TypeError)])
def test_release_grads_arguments(kw, exc):
    with pytest.raises(exc, match="release_grads"):
        HybridAdam([torch.nn.Parameter(torch.zeros(3))], **kw)

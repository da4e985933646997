"""Peak RSS of each phase of training a bf16 model of LAYERS x ``Linear(2048, 2048)`` (24 by
default: 100.7M parameters) with states on an NVMeStore, run in its own process by
tests/system/test_scale.py (RSS is per process).

    PYTHONPATH=. python tests/helpers/rss_worker.py DIR BUDGET_MIB [LAYERS]

Prints one JSON object: the model's parameter and gradient bytes and, per phase, the peak
RSS over the RSS before it (``VmHWM`` after ``/proc/self/clear_refs`` reset it, the heap
trimmed first so freed memory retained by the allocator cannot hide an allocation). The
optimizer over a disk store fixes glibc's mmap threshold (``statestore/_malloc.py``), so freed
blocks leave the RSS and each phase's peak is its live bytes.
"""
from __future__ import annotations

import ctypes
import gc
import json
import os
import sys

import torch

import statestore as ss  # noqa: E402
from statestore.optim import HybridAdam  # noqa: E402

WIDTH = 2048


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset() -> int:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


class Phase:
    def __init__(self, out: dict, name: str):
        self.out, self.name = out, name

    def __enter__(self):
        self.before = _reset()

    def __exit__(self, *exc):
        if exc[0] is None:
            self.out[self.name] = _status("VmHWM") - self.before


def _model(n_layers: int):
    torch.manual_seed(0)
    layers = []
    for _ in range(n_layers):
        lin = torch.nn.Linear(WIDTH, WIDTH, bias=False, dtype=torch.bfloat16)
        layers += [lin, torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _backward(model, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4, WIDTH, generator=g).to(torch.bfloat16)
    model(x).float().pow(2).mean().backward()


def main() -> None:
    d, budget = sys.argv[1], int(sys.argv[2]) << 20
    n_layers = int(sys.argv[3]) if len(sys.argv) > 3 else 24     # 24: 100.7M parameters
    torch.set_num_threads(1)
    out: dict = {}
    model = _model(n_layers)
    out["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    out["layer_bytes"] = WIDTH * WIDTH * 2

    # Steps after backward: gradients of the whole model are held by design.
    store = ss.NVMeStore(os.path.join(d, "a"), budget_bytes=budget)
    opt = HybridAdam(model.named_parameters(), lr=1e-3, state_store=store)
    _backward(model, 0)
    with Phase(out, "first step"):          # creates every state, masters from the params
        opt.step()
        store.sync()
    opt.zero_grad(set_to_none=True)
    with Phase(out, "save_checkpoint"):
        store.save_checkpoint(os.path.join(d, "ckpt"), progress=False)
    with Phase(out, "state_dict()"):
        sd = opt.state_dict()
    out["state_dict_bytes"] = sum(t.numel() * t.element_size() for s in sd["state"].values()
                                  for t in s.values() if t.dim())
    del sd, opt
    store.close()
    _backward(model, 1)                     # the gradients of the step after the resume
    with Phase(out, "load_checkpoint + optimizer + step"):
        store = ss.NVMeStore(os.path.join(d, "b"), budget_bytes=budget)
        store.load_checkpoint(os.path.join(d, "ckpt"), progress=False)
        opt = HybridAdam(model.named_parameters(), lr=1e-3, state_store=store)
        opt.step()
        store.sync()
    opt.zero_grad(set_to_none=True)
    del opt
    store.close()

    # update_in_backward + release_grads: the second step's backward keeps about a layer's
    # gradients, not the model's.
    store = ss.NVMeStore(os.path.join(d, "c"), budget_bytes=budget)
    opt = HybridAdam(model.named_parameters(), lr=1e-3, state_store=store,
                     update_in_backward=True, release_grads=True)
    _backward(model, 2)
    opt.step()
    opt.zero_grad(set_to_none=True)
    with Phase(out, "backward + step, release_grads"):
        _backward(model, 3)
        opt.step()
        store.sync()
    opt.zero_grad(set_to_none=True)
    store.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()

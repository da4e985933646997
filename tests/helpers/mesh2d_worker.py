"""Workers of the 2-D mesh tests (``tests/distributed/test_fsdp2_2d.py``): HSDP (``Replicate``
x ``Shard``) and FSDP x tensor parallel (``parallelize_module`` + ``fully_shard``) on a 2x2
mesh of 4 gloo ranks, then the checkpoints resumed on a 1-D mesh of 2. Each rank is started by
:func:`helpers.ranks.run_ranks`; rank 0 writes what the test checks into the output
directory."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import statestore as ss

from helpers import fsdp2_worker as W
from helpers.fsdp2_worker import _worker, full_params, full_states, write

K, N = 2, 4         # save at step K, train to step N
ADAMW = dict(lr=1e-2, weight_decay=0.05, amsgrad=True)


class TPNet(torch.nn.Module):
    """Column- then row-parallel linear layers (even tensor-parallel cuts, as DTensor's
    matmuls need; FSDP's cut of ``l1.weight``'s 3 rows is uneven)."""

    def __init__(self):
        super().__init__()
        self.l0 = torch.nn.Linear(5, 8)
        self.l1 = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.l1(torch.tanh(self.l0(x)))


class Matrices(torch.nn.Module):
    """Matrices only (Muon's parameters): uneven shards at 2 ranks (7 rows) and an empty one
    (1 row)."""

    def __init__(self):
        super().__init__()
        self.l0 = torch.nn.Linear(5, 7, bias=False)
        self.l1 = torch.nn.Linear(7, 9, bias=False)
        self.l2 = torch.nn.Linear(9, 1, bias=False)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(torch.tanh(self.l0(x)))))


MUON = dict(lr=2e-2, weight_decay=0.05, momentum=0.9)


def make(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return {"hsdp": lambda: W.Net().float(), "tp": TPNet, "muon": Matrices}[kind]()


#: classes keeping states not shaped like the parameter (per-parameter scalars, Adafactor's
#: row and column variances), over sharded matrices
OTHERS = {"NAdam": dict(lr=1e-2, weight_decay=0.05),
          "ASGD": dict(lr=1e-2, t0=2.0, weight_decay=0.05),
          "Adafactor": dict(lr=1e-2)}


def store_other(name: str, model, store):
    from statestore.optim import StoreOptimizer
    return StoreOptimizer(getattr(torch.optim, name), model.named_parameters(), **OTHERS[name],
                          state_store=store)


def store_muon(model, store):
    from statestore.optim import StoreOptimizer
    return StoreOptimizer(torch.optim.Muon, model.named_parameters(), **MUON, state_store=store)


def shard_2d(kind: str, model: torch.nn.Module, mesh) -> torch.nn.Module:
    """HSDP over ``mesh`` (replicate x shard), or TP over its "tp" dimension and FSDP over
    its "dp" one."""
    from torch.distributed.fsdp import fully_shard
    if kind == "hsdp":
        fully_shard(model, mesh=mesh)
        return model
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    parallelize_module(model, mesh["tp"], {"l0": ColwiseParallel(), "l1": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model


def hybrid(model, store, **kw):
    from statestore.optim import HybridAdam
    return HybridAdam(model.named_parameters(), **ADAMW, state_store=store, **kw)


def store_adamw(model, store):
    from statestore.optim import StoreOptimizer
    return StoreOptimizer(torch.optim.AdamW, model.named_parameters(), **ADAMW,
                          state_store=store)


def torch_adamw(model):
    return torch.optim.AdamW(model.named_parameters(), **ADAMW, foreach=False)


def locals_of(model) -> dict:
    return {n: p.to_local().detach().clone() for n, p in model.named_parameters()}


def _close(a: dict, b: dict, what: str) -> None:
    for n in b:
        torch.testing.assert_close(a[n], b[n], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{what} {n}: {m}")


def int8_close(got: dict, want: dict) -> None:
    """int8 moments re-quantized in other blocks against the saved ones: each value within
    one code step (3 mantissa bits: 1/16 relative to round) of the value, or of the new
    block's range floor (2**-14 of its largest, here 2**-12 of the tensor's largest)."""
    assert set(got) == set(want), set(got) ^ set(want)
    for k in want:
        a, b = got[k].float(), want[k].float()
        if k.endswith(("/exp_avg", "/exp_avg_sq")):
            tol = 0.07 * b.abs() + 2.0 ** -12 * b.abs().max()
            assert bool(((a - b).abs() <= tol).all()), (k, (a - b).abs().max())
        else:
            assert torch.equal(a, b), k


def refusals(mesh) -> None:
    """A Partial placement, and a strided shard that is not one box of the parameter, are
    refused naming the parameter and its placements."""
    import re
    from torch.distributed.tensor import DTensor, Partial, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    from statestore.optim import HybridAdam
    pp = torch.nn.Parameter(DTensor.from_local(torch.zeros(2, 3), mesh, [Partial(), Shard(0)]))
    ps = torch.nn.Parameter(DTensor.from_local(torch.zeros(2, 3), mesh,
                                               [_StridedShard(0, split_factor=2), Shard(1)],
                                               shape=(4, 6), stride=(6, 1)))
    for name, p, match in (("sum.w", pp, r"'sum.w' is a DTensor on a 2-D mesh .*Partial"),
                           ("s.w", ps, r"'s.w' .* not boxes of the parameter")):
        try:
            HybridAdam([(name, p)])
        except ss.StateStoreValueError as e:
            assert re.search(match, str(e)), str(e)
        else:
            raise AssertionError(f"not refused: {match}")


def _train_beside_torch(kind: str, mesh, out: str, rank: int) -> None:
    """``kind`` on the 2x2 mesh: HybridAdam on an NVMeStore per rank and StoreOptimizer(AdamW)
    beside torch's AdamW, the same batches; the store saved collectively at K (and the DCP
    checkpoint of ``get_optimizer_state_dict``); HybridAdam agrees with torch's AdamW to
    float32 rounding at every step, StoreOptimizer bit for bit; replicas of a shard hold the
    same states."""
    import torch.distributed.checkpoint as dcp
    ours = shard_2d(kind, make(kind), mesh)
    so = shard_2d(kind, make(kind), mesh)
    theirs = shard_2d(kind, make(kind), mesh)
    store = ss.NVMeStore(os.path.join(out, f"{kind}-store{rank}"))
    opt, sopt, topt = hybrid(ours, store), store_adamw(so, ss.DeviceStore("cpu")), \
        torch_adamw(theirs)
    for step in range(N):
        for m, o in ((ours, opt), (so, sopt), (theirs, topt)):
            W.forward(m, step).backward()
            o.step()
            o.zero_grad()
        want = locals_of(theirs)
        _close(locals_of(ours), want, f"{kind} HybridAdam step {step}")
        got = locals_of(so)
        for n in want:
            assert torch.equal(got[n], want[n]), f"{kind} StoreOptimizer step {step} {n}"
        if step == K - 1:
            store.save_checkpoint(os.path.join(out, f"{kind}-ckpt"), progress=False)
            dcp.save({"optim": W.dcp_optim(ours, opt)},
                     checkpoint_id=os.path.join(out, f"{kind}-dcp"))
            write(out, f"{kind}-weights_k.pt", full_params(ours))
            write(out, f"{kind}-states_k.pt", full_states(ours, opt))
            write(out, f"{kind}-torch_states_k.pt", full_states(theirs, topt))
    # replicas of one shard (equal regions on several ranks) hold equal states
    from statestore.optim._dtensor import region_of
    mine = {(n, region_of(p)): {k: v.to_local().clone() for k, v in opt.state[p].items()
                                if hasattr(v, "to_local")}
            for n, p in ours.named_parameters()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for other in every:
        for key, st in other.items():
            if key in mine:
                for s, v in st.items():
                    assert torch.equal(v, mine[key][s]), (key, s)
    write(out, f"{kind}-final.pt", {"params": full_params(ours),
                                    "states": full_states(ours, opt),
                                    "torch": full_states(theirs, topt)})
    store.close()


def clipping_refused(mesh) -> None:
    """``update_in_backward`` under HSDP: ``clip_grad_norm_`` (foreach, torch's default: its
    in-place ops on DTensor gradients bump no version counter) is refused at the first step
    with nothing updated, and, once backward updates parameters, at a later step after every
    parameter made it; on every rank (a rank whose shards are empty included)."""
    model = shard_2d("hsdp", make("hsdp"), mesh)
    opt = hybrid(model, ss.DeviceStore("cpu"), update_in_backward=True)
    for step in range(3):
        W.forward(model, step).backward()
        if step != 1:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            want = "Nothing was updated" if step == 0 else "every parameter made this step"
            try:
                opt.step()
            except ss.StateStoreError as e:
                assert "changed after backward" in str(e) and want in str(e), str(e)
            else:
                raise AssertionError(f"step {step}: clipping after backward not refused")
            if step == 0:
                opt.update_in_backward = False
                opt.step()
                opt.update_in_backward = True
        else:
            opt.step()
        opt.zero_grad()


def int8_saved(mesh, out: str) -> None:
    """HSDP with int8 moments trained to K and saved collectively (resharded in
    :func:`mesh1d`)."""
    model = shard_2d("hsdp", make("hsdp"), mesh)
    opt = hybrid(model, ss.DeviceStore("cpu"), moment_dtype="int8")
    W.train(model, opt, 0, K)
    opt.state_store.save_checkpoint(os.path.join(out, "hsdp8-ckpt"), progress=False)
    write(out, "hsdp8-states_k.pt", full_states(model, opt))


@_worker
def mesh2x2(rank: int, world: int, out: str) -> None:
    """At 4 ranks: the refusals, clipping refused with ``update_in_backward``
    (:func:`clipping_refused`), then HSDP and FSDP x TP beside torch's AdamW
    (:func:`_train_beside_torch`)."""
    from torch.distributed.device_mesh import init_device_mesh
    refusals(init_device_mesh("cpu", (2, 2)))
    clipping_refused(init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    _train_beside_torch("hsdp", hsdp, out, rank)
    int8_saved(hsdp, out)
    model = shard_2d("hsdp", make("muon"), hsdp)     # Muon gathered over a 2-D mesh
    W.train(model, store_muon(model, ss.DeviceStore("cpu")), 0, N)
    write(out, "muon-hsdp-final.pt", full_params(model))
    _train_beside_torch("tp", init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
                        out, rank)


@_worker
def mesh1d(rank: int, world: int, out: str) -> None:
    """At 2 ranks, a 1-D mesh (plain FSDP2): each 2x2 checkpoint resumed (the store loaded
    before the optimizer exists for HSDP, after it for FSDP x TP), its states at K equal to
    the 2x2 run's; trained on to N and saved again; the DCP checkpoint of the 2x2 run
    resumed into a HybridAdam."""
    from torch.distributed.fsdp import fully_shard
    for kind in ("hsdp", "tp"):
        model = make(kind)
        model.load_state_dict(torch.load(os.path.join(out, f"{kind}-weights_k.pt")))
        fully_shard(model)
        store = ss.NVMeStore(os.path.join(out, f"{kind}-1d-{rank}"))
        path = os.path.join(out, f"{kind}-ckpt")
        if kind == "hsdp":
            store.load_checkpoint(path, progress=False)
            opt = hybrid(model, store)
        else:
            opt = hybrid(model, store)
            store.load_checkpoint(path, progress=False)
        write(out, f"{kind}-1d-states_k.pt", full_states(model, opt))
        W.train(model, opt, K, N)
        store.save_checkpoint(os.path.join(out, f"{kind}-ckpt1d"), progress=False)
        write(out, f"{kind}-1d-final.pt", {"params": full_params(model),
                                          "states": full_states(model, opt)})
        store.close()
        model = make(kind)
        fully_shard(model)
        opt = hybrid(model, ss.DeviceStore("cpu"))
        W.dcp_load_optim(model, opt, os.path.join(out, f"{kind}-dcp"))
        write(out, f"{kind}-1d-dcp_states_k.pt", full_states(model, opt))
    model = make("hsdp")                # the 2x2 int8 checkpoint, re-quantized at 1-D 2
    fully_shard(model)
    store = ss.DeviceStore("cpu")
    store.load_checkpoint(os.path.join(out, "hsdp8-ckpt"), progress=False)
    write(out, "hsdp8-1d-states_k.pt", full_states(model, hybrid(model, store,
                                                                  moment_dtype="int8")))
    muon(rank, out)


def muon(rank: int, out: str) -> None:
    """StoreOptimizer(torch.optim.Muon) over FSDP2's sharded matrices (uneven and empty
    shards; NVMeStore per rank): trained to K, saved collectively, trained on to N; the same
    for NAdam, ASGD and Adafactor (:data:`OTHERS`)."""
    from torch.distributed.fsdp import fully_shard
    model = make("muon")
    fully_shard(model)
    store = ss.NVMeStore(os.path.join(out, f"muon-{rank}"))
    opt = store_muon(model, store)
    W.train(model, opt, 0, K)
    store.save_checkpoint(os.path.join(out, "muon-ckpt"), progress=False)
    write(out, "muon-weights_k.pt", full_params(model))
    W.train(model, opt, K, N)
    write(out, "muon-final.pt", {"params": full_params(model),
                                 "states": full_states(model, opt)})
    store.close()
    for name in OTHERS:
        model = make("muon")
        fully_shard(model)
        store = ss.NVMeStore(os.path.join(out, f"{name}-{rank}"))
        opt = store_other(name, model, store)
        W.train(model, opt, 0, K)
        store.save_checkpoint(os.path.join(out, f"{name}-ckpt"), progress=False)
        write(out, f"{name}-weights_k.pt", full_params(model))
        W.train(model, opt, K, N)
        write(out, f"{name}-final.pt", full_params(model))
        store.close()
    # the sharded NAdam checkpoint into plain (not sharded) parameters at 2 ranks: the store
    # loaded first takes this rank's rows, the optimizer then needs every state whole
    plain = make("muon")
    store = ss.DeviceStore("cpu")
    store.load_checkpoint(os.path.join(out, "NAdam-ckpt"), progress=False)
    opt = store_other("NAdam", plain, store)
    write(out, "NAdam-plain-states.pt", opt.state_dict()["state"])

"""Workers of the FSDP2 tests (``tests/distributed/test_fsdp2.py``): each runs in a process of a gloo
group on 127.0.0.1, started by :func:`helpers.ranks.run_ranks`, and writes what the test checks into files
of its output directory."""
from __future__ import annotations

import functools
import os
import traceback
import warnings

import torch
import torch.distributed as dist

import statestore as ss

from helpers.forked import exit_flushed
from helpers.ranks import free_port, run_ranks  # noqa: F401  (the FSDP2 tests start ranks here)


def _worker(fn):
    """A rank: joins the gloo group, runs ``fn``, leaves without interpreter finalization
    (gloo's threads have aborted finalizing processes now and then) once every rank is done."""
    @functools.wraps(fn)
    def run(rank: int, world: int, port: int, *args):
        warnings.simplefilter("ignore")
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)

        def body() -> None:
            fn(rank, world, *args)
            dist.barrier()
        _exit_after(body)
    return run


def _exit_after(body) -> None:
    """Run ``body()``, then leave the process without interpreter finalization
    (``helpers.forked.exit_flushed``): status 0, or 1 with the traceback on stderr if it
    raised (``SystemExit`` included)."""
    code = 1
    try:
        body()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        exit_flushed(code)


def run_example(rank: int, world: int, port: int, script: str, argv: list) -> None:
    """A rank of an example script (``main(argv)``), started by :func:`run_ranks` with the
    environment torchrun gives a rank; the script joins the group itself."""
    import runpy
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    _exit_after(lambda: runpy.run_path(script)["main"](argv))


# ------------------------------------------------------------------------------ FSDP2 training
K, N = 2, 4        # save at step K, train to step N


class Net(torch.nn.Module):
    """Uneven shapes (7 rows at 2 and 3 ranks; 1 row leaves ranks empty) and a bf16 layer
    (its states keep an fp32 master)."""

    def __init__(self):
        super().__init__()
        self.l0 = torch.nn.Linear(5, 7)
        self.l1 = torch.nn.Linear(7, 9).to(torch.bfloat16)
        self.l2 = torch.nn.Linear(9, 1)

    def forward(self, x):
        h = torch.tanh(self.l0(x))
        h = torch.tanh(self.l1(h.to(self.l1.weight.dtype))).float()
        return self.l2(h)


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return Net()


def forward(model, step: int) -> torch.Tensor:
    """The loss of ``step``'s batch: the same on every rank (so that the group's mean
    gradient is each rank's, exactly, at 1 and 2 ranks)."""
    g = torch.Generator().manual_seed(1000 + step)
    return model(torch.randn(6, 5, generator=g)).pow(2).mean()


def shard(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard
    fully_shard(model.l1)          # the bf16 layer: a param group of its own
    fully_shard(model)
    return model


def make_opt(model, store, **kw):
    from statestore.optim import HybridAdam
    return HybridAdam(model.named_parameters(), lr=1e-2, weight_decay=0.05, amsgrad=True,
                      state_store=store, **kw)


def train(model, opt, first: int, last: int) -> None:
    for step in range(first, last):
        forward(model, step).backward()
        opt.step()
        opt.zero_grad()


def full_params(model) -> dict:
    """Every parameter whole (collective: every rank calls it)."""
    out = {}
    for n, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[n] = t.detach().clone()
    return out


def full_states(model, opt) -> dict:
    """The optimizer's states whole, by ``name/state`` (collective), through DCP's
    ``get_optimizer_state_dict`` (full_state_dict=True): what torch's tooling sees."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_optimizer_state_dict)
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {f"{n}/{k}": (v.float() if k != "step" else v).clone()
            for n, st in osd["state"].items() for k, v in st.items()}


def write(out: str, name: str, obj) -> None:
    if dist.get_rank() == 0:
        torch.save(obj, os.path.join(out, name))


def result(model, opt) -> dict:
    """Whole parameters and states (collective)."""
    return {"params": full_params(model), "states": full_states(model, opt)}


def dcp_optim(model, opt):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    return get_optimizer_state_dict(model, opt)


def dcp_load_optim(model, opt, path: str) -> None:
    """Resume ``opt`` from a DCP checkpoint of an optimizer state dict: what torch's users
    write for torch's AdamW."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
    osd = dcp_optim(model, opt)
    dcp.load({"optim": osd}, checkpoint_id=path)
    set_optimizer_state_dict(model, opt, osd)


def refusals(rank: int, world: int) -> None:
    """A Partial placement on a 1-D mesh is refused, naming the parameter and the placement;
    so is ``process_group`` with DTensor parameters (2-D meshes: ``helpers.mesh2d_worker``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard
    from statestore.optim import HybridAdam
    mesh1 = init_device_mesh("cpu", (world,))
    pp = torch.nn.Parameter(DTensor.from_local(torch.zeros(2, 3), mesh1, [Partial()]))
    ps = torch.nn.Parameter(DTensor.from_local(torch.zeros(2, 3), mesh1, [Shard(0)]))
    for params, kw, match in (([("sum.w", pp)], {}, r"'sum.w' .* placement Partial\(sum\)"),
                              ([("w", ps)], {"process_group": dist.group.WORLD},
                               "leave process_group out")):
        try:
            HybridAdam(params, **kw)
        except ss.StateStoreValueError as e:
            import re
            assert re.search(match, str(e)), str(e)
        else:
            raise AssertionError(f"not refused: {match}")


def nonfinite_everywhere(rank: int) -> None:
    """``skip_nonfinite``: an inf in one rank's gradient shard skips the step on every rank."""
    model = shard(make_model())
    opt = make_opt(model, ss.DeviceStore("cpu"), skip_nonfinite=True)
    forward(model, 0).backward()
    if rank == 0:
        model.l0.weight.grad.to_local()[0, 0] = float("inf")
    opt.step()
    assert len(opt.state) == 0, "a rank stepped"
    opt.zero_grad()
    train(model, opt, 0, 1)
    assert len(opt.state) == 6


@_worker
def fsdp2_save(rank: int, world: int, out: str) -> None:
    """At 2 ranks: the refusals; ``skip_nonfinite`` agreeing across ranks; FSDP2 + HybridAdam (NVMeStore per rank, update_in_backward
    with release_grads) trained to K, saved collectively and through DCP, trained on to N;
    the same with int8 moments; torch's AdamW beside HybridAdam with clip_grad_norm_ on the
    DTensor gradients, and torch's states through DCP; StoreOptimizer's part
    (:func:`store_optimizer_part`). Rank 0 writes the results."""
    import torch.distributed.checkpoint as dcp
    refusals(rank, world)
    nonfinite_everywhere(rank)
    store_optimizer_part(rank, world, out)
    model = shard(make_model())
    store = ss.NVMeStore(os.path.join(out, f"store{rank}"))
    opt = make_opt(model, store, update_in_backward=True, release_grads=True)
    train(model, opt, 0, K)
    store.save_checkpoint(os.path.join(out, "ckpt"), progress=False)
    dcp.save({"optim": dcp_optim(model, opt)}, checkpoint_id=os.path.join(out, "dcp"))
    write(out, "weights_k.pt", full_params(model))
    write(out, "states_k.pt", full_states(model, opt))
    train(model, opt, K, N)
    write(out, "final2.pt", result(model, opt))
    store.close()

    model = shard(make_model())         # int8 moments: blockwise, saved per rank
    store = ss.NVMeStore(os.path.join(out, f"store8-{rank}"))
    opt = make_opt(model, store, moment_dtype="int8")
    train(model, opt, 0, K)
    store.save_checkpoint(os.path.join(out, "ckpt8"), progress=False)
    write(out, "weights_k8.pt", full_params(model))
    write(out, "states_k8.pt", full_states(model, opt))
    train(model, opt, K, N)
    write(out, "final8.pt", result(model, opt))
    store.close()

    # fp32 (torch's AdamW keeps no fp32 master of a bf16 layer); clip_grad_norm_ on DTensors
    ours, theirs = shard(make_model().float()), shard(make_model().float())
    opt = make_opt(ours, ss.DeviceStore("cpu"))
    topt = torch.optim.AdamW(theirs.named_parameters(), lr=1e-2, weight_decay=0.05, amsgrad=True,
                             foreach=False)
    for step in range(N):
        for m, o in ((ours, opt), (theirs, topt)):
            forward(m, step).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            o.step()
            o.zero_grad()
        if step == K - 1:
            dcp.save({"optim": dcp_optim(theirs, topt)},
                     checkpoint_id=os.path.join(out, "dcp_torch"))
            write(out, "torch_k.pt", full_states(theirs, topt))
    for (n, a), b in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(a.to_local(), b.to_local(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{n}: {m}")


@_worker
def fsdp2_resume3(rank: int, world: int, out: str) -> None:
    """At 3 ranks (other shards: 3/3/1 rows, empty ones): the 2-rank checkpoint resumed (the
    store loaded before the optimizer exists); the same from the DCP checkpoint; an
    unsharded checkpoint (one process's) resumed into FSDP2; torch's AdamW states loaded
    through DCP; and the int8 checkpoint resumed (its moments re-quantized in this rank's
    blocks)."""
    def fresh():
        model = make_model()
        model.load_state_dict(torch.load(os.path.join(out, "weights_k.pt")))
        return shard(model)
    for ckpt, name in (("ckpt", "final3.pt"), ("ckpt_plain", "final3_plain.pt")):
        model, store = fresh(), ss.NVMeStore(os.path.join(out, f"r3-{name}-{rank}"))
        store.load_checkpoint(os.path.join(out, ckpt), progress=False)
        opt = make_opt(model, store)
        train(model, opt, K, N)
        write(out, name, result(model, opt))
        store.close()
    model = fresh()
    opt = make_opt(model, ss.DeviceStore("cpu"))
    dcp_load_optim(model, opt, os.path.join(out, "dcp"))
    train(model, opt, K, N)
    write(out, "final3_dcp.pt", result(model, opt))
    model = shard(make_model().float())         # torch's AdamW states: an fp32 model's
    opt = make_opt(model, ss.DeviceStore("cpu"))
    dcp_load_optim(model, opt, os.path.join(out, "dcp_torch"))
    write(out, "torch_k3.pt", full_states(model, opt))
    model = make_model()                # int8 moments re-quantized in this rank's blocks
    model.load_state_dict(torch.load(os.path.join(out, "weights_k8.pt")))
    model = shard(model)
    store = ss.DeviceStore("cpu")
    store.load_checkpoint(os.path.join(out, "ckpt8"), progress=False)
    opt = make_opt(model, store, moment_dtype="int8")
    write(out, "states8_3.pt", full_states(model, opt))
    train(model, opt, K, N)
    write(out, "final8_3.pt", result(model, opt))


@_worker
def fsdp2_resume2(rank: int, world: int, out: str) -> None:
    """At 2 ranks again: the checkpoint resumed into an NVMeStore on its filesystem (each
    rank's shard taken by link), the optimizer built before the load (torch's order); the
    int8 checkpoint resumed; training through the staging path of CUDA parameters.
    Rank 0 writes the results (bit for bit those of the uninterrupted run)."""
    model = make_model()
    model.load_state_dict(torch.load(os.path.join(out, "weights_k.pt")))
    model = shard(model)
    store = ss.NVMeStore(os.path.join(out, f"r2-{rank}"))
    opt = make_opt(model, store)
    store.load_checkpoint(os.path.join(out, "ckpt"), progress=False)
    linked = [f for f in os.listdir(os.path.join(out, "ckpt")) if f"-r{rank:05d}-" in f
              and os.stat(os.path.join(out, "ckpt", f)).st_nlink > 1]
    write(out, "linked.txt", str(len(linked)))
    train(model, opt, K, N)
    write(out, "final2_resumed.pt", result(model, opt))
    store.close()
    model = make_model()
    model.load_state_dict(torch.load(os.path.join(out, "weights_k8.pt")))
    model = shard(model)
    store = ss.DeviceStore("cpu")
    store.load_checkpoint(os.path.join(out, "ckpt8"), progress=False)
    opt = make_opt(model, store, moment_dtype="int8")
    train(model, opt, K, N)
    write(out, "final8_resumed.pt", result(model, opt))

    # the data path of CUDA parameters over host stores (docs/gpu.md), run on the CPU by
    # tests/helpers/deferred_lane.py: staged gradients and uploads of each rank's local shards
    from helpers import deferred_lane
    from helpers.deferred_lane import DeferredLane
    model = shard(make_model())
    opt = make_opt(model, ss.DeviceStore("cpu"))
    path = deferred_lane.install(opt, DeferredLane)
    train(model, opt, 0, N)
    write(out, "final2_offload.pt", dict(result(model, opt), staged=path.stats()))


# ------------------------------------------------------------------------------ StoreOptimizer
def make_store_opt(model, store):
    from statestore.optim import StoreOptimizer
    return StoreOptimizer(torch.optim.RMSprop, model.named_parameters(), **RMSPROP,
                          state_store=store)


RMSPROP = dict(lr=1e-2, weight_decay=0.05, momentum=0.9, centered=True)


def store_optimizer_part(rank: int, world: int, out: str) -> None:
    """At 2 ranks: StoreOptimizer(RMSprop, centered, momentum) over FSDP2's DTensor
    parameters on an NVMeStore per rank, trained to K, saved collectively, trained on to N;
    the states through DCP's ``get_optimizer_state_dict`` (Muon, NAdam, ASGD, Adafactor:
    ``helpers.mesh2d_worker.muon``)."""
    model = shard(make_model())
    store = ss.NVMeStore(os.path.join(out, f"so{rank}"))
    opt = make_store_opt(model, store)
    train(model, opt, 0, K)
    store.save_checkpoint(os.path.join(out, "so_ckpt"), progress=False)
    write(out, "so_weights_k.pt", full_params(model))
    write(out, "so_states_k.pt", full_states(model, opt))
    train(model, opt, K, N)
    write(out, "so_final.pt", result(model, opt))
    store.close()

"""Worker of the multi-process tests: run by ``torch.multiprocessing.spawn`` from
tests/distributed/test_distributed.py (module-level functions, so they can be pickled)."""
from __future__ import annotations

import functools
import os
import sys
import warnings

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import statestore as ss
from statestore.optim import CPUAdam

FEATURES = (8, 16, 12, 4)


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(FEATURES[:-1], FEATURES[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def batch(step: int, n: int = 12):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(n, FEATURES[0], generator=g)
    return x, torch.cos(x[:, :FEATURES[-1]])


def train(model, opt, first, last, rank=0, world=1, full=False):
    """Steps ``first..last-1``; each rank takes its slice of the batch, or (``full``) the whole
    batch, which makes the averaged gradient of 1 or 2 ranks bit-identical to one process's."""
    for step in range(first, last):
        x, y = batch(step)
        per = x.shape[0] // world
        xs, ys = (x, y) if full else (x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        loss = torch.nn.functional.mse_loss(model(xs), ys)
        opt.zero_grad()
        loss.backward()
        opt.step()


def make_store(kind: str, directory: str):
    if kind == "nvme" and hasattr(ss, "NVMeStore"):
        return ss.NVMeStore(directory)
    if kind in ("file", "nvme"):
        return ss.FileStore(directory)
    return ss.DeviceStore("cpu")


def _done() -> None:
    """Every rank has finished its collectives: only then tear the group down (gloo aborts a
    process now and then with "terminate called without an active exception" when one rank
    destroys the group while a peer is still using its connection)."""
    dist.barrier()


def _exit_without_finalizing(fn):
    """A worker that returned (its results are in files, its group destroyed) leaves with
    ``os._exit(0)``: interpreter finalization after gloo has run aborted a worker now and
    then with "terminate called without an active exception" (seen in CI once in a few
    hundred workers; pytorch/pytorch#179291 describes gloo's threads releasing tensors at
    finalization). A worker that raised exits as usual, with its traceback."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        fn(*args, **kwargs)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return run


def _init(rank: int, world: int, port: int) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)


@_exit_without_finalizing
def sharded_train(rank: int, world: int, port: int, out: str, kind: str, steps: int) -> None:
    """Train with states sharded over the group; rank 0 saves the final parameters."""
    _init(rank, world, port)
    try:
        model = make_model()
        store = make_store(kind, os.path.join(out, f"rank{rank}"))
        opt = CPUAdam(model.named_parameters(), lr=1e-2, weight_decay=0.05, state_store=store,
                      process_group=dist.group.WORLD)
        train(model, opt, 0, steps, rank, world)
        owned = sorted({k.param for k in store.keys()})
        with open(os.path.join(out, f"owned{rank}.txt"), "w") as f:
            f.write("\n".join(owned))
        if rank == 0:
            save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                      os.path.join(out, "params.safetensors"))
        store.close()
        _done()
    finally:
        dist.destroy_process_group()


def _save_params(model, path: str) -> None:
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, path)


def _load_params(model, path: str) -> None:
    model.load_state_dict(load_file(path))


@_exit_without_finalizing
def save_sharded(rank: int, world: int, port: int, out: str, kind: str, k: int, n: int) -> None:
    """Train ``k`` steps sharded over ``world`` ranks, save one checkpoint collectively, train
    on to ``n``; rank 0 keeps the parameters at ``k`` and at ``n``."""
    _init(rank, world, port)
    try:
        model = make_model()
        store = make_store(kind, os.path.join(out, f"a{world}-rank{rank}"))
        opt = CPUAdam(model.named_parameters(), lr=1e-2, weight_decay=0.05, state_store=store,
                      process_group=dist.group.WORLD)
        train(model, opt, 0, k, rank, world, full=True)
        store.save_checkpoint(os.path.join(out, "ckpt"))
        # torch.distributed.checkpoint saves the torch-format shard of each rank (state_dict()
        # refuses a shard: shard_state_dict() marks it as one)
        import torch.distributed.checkpoint as dcp
        dcp.save({"optim": opt.shard_state_dict()}, checkpoint_id=os.path.join(out, "dcp"))
        if rank == 0:
            _save_params(model, os.path.join(out, f"params{k}.safetensors"))
        train(model, opt, k, n, rank, world, full=True)
        if rank == 0:
            _save_params(model, os.path.join(out, f"a{world}-final.safetensors"))
        store.close()
        _done()
    finally:
        dist.destroy_process_group()


@_exit_without_finalizing
def resume_sharded(rank: int, world: int, port: int, out: str, kind: str, k: int, n: int) -> None:
    """Every rank loads ``out/ckpt`` (saved at any world size) into its own store before
    building its sharded optimizer, trains from ``k`` to ``n`` and saves collectively."""
    _init(rank, world, port)
    try:
        model = make_model()
        _load_params(model, os.path.join(out, f"params{k}.safetensors"))
        store = make_store(kind, os.path.join(out, f"b{world}-rank{rank}"))
        store.load_checkpoint(os.path.join(out, "ckpt"))
        with open(os.path.join(out, f"b{world}-loaded{rank}.txt"), "w") as f:
            f.write(f"{store.stats()['nbytes']}\n" + "\n".join(str(k_) for k_ in store.keys()))
        try:                             # a lone rank cannot save a shard as a checkpoint
            store.save_checkpoint(os.path.join(out, f"lone{rank}"), process_group=None)
            lone = "saved"
        except ss.CheckpointError as e:
            lone = str(e)
        with open(os.path.join(out, f"b{world}-lone{rank}.txt"), "w") as f:
            f.write(lone)
        # An optimizer that is not sharded (replicated data parallel) fetches the rest.
        with ss.DeviceStore("cpu") as full:
            full.load_checkpoint(os.path.join(out, "ckpt"))
            part = len(full)
            CPUAdam(make_model().named_parameters(), state_store=full)
            with open(os.path.join(out, f"b{world}-replicated{rank}.txt"), "w") as f:
                f.write(f"{part} {len(full)}")
        opt = CPUAdam(model.named_parameters(), lr=1e-2, weight_decay=0.05, state_store=store,
                      process_group=dist.group.WORLD)
        train(model, opt, k, n, rank, world, full=True)
        store.save_checkpoint(os.path.join(out, f"b{world}-end"))
        if rank == 0:
            _save_params(model, os.path.join(out, f"b{world}-final.safetensors"))
        store.close()
        _done()
    finally:
        dist.destroy_process_group()


def killed_mid_save(rank: int, world: int, port: int, out: str, kind: str) -> None:
    """Save a good checkpoint, step once more, then start a second save into the same path
    during which rank 1 is SIGKILLed after writing its first shard."""
    import signal
    from statestore.checkpoint import writer as ckpt_writer
    _init(rank, world, port)
    try:
        model = make_model()
        store = make_store(kind, os.path.join(out, f"k-rank{rank}"))
        opt = CPUAdam(model.named_parameters(), lr=1e-2, state_store=store,
                      process_group=dist.group.WORLD)
        train(model, opt, 0, 2, rank, world)
        store.save_checkpoint(os.path.join(out, "ckpt"), shard_bytes=512)
        dist.barrier()
        with open(os.path.join(out, f"saved{rank}"), "w") as f:
            f.write("ok")
        # one rank failing before it writes anything fails the save on every rank
        try:
            store.save_checkpoint(os.path.join(out, "ckpt"),
                                  metadata={"bad": object()} if rank == 1 else None)
            early = "saved"
        except ss.StateStoreError as e:
            early = f"{type(e).__name__}: {e}"
        with open(os.path.join(out, f"early{rank}.txt"), "w") as f:
            f.write(early)
        train(model, opt, 2, 3, rank, world)
        if rank == 1:
            real_commit = ckpt_writer.commit

            def commit_then_die(fs, f, tmp, final, then=None):
                real_commit(fs, f, tmp, final, then)
                os.kill(os.getpid(), signal.SIGKILL)
            ckpt_writer.commit = commit_then_die
        store.save_checkpoint(os.path.join(out, "ckpt"), shard_bytes=512)
        with open(os.path.join(out, f"second-save-returned{rank}"), "w") as f:
            f.write("unexpected")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@_exit_without_finalizing
def store_optimizer_sharded(rank: int, world: int, port: int, out: str, k: int,
                            n: int) -> None:
    """StoreOptimizer(Adafactor) sharded over ``world`` ranks on NVMe stores, every rank on
    the full batch (the averaged gradient is then the batch's, bit for bit): one checkpoint
    saved collectively at ``k``, training on to ``n``; rank 0 keeps the parameters at ``k``
    and ``n``."""
    from statestore.optim import StoreOptimizer
    _init(rank, world, port)
    try:
        model = make_model()
        store = make_store("nvme", os.path.join(out, f"rank{rank}"))
        opt = StoreOptimizer(torch.optim.Adafactor, model.named_parameters(), lr=1e-2,
                             state_store=store, process_group=dist.group.WORLD)
        train(model, opt, 0, k, rank, world, full=True)
        store.save_checkpoint(os.path.join(out, "ckpt"))
        if rank == 0:
            _save_params(model, os.path.join(out, "at_k.safetensors"))
        train(model, opt, k, n, rank, world, full=True)
        if rank == 0:
            _save_params(model, os.path.join(out, "at_n.safetensors"))
        store.close()
        _done()
    finally:
        dist.destroy_process_group()

"""Workers of the FSDP2 tests (``tests/test_fsdp2.py``): each runs in a process of a gloo
group on 127.0.0.1, started by :func:`run_ranks`, and writes what the test checks into files
of its output directory."""
from __future__ import annotations

import functools
import os
import socket
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import statestore as ss
from statestore._regions import Region, chunk_region

#: the tensors of the bare-store checkpoint test: name -> global shape (dims not divisible by
#: 2 or 3: uneven shards; (2, 1) at 3 ranks: an empty shard)
BARE = {"a": (7, 3), "b": (5,), "c": (2, 1)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(fn, world: int, *args, timeout: float = 120.0) -> None:
    """Run ``fn(rank, world, port, *args)`` in ``world`` new processes and wait for all, at
    most ``timeout`` seconds (then they are killed and the test fails)."""
    # forkserver: one server process imports torch once and forks every rank from it,
    # seconds faster per rank than a fresh interpreter each. Only torch: the server starts
    # before the test's sys.path applies, so statestore would come from wherever the
    # interpreter finds it first (an installed copy), not from this tree.
    mp.set_forkserver_preload(["torch"])
    ctx = mp.start_processes(fn, args=(world, free_port()) + args, nprocs=world, join=False,
                             start_method="forkserver")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{fn.__name__}: ranks still running after {timeout} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def _worker(fn):
    """A rank: joins the gloo group, runs ``fn``, leaves without interpreter finalization
    (gloo's threads have aborted finalizing processes now and then) once every rank is done."""
    @functools.wraps(fn)
    def run(rank: int, world: int, port: int, *args):
        warnings.simplefilter("ignore")
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        try:
            fn(rank, world, *args)
            dist.barrier()
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return run


def bare_full(name: str) -> torch.Tensor:
    """The whole tensor ``name`` of :data:`BARE`, as every rank computes it."""
    shape = BARE[name]
    base = 100.0 * list(BARE).index(name)
    return base + torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


def cut(t: torch.Tensor, r: Region) -> torch.Tensor:
    return t[tuple(slice(o, o + n) for o, n in zip(r.offsets, r.shape))]


@_worker
def bare_save(rank: int, world: int, path: str) -> None:
    """Each rank keeps its ``Shard(0)`` region of ``a``/``b``/``c`` (``exp_avg`` fp32,
    ``master`` as bf16) and a replicated ``r``, records the regions, and saves collectively."""
    store = ss.NVMeStore(f"{path}-store{rank}")
    regions = {}
    for name in BARE:
        reg = chunk_region(BARE[name], 0, rank, world)
        regions[name] = reg
        store.create((name, "exp_avg"), reg.shape, torch.float32, cut(bare_full(name), reg))
        store.create((name, "master"), reg.shape, torch.bfloat16,
                     cut(bare_full(name), reg).bfloat16())
    store.create(("r", "exp_avg"), (3,), torch.float32, torch.tensor([1.0, 2.0, 3.0]))
    store.record_regions(regions)
    store.attach_metadata(lambda: {"params": {n: {"shape": list(s), "dtype": "float32"}
                                              for n, s in BARE.items()},
                                   "param_groups": [{"params": list(BARE) + ["r"]}]},
                          process_group=dist.group.WORLD)
    store.save_checkpoint(path, progress=False)
    store.close()


@_worker
def bare_load(rank: int, world: int, path: str) -> None:
    """Load the bare checkpoint at this world size: each rank gets its ``Shard(0)`` region
    of ``a``/``b``/``c`` (cut out of the saved ones) and the whole ``r``."""
    store = ss.DeviceStore("cpu")
    store.load_checkpoint(path, progress=False)
    for name in BARE:
        reg = chunk_region(BARE[name], 0, rank, world)
        assert store.regions.get(name, Region.whole(BARE[name])) == reg, (name, store.regions)
        assert torch.equal(store.get((name, "exp_avg")), cut(bare_full(name), reg)), name
        assert torch.equal(store.get((name, "master")),
                           cut(bare_full(name), reg).bfloat16()), name
    assert torch.equal(store.get(("r", "exp_avg")), torch.tensor([1.0, 2.0, 3.0]))
    store.close()


"""Workers of tests/distributed/test_sharded_frameworks.py: a sharded optimizer (``process_group=``) over
two gloo ranks through the ways frameworks save an optimizer (module-level functions, so that
``torch.multiprocessing.spawn`` can pickle them). Each writes what it saw to ``out``."""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

import statestore as ss
from statestore.optim import CPUAdam

from helpers.dist_worker import _exit_without_finalizing, _init, make_model, train


def _write(out: str, name: str, value) -> None:
    with open(os.path.join(out, name), "w") as f:
        json.dump(value, f)


def _outcome(fn):
    """``"ok"`` or ``"<exception type>: <message>"``."""
    try:
        fn()
        return "ok"
    except Exception as e:         # noqa: BLE001 - the test reads what was raised
        return f"{type(e).__name__}: {e}"


@_exit_without_finalizing
def state_dict_paths(rank: int, world: int, port: int, out: str) -> None:
    """state_dict() on one rank (HF Trainer's optimizer.pt: only rank 0 calls it) and on
    every rank (accelerate, Lightning); shard_state_dict() and load_state_dict() of shards."""
    _init(rank, world, port)
    try:
        model = make_model()
        opt = CPUAdam(model.named_parameters(), lr=1e-2, state_store=ss.DeviceStore("cpu"),
                      process_group=dist.group.WORLD)
        train(model, opt, 0, 2, rank, world, full=True)
        seen = {}
        if rank == 0:           # rank 0 alone: a collective here would hang
            seen["rank0_only"] = _outcome(opt.state_dict)
        dist.barrier()
        seen["every_rank"] = _outcome(opt.state_dict)
        mine = opt.shard_state_dict()
        seen["shard_keys"] = sorted(mine["state"])
        seen["marker"] = mine["statestore_shard"]
        torch.save(mine, os.path.join(out, f"shard{rank}.pt"))
        dist.barrier()
        other = torch.load(os.path.join(out, f"shard{1 - rank}.pt"), weights_only=False)
        seen["load_other"] = _outcome(lambda: opt.load_state_dict(other))
        seen["load_own"] = _outcome(lambda: opt.load_state_dict(mine))
        # a replicated (not sharded) optimizer needs every rank's states
        plain = CPUAdam(make_model().named_parameters(), lr=1e-2)
        seen["plain_load_shard"] = _outcome(lambda: plain.load_state_dict(mine))
        both = {"state": {**mine["state"], **other["state"]},
                "param_groups": mine["param_groups"], "statestore_shard": mine["statestore_shard"]}
        seen["plain_load_merged"] = _outcome(lambda: plain.load_state_dict(both))
        _write(out, f"seen{rank}.json", seen)
        # torch.distributed.checkpoint through StateStoreStateful: each rank its own shard
        import torch.distributed.checkpoint as dcp
        from statestore.integrations.dcp import StateStoreStateful
        dcp.save({"optim": StateStoreStateful(opt)}, checkpoint_id=os.path.join(out, "dcp"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _lightning_run(rank: int, out: str, tag: str, epochs: int, ckpt_path=None):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from statestore.integrations.lightning import StateStoreCheckpoint

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_model()
            self.store = ss.NVMeStore(os.path.join(out, f"store-{tag}-{rank}"),
                                      budget_bytes=1 << 20)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return CPUAdam(self.net.named_parameters(), lr=1e-2, state_store=self.store,
                           process_group=dist.group.WORLD)

    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, torch.cos(x[:, :4]))
    module = Module()
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=2, strategy="ddp",
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, enable_checkpointing=True,
                        callbacks=[ModelCheckpoint(dirpath=os.path.join(out, "ckpts"),
                                                   save_top_k=-1, every_n_epochs=1,
                                                   save_on_train_epoch_end=True),
                                   StateStoreCheckpoint()])
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4), ckpt_path=ckpt_path)
    params = {n: p.detach().clone() for n, p in module.net.named_parameters()}
    module.store.close()
    return params


@_exit_without_finalizing
def lightning_sharded(rank: int, world: int, port: int, out: str) -> None:
    """Lightning's DDP (processes launched here, as torchrun would) with a sharded optimizer
    and StateStoreCheckpoint: fit 2 epochs saving each, then resume from the first."""
    import warnings
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                      RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0")
    full = _lightning_run(rank, out, "full", 2)
    first = sorted(n for n in os.listdir(os.path.join(out, "ckpts"))
                   if n.startswith("epoch=0") and n.endswith(".ckpt"))[0]
    resumed = _lightning_run(rank, out, "resumed", 2,
                             ckpt_path=os.path.join(out, "ckpts", first))
    _write(out, f"lightning{rank}.json",
           {"first": first, "same": sorted(n for n in full if torch.equal(full[n], resumed[n])),
            "names": sorted(full)})
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()

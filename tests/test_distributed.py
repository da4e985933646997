"""Sharded optimizer states over real gloo process groups on localhost."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from statestore.distributed import partition
from statestore.errors import StateStoreError, StateStoreValueError
from statestore.optim import CPUAdam

import dist_worker as W


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_partition_balanced_and_deterministic():
    numels = [100, 1, 50, 50, 7, 200, 3]
    owners = partition(numels, 3)
    assert owners == partition(numels, 3)
    loads = [sum(n for n, o in zip(numels, owners) if o == r) for r in range(3)]
    assert max(loads) - min(loads) <= max(numels)
    assert partition(numels, 1) == [0] * len(numels)
    assert set(partition(numels, 20)) <= set(range(20))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_partition_rejects_bad_world_size(bad):
    with pytest.raises(StateStoreValueError, match="world_size"):
        partition([1, 2], bad)


def test_process_group_without_init_is_a_clear_error():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(StateStoreError, match="not initialized"):
        CPUAdam([p], process_group=object())


@pytest.mark.parametrize("world,kind", [(2, "ram"), (3, "nvme")])
def test_sharded_training_equals_single_process(tmp_path, world, kind):
    steps = 6
    mp.spawn(W.sharded_train, args=(world, _port(), str(tmp_path), kind, steps), nprocs=world,
             join=True)
    owned = [set(filter(None, (tmp_path / f"owned{r}.txt").read_text().split("\n")))
             for r in range(world)]
    names = [n for n, _ in W.make_model().named_parameters()]
    assert set().union(*owned) == set(names)                    # every parameter owned ...
    assert sum(len(o) for o in owned) == len(names)             # ... by exactly one rank

    model = W.make_model()
    opt = CPUAdam(model.named_parameters(), lr=1e-2, weight_decay=0.05)
    W.train(model, opt, 0, steps)
    got = load_file(str(tmp_path / "params.safetensors"))
    for k, v in model.state_dict().items():
        # Gradients are averaged over ranks' micro-batches instead of one full batch: equal
        # to float32 rounding of the mean, amplified a little by 6 Adam steps.
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)

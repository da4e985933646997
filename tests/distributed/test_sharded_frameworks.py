"""A sharded optimizer (``process_group=``) through the ways frameworks save an optimizer, over
two gloo ranks on 127.0.0.1 (tests/helpers/sharded_worker.py): ``state_dict()`` never hands out one
rank's shard as if it were the whole optimizer, a shard is refused where other ranks' states
are needed, and Lightning's ``StateStoreCheckpoint`` saves collectively and resumes bit for
bit instead of waiting for ever."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

from helpers.ranks import run_ranks
from helpers import sharded_worker as W
from helpers.dist_worker import make_model
from statestore.optim import CPUAdam


def _run(fn, tmp_path, timeout: float, world: int = 2) -> None:
    """``world`` ranks of ``fn``; a rank that hangs fails the test after ``timeout``."""
    run_ranks(fn, world, str(tmp_path), timeout=timeout)


def test_state_dict_of_a_sharded_optimizer_is_never_partial(tmp_path):
    _run(W.state_dict_paths, tmp_path, timeout=120)
    seen = [json.loads((tmp_path / f"seen{r}.json").read_text()) for r in range(2)]
    # rank 0 alone (HF Trainer's optimizer.pt): an error at once, saying what to call
    assert seen[0]["rank0_only"].startswith("StateStoreError")
    for want in ("rank 0", "save_checkpoint", "shard_state_dict"):
        assert want in seen[0]["rank0_only"]
    for r in range(2):
        assert seen[r]["every_rank"].startswith("StateStoreError")
        assert f"rank {r} keeps the states of" in seen[r]["every_rank"]
    # the shards: each rank's own parameters, marked, together every parameter
    assert set(seen[0]["shard_keys"]).isdisjoint(seen[1]["shard_keys"])
    assert sorted(seen[0]["shard_keys"] + seen[1]["shard_keys"]) == list(range(6))
    assert seen[0]["marker"] == seen[1]["marker"] and seen[0]["marker"]["world_size"] == 2
    for r in range(2):
        assert seen[r]["load_own"] == "ok"
        assert seen[r]["load_other"].startswith("StateStoreError")
        assert f"needs rank {r}'s" in seen[r]["load_other"]
        assert seen[r]["plain_load_shard"].startswith("StateStoreError")
        assert "every rank's" in seen[r]["plain_load_shard"]
        assert seen[r]["plain_load_merged"] == "ok"
    # the ranks' StateStoreStateful shards, loaded by one process: every parameter's states
    import torch.distributed.checkpoint as dcp
    from statestore.integrations.dcp import StateStoreStateful
    shards = [torch.load(tmp_path / f"shard{r}.pt", weights_only=False) for r in range(2)]
    opt = CPUAdam(make_model().named_parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # "assuming the intent is to load in a single process"
        dcp.load({"optim": StateStoreStateful(opt)}, checkpoint_id=str(tmp_path / "dcp"),
                 no_dist=True)
    got = opt.state_dict()["state"]
    assert sorted(got) == list(range(6))
    for sd in shards:
        for i, st in sd["state"].items():
            for name in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(torch.as_tensor(got[i][name]), torch.as_tensor(st[name])), (i, name)


@pytest.mark.slow
def test_lightning_checkpoint_with_a_sharded_optimizer(tmp_path):
    """Before: rank 0 alone entered the collective save and waited for ever."""
    pytest.importorskip("lightning")
    _run(W.lightning_sharded, tmp_path, timeout=240)
    for r in range(2):
        got = json.loads((tmp_path / f"lightning{r}.json").read_text())
        assert got["same"] == got["names"], f"rank {r}: resumed parameters differ"
        stem = got["first"][:-len(".ckpt")]
        assert (tmp_path / "ckpts" / f"{stem}.statestore" / "manifest.parquet").is_file()

"""Sharded optimizer states over real gloo process groups on localhost."""
from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from safetensors.torch import load_file

import statestore as ss
from statestore.checkpoint import read_manifest, verify_checkpoint
from statestore.distributed import owners_from_metadata, partition
from statestore.errors import StateStoreError, StateStoreValueError
from statestore.optim import CPUAdam

from helpers.ranks import run_ranks
from helpers import dist_worker as W


def test_partition_balanced_and_deterministic():
    numels = [100, 1, 50, 50, 7, 200, 3]
    owners = partition(numels, 3)
    assert owners == partition(numels, 3)
    loads = [sum(n for n, o in zip(numels, owners) if o == r) for r in range(3)]
    assert max(loads) - min(loads) <= max(numels)
    assert partition(numels, 1) == [0] * len(numels)
    assert set(partition(numels, 20)) <= set(range(20))


def test_owners_from_metadata_follow_the_optimizer_partition():
    names = ["a", "b", "c", "d"]
    shapes = {"a": [10, 10], "b": [10], "c": [300], "d": [7, 3]}
    meta = {"params": {n: {"shape": shapes[n], "dtype": "float32"} for n in names}}
    numels = [100, 10, 300, 21]
    sizes = dict(zip(names, numels))
    for world in (1, 2, 3):
        want = dict(zip(names, partition(numels, world)))
        assert owners_from_metadata(meta, {n: 0 for n in reversed(names)}, world) == want
    # no optimizer metadata: manifest order and the states' sizes
    assert owners_from_metadata({}, sizes, 2) == dict(zip(names, partition(numels, 2)))


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
    run_ranks(W.sharded_train, world, str(tmp_path), kind, steps)
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


# ------------------------------------------------------------------ distributed checkpoints
K, N = 3, 6


def _reference(steps_to: int):
    """One process, no sharding: parameters at K and at ``steps_to``, states at the end."""
    model = W.make_model()
    store = ss.DeviceStore("cpu")
    opt = CPUAdam(model.named_parameters(), lr=1e-2, weight_decay=0.05, state_store=store)
    W.train(model, opt, 0, K)
    at_k = {k: v.clone() for k, v in model.state_dict().items()}
    _reference.optim_at_k = copy.deepcopy(opt.state_dict())
    W.train(model, opt, K, steps_to)
    states = {str(k): store.get(k).clone() for k in store.keys()}
    return at_k, {k: v.clone() for k, v in model.state_dict().items()}, states


def _assert_same(got, want, exact):
    assert set(got) == set(want)
    for k in want:
        if exact:
            assert torch.equal(got[k], want[k]), k
        else:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_save_at_2_resume_at_1_and_3(tmp_path):
    """One checkpoint written collectively by 2 ranks (NVMe store per rank) resumes at 1 and
    at 3 ranks. Each rank trains on the whole batch, so the group-averaged gradient of 1 or 2
    ranks is bit-identical to one process's: resuming at 1 must equal the uninterrupted run
    bit for bit; at 3 ranks the average of 3 equal gradients rounds, so float32 rounding."""
    run_ranks(W.save_sharded, 2, str(tmp_path), "nvme", K, N)
    ckpt = tmp_path / "ckpt"
    assert verify_checkpoint(str(ckpt)) == []
    m = read_manifest(str(ckpt))
    assert m.info["save_id"] and len({r["key"] for r in m.rows}) == len(m.rows)
    files = {r["file"] for r in m.rows}
    assert any("-r00000-" in f for f in files) and any("-r00001-" in f for f in files)
    ref_k, ref_final, ref_states = _reference(N)
    assert set(ref_states) == {r["key"] for r in m.rows}
    _assert_same(load_file(str(tmp_path / f"params{K}.safetensors")), ref_k, exact=True)
    _assert_same(load_file(str(tmp_path / "a2-final.safetensors")), ref_final, exact=True)

    # torch.distributed.checkpoint holds the 2 ranks' torch-format shards: a single process
    # loads them into the full optimizer state_dict
    import torch.distributed.checkpoint as dcp
    want = _reference.optim_at_k
    template = {"optim": copy.deepcopy(want)}
    for st in template["optim"]["state"].values():
        for name, v in st.items():
            if torch.is_tensor(v):
                v.zero_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # "assuming the intent is to load in a single process"
        dcp.load(template, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    got = template["optim"]
    assert set(got["state"]) == set(want["state"])
    for i, st in want["state"].items():
        for name, v in st.items():
            assert torch.equal(torch.as_tensor(got["state"][i][name]), torch.as_tensor(v)), (i, name)

    # resume at 1: a plain single process loads the 2-rank checkpoint
    model = W.make_model()
    model.load_state_dict(load_file(str(tmp_path / f"params{K}.safetensors")))
    with ss.NVMeStore(str(tmp_path / "b1")) as store:
        store.load_checkpoint(str(ckpt))
        opt = CPUAdam(model.named_parameters(), lr=1e-2, weight_decay=0.05, state_store=store)
        assert set(opt._steps.values()) == {K}
        W.train(model, opt, K, N)
        _assert_same({k: v for k, v in model.state_dict().items()}, ref_final, exact=True)
        _assert_same({str(k): store.get(k) for k in store.keys()}, ref_states, exact=True)

    # resume at 3: each rank loads only its shard of the 2-rank checkpoint
    run_ranks(W.resume_sharded, 3, str(tmp_path), "nvme", K, N)
    loaded = [(tmp_path / f"b3-loaded{r}.txt").read_text().split("\n") for r in range(3)]
    loaded_keys = [set(filter(None, lines[1:])) for lines in loaded]
    assert sum(len(s) for s in loaded_keys) == len(m.rows)          # each state read once ...
    assert set().union(*loaded_keys) == {r["key"] for r in m.rows}  # ... by exactly one rank
    assert sum(int(lines[0]) for lines in loaded) == m.nbytes
    assert all(loaded_keys)                                          # every rank got a share
    for r in range(3):
        assert "shard" in (tmp_path / f"b3-lone{r}.txt").read_text()
        part, after = map(int, (tmp_path / f"b3-replicated{r}.txt").read_text().split())
        assert part == len(loaded_keys[r]) and after == len(m.rows)
    assert not list(tmp_path.glob("lone*"))
    _assert_same(load_file(str(tmp_path / "b3-final.safetensors")), ref_final, exact=False)
    end = tmp_path / "b3-end"
    assert verify_checkpoint(str(end)) == []
    assert len({r["file"].split("-r")[1][:5] for r in read_manifest(str(end)).rows}) == 3
    with ss.DeviceStore("cpu") as whole:
        whole.load_checkpoint(str(end))
        _assert_same({str(k): whole.get(k) for k in whole.keys()}, ref_states, exact=False)
        assert set(whole.loaded_metadata["steps"].values()) == {N}


def test_rank_killed_mid_save_leaves_previous_checkpoint(tmp_path):
    with pytest.raises(AssertionError, match="killed_mid_save at 2 ranks.*SIGKILL"):
        run_ranks(W.killed_mid_save, 2, str(tmp_path), "nvme")
    assert (tmp_path / "saved0").exists() and (tmp_path / "saved1").exists()
    assert not list(tmp_path.glob("second-save-returned*"))
    assert "failed on rank 1" in (tmp_path / "early0.txt").read_text()
    assert "metadata" in (tmp_path / "early1.txt").read_text()
    ckpt = str(tmp_path / "ckpt")
    assert verify_checkpoint(ckpt) == []
    m = read_manifest(ckpt)
    steps = m.metadata["steps"]
    assert steps and set(steps.values()) == {2}                      # the first save's
    with ss.DeviceStore("cpu") as store:
        store.load_checkpoint(ckpt)
        assert len(store) == len(m.rows)

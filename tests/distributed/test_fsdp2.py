"""FSDP2: regions of states in stores and checkpoints, and the optimizers over DTensor
parameters (``docs/distributed.md``, "FSDP2"). Multi-process tests run gloo groups on
127.0.0.1 through ``helpers.ranks.run_ranks`` (every join bounded)."""
from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import statestore as ss
from statestore.__main__ import to_torch_state_dict
from statestore._regions import Region, chunk_region, runs
from statestore.checkpoint import read_manifest, sealed, verify_checkpoint
from statestore.errors import CheckpointCorruptError, CheckpointError

from helpers import fsdp2_worker as W
from helpers import mesh2d_worker as M


# ------------------------------------------------------------------------------ regions
def test_runs_copy_one_region_into_another():
    """``runs(src, dst)`` moves exactly the shared elements, in order, for boxes cut along
    any dimensions (checked against numpy indexing)."""
    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 3)))
        full = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)

        def box():
            offs = tuple(rng.randint(0, s - 1) for s in shape)
            return Region(shape, offs, tuple(rng.randint(1, s - o) for s, o in zip(shape, offs)))
        src, dst = box(), box()
        s_flat = full[tuple(slice(o, o + n) for o, n in zip(src.offsets, src.shape))].reshape(-1)
        out = np.full(dst.numel, -1, dtype=np.int64)
        for s, d, n in runs(src, dst):
            out[d:d + n] = s_flat[s:s + n]
        want = np.full(dst.shape, -1, dtype=np.int64)
        common = src.intersect(dst)
        if common is not None:
            sel = tuple(slice(c - o, c - o + n)
                        for c, o, n in zip(common.offsets, dst.offsets, common.shape))
            want[sel] = full[tuple(slice(c, c + n) for c, n in zip(common.offsets, common.shape))]
        assert np.array_equal(out.reshape(dst.shape), want), (src, dst)


def test_chunk_region_is_dtensor_shard_semantics():
    """The region of ``Shard(d)`` on a 1-D mesh: torch.chunk's pieces, empty ones at the end
    starting at the dimension's size (as DTensor reports their offset)."""
    for n in range(0, 10):
        for world in range(1, 6):
            pieces = list(torch.arange(n).chunk(world)) if n else []
            start = 0
            for rank in range(world):
                r = chunk_region((3, n), 1, rank, world)
                size = len(pieces[rank]) if rank < len(pieces) else 0
                assert r.shape == (3, size) and r.offsets == (0, min(start, n)), (n, world, rank)
                start += size


# ------------------------------------------------------------------------------ checkpoints
def test_store_holding_regions_refuses_a_save_alone(tmp_path):
    """A store that records a region (one rank's shard) never writes a partial checkpoint
    alone: the save must be collective."""
    with ss.DeviceStore("cpu") as store:
        store.create(("w", "exp_avg"), (2, 3), torch.float32)
        store.record_regions({"w": chunk_region((4, 3), 0, 0, 2)})
        with pytest.raises(CheckpointError, match="save it collectively"):
            store.save_checkpoint(str(tmp_path / "c"), process_group=None, progress=False)
        assert not (tmp_path / "c").exists()
        store.record_regions({"w": Region.whole((2, 3))})
        assert store.regions == {}


# ------------------------------------------------------------------------------ FSDP2
def _same(got: dict, want: dict, exact: bool = True) -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    for k in want:
        if exact:
            assert torch.equal(got[k], want[k]), k
        else:
            # 3 ranks' mean gradient rounds (in bf16 for the bf16 layer, whose parameters may
            # then round one bf16 step apart, and whose states follow)
            bf16 = k.startswith("l1.")
            torch.testing.assert_close(got[k], want[k], rtol=2e-2 if bf16 else 1e-5,
                                       atol=1e-3 if bf16 else 1e-6, msg=lambda m: f"{k}: {m}")


def _reference(out, upto: int, save_at: int = None):
    """One process, no FSDP2, the same batches: parameters and states (DCP's full view)."""
    model = W.make_model()
    store = ss.DeviceStore("cpu")
    opt = W.make_opt(model, store)
    W.train(model, opt, 0, save_at or upto)
    if save_at:
        store.save_checkpoint(str(out / "ckpt_plain"), progress=False)
        W.train(model, opt, save_at, upto)
    names = [n for n, _ in model.named_parameters()]
    states = {f"{names[i]}/{k}": v.float().clone() for i, st in opt.state_dict()["state"].items()
              for k, v in st.items()}
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "states": states}


def test_fsdp2_train_save_and_resume_at_1_2_3(tmp_path):
    """FSDP2 (``fully_shard``, gloo, 2 ranks; uneven and empty shards, a bf16 layer with fp32
    masters) with HybridAdam on an NVMeStore per rank, updating in backward after each
    reduce-scatter with gradients released: bit for bit one process's training on the same
    batches, and what ``get_optimizer_state_dict`` shows is one process's states. The
    store's collective checkpoint at step K resumes bit for bit at 2 ranks (the optimizer
    first, each rank's shard linked), in one plain process (regions assembled) and at 3 ranks
    (regions cut anew; float32 rounding of the mean of 3 gradients), as does DCP's
    checkpoint of ``get_optimizer_state_dict``; an unsharded checkpoint resumes into FSDP2;
    int8 moments resume at 2 ranks bit for bit, and at 3 ranks and in one process
    re-quantized in new blocks (within a code step); the staging path
    of CUDA parameters (staged local shards; run on the CPU) trains bit for bit. torch's
    AdamW beside HybridAdam with ``clip_grad_norm_`` on DTensor gradients agrees, and its DCP
    states load into HybridAdam. Placements other than Shard/Replicate on a 1-D mesh are refused.
    ``convert --to torch`` assembles regions; a manifest whose regions leave a gap or
    overlap is refused. StoreOptimizer in the same ranks: :func:`_check_store_optimizer`."""
    out = tmp_path
    want = _reference(out, W.N, save_at=W.K)
    W.run_ranks(W.fsdp2_save, 2, str(out))
    _check_store_optimizer(out)
    final2 = torch.load(out / "final2.pt")
    _same(final2["params"], want["params"])
    _same(final2["states"], want["states"])
    m = read_manifest(str(out / "ckpt"))
    assert m.info["format_version"] == 2 and verify_checkpoint(str(out / "ckpt")) == []
    rows = [r for r in m.rows if r.key == "l0.weight/exp_avg"]
    assert {(r.offsets, r.shape, r.global_shape) for r in rows} == {((0, 0), (4, 5), (7, 5)),
                                                                    ((4, 0), (3, 5), (7, 5))}
    assert len({r.file for r in rows}) == 2                 # each rank's in its own shard

    # one process, no FSDP2: the 2-rank checkpoint's regions assembled into whole states
    model = W.make_model()
    model.load_state_dict(torch.load(out / "weights_k.pt"))
    store = ss.DeviceStore("cpu")
    store.load_checkpoint(str(out / "ckpt"), progress=False)
    opt = W.make_opt(model, store)
    W.train(model, opt, W.K, W.N)
    _same({n: p.detach() for n, p in model.named_parameters()}, want["params"])

    W.run_ranks(W.fsdp2_resume3, 3, str(out))
    final3 = torch.load(out / "final3.pt")
    _same(final3["params"], want["params"], exact=False)
    _same(final3["states"], want["states"], exact=False)
    for other in ("final3_plain.pt", "final3_dcp.pt"):      # the same start: the same result
        got = torch.load(out / other)
        _same(got["params"], final3["params"])
        _same(got["states"], final3["states"])
    _same(torch.load(out / "torch_k3.pt"), torch.load(out / "torch_k.pt"))
    # int8 moments at 3 ranks and in one process: re-quantized in new blocks
    k8 = torch.load(out / "states_k8.pt")
    M.int8_close(torch.load(out / "states8_3.pt"), k8)
    model = W.make_model()
    store = ss.DeviceStore("cpu")
    store.load_checkpoint(str(out / "ckpt8"), progress=False)
    M.int8_close(_states(model, W.make_opt(model, store, moment_dtype="int8")), k8)
    got8, want8 = torch.load(out / "final8_3.pt"), torch.load(out / "final8.pt")
    for k in want8["params"]:
        torch.testing.assert_close(got8["params"][k].float(), want8["params"][k].float(),
                                   rtol=0, atol=3e-2, msg=lambda m: f"{k}: {m}")

    W.run_ranks(W.fsdp2_resume2, 2, str(out))
    assert int(torch.load(out / "linked.txt")) >= 1      # each rank's shard linked
    got = torch.load(out / "final2_resumed.pt")
    _same(got["params"], final2["params"])
    _same(got["states"], final2["states"])
    got, want8 = torch.load(out / "final8_resumed.pt"), torch.load(out / "final8.pt")
    _same(got["params"], want8["params"])
    _same(got["states"], want8["states"])
    got = torch.load(out / "final2_offload.pt")          # CUDA shards' path, run on the CPU
    assert got["staged"]["staged_params"] == 6
    _same(got["params"], final2["params"])
    _same(got["states"], final2["states"])

    # convert --to torch: whole tensors (int8 decoded region by region)
    conv = to_torch_state_dict(str(out / "ckpt"))["state"]
    assert torch.equal(conv[0]["exp_avg"], torch.load(out / "states_k.pt")["l0.weight/exp_avg"])
    conv8, k8 = to_torch_state_dict(str(out / "ckpt8"))["state"], torch.load(out / "states_k8.pt")
    names = [n for n, _ in W.make_model().named_parameters()]
    for i, n in enumerate(names):
        for state in ("exp_avg", "exp_avg_sq", "master"):
            if f"{n}/{state}" in k8:
                assert torch.equal(conv8[i][state], k8[f"{n}/{state}"]), (n, state)
    # regions that leave a gap, or overlap, are refused
    path = str(out / "ckpt")
    table = pq.read_table(f"{path}/manifest.parquet")
    keys, offs = table.column("key").to_pylist(), table.column("offsets").to_pylist()
    keep = [i for i, (k, o) in enumerate(zip(keys, offs))
            if (k, o) != ("l0.weight/exp_avg", [4, 0])]
    pq.write_table(sealed(table.take(keep)), f"{path}/manifest.parquet")
    with pytest.raises(CheckpointCorruptError, match="'l0.weight/exp_avg': its regions cover 4 "
                                                      "of the 7 entries of dimension 0"):
        read_manifest(path)
    bad = [[3, 0] if (k, o) == ("l0.weight/exp_avg", [4, 0]) else o for k, o in zip(keys, offs)]
    pq.write_table(sealed(table.set_column(table.schema.get_field_index("offsets"), "offsets",
                                           pa.array(bad, type=pa.list_(pa.int64())))),
                   f"{path}/manifest.parquet")
    with pytest.raises(CheckpointCorruptError, match="'l0.weight/exp_avg': region .* overlaps"):
        read_manifest(path)


def test_param_groups_replaced_from_outside_are_refused():
    """DeepSpeed's ZeRO-1/2 (and its fp16/bf16 wrappers) put flat partitions of their own in
    a client optimizer's ``param_groups`` and step it on them: a statestore optimizer, whose
    states are per parameter and by name, says so at that step instead of a KeyError."""
    from statestore.optim import HybridAdam
    p = torch.nn.Parameter(torch.ones(4))
    opt = HybridAdam([("w", p)])
    flat = torch.zeros(4, requires_grad=True)
    flat.grad = torch.ones(4)
    opt.param_groups[0]["params"] = [flat]
    with pytest.raises(ss.StateStoreError, match=r"param_groups\[0\]\['params'\] holds tensors "
                                                 r"this optimizer was not given.*DeepSpeed"):
        opt.step()


def _states(model, opt) -> dict:
    """A torch optimizer's states by ``name/state``, as ``fsdp2_worker.full_states`` gives
    them (floating states in fp32)."""
    names = [n for n, _ in model.named_parameters()]
    return {f"{names[i]}/{k}": (v.float() if k != "step" else v).clone()
            for i, st in opt.state_dict()["state"].items() for k, v in st.items()}


def _check_store_optimizer(tmp_path) -> None:
    """StoreOptimizer(RMSprop) over FSDP2's DTensor parameters (2 ranks, uneven and empty
    shards, a bf16 layer): each rank updates its local shards, states keyed by the
    parameters' names; bit for bit torch's RMSprop(foreach=False) in one process, parameters
    and the states DCP's ``get_optimizer_state_dict`` gathers. The 2-rank checkpoint resumes
    in one plain process bit for bit. Muon, NAdam, ASGD and Adafactor over sharded parameters:
    ``tests/distributed/test_fsdp2_2d.py``."""
    model = W.make_model()
    opt = torch.optim.RMSprop(model.named_parameters(), **W.RMSPROP, foreach=False)
    W.train(model, opt, 0, W.K)
    _same(_states(model, opt), torch.load(tmp_path / "so_states_k.pt"))
    W.train(model, opt, W.K, W.N)
    got = torch.load(tmp_path / "so_final.pt")
    _same(got["params"], {n: p.detach() for n, p in model.named_parameters()})
    _same(got["states"], _states(model, opt))

    resumed = W.make_model()
    resumed.load_state_dict(torch.load(tmp_path / "so_weights_k.pt"))
    store = ss.DeviceStore("cpu")
    store.load_checkpoint(str(tmp_path / "so_ckpt"), progress=False)
    W.train(resumed, W.make_store_opt(resumed, store), W.K, W.N)
    _same({n: p.detach() for n, p in resumed.named_parameters()}, got["params"])


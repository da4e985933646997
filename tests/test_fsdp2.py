"""FSDP2: regions of states in stores and checkpoints, and the optimizers over DTensor
parameters (``docs/distributed.md``, "FSDP2"). Multi-process tests run gloo groups on
127.0.0.1 through ``fsdp2_worker.run_ranks`` (every join bounded)."""
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

import fsdp2_worker as W


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
def test_region_checkpoint_saved_at_2_loads_at_1_and_3(tmp_path):
    """Two ranks each hold ``Shard(0)`` regions (uneven: 7 and 5 rows at 2 ranks; 2 rows at 3
    ranks leave one empty) in an NVMeStore and save collectively: one version-2 checkpoint
    whose rows record each region. A single process loads every tensor whole (assembled from
    the regions, every checksum verified), three ranks each load their own region, ``convert
    --to torch`` gives whole tensors, and a manifest whose regions leave a gap or overlap is
    refused."""
    path = str(tmp_path / "ckpt")
    W.run_ranks(W.bare_save, 2, path)
    m = read_manifest(path)
    assert m.info["format_version"] == 2 and verify_checkpoint(path) == []
    rows = {(r.key, r.offsets): r for r in m.rows}
    a0, a1 = rows[("a/exp_avg", (0, 0))], rows[("a/exp_avg", (4, 0))]
    assert (a0.shape, a1.shape, a0.global_shape) == ((4, 3), (3, 3), (7, 3))
    assert a0.file != a1.file and ("r/exp_avg", (0,)) in rows          # written once
    assert sum(1 for r in m.rows if r.key == "r/exp_avg") == 1
    with ss.DeviceStore("cpu") as store:         # one process: every tensor whole
        store.load_checkpoint(path, progress=False)
        assert store.regions == {}
        for name in W.BARE:
            assert torch.equal(store.get((name, "exp_avg")), W.bare_full(name))
            assert torch.equal(store.get((name, "master")), W.bare_full(name).bfloat16())
    W.run_ranks(W.bare_load, 3, path)
    state = to_torch_state_dict(path)["state"]           # convert --to torch: whole tensors
    assert torch.equal(state[0]["exp_avg"], W.bare_full("a"))
    assert torch.equal(state[2]["master"], W.bare_full("c").bfloat16())

    table = pq.read_table(f"{path}/manifest.parquet")
    keep = [i for i, k in enumerate(table.column("key").to_pylist())
            if not (k == "a/exp_avg" and table.column("offsets")[i].as_py() == [4, 0])]
    pq.write_table(sealed(table.take(keep)), f"{path}/manifest.parquet")
    with pytest.raises(CheckpointCorruptError, match="'a/exp_avg': its regions cover 4 of"):
        read_manifest(path)
    offs = [o if k != "b/exp_avg" or o == [0] else [2]
            for k, o in zip(table.column("key").to_pylist(), table.column("offsets").to_pylist())]
    bad = table.set_column(table.schema.get_field_index("offsets"), "offsets",
                           pa.array(offs, type=pa.list_(pa.int64())))
    pq.write_table(sealed(bad), f"{path}/manifest.parquet")
    with pytest.raises(CheckpointCorruptError, match="'b/exp_avg': region .* overlaps"):
        read_manifest(path)


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

"""Collective saves and loads (``process_group=``) when the ranks do not see one directory, a
rank's shard is corrupt, or a rank is killed (issue 47 items 2, 9, 10): every rank ends with
the same outcome, a ``StateStoreError`` naming the rank or the cause, and no rank's files left
behind in the checkpoint (``docs/reliability.md``, "Collective saves and loads"). Two gloo
ranks on 127.0.0.1, every join bounded."""
from __future__ import annotations

import os
import signal

import pytest

from statestore.checkpoint import read_manifest, verify_checkpoint

from helpers import collective_worker as CW
from helpers.ranks import run_ranks, run_ranks_to_the_end


def _shards(d) -> list:
    return sorted(n for n in os.listdir(d) if "shard-" in n) if os.path.isdir(d) else []


# ------------------------------------------------ item 2: a path each rank has on its own disk
def test_collective_save_to_a_path_not_shared_between_ranks_fails_on_every_rank(tmp_path):
    """Two ranks save to "ckpt", each relative to a directory of its own (nodes with local
    disks): both raise CheckpointError saying the path is not shared between ranks; rank 0's
    good checkpoint at that path is still the one there, and neither directory keeps a shard
    of the failed save. Before: both saves returned, and rank 0's directory held a manifest
    naming rank 1's shard, which it did not have."""
    good = tmp_path / "node0" / "ckpt"
    run_ranks(CW.save_to_local_disks, 2, str(tmp_path), timeout=90)
    for r in range(2):
        got = (tmp_path / f"save{r}.txt").read_text()
        assert got.startswith("statestore.errors.CheckpointError"), got
        assert "not shared between ranks" in got, got
    assert "rank 0 does not see 1 shard(s) that rank(s) 1 wrote" in \
        (tmp_path / "save0.txt").read_text()
    assert verify_checkpoint(str(good), progress=False) == []
    assert [r["key"] for r in read_manifest(str(good)).rows] == ["w/exp_avg"]
    files = set(os.listdir(good))
    assert len(_shards(good)) == 1 and not any(n.startswith(".") and "shard" in n for n in files)
    assert _shards(tmp_path / "node1" / "ckpt") == []
    assert not (tmp_path / "node1" / "ckpt" / "manifest.parquet").exists()


# ------------------------------------------------------- item 10: a rank killed mid-save
@pytest.mark.parametrize("case,committed", [("rank1-writing-shards", False),
                                            ("rank1-after-gather", True),
                                            ("rank0-before-commit", False),
                                            ("rank0-after-commit", True)])
def test_rank_killed_in_a_collective_save(tmp_path, case, committed):
    """One of two ranks SIGKILLed at a point of a collective save over a good checkpoint: the
    survivor returns when the new checkpoint committed, else raises RankLostError naming the
    killed rank and removes every shard it wrote; the checkpoint at the path is the previous
    one or the new one, whole. Before: gloo's raw RuntimeError, the survivor's linked shards
    left in the directory, and rank 0 raising though its manifest had committed."""
    victim = 1 if case.startswith("rank1") else 0
    survivor = 1 - victim
    codes = run_ranks_to_the_end(CW.killed_in_collective_save, 2, str(tmp_path), case,
                                 timeout=90)
    assert codes[victim] == -signal.SIGKILL and codes[survivor] == 0, codes
    got = (tmp_path / f"second{survivor}.txt").read_text()
    ck = tmp_path / "ckpt"
    assert verify_checkpoint(str(ck), progress=False) == []
    m = read_manifest(str(ck))
    assert set(m.metadata["steps"].values()) == ({3} if committed else {2}), got
    if committed:
        assert got == "ok"
    else:
        assert got.startswith("statestore.errors.RankLostError"), got
        assert f"rank {victim} of the group was lost" in got, got
    # every shard file left but the manifest's is the killed rank's, or (committed) of the
    # previous save, which rank 0 removes after its commit (or the next save does)
    extra = [n for n in _shards(ck) if n not in {r["file"] for r in m.rows}]
    assert all(f"-r{victim:05d}-" in n or committed and m.info["save_id"] not in n
               for n in extra), (extra, got)


# ------------------------------------- item 9: one rank's shard damaged, at another world size
def test_collective_load_with_one_ranks_shard_damaged_fails_on_every_rank(tmp_path):
    """A checkpoint saved by one process, loaded by two ranks, a shard only rank 1 reads
    damaged: both ranks raise the same CheckpointCorruptError. Truncated (refused before a
    tensor is read): both stores stay as they were. A flipped byte (found while streaming):
    both stores are left empty with load_error set, as a failed load leaves one. Then the
    intact checkpoint loads on both. Before: rank 0 loaded and only rank 1 raised."""
    import json
    import shutil

    import statestore as ss
    from statestore.distributed import owners_from_metadata
    from statestore.optim import CPUAdam
    from helpers import dist_worker as W

    model = W.make_model()
    with ss.DeviceStore("cpu") as store:
        opt = CPUAdam(model.named_parameters(), lr=1e-2, state_store=store)
        W.train(model, opt, 0, 2)
        store.save_checkpoint(str(tmp_path / "ck_good"), shard_bytes=1, progress=False)
    m = read_manifest(str(tmp_path / "ck_good"))
    numels = {}
    for r in m.rows:
        numels.setdefault(r.param, r.spec.numel)
    owners = owners_from_metadata(m.metadata, numels, 2)
    row = max((r for r in m.rows if owners[r.param] == 1), key=lambda r: r.nbytes)
    for name in ("ck_header", "ck_data"):
        shutil.copytree(tmp_path / "ck_good", tmp_path / name)
    with open(tmp_path / "ck_header" / row.file, "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / "ck_header" / row.file) - 1)
    with open(tmp_path / "ck_data" / row.file, "r+b") as f:
        f.seek(row.offset + row.nbytes // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))

    run_ranks(CW.load_damaged, 2, str(tmp_path), timeout=90)
    seen = [json.loads((tmp_path / f"loads{r}.json").read_text()) for r in range(2)]
    for name, kept in (("ck_header", [1, False]), ("ck_data", [0, True])):
        assert seen[0][name] == seen[1][name], (name, seen)
        assert seen[0][name].startswith("statestore.errors.CheckpointCorruptError"), seen
        assert row.file in seen[0][name], seen
        assert seen[0][f"{name}_store"] == seen[1][f"{name}_store"] == kept, (name, seen)
    assert seen[0]["ck_good"] == seen[1]["ck_good"] == "ok"
    assert seen[0]["ck_good_store"][0] + seen[1]["ck_good_store"][0] == len(m.rows)

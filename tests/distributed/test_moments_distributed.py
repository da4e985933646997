"""Compressed moments with states sharded over a gloo group: the sharded run, its collective
checkpoint and a single-process resume give the same bits as one process (each rank trains
on the whole batch, so the group-averaged gradient of 2 ranks equals one process's)."""
from __future__ import annotations


import pytest
import torch
from safetensors.torch import load_file

import statestore as ss
from statestore.checkpoint import read_manifest, verify_checkpoint
from statestore.optim import CPUAdam

from helpers.ranks import run_ranks
from helpers import dist_moments_worker as MW
from helpers import dist_worker as W

K, N = 3, 6


@pytest.mark.parametrize("md", ["bf16", "int8"])
def test_sharded_compressed_moments_save_and_resume(tmp_path, md):
    run_ranks(MW.save_sharded, 2, str(tmp_path), md, K, N)
    ckpt = str(tmp_path / "ckpt")
    assert verify_checkpoint(ckpt) == []
    assert read_manifest(ckpt).metadata["moment_dtype"] == md
    want_dtype = "torch.bfloat16" if md == "bf16" else "torch.int8"
    for r in range(2):
        assert want_dtype in (tmp_path / f"dtypes{r}.txt").read_text()
    # one process, never sharded
    model = W.make_model()
    with ss.DeviceStore("cpu") as st:
        opt = CPUAdam(model.named_parameters(), lr=1e-2, weight_decay=0.05, state_store=st,
                      moment_dtype=md)
        W.train(model, opt, 0, N)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    got = load_file(str(tmp_path / "final.safetensors"))
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    # resume the 2-rank checkpoint in one process
    model = W.make_model()
    model.load_state_dict(load_file(str(tmp_path / f"params{K}.safetensors")))
    with ss.DeviceStore("cpu") as st:
        st.load_checkpoint(ckpt)
        opt = CPUAdam(model.named_parameters(), lr=1e-2, weight_decay=0.05, state_store=st,
                      moment_dtype=md)
        W.train(model, opt, K, N)
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k]), k

"""FSDP2 on 2-D meshes (``docs/distributed.md``, "FSDP2", "2-D meshes"): HSDP and FSDP x
tensor parallel at 4 gloo ranks, their checkpoints resumed on a 1-D mesh of 2 and in one
process (``helpers.mesh2d_worker``; every join bounded)."""
from __future__ import annotations

import torch

import statestore as ss
from statestore.checkpoint import read_manifest, verify_checkpoint

from helpers import mesh2d_worker as M
from helpers.ranks import run_ranks


def _same(got: dict, want: dict, exact: bool = True, what: str = "") -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    for k in want:
        if exact:
            assert torch.equal(got[k], want[k]), f"{what} {k}"
        else:       # another mesh reduces the gradients in another order: float32 rounding
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{what} {k}: {m}")


def _one_process(kind: str, path: str) -> dict:
    """The states a single process (no FSDP2) resumes from checkpoint ``path``, by
    ``name/state``."""
    model = M.make(kind)
    store = ss.DeviceStore("cpu")
    store.load_checkpoint(path, progress=False)
    opt = M.hybrid(model, store)
    names = [n for n, _ in model.named_parameters()]
    return {f"{names[i]}/{k}": v.float() if k != "step" else v
            for i, st in opt.state_dict()["state"].items() for k, v in st.items()}


def test_hsdp_and_fsdp_tp_match_torch_and_reshard(tmp_path):
    """At 4 ranks on a 2x2 mesh, HSDP (Replicate x Shard, uneven and empty shards) and
    FSDP x TP (ColwiseParallel/RowwiseParallel + fully_shard: strided and 2-D boxes, a bias
    replicated over TP): HybridAdam (NVMeStore per rank) agrees with torch's AdamW to
    float32 rounding at every step, StoreOptimizer(AdamW) bit for bit; replicas of a shard
    hold equal states and the checkpoint holds each region once; DCP's full state dict
    equals torch's AdamW's to float32 rounding. Each 2x2 checkpoint loads bit for bit on a
    1-D mesh of 2 (store before or after the optimizer) and in one process, and the 1-D run
    trained on agrees with the 2x2 run; its checkpoint loads in one process bit for bit; the
    2x2 DCP checkpoint loads at 1-D 2. Partial placements and strided shards that are not
    boxes are refused. Clipping with ``update_in_backward`` is refused under HSDP. int8
    moments saved at 2x2 load at 1-D 2 (re-quantized). Muon over 2 ranks:
    :func:`_check_muon`."""
    out = str(tmp_path)
    run_ranks(M.mesh2x2, 4, out)
    run_ranks(M.mesh1d, 2, out)
    _check_muon(out)
    M.int8_close(torch.load(f"{out}/hsdp8-1d-states_k.pt"), torch.load(f"{out}/hsdp8-states_k.pt"))
    for kind in ("hsdp", "tp"):
        ckpt = f"{out}/{kind}-ckpt"
        assert verify_checkpoint(ckpt) == []
        m = read_manifest(ckpt)
        w = M.make(kind)
        first = next(n for n, _ in w.named_parameters())
        rows = [r for r in m.rows if r.key == f"{first}/exp_avg"]
        # each region once (HSDP's replicas wrote it once), tiling the parameter
        assert len(rows) == len({(r.offsets, r.shape) for r in rows}) > 1, rows
        assert sum(r.spec.numel for r in rows) == dict(w.named_parameters())[first].numel()
        k_states = torch.load(f"{out}/{kind}-states_k.pt")
        _same(torch.load(f"{out}/{kind}-torch_states_k.pt"), k_states, exact=False,
              what=f"{kind} DCP view against torch's AdamW")
        _same(_one_process(kind, ckpt), k_states, what=f"{kind} 2x2 -> 1 process")
        _same(torch.load(f"{out}/{kind}-1d-states_k.pt"), k_states, what=f"{kind} 2x2 -> 1-D 2")
        _same(torch.load(f"{out}/{kind}-1d-dcp_states_k.pt"), k_states,
              what=f"{kind} 2x2 DCP -> 1-D 2")
        final = torch.load(f"{out}/{kind}-final.pt")
        final1d = torch.load(f"{out}/{kind}-1d-final.pt")
        _same(final["states"], final["torch"], exact=False, what=f"{kind} final against torch")
        _same(final1d["params"], final["params"], exact=False, what=f"{kind} 1-D 2 params")
        _same(final1d["states"], final["states"], exact=False, what=f"{kind} 1-D 2 states")
        _same(_one_process(kind, f"{out}/{kind}-ckpt1d"), final1d["states"],
              what=f"{kind} 1-D 2 -> 1 process")


def _muon_reference(first: int, last: int, model=None, opt=None):
    """torch's Muon on the unsharded model, the same batches, one thread (as each rank)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = model or M.make("muon")
        opt = opt or torch.optim.Muon(model.parameters(), **M.MUON)
        M.W.train(model, opt, first, last)
    finally:
        torch.set_num_threads(threads)
    return model, opt


def _check_muon(out: str) -> None:
    """StoreOptimizer(Muon) over 2 ranks' shards (uneven, empty) computes what torch's Muon
    computes on the unsharded model, bit for bit, as over HSDP's 2x2 mesh; its 2-rank
    checkpoint resumes in one process bit for bit. The same for NAdam and ASGD
    (per-parameter scalar states, kept whole by each rank) and Adafactor (gathered; its row
    and column variances kept whole)."""
    got = torch.load(f"{out}/muon-final.pt")
    model, opt = _muon_reference(0, M.N)
    _same(got["params"], {n: p.detach() for n, p in model.named_parameters()}, what="Muon")
    _same(torch.load(f"{out}/muon-hsdp-final.pt"),
          {n: p.detach() for n, p in model.named_parameters()}, what="Muon under HSDP 2x2")
    names = [n for n, _ in model.named_parameters()]
    _same({k: v for k, v in got["states"].items() if not k.endswith("/step")},
          {f"{names[i]}/{k}": v for i, st in opt.state_dict()["state"].items()
           for k, v in st.items()}, what="Muon states")
    resumed = M.make("muon")
    resumed.load_state_dict(torch.load(f"{out}/muon-weights_k.pt"))
    store = ss.DeviceStore("cpu")
    store.load_checkpoint(f"{out}/muon-ckpt", progress=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        M.W.train(resumed, M.store_muon(resumed, store), M.K, M.N)
    finally:
        torch.set_num_threads(threads)
    _same({n: p.detach() for n, p in resumed.named_parameters()}, got["params"],
          what="Muon resumed")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, kw in M.OTHERS.items():
            model = M.make("muon")
            M.W.train(model, getattr(torch.optim, name)(model.parameters(), **kw,
                                                         foreach=False), 0, M.N)
            got = torch.load(f"{out}/{name}-final.pt")
            _same(got, {n: p.detach() for n, p in model.named_parameters()}, what=name)
            resumed = M.make("muon")
            resumed.load_state_dict(torch.load(f"{out}/{name}-weights_k.pt"))
            store = ss.DeviceStore("cpu")
            store.load_checkpoint(f"{out}/{name}-ckpt", progress=False)
            M.W.train(resumed, M.store_other(name, resumed, store), M.K, M.N)
            _same({n: p.detach() for n, p in resumed.named_parameters()}, got,
                  what=f"{name} resumed")
            if name == "NAdam":         # at 2 ranks into plain parameters: every state whole
                plain = torch.load(f"{out}/NAdam-plain-states.pt")
                fresh = ss.DeviceStore("cpu")
                fresh.load_checkpoint(f"{out}/{name}-ckpt", progress=False)
                one = M.store_other(name, M.make("muon"), fresh).state_dict()["state"]
                assert plain.keys() == one.keys()
                for i in one:
                    _same(plain[i], one[i], what=f"NAdam plain at 2 ranks, parameter {i}")
    finally:
        torch.set_num_threads(threads)


def test_example_trains_on_a_2d_mesh_and_resumes_on_another(tmp_path):
    """``examples/fsdp2_train.py --mesh 2x2`` (HSDP, states on an NVMeStore per rank) at 4
    ranks, resumed on a 1-D mesh of 2: the run picks up at the step saved, and the checkpoint
    of the 2-D run holds each region once."""
    from helpers import fsdp2_worker as W
    from helpers import paths
    script = f"{paths.ROOT}/examples/fsdp2_train.py"
    out, losses = str(tmp_path / "run"), str(tmp_path / "losses.txt")
    base = ["--dir", out, "--losses", losses]
    run_ranks(W.run_example, 4, script, base + ["--mesh", "2x2", "--steps", "2"])
    rows = [r for r in read_manifest(f"{out}/ckpt").rows if r.key == "embed.weight/exp_avg"]
    assert sorted(r.offsets for r in rows) == [(0, 0), (129, 0)], rows     # 2 regions, once
    run_ranks(W.run_example, 2, script, base + ["--steps", "3", "--resume"])
    steps = [int(line.split()[0]) for line in open(losses)]
    assert steps == [1, 2, 3], steps
    assert read_manifest(f"{out}/ckpt").metadata["steps"]["embed.weight"] == 3

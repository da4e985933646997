"""Compressed Adam moments (``moment_dtype="bf16"`` / ``"int8"``) through the optimizers, every
store of ``helpers.stores.BACKENDS``, checkpoints and torch's state_dict.

Exactness: the stores only move bytes, so every backend gives the same bits as a DeviceStore
(``torch.equal``), also where a disk store's budget cuts a parameter into several pipeline
units (offsets and random bits follow the parameter's elements, not the units). Accuracy
against fp32 moments is the encodings' (tests/kernels/test_moments_quant.py); here a loose check
that a few steps stay close to torch.optim.AdamW.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import statestore as ss
from statestore import StateKey
from statestore.errors import CheckpointMismatchError, StateStoreValueError
from statestore.optim import CPUAdam, HybridAdam
from statestore.kernels import _quant as Q

K = StateKey
MOMENTS = ["bf16", "int8"]
# 9000 elements: cut into units on the small-budget simulated disk (bf16); 300x7: several
# int8 blocks with a partial last one
SHAPES = [(7,), (300, 7), (9000,), (1,)]


def make_params(seed=0, shapes=SHAPES, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def clone(params):
    return [nn.Parameter(p.detach().clone()) for p in params]


def grads_for(params, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g).to(p.dtype) for p in params] for _ in range(steps)]


def train(opt, params, grads):
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()


def named(params):
    return [(f"p{i}", p) for i, p in enumerate(params)]


@pytest.mark.parametrize("md", MOMENTS)
def test_every_backend_bit_identical_to_device_store(store, md):
    params = make_params()
    grads = grads_for(params, 4)
    ref = clone(params)
    with ss.DeviceStore("cpu") as dev:
        o1 = CPUAdam(named(ref), lr=1e-2, weight_decay=0.01, state_store=dev, moment_dtype=md)
        train(o1, ref, grads)
        want = {str(k): dev.get(k).clone() for k in dev.keys()}
    o2 = CPUAdam(named(params), lr=1e-2, weight_decay=0.01, state_store=store, moment_dtype=md)
    train(o2, params, grads)
    for a, b in zip(params, ref):
        assert torch.equal(a, b)
    store.sync()
    assert {str(k) for k in store.keys()} == set(want)
    for k in store.keys():
        assert store.spec(k).dtype == want[str(k)].dtype
        assert torch.equal(store.get(k).cpu(), want[str(k)]), str(k)


@pytest.mark.parametrize("md", MOMENTS)
def test_cut_into_units_on_disk_same_bits(tmp_path, md):
    """A parameter larger than a disk store's unit is cut (int8: at multiples of 262144
    elements, where every slice starts 4096-aligned); the result does not depend on it."""
    n = 3 * 262144 + 1000
    params = [nn.Parameter(torch.randn(n)), nn.Parameter(torch.randn(300))]
    grads = grads_for(params, 3)
    ref = clone(params)
    with ss.DeviceStore("cpu") as dev, \
            ss.NVMeStore(str(tmp_path / "n"), budget_bytes=8 << 20) as nv:
        o1 = CPUAdam(ref, lr=1e-3, state_store=dev, moment_dtype=md)
        o2 = CPUAdam(params, lr=1e-3, state_store=nv, moment_dtype=md)
        units, _ = o2._plan(nv, [(o2.param_groups[0], params)])
        assert len(units) > 1          # really cut
        train(o1, ref, grads)
        train(o2, params, grads)
        for a, b in zip(params, ref):
            assert torch.equal(a, b)
        for k in dev.keys():
            assert torch.equal(nv.get(k), dev.get(k)), str(k)


@pytest.mark.parametrize("md", MOMENTS)
@pytest.mark.parametrize("pdtype", [torch.float32, torch.bfloat16], ids=str)
def test_close_to_torch_adamw(md, pdtype):
    """A few steps of compressed moments stay near torch's fp32 AdamW (the encodings'
    error, not float32 rounding: 2% of the parameter change for bf16, 5% for int8, whose
    E4M3 exp_avg keeps 1/16 relative error at every magnitude, not 1% at the block's top)."""
    params = make_params(dtype=pdtype)
    start = [p.detach().float().clone() for p in params]
    ref = [nn.Parameter(p.detach().float().clone()) for p in params]
    grads = grads_for(params, 5)
    opt = CPUAdam(params, lr=1e-2, moment_dtype=md)
    topt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.0, foreach=False)
    train(opt, params, grads)
    train(topt, ref, [[g.float() for g in gs] for gs in grads])
    for p, r, s in zip(params, ref, start):
        dp, dr = p.detach().float() - s, r.detach() - s
        tol = (0.05 if md == "int8" else 0.02) * dr.abs().max() + \
            (0.01 if pdtype == torch.bfloat16 else 0)
        assert float((dp - dr).abs().max()) <= float(tol) + 1e-6


@pytest.mark.parametrize("md", ["fp32"] + MOMENTS)
@pytest.mark.parametrize("big", [1e21, 1e30])
def test_finite_gradient_keeps_every_parameter_finite_as_torch(md, big):
    """A finite gradient element whose square overflows float32: torch's exp_avg_sq is +inf,
    its parameter stops moving and every parameter stays finite; so here, for every
    moment_dtype (int8 used to store the whole block of 256 as NaN)."""
    params = make_params(shapes=[(1000,)])
    ref = clone(params)
    grads = grads_for(params, 4)
    grads[0][0][300] = big
    opt = CPUAdam(params, lr=1e-3, moment_dtype=md, skip_nonfinite=True)
    topt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.0, foreach=False)
    train(opt, params, grads)
    train(topt, ref, grads)
    p, r = params[0].detach(), ref[0].detach()
    assert torch.isfinite(r).all() and torch.isfinite(p).all()
    assert float((p[300] - r[300]).abs()) < 1e-6          # torch's: frozen since step 1
    st = opt.state_dict()["state"][0]
    assert torch.isfinite(st["exp_avg"]).all()
    near = [i for i in range(1000) if i // 256 != 1]
    assert float((p[near] - r[near]).abs().max()) < 1e-3   # other blocks: as before


@pytest.mark.parametrize("md", ["fp32"] + MOMENTS)
def test_stats_nbytes_shows_saving(md):
    params = make_params(shapes=[(1000, 256)])
    with ss.DeviceStore("cpu") as st:
        opt = CPUAdam(params, state_store=st, moment_dtype=md)
        train(opt, params, grads_for(params, 1))
        n = 1000 * 256
        want = {"fp32": 8 * n, "bf16": 4 * n, "int8": 2 * n + 2 * 4 * (n // 256)}[md]
        assert st.stats()["nbytes"] == want
        assert opt.moment_dtype == md


@pytest.mark.parametrize("md", MOMENTS)
def test_state_dict_is_torch_format_and_adamw_loads_it(store, md):
    params = make_params()
    grads = grads_for(params, 3)
    opt = CPUAdam(named(params), lr=1e-2, state_store=store, moment_dtype=md)
    train(opt, params, grads)
    sd = opt.state_dict()
    for i, p in enumerate(params):
        st = sd["state"][i]
        assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
        for n in ("exp_avg", "exp_avg_sq"):
            assert st[n].dtype == torch.float32 and st[n].shape == p.shape
        # the decoded store states, exactly
        key = f"p{i}"
        codes = store.get(K(key, "exp_avg"))
        sc = store.get(K(key, "exp_avg_scale")) if md == "int8" else None
        assert torch.equal(st["exp_avg"].reshape(-1), Q.decode(md, 0, codes, sc))
    tparams = clone(params)
    topt = torch.optim.AdamW(tparams, lr=1e-2)
    topt.load_state_dict(sd)
    more = grads_for(params, 1, seed=9)
    train(topt, tparams, more)
    assert all(torch.isfinite(p).all() for p in tparams)


@pytest.mark.parametrize("md", MOMENTS)
def test_load_fp32_state_dict_quantizes(store, md):
    params = make_params()
    tparams = clone(params)
    topt = torch.optim.AdamW(tparams, lr=1e-2, weight_decay=0.0)
    train(topt, tparams, grads_for(params, 3))
    sd = topt.state_dict()
    opt = CPUAdam(params, lr=1e-2, state_store=store, moment_dtype=md)
    opt.load_state_dict(sd)
    dt = {"bf16": (torch.bfloat16, torch.bfloat16), "int8": (torch.int8, torch.uint8)}[md]
    assert store.spec(K("0", "exp_avg")).dtype == dt[0]
    assert store.spec(K("0", "exp_avg_sq")).dtype == dt[1]
    back = opt.state_dict()
    for i in sd["state"]:
        for n in ("exp_avg", "exp_avg_sq"):
            x, y = sd["state"][i][n], back["state"][i][n]
            c, s = Q.encode(md, 0 if n == "exp_avg" else 1, x.reshape(-1), rounding="nearest")
            assert torch.equal(y.reshape(-1).cpu(), Q.decode(md, 0 if n == "exp_avg" else 1, c, s))
        assert int(back["state"][i]["step"]) == 3


@pytest.mark.parametrize("md", MOMENTS)
def test_checkpoint_resume_bit_identical_across_stores(tmp_path, md):
    """Save from NVMe, load into a pinned-memory store in a new optimizer, train on: the same
    bits as never stopping; shards open with stock safetensors and keep the encoded dtypes;
    the metadata records the encoding."""
    from safetensors import safe_open
    params = make_params(dtype=torch.float32) + make_params(seed=3, shapes=[(513,)],
                                                             dtype=torch.bfloat16)
    grads = grads_for(params, 6)
    ref = clone(params)
    with ss.DeviceStore("cpu") as dev:
        o = CPUAdam(named(ref), lr=1e-2, state_store=dev, moment_dtype=md)
        train(o, ref, grads)
    run = clone(params)
    ck = str(tmp_path / "ck")
    with ss.NVMeStore(str(tmp_path / "nv"), budget_bytes=4 << 20) as nv:
        o = CPUAdam(named(run), lr=1e-2, state_store=nv, moment_dtype=md)
        train(o, run, grads[:3])
        nv.save_checkpoint(ck)
    dtypes = set()
    for f in os.listdir(ck):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(ck, f), "pt") as sf:
                for k in sf.keys():
                    dtypes.add(sf.get_tensor(k).dtype)
    want = {torch.bfloat16} if md == "bf16" else {torch.int8, torch.uint8}
    assert want <= dtypes
    man = ss.checkpoint.read_manifest(ck)
    meta = man.metadata
    meta = meta if "moment_dtype" in meta else json.loads(json.dumps(meta))
    assert meta["moment_dtype"] == md
    assert meta["moment_encoding"]["version"] == (2 if md == "int8" else 1)
    if md == "int8":
        assert "e4m3" in meta["moment_encoding"]["exp_avg"]
    with ss.PinnedCPUStore() as pin:
        pin.load_checkpoint(ck)
        o = CPUAdam(named(run), lr=1e-2, state_store=pin, moment_dtype=md)
        train(o, run, grads[3:])
    for a, b in zip(run, ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("saved,resumed", [("int8", "fp32"), ("fp32", "bf16"),
                                           ("bf16", "int8")])
def test_resume_with_other_moment_dtype_raises(tmp_path, saved, resumed):
    params = make_params()
    with ss.DeviceStore("cpu") as st:
        o = CPUAdam(named(params), state_store=st, moment_dtype=saved)
        train(o, params, grads_for(params, 1))
        st.save_checkpoint(str(tmp_path / "ck"))
    with ss.DeviceStore("cpu") as st:
        st.load_checkpoint(str(tmp_path / "ck"))
        with pytest.raises(CheckpointMismatchError, match="moment_dtype"):
            CPUAdam(named(params), state_store=st, moment_dtype=resumed)


def test_int8_checkpoint_of_encoding_version_1_is_refused_by_name(tmp_path):
    """A checkpoint of the version-1 int8 encoding (the power maps of earlier releases): an
    int8 optimizer refuses to step it, naming the encoding and the way to convert; its
    moments still decode with the version-1 maps (what statestore convert uses)."""
    from statestore.optim._moments import MomentFormat
    params = make_params()
    with ss.DeviceStore("cpu") as st:
        o = CPUAdam(named(params), state_store=st, moment_dtype="int8")
        train(o, params, grads_for(params, 1))
        st.save_checkpoint(str(tmp_path / "ck"))
    with ss.DeviceStore("cpu") as st:
        st.load_checkpoint(str(tmp_path / "ck"))
        meta = st.loaded_metadata
        meta["moment_encoding"] = {"version": 1, "exp_avg": "int8 sign(c)*(c/127)^2*scale",
                                   "exp_avg_sq": "uint8 (c/255)^4*scale"}
        with pytest.raises(CheckpointMismatchError, match=r"encoding version 1.*convert"):
            CPUAdam(named(params), state_store=st, moment_dtype="int8")
    old = MomentFormat("int8", encoding={"version": 1})
    codes = torch.tensor([127, -64, 0], dtype=torch.int8)
    got = old.to_fp32("exp_avg", codes, torch.tensor([3.0]))
    assert torch.allclose(got, torch.tensor([3.0, -3.0 * 64 * 64 / 127 ** 2, 0.0]))
    assert not torch.allclose(MomentFormat("int8").to_fp32("exp_avg", codes, torch.tensor([3.0])),
                              got)


@pytest.mark.parametrize("bad", ["fp16", "int4", 3, None])
def test_bad_moment_dtype(bad):
    with pytest.raises(StateStoreValueError, match="moment_dtype"):
        CPUAdam(make_params(), moment_dtype=bad)
    with pytest.raises(StateStoreValueError, match="moment_rounding"):
        HybridAdam(make_params(), moment_dtype="bf16", moment_rounding="up")


def test_amsgrad_and_low_precision_params_with_int8(store):
    params = make_params(dtype=torch.bfloat16)
    opt = CPUAdam(named(params), lr=1e-2, amsgrad=True, state_store=store, moment_dtype="int8")
    train(opt, params, grads_for(params, 3))
    names = {k.state for k in store.keys()}
    assert names == {"exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale",
                     "max_exp_avg_sq", "master"}
    assert store.spec(K("p1", "master")).dtype == torch.float32
    assert store.spec(K("p1", "max_exp_avg_sq")).dtype == torch.float32
    assert all(torch.isfinite(p.float()).all() for p in params)


@pytest.mark.parametrize("md", MOMENTS)
def test_convert_to_torch_decodes_moments(tmp_path, md):
    from statestore.__main__ import to_torch_state_dict
    params = make_params()
    with ss.DeviceStore("cpu") as st:
        o = CPUAdam(named(params), lr=1e-2, state_store=st, moment_dtype=md)
        train(o, params, grads_for(params, 2))
        want = o.state_dict()
        st.save_checkpoint(str(tmp_path / "ck"))
    sd = to_torch_state_dict(str(tmp_path / "ck"))
    for i, st_ in want["state"].items():
        assert set(sd["state"][i]) == {"step", "exp_avg", "exp_avg_sq"}
        for n in ("exp_avg", "exp_avg_sq"):
            assert sd["state"][i][n].dtype == torch.float32
            assert torch.equal(sd["state"][i][n], st_[n])
    torch.optim.AdamW(clone(params), lr=1e-2).load_state_dict(sd)


def test_checkpoint_of_other_moment_dtype_loaded_under_a_live_optimizer_raises(tmp_path):
    """torch's order (optimizer first, then the checkpoint into its store): states of another
    encoding are refused with a message naming both, nothing is updated."""
    params = make_params()
    with ss.DeviceStore("cpu") as st:
        o = CPUAdam(named(params), state_store=st, moment_dtype="fp32")
        train(o, params, grads_for(params, 1))
        st.save_checkpoint(str(tmp_path / "ck"))
    with ss.DeviceStore("cpu") as st:
        o = CPUAdam(named(params), state_store=st, moment_dtype="int8")
        before = [p.detach().clone() for p in params]
        # refused when the load updates the live optimizer, or at the latest by the step
        with pytest.raises((CheckpointMismatchError, StateStoreValueError),
                           match="moment_dtype.*'int8'"):
            st.load_checkpoint(str(tmp_path / "ck"))
            train(o, params, grads_for(params, 1))
        assert all(torch.equal(a, b) for a, b in zip(params, before))


@pytest.mark.parametrize("md", MOMENTS)
def test_update_in_backward_same_bits(tmp_path, md):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 300), nn.Tanh(), nn.Linear(300, 5))
    twin = nn.Sequential(nn.Linear(40, 300), nn.Tanh(), nn.Linear(300, 5))
    twin.load_state_dict(model.state_dict())
    x = torch.randn(16, 40)
    with ss.NVMeStore(str(tmp_path / "a"), budget_bytes=4 << 20) as a, \
            ss.NVMeStore(str(tmp_path / "b"), budget_bytes=4 << 20) as b:
        o1 = CPUAdam(model.parameters(), lr=1e-2, state_store=a, moment_dtype=md)
        o2 = CPUAdam(twin.parameters(), lr=1e-2, state_store=b, moment_dtype=md,
                     update_in_backward=True)
        for _ in range(4):
            for m_, o in ((model, o1), (twin, o2)):
                m_(x).pow(2).mean().backward()
                o.step()
                o.zero_grad()
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q)

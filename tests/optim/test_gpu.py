"""Every CUDA path, against torch on the same GPU (all marked ``cuda``; they skip without CUDA,
and ``make gpu-test`` runs them with ``STATESTORE_REQUIRE_CUDA=1``, which fails instead).

* HybridAdam with CUDA parameters against ``torch.optim.AdamW(fused=True)`` on CUDA: fp32, bf16
  and fp16 parameters and gradients (bf16/fp16 parameters: fp32 masters in the store, checked
  against torch's fused AdamW over fp32 copies), amsgrad, both decay modes, loss scaling against
  torch's ``grad_scale``, the non-finite skip against its ``found_inf``; on a CUDA store (the
  fused CUDA kernel) and on host and NVMe stores (the staging path, docs/gpu.md).
* The staging path on a real device: page-locked staging, gradients staged during
  backward, bit-identical to the synchronous copies it replaces (same CPU kernel, same data),
  with clipping, accumulation and ``update_in_backward``.
* NVMe -> page-locked ring -> GPU: the store's pipeline hands out page-locked host tensors that
  go to the GPU asynchronously.
* Checkpoints from a CUDA store load into CPU stores and back, bit for bit, and training
  resumed on the GPU is bit-identical to never stopping.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

import statestore as ss
from statestore.kernels import kernels_info
from statestore.optim import HybridAdam

pytestmark = pytest.mark.cuda

RTOL, ATOL = 1e-5, 1e-6       # float32 rounding headroom, as tests/optim/test_optim.py
SHAPES = [(7,), (9000,), (3, 5), (1,), (257, 129)]


def _host_store(name, tmp):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        if name == "pinned":
            return ss.PinnedCPUStore()
        if name == "device-cpu":
            return ss.DeviceStore("cpu")
        if name == "file":
            return ss.FileStore(str(tmp / "file"))
        if name == "nvme":
            return ss.NVMeStore(str(tmp / "nvme"), budget_bytes=1 << 20)
        if name == "device-cuda":
            return ss.DeviceStore("cuda")
    raise ValueError(name)


STORES = ["device-cuda", "pinned", "device-cpu", "nvme"]


def _params(dtype, seed=0, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g).to(dtype).to(device)) for s in SHAPES]


def _grads(params, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g).to(p.dtype).to(p.device) for p in params]
            for _ in range(steps)]


def test_require_cuda_means_the_fused_kernel():
    """What make gpu-test checks first: a CUDA device, and the extension's CUDA kernel."""
    assert torch.cuda.is_available()
    info = kernels_info()
    if os.environ.get("STATESTORE_REQUIRE_CUDA", "") not in ("", "0"):
        assert info["cuda"] == "fused-cuda", info


# ============================================================================ against torch
@pytest.mark.parametrize("store_name", STORES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("hp", [dict(weight_decay=0.1), dict(amsgrad=True, weight_decay=0.1),
                                dict(adamw_mode=False, weight_decay=0.1)],
                         ids=["adamw", "amsgrad", "l2"])
def test_hybrid_adam_against_torch_fused(store_name, dtype, hp, tmp_path):
    params = _params(dtype)
    grads = _grads(params, 4)
    store = _host_store(store_name, tmp_path)
    opt = HybridAdam(params, lr=1e-2, state_store=store, **hp)
    adamw = hp.get("adamw_mode", True)
    # the reference: torch's fused Adam(W) over fp32 copies (the masters of bf16/fp16 params)
    ref = [nn.Parameter(p.detach().float().clone()) for p in params]
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    topt = cls(ref, lr=1e-2, fused=True, weight_decay=hp["weight_decay"],
               amsgrad=hp.get("amsgrad", False))
    for gs in grads:
        for p, r, g in zip(params, ref, gs):
            p.grad = g.clone()
            r.grad = g.float()
        opt.step()
        topt.step()
    torch.cuda.synchronize()
    if store_name != "device-cuda":
        assert opt._staging is not None
        st = opt._staging.stats()
        assert st["staged_params"] == len(params) and st["staging_pageable_bytes"] == 0
    for i, (p, r) in enumerate(zip(params, ref)):
        if dtype == torch.float32:
            torch.testing.assert_close(p, r, rtol=RTOL, atol=ATOL)
        else:
            master = store.get(ss.StateKey(str(i), "master")).to("cuda")
            torch.testing.assert_close(master, r.detach(), rtol=RTOL, atol=ATOL)
            assert torch.equal(p.detach(), master.to(dtype))
        s = topt.state[r]
        torch.testing.assert_close(store.get(ss.StateKey(str(i), "exp_avg")).to("cuda"),
                                   s["exp_avg"], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(store.get(ss.StateKey(str(i), "exp_avg_sq")).to("cuda"),
                                   s["exp_avg_sq"], rtol=RTOL, atol=ATOL)
    store.close()


@pytest.mark.parametrize("store_name", STORES)
def test_grad_scale_and_found_inf(store_name, tmp_path):
    """step(div_scale=S) against torch's fused AdamW with grad_scale=S (what GradScaler
    passes); skip_nonfinite against found_inf: a step with an inf gradient changes nothing."""
    scale = 1024.0                  # a power of two: 1/S is exact (docs/kernels.md)
    params = _params(torch.float32, seed=2)
    grads = _grads(params, 4, seed=3)
    grads[2][1][5] = float("inf")
    store = _host_store(store_name, tmp_path)
    opt = HybridAdam(params, lr=1e-2, weight_decay=0.1, state_store=store, skip_nonfinite=True)
    ref = [nn.Parameter(p.detach().clone()) for p in params]
    topt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True)
    for gs in grads:
        finite = all(bool(torch.isfinite(g).all()) for g in gs)
        for p, r, g in zip(params, ref, gs):
            p.grad = g * scale
            r.grad = g * scale
        opt.step(div_scale=scale)
        topt.grad_scale = torch.tensor(scale, device="cuda")
        topt.found_inf = torch.tensor(0.0 if finite else 1.0, device="cuda")
        topt.step()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r, rtol=RTOL, atol=ATOL)
    assert opt._steps["0"] == 3
    store.close()


@pytest.mark.parametrize("moment_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("store_name", ["device-cuda", "pinned"])
def test_moment_dtypes(moment_dtype, store_name, tmp_path):
    """Compressed moments with CUDA parameters follow the same optimizer with CPU ones."""
    try:
        HybridAdam([nn.Parameter(torch.zeros(2))], moment_dtype=moment_dtype)
    except TypeError as e:
        pytest.skip(f"moment_dtype is not in this build: {e}")
    runs = []
    for dev in ("cuda", "cpu"):
        params = _params(torch.float32, device=dev)
        store = _host_store(store_name if dev == "cuda" else "device-cpu", tmp_path / dev)
        opt = HybridAdam(params, lr=1e-2, state_store=store, moment_dtype=moment_dtype)
        for gs in _grads(params, 3):
            for p, g in zip(params, gs):
                p.grad = g
            opt.step()
        runs.append([p.detach().cpu() for p in params])
        store.close()
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ============================================================================ the staging path
class _Net(nn.Module):
    """Linear layers only: their backward (cuBLAS products, sums) gives the same bits run to
    run, which the comparisons need (an embedding's backward may use atomics)."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(64, 256)
        self.hid = nn.Linear(256, 256)
        self.out = nn.Linear(256, 300)
        self.to(dtype).cuda()

    def forward(self, x):
        return self.out(torch.tanh(self.hid(torch.tanh(self.inp(x)))))


def _batch(step, dtype):
    g = torch.Generator().manual_seed(step)
    return (torch.randn(256, 64, generator=g).to(dtype).cuda(),
            torch.randint(300, (256,), generator=g).cuda())


def _train(store, dtype, steps=4, sync_path=False, between=None, backwards=1, **kw):
    model = _Net(dtype)
    opt = HybridAdam(model.named_parameters(), lr=1e-2, weight_decay=0.1, state_store=store, **kw)
    if sync_path:
        opt._staging.close()
        opt._staging = None             # the synchronous copies the path replaces
    for step in range(steps):
        for _ in range(backwards):
            x, y = _batch(step, dtype)
            nn.functional.cross_entropy(model(x).float(), y).backward()
        if between is not None:
            between(model, opt)
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, opt


@pytest.mark.parametrize("store_name", ["pinned", "nvme"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ["plain", "clip", "accumulate", "in_backward"])
def test_staging_bit_identical_to_sync_copies(store_name, dtype, case, tmp_path):
    kw = {}
    if case == "clip":
        kw["between"] = lambda m, o: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
    elif case == "accumulate":
        kw["backwards"] = 2
    elif case == "in_backward":
        kw["update_in_backward"] = True
    want, _ = _train(_host_store(store_name, tmp_path / "a"), dtype, sync_path=True, **kw)
    got, opt = _train(_host_store(store_name, tmp_path / "b"), dtype, **kw)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    st = opt._staging.stats()
    assert st["staging_pinned_bytes"] > 0 and st["staging_pageable_bytes"] == 0
    opt.state_store.close()


def test_gradients_staged_during_backward(tmp_path):
    """After backward and before step(), every gradient's copy is already queued."""
    store = ss.PinnedCPUStore()
    model = _Net(torch.float32)
    opt = HybridAdam(model.parameters(), state_store=store)
    x, _ = _batch(0, torch.float32)
    model(x).sum().backward()
    path = opt._staging
    for p in model.parameters():
        st = path._staging[p]
        assert st.grad_event is not None and path._fresh(st, p, p.grad, param=True)
        assert st.grad.is_pinned()
    opt.step()
    store.close()


# ============================================================================ stores
def test_pinned_store_is_page_locked():
    store = ss.PinnedCPUStore()
    store.create("a/m", (1 << 20,), torch.float32, torch.arange(1 << 20, dtype=torch.float32))
    t = store.get("a/m")
    assert store.stats()["pinned"] and store.stats()["pinned_bytes"] >= 4 << 20
    assert t.is_pinned()
    d = t.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(d.cpu(), t)
    store.close()


def test_small_pinned_slabs_of_many_stores_all_register():
    """Slabs smaller than a page from the C heap shared pages, and cudaHostRegister of the
    second failed (error 712), leaving the runtime's last error set for torch's next kernel."""
    stores = [ss.PinnedCPUStore() for _ in range(3)]
    for i in range(12):
        for j, st in enumerate(stores):
            st.create_many([(f"{i}/{j}/m", (3 + i,), torch.float32, None),
                            (f"{i}/{j}/s", (), torch.float32, torch.tensor(1.0))])
    for st in stores:
        for k in st.keys():
            assert st.get(k).is_pinned(), k
    assert torch.zeros(4, device="cuda").sum().item() == 0     # no error left behind
    for st in stores:
        st.close()


def test_nvme_to_pinned_to_gpu_pipeline(tmp_path):
    """NVMe -> the store's page-locked ring -> GPU (non_blocking) -> back, unit by unit."""
    n = 3 << 18
    store = ss.NVMeStore(str(tmp_path / "nvme"), budget_bytes=1 << 20)
    assert store.stats()["buffer_kind"] in (None, "cuda-registered")
    src = torch.randn(n)
    store.create("a/m", (n,), torch.float32, src)
    step = 1 << 16
    units = [[ss.Slice(ss.StateKey("a", "m"), s, min(s + step, n))] for s in range(0, n, step)]
    on_gpu = torch.empty(n, device="cuda")
    with store.pipeline(units, mode="rw") as pipe:
        for u, (t,) in zip(units, pipe):
            a, b = u[0].start, u[0].stop
            assert t.is_pinned()
            on_gpu[a:b].copy_(t, non_blocking=True)
            on_gpu[a:b].mul_(2)
            t.copy_(on_gpu[a:b], non_blocking=True)
            torch.cuda.current_stream().synchronize()   # before the store writes t back
    assert store.stats()["buffer_kind"] == "cuda-registered"
    assert torch.equal(store.get("a/m"), src * 2)
    assert torch.equal(on_gpu.cpu(), src * 2)
    store.close()


# ============================================================================ checkpoints
def _cuda_model_run(store, steps, start=None):
    params = _params(torch.bfloat16, seed=4)
    if start is not None:
        with torch.no_grad():
            for p, s in zip(params, start):
                p.copy_(s)
    opt = HybridAdam(params, lr=1e-2, weight_decay=0.1, amsgrad=True, state_store=store)
    grads = _grads(params, 6, seed=5)
    done = opt._steps.get("0", 0)
    for gs in grads[done:done + steps]:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    return params, opt


@pytest.mark.parametrize("host", ["pinned", "device-cpu", "file", "nvme"])
def test_checkpoint_cuda_to_host_and_back(host, tmp_path):
    cuda_store = ss.DeviceStore("cuda")
    never_stopped, _ = _cuda_model_run(ss.DeviceStore("cuda"), 6)
    params, opt = _cuda_model_run(cuda_store, 3)
    cuda_store.save_checkpoint(str(tmp_path / "c1"))
    saved = {str(k): cuda_store.get(k).cpu().clone() for k in cuda_store.keys()}
    hs = _host_store(host, tmp_path)
    hs.load_checkpoint(str(tmp_path / "c1"))
    assert {str(k): hs.get(k).cpu() for k in hs.keys()}.keys() == saved.keys()
    for k in hs.keys():
        assert torch.equal(hs.get(k).cpu(), saved[str(k)]), k
    hs.save_checkpoint(str(tmp_path / "c2"))
    back = ss.DeviceStore("cuda")
    back.load_checkpoint(str(tmp_path / "c2"))
    for k in back.keys():
        assert back.get(k).is_cuda and torch.equal(back.get(k).cpu(), saved[str(k)]), k
    # resumed on the GPU from the round trip: bit-identical to never having stopped
    resumed, opt2 = _cuda_model_run(back, 3, start=[p.detach() for p in params])
    assert opt2._steps["0"] == 6
    for a, b in zip(resumed, never_stopped):
        assert torch.equal(a, b)
    for s in (cuda_store, hs, back):
        s.close()

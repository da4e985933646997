"""Tests of the Adam kernels (statestore.kernels): every SIMD path and the scalar path against
a float64 reference, against torch.optim.AdamW / Adam, and against each other bit for bit.

Tolerances: the kernels compute in float32; after a few steps they agree with the float64
reference to a few float32 ulps of the values involved (rtol 2e-5 below leaves room for the
lerp/addcmul rounding differences); low-precision parameters are compared exactly with the
float32 master converted by torch (round to nearest even).
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings

import pytest
import torch

import statestore.kernels as K
from statestore.kernels import _dispatch
from statestore.kernels._reference import adam_step_reference

ext = _dispatch.load_extension()
needs_ext = pytest.mark.skipif(ext is None, reason=f"statestore._C_adam missing: {_dispatch._state['reason']}")
SUPPORTED = _dispatch.simd_supported()
ALL_PATHS = ["avx512", "avx2", "scalar"]
SIZES = [1, 7, 15, 16, 17, 1023, 2 ** 20 + 3]
LOWP = [torch.float16, torch.bfloat16]
HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


@pytest.fixture
def simd(request):
    """Selects a CPU path for one test and restores the default afterwards."""
    name = request.param
    if ext is None:
        pytest.skip("statestore._C_adam missing")
    if name not in SUPPORTED:
        pytest.skip(f"this processor lacks {name} (supports {SUPPORTED})")
    K._set_simd(name)
    yield name
    K._set_simd("auto")


def make(n, *, gdtype=torch.float32, pdtype=torch.float32, amsgrad=False, seed=0, scale=1.0):
    """A parameter set: dict with p, g, m, v, vmax, master (None for fp32 params)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=gen)
    g = (torch.randn(n, generator=gen) * scale).to(gdtype)
    m = torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 0.01
    vmax = v + torch.rand(n, generator=gen) * 0.01 if amsgrad else None
    if pdtype == torch.float32:
        return dict(p=w, g=g, m=m, v=v, vmax=vmax, master=None)
    return dict(p=w.to(pdtype), g=g, m=m, v=v, vmax=vmax, master=w.clone())


def clone(case):
    return {k: (t.clone() if t is not None else None) for k, t in case.items()}


def run(fn, cases, *, step=1, amsgrad=False, **kw):
    has_master = any(c["master"] is not None for c in cases)
    fn(K.AdamTensors([c["p"] for c in cases], [c["g"] for c in cases], [c["m"] for c in cases],
                     [c["v"] for c in cases], [step] * len(cases),
                     [c["vmax"] for c in cases] if amsgrad else None,
                     [c["master"] for c in cases] if has_master else None),
       K.AdamHyper(**{**HP, **kw}, amsgrad=amsgrad))


def reference64(case, *, steps, amsgrad, **kw):
    """float64 copy of ``case`` stepped by the reference for steps 1..steps."""
    c = {k: (t.double() if t is not None else None) for k, t in case.items()}
    c["master"] = None
    if case["master"] is not None:
        c["p"] = case["master"].double()
    for s in range(1, steps + 1):
        run(adam_step_reference, [c], step=s, amsgrad=amsgrad, **kw)
    return c


def assert_close64(got, want, name):
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


OPTIONS = [
    dict(weight_decay=0.0, adamw_mode=True),
    dict(weight_decay=0.1, adamw_mode=True),
    dict(weight_decay=0.1, adamw_mode=False),
    dict(weight_decay=0.01, adamw_mode=True, maximize=True, grad_scale=1024.0),
    dict(weight_decay=0.01, adamw_mode=False, amsgrad=True, grad_scale=3.0),
]


# ---------------------------------------------------------------- every path vs float64
@needs_ext
@pytest.mark.parametrize("simd", ALL_PATHS, indirect=True)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("opt", range(len(OPTIONS)))
def test_fp32_params_vs_float64(simd, n, opt):
    kw = dict(OPTIONS[opt])
    amsgrad = kw.pop("amsgrad", False)
    scale = kw.get("grad_scale", 1.0)
    case = make(n, amsgrad=amsgrad, seed=n + opt, scale=scale)
    ref = reference64(case, steps=3, amsgrad=amsgrad, **kw)
    for s in range(1, 4):
        run(K.adam_step, [case], step=s, amsgrad=amsgrad, **kw)
    for k in ("p", "m", "v") + (("vmax",) if amsgrad else ()):
        assert_close64(case[k], ref[k], k)


@needs_ext
@pytest.mark.parametrize("simd", ALL_PATHS, indirect=True)
@pytest.mark.parametrize("gdtype", [torch.float32] + LOWP, ids=str)
@pytest.mark.parametrize("pdtype", [torch.float32] + LOWP, ids=str)
@pytest.mark.parametrize("n", [17, 1023, 2 ** 20 + 3])
def test_dtypes_vs_float64(simd, gdtype, pdtype, n):
    if n > 2 ** 20 and simd == "scalar" and (gdtype, pdtype) != (torch.bfloat16, torch.bfloat16):
        pytest.skip("one large scalar case is enough")
    kw = dict(weight_decay=0.05, adamw_mode=True)
    case = make(n, gdtype=gdtype, pdtype=pdtype, seed=3)
    ref = reference64(case, steps=2, amsgrad=False, **kw)
    for s in (1, 2):
        run(K.adam_step, [case], step=s, **kw)
    w = case["master"] if case["master"] is not None else case["p"]
    assert_close64(w, ref["p"], "master" if case["master"] is not None else "p")
    assert_close64(case["m"], ref["m"], "m")
    assert_close64(case["v"], ref["v"], "v")
    if case["master"] is not None:
        # written back in the same pass, rounded to nearest even as torch's .to() does
        assert torch.equal(case["p"], case["master"].to(pdtype))


# ---------------------------------------------------------------- SIMD == scalar, bit for bit
@needs_ext
@pytest.mark.parametrize("path", ["avx512", "avx2"])
@pytest.mark.parametrize("gdtype", [torch.float32] + LOWP, ids=str)
@pytest.mark.parametrize("pdtype", [torch.float32] + LOWP, ids=str)
@pytest.mark.parametrize("amsgrad", [False, True])
def test_simd_bit_identical_to_scalar(path, gdtype, pdtype, amsgrad):
    if path not in SUPPORTED:
        pytest.skip(f"this processor lacks {path}")
    kw = dict(weight_decay=0.02, adamw_mode=not amsgrad, maximize=amsgrad, grad_scale=2.0)
    try:
        for n in (1, 7, 15, 16, 17, 33, 1023):
            case = make(n, gdtype=gdtype, pdtype=pdtype, amsgrad=amsgrad, seed=n)
            a, b = clone(case), clone(case)
            K._set_simd(path)
            run(K.adam_step, [a], step=5, amsgrad=amsgrad, **kw)
            K._set_simd("scalar")
            run(K.adam_step, [b], step=5, amsgrad=amsgrad, **kw)
            for k in a:
                if a[k] is not None:
                    assert torch.equal(a[k], b[k]), (n, k)
    finally:
        K._set_simd("auto")


# ---------------------------------------------------------------- vs torch.optim
@needs_ext
@pytest.mark.parametrize("simd", ALL_PATHS, indirect=True)
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
def test_against_torch_optim(simd, adamw_mode, amsgrad, maximize):
    torch.manual_seed(0)
    shapes = [(1,), (7,), (17,), (33, 31), (1023,)]
    ours = [torch.randn(s) for s in shapes]
    theirs = [t.clone().requires_grad_() for t in ours]
    cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    opt = cls(theirs, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, amsgrad=amsgrad,
              maximize=maximize, foreach=False)
    m = [torch.zeros_like(t) for t in ours]
    v = [torch.zeros_like(t) for t in ours]
    vmax = [torch.zeros_like(t) for t in ours] if amsgrad else None
    for step in range(1, 6):
        grads = [torch.randn(s) for s in shapes]
        for t, g in zip(theirs, grads):
            t.grad = g.clone()
        opt.step()
        K.adam_step(K.AdamTensors(ours, grads, m, v, [step] * len(ours), vmax),
                    K.AdamHyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1,
                                adamw_mode=adamw_mode, amsgrad=amsgrad, maximize=maximize))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
    for i, t in enumerate(theirs):
        torch.testing.assert_close(m[i], opt.state[t]["exp_avg"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(v[i], opt.state[t]["exp_avg_sq"], rtol=1e-5, atol=1e-9)


# ---------------------------------------------------------------- threads
@needs_ext
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16], ids=str)
def test_threads_bit_identical(gdtype):
    sizes = [2 ** 20 + 3] + [1000 + 37 * i for i in range(60)] + [3 * 2 ** 14 + 5]
    base = [make(n, gdtype=gdtype, pdtype=torch.bfloat16 if i % 3 == 0 else torch.float32,
                 amsgrad=True, seed=i) for i, n in enumerate(sizes)]
    old = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            cases = [clone(c) for c in base]
            run(K.adam_step, cases, step=2, amsgrad=True, weight_decay=0.1, adamw_mode=True)
            results.append(cases)
    finally:
        torch.set_num_threads(old)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            for k in a:
                if a[k] is not None:
                    assert torch.equal(a[k], b[k])


# ---------------------------------------------------------------- grads_finite
@pytest.mark.parametrize("dtype", [torch.float32] + LOWP, ids=str)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_grads_finite(dtype, bad):
    for n in (1, 17, 4099, 2 ** 17 + 3):
        gs = [torch.randn(5).to(dtype), torch.randn(n).to(dtype)]
        assert K.grads_finite(gs)
        for pos in {0, n // 2, n - 1}:
            g = gs[1].clone()
            g[pos] = bad
            assert not K.grads_finite([gs[0], g]), (n, pos)
    big = torch.full((3,), 6e4, dtype=dtype)  # large but finite
    assert K.grads_finite([big])
    assert K.grads_finite([])
    assert not K.grads_finite([torch.tensor([1.0, float("nan")], dtype=torch.float64)])
    nc = torch.randn(64, 64).to(dtype).t()
    nc[3, 5] = bad
    assert not K.grads_finite([nc])


@needs_ext
@pytest.mark.parametrize("simd", ALL_PATHS, indirect=True)
def test_grads_finite_each_path(simd):
    g = torch.randn(2 ** 16 + 17)
    assert K.grads_finite([g])
    g[-1] = float("nan")
    assert not K.grads_finite([g])


# ---------------------------------------------------------------- odd inputs, errors
@needs_ext
def test_non_contiguous_falls_back_per_tensor():
    base = torch.randn(32, 16)
    p_nc = base.clone().t()
    p_c = torch.randn(100)
    cases = [dict(p=p_nc, g=torch.randn(32, 16).t(), m=torch.zeros(16, 32), v=torch.zeros(16, 32)),
             dict(p=p_c, g=torch.randn(100), m=torch.zeros(100), v=torch.zeros(100))]
    refs = [{k: t.clone() for k, t in c.items()} for c in cases]
    lists = lambda cs: K.AdamTensors([c["p"] for c in cs], [c["g"] for c in cs],  # noqa: E731
                                     [c["m"] for c in cs], [c["v"] for c in cs], [1, 1])
    K.adam_step(lists(cases), K.AdamHyper(**HP))
    adam_step_reference(lists(refs), K.AdamHyper(**HP))
    for c, r in zip(cases, refs):
        torch.testing.assert_close(c["p"], r["p"], rtol=1e-6, atol=1e-7)


def test_python_argument_errors():
    p = [torch.randn(4)]
    z = [torch.zeros(4)]
    h = K.AdamHyper(**HP)
    with pytest.raises(ValueError, match="grads"):
        K.adam_step(K.AdamTensors(p, [], z, z, [1]), h)
    with pytest.raises(ValueError, match="max_exp_avg_sqs"):
        K.adam_step(K.AdamTensors(p, z, z, z, [1]), K.AdamHyper(**HP, amsgrad=True))
    with pytest.raises(ValueError, match="steps"):
        K.adam_step(K.AdamTensors(p, z, z, z, [0]), h)
    with pytest.raises(ValueError, match="grad_scale"):
        K.adam_step(K.AdamTensors(p, z, z, z, [1]), K.AdamHyper(**HP, grad_scale=0.0))


HYPER = [1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0, 0.0, 1.0, 0.0]   # tuple(K.AdamHyper())


@needs_ext
def test_op_errors_name_the_argument():
    op = torch.ops.statestore.adam_
    p, z = [torch.randn(4)], [torch.zeros(4)]

    def call(params=p, grads=z, m=z, v=z, hyper=HYPER, moments="fp32", steps=(1,), vmax=()):
        op(params, grads, m, v, [], [], list(vmax), [], list(steps), [], [], hyper, moments)

    with pytest.raises(RuntimeError, match=r"need one tensor per param \(1\), got 2, 1, 1"):
        call(grads=z * 2)
    with pytest.raises(RuntimeError, match=r"exp_avgs\[0\] has 5 elements"):
        call(m=[torch.zeros(5)])
    with pytest.raises(RuntimeError, match=r"params\[0\] is BFloat16 without an fp32 master"):
        call(params=[torch.zeros(4, dtype=torch.bfloat16)])
    with pytest.raises(RuntimeError, match=r"grads\[0\] must be float32"):
        call(grads=[torch.zeros(4, dtype=torch.float64)])
    with pytest.raises(RuntimeError, match=r"exp_avg_sqs\[0\] is not contiguous"):
        call(v=[torch.zeros(8)[::2]])
    with pytest.raises(RuntimeError, match=r"exp_avgs\[0\] must be Float, got BFloat16"):
        call(m=[torch.zeros(4, dtype=torch.bfloat16)])
    with pytest.raises(RuntimeError, match="moments must be fp32, bf16-nearest"):
        call(moments="fp16")
    with pytest.raises(RuntimeError, match=r"hyper must hold 9 values \(lr, beta1"):
        call(hyper=HYPER[:8])
    with pytest.raises(RuntimeError, match="grad_scale must be a positive finite number"):
        call(hyper=HYPER[:7] + [0.0] + HYPER[8:])
    with pytest.raises(RuntimeError, match="adamw_mode, maximize and amsgrad must be 0 or 1"):
        call(hyper=HYPER[:6] + [0.5] + HYPER[7:])
    with pytest.raises(RuntimeError, match="steps need one value per param"):
        call(steps=())
    with pytest.raises(RuntimeError, match=r"steps\[0\] = 0: step counts start at 1"):
        call(steps=(0,))
    with pytest.raises(RuntimeError, match=r"1 - beta1\^step must not be 0"):
        call(hyper=[1e-3, 1.0] + HYPER[2:])
    with pytest.raises(RuntimeError, match="hyper's amsgrad is 0 but max_exp_avg_sqs has"):
        call(vmax=[torch.zeros(4)])
    with pytest.raises(RuntimeError, match="hyper's amsgrad is 1 but max_exp_avg_sqs has no"):
        call(hyper=HYPER[:8] + [1.0])


def test_adam_hyper_is_the_op_argument_in_its_order():
    h = K.AdamHyper(lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1,
                    adamw_mode=False, maximize=True, grad_scale=4.0, amsgrad=True)
    assert list(h) == [1e-3, 0.9, 0.99, 1e-8, 0.1, 0.0, 1.0, 4.0, 1.0]
    assert K.AdamHyper.of_group({"lr": torch.tensor(0.5), "betas": (0.8, 0.9), "eps": 1e-6,
                                 "weight_decay": 0.0, "adamw_mode": True, "maximize": False,
                                 "amsgrad": False}, grad_scale=2.0) == \
        (0.5, 0.8, 0.9, 1e-6, 0.0, True, False, 2.0, False)


@needs_ext
def test_opcheck_schema_and_fake():
    p, g, m, v = torch.randn(40), torch.randn(40), torch.zeros(40), torch.zeros(40)
    torch.library.opcheck(torch.ops.statestore.adam_.default,
                          ([p], [g], [m], [v], [], [], [], [None], [3], [], [], HYPER, "fp32"),
                          test_utils=("test_schema", "test_faketensor"))
    c = torch.zeros(40, dtype=torch.int8), torch.zeros(40, dtype=torch.uint8)
    torch.library.opcheck(torch.ops.statestore.adam_.default,
                          ([p], [g], [c[0]], [c[1]], [torch.zeros(1)], [torch.zeros(1)], [],
                           [None], [3], [3, 4], [0], HYPER, "int8-stochastic"),
                          test_utils=("test_schema", "test_faketensor"))


@needs_ext
def test_set_simd_errors():
    with pytest.raises(ValueError, match="unknown path"):
        K._set_simd("sse9")
    if "avx512" not in SUPPORTED:
        with pytest.raises(RuntimeError, match="AVX-512|caps this process"):
            K._set_simd("avx512")
    assert K._set_simd("auto") == SUPPORTED[0]


@needs_ext
def test_kernels_info():
    info = K.kernels_info()
    assert info["cpu"] == "simd" and info["simd"] == SUPPORTED[0]
    assert info["simd_width"] in (512, 256, 32)
    if not torch.cuda.is_available():
        assert info["cuda"] == "unavailable"
    assert (info["cuda_moments"] in ("block", "wide")) == (info["cuda"] == "fused-cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not getattr(_dispatch.load_extension(), "with_cuda", False),
                    reason="needs the CUDA kernel")
def test_cuda_moments_layout_from_the_environment_and_refused_names():
    """STATESTORE_CUDA_MOMENTS picks the compressed-moment CUDA kernel's layout for the
    process (checked at the first launch); an unknown layout is refused by name."""
    code = ("import torch, statestore.kernels as K\n"
            "from statestore.kernels._moments import MomentCodes, adam_step_moments\n"
            "z = lambda dt=torch.float32: torch.zeros(300, device='cuda', dtype=dt)\n"
            "t = K.AdamTensors([z()], [z()], [z(torch.bfloat16)], [z(torch.bfloat16)], [1])\n"
            "try:\n"
            "    adam_step_moments(t, K.AdamHyper(), MomentCodes('bf16', 'nearest', [(1, 2)], [0],"
            " None, None))\n"
            "    torch.cuda.synchronize(); print(K.kernels_info()['cuda_moments'])\n"
            "except RuntimeError as e: print('refused:', e)\n")
    assert _python(code, STATESTORE_CUDA_MOMENTS="wide").stdout.strip().endswith("wide")
    out = _python(code, STATESTORE_CUDA_MOMENTS="tiles").stdout
    assert "refused:" in out and "STATESTORE_CUDA_MOMENTS must be 'block' or 'wide'" in out
    ext = K._dispatch.load_extension()
    with pytest.raises(RuntimeError, match="must be 'block' or 'wide', got 'tiles'"):
        ext.set_cuda_moments("tiles")


def _python(code, **env):
    e = {**os.environ, **env}
    r = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True,
                       text=True, env=e, timeout=120)
    assert r.returncode == 0, r.stderr
    return r


def test_force_reference_warns_once():
    code = ("import torch, statestore.kernels as K\n"
            "p=[torch.randn(8)]; z=[torch.zeros(8)]\n"
            "for s in (1,2,3): K.adam_step(K.AdamTensors(p,[torch.randn(8)],z,[torch.zeros(8)],"
            "[s]),K.AdamHyper(lr=1e-3))\n"
            "print(K.kernels_info()['cpu'])\n")
    r = _python(code, STATESTORE_FORCE_REFERENCE="1")
    assert r.stdout.strip() == "reference"
    assert r.stderr.count("STATESTORE_FORCE_REFERENCE") == 1


@needs_ext
def test_simd_env_var_forces_and_clamps():
    code = "import statestore.kernels as K; print(K.kernels_info()['simd'])"
    assert _python(code, STATESTORE_SIMD="scalar").stdout.strip() == "scalar"
    host = list(ext.simd_supported())  # the processor's own, whatever caps this process
    if "avx512" not in host:
        r = _python(code, STATESTORE_SIMD="avx512")
        assert r.stdout.strip() == host[0]
        assert "supports only" in r.stderr


@needs_ext
@pytest.mark.parametrize("cap", ["avx2", "scalar"])
def test_simd_env_var_caps_what_the_process_sees(cap):
    """STATESTORE_SIMD=avx2 on an AVX-512 host is an AVX2 host to the process (``make
    test-simd`` runs the suite so): the supported list, "auto" and set_simd all stop there."""
    host = list(ext.simd_supported())
    if cap not in host:
        pytest.skip(f"this processor lacks {cap} (supports {host})")
    code = ("import statestore.kernels as K\n"
            "i = K.kernels_info(); print(i['simd'], ','.join(i['simd_supported']))\n"
            "print(K.set_simd('auto'))\n"
            "try:\n    K.set_simd('avx512'); print('avx512 taken')\n"
            "except RuntimeError as e:\n    print('refused:', e)\n")
    out = _python(code, STATESTORE_SIMD=cap).stdout.splitlines()
    want = host[host.index(cap):]
    assert out[0] == f"{cap} {','.join(want)}"
    assert out[1] == cap
    if cap == "avx512":
        assert out[2] == "avx512 taken"
    else:
        assert out[2].startswith("refused:"), out


def test_torch_fused_fallback_matches_reference():
    # the GPU fallback (torch._fused_adam[w]_) runs on CPU too, so it is checked here
    for adamw_mode, amsgrad, pd in [(True, False, torch.float32), (False, True, torch.bfloat16)]:
        cases = [make(n, gdtype=torch.bfloat16, pdtype=pd, amsgrad=amsgrad, seed=n) for n in (7, 1000)]
        refs = [clone(c) for c in cases]
        kw = dict(weight_decay=0.1, adamw_mode=adamw_mode, maximize=True, grad_scale=4.0)
        g_before = [c["g"].clone() for c in cases]
        L = lambda cs, k: [c[k] for c in cs]  # noqa: E731
        _dispatch._torch_fused_step(
            K.AdamTensors(L(cases, "p"), L(cases, "g"), L(cases, "m"), L(cases, "v"), [3, 3],
                          L(cases, "vmax") if amsgrad else None,
                          L(cases, "master") if pd != torch.float32 else None),
            K.AdamHyper(**HP, **kw, amsgrad=amsgrad))
        run(adam_step_reference, refs, step=3, amsgrad=amsgrad, **kw)
        for c, r, g0 in zip(cases, refs, g_before):
            assert torch.equal(c["g"], g0)  # grads untouched
            w, wr = (c["master"], r["master"]) if pd != torch.float32 else (c["p"], r["p"])
            torch.testing.assert_close(w, wr, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- CUDA
cuda = pytest.mark.cuda   # skipped without CUDA by conftest.py; run by make gpu-test


@cuda
@pytest.mark.parametrize("gdtype", [torch.float32] + LOWP, ids=str)
@pytest.mark.parametrize("pdtype", [torch.float32] + LOWP, ids=str)
@pytest.mark.parametrize("amsgrad", [False, True])
def test_cuda_matches_cpu(gdtype, pdtype, amsgrad):
    kw = dict(weight_decay=0.05, adamw_mode=not amsgrad, maximize=amsgrad, grad_scale=2.0)
    cpu = [make(n, gdtype=gdtype, pdtype=pdtype, amsgrad=amsgrad, seed=n) for n in SIZES]
    gpu = [{k: (t.cuda() if t is not None else None) for k, t in c.items()} for c in cpu]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in (1, 2):
            run(K.adam_step, gpu, step=s, amsgrad=amsgrad, **kw)
    for s in (1, 2):
        run(K.adam_step, cpu, step=s, amsgrad=amsgrad, **kw)
    for c, g in zip(cpu, gpu):
        for k in c:
            if c[k] is not None and k != "g":
                torch.testing.assert_close(g[k].cpu().float(), c[k].float(), rtol=2e-5,
                                           atol=1e-6 if c[k].dtype == torch.float32 else 1e-2)


@cuda
def test_cuda_grads_finite():
    g = torch.randn(1000, device="cuda")
    assert K.grads_finite([g])
    g[10] = float("inf")
    assert not K.grads_finite([g])


@needs_ext
@pytest.mark.parametrize("simd", ALL_PATHS, indirect=True)
@pytest.mark.parametrize("pdtype", LOWP, ids=str)
def test_lowp_writeback_rounding_edges(simd, pdtype):
    # lr=0, no decay: the master is unchanged and the param gets master.to(pdtype); the edge
    # values (ties, subnormals, overflow, inf) must round exactly as torch rounds them
    edges = [0.0, -0.0, 1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11,
             6e-8, 3e-8, 2.9802322387695312e-08, 5.960464477539063e-08, 1e-6, 6.1e-5, 65504.0,
             65519.0, 65520.0, 1e10, float("inf"), float("-inf"), 1e-39, -1e-40, 3.4e38,
             float(torch.finfo(torch.float32).tiny)]
    master = torch.tensor(edges * 3 + list(torch.randn(50).tolist()), dtype=torch.float32)
    n = master.numel()
    case = dict(p=torch.zeros(n, dtype=pdtype), g=torch.randn(n), m=torch.zeros(n),
                v=torch.zeros(n), vmax=None, master=master.clone())
    run(K.adam_step, [case], step=1, lr=0.0, weight_decay=0.0, adamw_mode=True)
    assert torch.equal(case["master"], master)  # (== ignores the sign of zero, lr=0 may flip it)
    assert torch.equal(case["p"].view(torch.int16), case["master"].to(pdtype).view(torch.int16))


# ---------------------------------------------------------------- stream_copy (ring fills)
@needs_ext
@pytest.mark.parametrize("simd", ALL_PATHS, indirect=True)
@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 255, 256, 4096 + 7, 3 * 2 ** 20 + 5])
@pytest.mark.parametrize("src_off,dst_off", [(0, 0), (1, 0), (0, 5), (3, 1)])
def test_stream_copy_bytes(simd, n, src_off, dst_off):
    """Every byte arrives and nothing around the destination is touched, whatever the
    alignment of either end (the SIMD loop handles an unaligned head and a short tail)."""
    gen = torch.Generator().manual_seed(n)
    src = torch.randint(0, 256, (n + src_off,), dtype=torch.uint8, generator=gen)[src_off:]
    buf = torch.zeros(n + dst_off + 64, dtype=torch.uint8)
    ext.stream_copy(buf[dst_off:dst_off + n], src)
    assert torch.equal(buf[dst_off:dst_off + n], src)
    assert not buf[:dst_off].any() and not buf[dst_off + n:].any()


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_stream_copy_wrapper_matches_copy(dtype):
    """stream_copy_ takes the streaming path for large same-dtype copies and falls back to
    copy_ (with conversion) otherwise; the result is copy_'s either way."""
    src = torch.randn(K._dispatch.STREAM_COPY_MIN_BYTES // 2 + 3).to(dtype)[1:]
    for dst in (torch.empty_like(src), torch.empty(src.numel(), dtype=torch.float16),
                torch.empty(src.numel() * 2, dtype=dtype)[::2]):
        expect = dst.clone().copy_(src)
        assert K.stream_copy_(dst, src) is dst
        assert torch.equal(dst, expect)


@needs_ext
def test_stream_copy_rejects_mismatch():
    a = torch.zeros(1 << 18)
    with pytest.raises(RuntimeError, match="elements"):
        ext.stream_copy(a[:10], a[20:31])
    with pytest.raises(RuntimeError, match="does not convert"):
        ext.stream_copy(a[:10].double(), a[20:30])
    with pytest.raises(RuntimeError, match="overlap"):
        ext.stream_copy(a[1:], a[:-1])
    with pytest.raises(RuntimeError, match="contiguous"):
        ext.stream_copy(a[:20:2], a[40:50])

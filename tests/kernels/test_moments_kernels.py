"""The compressed-moment kernels (``torch.ops.statestore.adam_``, bf16 and int8) on every CPU
path (AVX-512, AVX2, scalar), against

* the unfused algorithm (decode with the torch reference, the fp32 kernel, encode with the
  torch reference): bit for bit, so SIMD bodies, tails, threads and the reference agree;
* a float64 reference of the same algorithm (decode exactly, update in float64, encode): the
  weights to float32 rounding, the codes within one code (bf16: one ulp), scales to float32
  rounding;

parametrized over encodings, rounding, gradient/parameter dtypes, amsgrad and odd sizes that
reach every SIMD tail and a partial last int8 block.
"""
from __future__ import annotations

import pytest
import torch

import statestore.kernels as K
from statestore.kernels import _dispatch, _quant as Q
from statestore.kernels._moments import MomentCodes, _unfused, adam_step_moments
from statestore.kernels._reference import adam_step_reference

ext = _dispatch.load_extension()
SUPPORTED = _dispatch.simd_supported()
PATHS = ["avx512", "avx2", "scalar"]
SIZES = [1, 7, 15, 17, 255, 256, 257, 1000 + 3, 3 * 16384 + 5]
HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True)
pytestmark = pytest.mark.skipif(ext is None, reason="statestore._C_adam missing")


@pytest.fixture
def simd(request):
    name = request.param
    if name not in SUPPORTED:
        pytest.skip(f"this processor lacks {name}")
    K._set_simd(name)
    yield name
    K._set_simd("auto")


def make(n, kind, *, gdtype=torch.float32, pdtype=torch.float32, amsgrad=False, seed=0,
         offset=0):
    g_ = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g_)
    m = torch.randn(n, generator=g_) * 0.1 * 10.0 ** (-3 * torch.rand(n, generator=g_))
    v = torch.rand(n, generator=g_) * 0.01 * 10.0 ** (-4 * torch.rand(n, generator=g_))
    cm, sm = Q.encode(kind, 0, m, seed=1, offset=offset, rounding="nearest")
    cv, sv = Q.encode(kind, 1, v, seed=2, offset=offset, rounding="nearest")
    case = dict(g=(torch.randn(n, generator=g_) * 0.1).to(gdtype), m=cm, v=cv, ms=sm, vs=sv,
                vmax=(Q.decode(kind, 1, cv, sv) + torch.rand(n, generator=g_) * 1e-3)
                if amsgrad else None)
    if pdtype == torch.float32:
        case.update(p=w, master=None)
    else:
        case.update(p=w.to(pdtype), master=w.clone())
    return case


def copy(c):
    return {k: (t.clone() if t is not None else None) for k, t in c.items()}


def fused(c, kind, rounding, step=3, amsgrad=False, offset=0, seeds=(11, 12), **kw):
    adam_step_moments(_tensors(c, step, amsgrad), K.AdamHyper(**{**HP, **kw}, amsgrad=amsgrad),
                      MomentCodes(kind, rounding, [seeds], [offset],
                                  [c["ms"]] if kind == "int8" else None,
                                  [c["vs"]] if kind == "int8" else None))


def _tensors(c, step, amsgrad):
    return K.AdamTensors([c["p"]], [c["g"]], [c["m"]], [c["v"]], [step],
                         [c["vmax"]] if amsgrad else None,
                         [c["master"]] if c["master"] is not None else None)


def unfused(c, kind, rounding, step=3, amsgrad=False, offset=0, seeds=(11, 12), **kw):
    _unfused(_tensors(c, step, amsgrad),
             K.AdamHyper(**{**HP, **kw, "grad_scale": 1.0, "maximize": False}, amsgrad=amsgrad),
             MomentCodes(kind, rounding, [seeds], [offset], [c["ms"]], [c["vs"]]))


def same(a, b):
    for k in a:
        if a[k] is None:
            continue
        x, y = a[k], b[k]
        if x.dtype in (torch.bfloat16, torch.float16):
            x, y = x.view(torch.int16), y.view(torch.int16)
        assert torch.equal(x, y) or (x.is_floating_point() and torch.equal(
            torch.nan_to_num(x, nan=7.0), torch.nan_to_num(y, nan=7.0))), k


@pytest.mark.parametrize("simd", PATHS, indirect=True)
@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("n", SIZES)
def test_fused_equals_unfused_bitwise(simd, kind, rounding, n):
    c = make(n, kind, seed=n)
    a, b = copy(c), copy(c)
    fused(a, kind, rounding)
    unfused(b, kind, rounding)
    same(a, b)


@pytest.mark.parametrize("simd", PATHS, indirect=True)
@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("pdtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("amsgrad", [False, True])
def test_dtypes_and_amsgrad_bitwise(simd, kind, gdtype, pdtype, amsgrad):
    c = make(1000 + 3, kind, gdtype=gdtype, pdtype=pdtype, amsgrad=amsgrad)
    a, b = copy(c), copy(c)
    fused(a, kind, "stochastic", amsgrad=amsgrad, adamw_mode=False, weight_decay=0.1)
    unfused(b, kind, "stochastic", amsgrad=amsgrad, adamw_mode=False, weight_decay=0.1)
    same(a, b)


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_simd_paths_bit_identical(kind):
    outs = []
    for path in [p for p in PATHS if p in SUPPORTED]:
        K._set_simd(path)
        try:
            c = make(4099, kind, pdtype=torch.bfloat16, amsgrad=True)
            fused(c, kind, "stochastic", amsgrad=True)
            outs.append(c)
        finally:
            K._set_simd("auto")
    for o in outs[1:]:
        same(outs[0], o)


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_threads_and_cuts_do_not_change_bits(kind):
    n = 5 * 16384 + 300
    c = make(n, kind, seed=4)
    one = copy(c)
    torch.set_num_threads(1)
    try:
        fused(one, kind, "stochastic")
    finally:
        torch.set_num_threads(2)
    two = copy(c)
    fused(two, kind, "stochastic")
    same(one, two)
    # the same tensor updated in two pieces (as two pipeline units), each with its offset
    cut = 2 * 16384 + 512
    parts = copy(c)
    for a, b in [(0, cut), (cut, n)]:
        piece = {k: (t[a:b] if k not in ("ms", "vs") else t[a // 256:-(-b // 256)])
                 for k, t in parts.items() if t is not None}
        piece.setdefault("master", None)
        piece.setdefault("vmax", None)
        fused(piece, kind, "stochastic", offset=a)
    same(one, parts)


@pytest.mark.parametrize("simd", PATHS, indirect=True)
@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("n", [7, 257, 1000 + 3])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_against_float64_reference(simd, kind, n, rounding):
    c = make(n, kind, seed=n + 1)
    got = copy(c)
    fused(got, kind, rounding, step=5)
    m64 = Q.decode(kind, 0, c["m"], c["ms"]).double()
    v64 = Q.decode(kind, 1, c["v"], c["vs"]).double()
    w64 = c["p"].double().clone()
    adam_step_reference(K.AdamTensors([w64], [c["g"].double()], [m64], [v64], [5]),
                        K.AdamHyper(**HP))
    torch.testing.assert_close(got["p"].double(), w64, rtol=2e-6, atol=1e-7)
    for which, x64, codes, sc in ((0, m64, got["m"], got["ms"]), (1, v64, got["v"], got["vs"])):
        want, wsc = Q.encode(kind, which, x64.float(), seed=11 + which,
                             offset=0, rounding=rounding)
        if kind == "bf16":
            diff = (codes.view(torch.int16).int() - want.view(torch.int16).int()).abs()
        else:
            torch.testing.assert_close(sc, wsc, rtol=1e-6, atol=0)
            diff = (codes.int() - want.int()).abs()
        assert int(diff.max()) <= 1


def _mixed_blocks(n, gdtype=torch.float32, pdtype=torch.float32):
    """int8 moments whose blocks reach every branch of the SIMD body: scales of 2^16 and more
    (decoded without the blend-free path), blocks with zeros (exp_avg_sq codes through the
    subnormal step), tiny, ordinary and all-zero blocks; odd n for the tails."""
    c = make(n, "int8", gdtype=gdtype, pdtype=pdtype, seed=n)
    m = Q.decode("int8", 0, c["m"], c["ms"])
    v = Q.decode("int8", 1, c["v"], c["vs"])
    m[256:512] *= 3e6
    v[256:512] *= 1e16
    m[512:768:3] = 0.0
    v[512:768:5] = 0.0
    m[768:1024] *= 1e-30
    v[768:1024] *= 1e-30
    m[1024:1280] = 0.0
    v[1024:1280] = 0.0
    c["g"][1024:1280] = 0.0
    c["m"], c["ms"] = Q.encode("int8", 0, m, seed=1, offset=0, rounding="nearest")
    c["v"], c["vs"] = Q.encode("int8", 1, v, seed=2, offset=0, rounding="nearest")
    assert float(c["ms"][1]) >= 2 ** 16 and float(c["vs"][1]) >= 2 ** 16
    return c


@pytest.mark.parametrize("simd", PATHS, indirect=True)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("gdtype,pdtype", [(torch.float32, torch.float32),
                                           (torch.bfloat16, torch.bfloat16)], ids=str)
def test_int8_block_branches_bitwise(simd, rounding, gdtype, pdtype):
    c = _mixed_blocks(1280 + 256 + 13, gdtype, pdtype)
    a, b = copy(c), copy(c)
    fused(a, "int8", rounding)
    unfused(b, "int8", rounding)
    same(a, b)


def test_int8_simd_under_flush_denormal_equals_scalar():
    """With the processor flushing subnormal operands (torch.set_flush_denormal), the SIMD
    paths decode without their subnormal-float shortcut and still equal the scalar path."""
    c = make(1000 + 3, "int8", seed=5)
    k = torch.arange(1000 + 3) % 8                # codes of the subnormal step (1..7), both signs
    c["m"][::3] = (k[::3] * (1 - 2 * (k[::3] % 2))).to(torch.int8)
    c["v"][1::3] = k[1::3].to(torch.uint8)
    outs = []
    if not torch.set_flush_denormal(True):
        pytest.skip("this processor cannot flush denormals")
    try:
        for path in [p for p in PATHS if p in SUPPORTED]:
            K._set_simd(path)
            try:
                x = copy(c)
                fused(x, "int8", "nearest")     # 1003 elements: runs on this thread
                outs.append(x)
            finally:
                K._set_simd("auto")
    finally:
        torch.set_flush_denormal(False)
    assert len(outs) >= 2
    for o in outs[:-1]:
        same(outs[-1], o)                         # each SIMD path against the scalar one


def test_non_finite_moment_poisons_its_block_only():
    c = make(600, "int8")
    c["g"][300] = float("inf")
    fused(c, "int8", "nearest")
    assert torch.isnan(c["ms"][1]) and torch.isfinite(c["ms"][[0, 2]]).all()
    assert torch.isnan(Q.decode("int8", 0, c["m"], c["ms"])[256:512]).all()


def test_op_errors_name_the_argument():
    c = make(300, "int8")
    with pytest.raises(ValueError, match="offsets"):
        fused(c, "int8", "nearest", offset=100)
    hyper = K.AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                        adamw_mode=True)

    def op(m=(c["m"],), v=(c["v"],), ms=(c["ms"],), vs=(c["vs"],), grads=(c["g"],),
           seeds=(1, 2), offsets=(0,), moments="int8-nearest"):
        torch.ops.statestore.adam_([c["p"]], list(grads), list(m), list(v), list(ms), list(vs),
                                   [], [], [1], list(seeds), list(offsets), hyper,
                                   moments)

    with pytest.raises(RuntimeError, match=r"exp_avg_scales\[0\] has 1 elements"):
        op(ms=(c["ms"][:1],))
    with pytest.raises(RuntimeError, match=r"exp_avgs\[0\] must be Char"):
        op(m=(c["m"].view(torch.uint8),))
    with pytest.raises(RuntimeError, match=r"offsets\[0\] = 100 is not a multiple of 256"):
        op(offsets=(100,))
    with pytest.raises(RuntimeError, match=r"need one tensor per param \(1\), got 2, 1, 1"):
        op(grads=(c["g"], c["g"]))
    with pytest.raises(RuntimeError, match="one tensor per param with int8 moments"):
        op(ms=(), vs=())
    with pytest.raises(RuntimeError, match=r"seeds need two values per param \(2\)"):
        op(seeds=(1,), moments="int8-stochastic")
    with pytest.raises(RuntimeError, match=r"exp_avgs\[0\] must be BFloat16"):
        op(ms=(), vs=(), moments="bf16-nearest")


def needs_cuda_kernel(test):
    """Marked cuda (`make gpu-test` runs those; conftest.py skips them without CUDA), and
    skipped where the extension has no CUDA kernel."""
    return pytest.mark.cuda(pytest.mark.skipif(
        not torch.cuda.is_available() or ext is None or not getattr(ext, "with_cuda", False),
        reason="needs CUDA and the CUDA kernel")(test))


@pytest.fixture(params=["block", "wide"])
def layout(request):
    """Each layout of the compressed-moment CUDA kernel (the same bits by design)."""
    before = ext.cuda_moments()
    assert ext.set_cuda_moments(request.param) == request.param
    yield request.param
    ext.set_cuda_moments(before)


@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("pdtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("amsgrad", [False, True])
@needs_cuda_kernel
def test_cuda_matches_cpu_bitwise(kind, pdtype, amsgrad, layout):
    c = make(3 * 16384 + 777, kind, pdtype=pdtype, amsgrad=amsgrad, seed=8)
    cpu = copy(c)
    fused(cpu, kind, "stochastic", amsgrad=amsgrad)
    gpu = {k: (t.cuda() if t is not None else None) for k, t in c.items()}
    fused(gpu, kind, "stochastic", amsgrad=amsgrad)
    same(cpu, {k: (t.cpu() if t is not None else None) for k, t in gpu.items()})


@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@needs_cuda_kernel
def test_cuda_many_tensors_match_cpu_bitwise(kind, rounding, layout):
    """One launch over tensors of every size class (below a warp, one int8 block and one
    element past it, a chunk and one past it, several chunks with a partial block), fp32
    and bf16 parameters mixed, with their offsets in their parameters: every tensor's bits
    are the CPU kernel's."""
    sizes = [1, 31, 256, 257, 16384, 16385, 3 * 16384 + 777]
    cases = [make(n, kind, pdtype=torch.bfloat16 if i % 2 else torch.float32, seed=20 + i,
                  offset=256 * i) for i, n in enumerate(sizes)]

    def run(cs):
        t = K.AdamTensors([c["p"] for c in cs], [c["g"] for c in cs], [c["m"] for c in cs],
                          [c["v"] for c in cs], [3 + i for i in range(len(cs))], None,
                          [c["master"] for c in cs])
        adam_step_moments(t, K.AdamHyper(**HP), MomentCodes(
            kind, rounding, [(31 + i, 41 + i) for i in range(len(cs))],
            [256 * i for i in range(len(cs))],
            [c["ms"] for c in cs] if kind == "int8" else None,
            [c["vs"] for c in cs] if kind == "int8" else None))

    cpu = [copy(c) for c in cases]
    gpu = [{k: (t.cuda() if t is not None else None) for k, t in c.items()} for c in cases]
    run(cpu)
    run(gpu)
    for a, b in zip(cpu, gpu):
        same(a, {k: (t.cpu() if t is not None else None) for k, t in b.items()})


@pytest.mark.parametrize("simd", PATHS, indirect=True)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("big", [1e21, -1e30, 3.4e38])
def test_finite_gradient_whose_square_overflows_keeps_int8_block_finite(simd, rounding,
                                                                       amsgrad, big):
    """A finite gradient whose square overflows float32 (torch's exp_avg_sq: +inf) leaves
    every scale, moment and parameter finite (the overflow rule of ``csrc/adam_math.h``), on
    every path bit for bit, in this step and the next; the element's exp_avg_sq is stored as
    the largest float32 and its exp_avg as 0, and it moves no more than torch's (0)."""
    c = make(1003, "int8", amsgrad=amsgrad, seed=4)
    c["g"][300] = big                          # block 1 of 4; element 1000: the partial block
    c["g"][1000] = -big
    a, b = copy(c), copy(c)
    fused(a, "int8", rounding, amsgrad=amsgrad)
    unfused(b, "int8", rounding, amsgrad=amsgrad)
    same(a, b)
    for x in (a["ms"], a["vs"], a["p"]):
        assert torch.isfinite(x).all()
    m = Q.decode("int8", 0, a["m"], a["ms"])
    v = Q.decode("int8", 1, a["v"], a["vs"])
    assert torch.isfinite(m).all() and torch.isfinite(v).all()
    assert m[300] == 0 and m[1000] == 0 and v[300] > 3e38 and v[1000] > 3e38
    assert torch.equal(a["ms"][[0, 2]], b["ms"][[0, 2]])
    w300 = a["p"][300].clone()
    for d in (a, b):
        d["g"] = torch.randn(1003, generator=torch.Generator().manual_seed(5)) * 0.1
    fused(a, "int8", rounding, step=4, amsgrad=amsgrad)
    unfused(b, "int8", rounding, step=4, amsgrad=amsgrad)
    same(a, b)
    assert torch.isfinite(a["p"]).all() and torch.isfinite(a["ms"]).all()
    assert float((a["p"][300] - w300 * (1 - HP["lr"] * HP["weight_decay"])).abs()) < 1e-12


@pytest.mark.parametrize("amsgrad", [False, True])
@needs_cuda_kernel
def test_cuda_overflow_rule_matches_cpu_bitwise(amsgrad, layout):
    c = make(3 * 16384 + 777, "int8", amsgrad=amsgrad, seed=9)
    c["g"][300] = 1e30
    c["g"][3 * 16384 + 700] = -1e21             # the partial last block
    cpu = copy(c)
    fused(cpu, "int8", "stochastic", amsgrad=amsgrad)
    gpu = {k: (t.cuda() if t is not None else None) for k, t in c.items()}
    fused(gpu, "int8", "stochastic", amsgrad=amsgrad)
    same(cpu, {k: (t.cpu() if t is not None else None) for k, t in gpu.items()})
    assert torch.isfinite(cpu["ms"]).all() and torch.isfinite(cpu["vs"]).all()

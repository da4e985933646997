"""Tests of the compressed-moment encodings (statestore.kernels._quant): round-trip error
bounds, zeros, tiny and huge values, non-finite values, stochastic rounding's mean, and the
independence of the random bits from how a tensor is cut."""
from __future__ import annotations

import math

import pytest
import torch

from statestore.kernels import _quant as Q

SIZES = [1, 255, 256, 257, 1000, 4096 + 3]
ROUND = ["nearest", "stochastic"]


def sample(n, seed=0, spread=6.0):
    """Values over ``spread`` decades, both signs (exp_avg-like)."""
    g = torch.Generator().manual_seed(seed)
    mag = 10.0 ** (-spread * torch.rand(n, generator=g))
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return (mag * sign).float()


def block_max(x):
    xb, n = Q._blocks(x.abs())
    return xb.amax(dim=1).repeat_interleave(Q.BLOCK)[:n]


def f8_table(mbits):
    """val(k) of the 8-bit floats (exponent bias 15, ``mbits`` mantissa bits), in float64,
    from their definition: 2**(e-15) (1 + f/2**mbits) for e >= 1, f 2**-(14+mbits) for e = 0."""
    out = []
    for k in range(1 << (4 + mbits)):
        e, f = k >> mbits, k & ((1 << mbits) - 1)
        out.append(2.0 ** (e - 15) * (1 + f / 2 ** mbits) if e else f * 2.0 ** -(14 + mbits))
    return torch.tensor(out, dtype=torch.float64)


def f8_ulp(r, mbits):
    """Gap between the two codes around ratios r (float64): 2**(floor(log2 r) - mbits) in the
    normal range, 2**-(14+mbits) below 2**-14."""
    e = torch.floor(torch.log2(r.clamp(min=2.0 ** -14)))
    return torch.where(r < 2.0 ** -14, torch.full_like(r, 2.0 ** -(14 + mbits)), 2.0 ** (e - mbits))


def test_int8_decode_is_the_float8_table():
    """Every code decodes to its table value times the block's scale (exp_avg E4M3 signed,
    sqrt(exp_avg_sq) E4M4), the largest code being 1.875 / 1.9375 of the scale."""
    tm, tv = f8_table(3), f8_table(4)
    assert tm[127] == 1.875 and tv[255] == 1.9375 and tm[8] == tv[16] == 2.0 ** -14
    scale = torch.tensor([0.75, 3.0e-20], dtype=torch.float32)
    k = torch.arange(-127, 128, dtype=torch.int64)
    z = torch.zeros(1, dtype=torch.int64)
    codes = torch.cat([k, z, k, z]).to(torch.int8)
    d = Q.int8_decode_m(codes, scale).double()
    want = torch.sign(codes.double()) * tm[codes.long().abs()]
    want = want * scale.double().repeat_interleave(256)[:512]
    assert torch.equal(d, want.float().double())
    kv = torch.arange(256, dtype=torch.int64)
    codes = torch.cat([kv, kv]).to(torch.uint8)
    d = Q.int8_decode_v(codes, scale).double()
    t = (tv[codes.long()] * scale.double().repeat_interleave(256)).float().double()
    assert torch.equal(d, (t * t).float().double())


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("rounding", ROUND)
def test_int8_m_round_trip_bound(n, rounding):
    x = sample(n, seed=n)
    c, s = Q.int8_encode_m(x, seed=7, rounding=rounding)
    assert c.dtype == torch.int8 and c.shape == (n,) and s.shape == (Q.nblocks(n),)
    assert int(c.abs().max()) <= Q.M_LEVELS
    d = Q.int8_decode_m(c, s)
    smax = block_max(x).double()
    scale = s.double().repeat_interleave(Q.BLOCK)[:n]
    # the scale is the block's largest magnitude / 1.875 (to a float's rounding)
    assert bool(((scale * 1.875 - smax).abs() <= smax * 2.0 ** -22).all())
    # nearest: within half the gap between the codes around |x| / scale; stochastic: within
    # one gap (one of the two codes around it)
    r = x.abs().double() / scale
    gap = f8_ulp(r, 3) * scale
    bound = gap * (0.5 if rounding == "nearest" else 1.0) * (1 + 1e-5) + 1e-30
    err = (d.double() - x.double()).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    # signs are kept (a value may round to zero, never to the other sign)
    assert bool(((d * x) >= 0).all())
    # the block's largest magnitude decodes to itself, to a float's rounding, never above
    if rounding == "nearest":
        for b in range(Q.nblocks(n)):
            seg = x[b * 256:(b + 1) * 256]
            i = int(seg.abs().argmax())
            got, want = float(d[b * 256 + i]), float(seg[i])
            assert abs(got) <= abs(want) and abs(got - want) <= abs(want) * 2.0 ** -21


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("rounding", ROUND)
def test_int8_v_round_trip_bound(n, rounding):
    x = sample(n, seed=n + 1, spread=10.0).abs()
    c, s = Q.int8_encode_v(x, seed=3, rounding=rounding)
    assert c.dtype == torch.uint8
    d = Q.int8_decode_v(c, s)
    # sqrt(v) is what is encoded (and what the update divides by): its scale is the block's
    # largest sqrt(v) / 1.9375 and its error is within half a gap (nearest) or one gap
    root = x.double().sqrt()
    rmax = block_max(x).double().sqrt()
    scale = s.double().repeat_interleave(Q.BLOCK)[:n]
    assert bool(((scale * 1.9375 - rmax).abs() <= rmax * 2.0 ** -22).all())
    r = root / scale
    gap = f8_ulp(r, 4) * scale
    bound = gap * (0.5 if rounding == "nearest" else 1.0) * (1 + 1e-5) + root * 1e-7 + 1e-30
    err = (d.double().sqrt() - root).abs()
    assert bool((err <= bound).all()), float((err / bound).max())


@pytest.mark.parametrize("rounding", ROUND)
def test_int8_keeps_relative_precision_over_the_range(rounding):
    """Adam divides exp_avg by sqrt(exp_avg_sq), so an element far below its block's largest
    needs its moments as precise as the largest: down to 2**-14 of the block's scale, exp_avg
    keeps 1/16 (nearest; 1/8 stochastic) and sqrt(exp_avg_sq) 1/32 (1/16) relative error.
    (The power maps of version 1 lost 27% of exp_avg at 1e-3 of the block's largest.)"""
    g = torch.Generator().manual_seed(4)
    ratio = 10.0 ** (-4 * torch.rand(4096, generator=g, dtype=torch.float64))
    ratio[::256] = 1.0                                    # each block's largest
    m = (ratio * torch.where(torch.rand(4096, generator=g) < 0.5, -1.0, 1.0)).float()
    c, s = Q.int8_encode_m(m, seed=9, rounding=rounding)
    rel = (Q.int8_decode_m(c, s).double() - m.double()).abs() / m.double().abs()
    assert float(rel.max()) <= (1 / 16 if rounding == "nearest" else 1 / 8) * (1 + 1e-5)
    v = (ratio ** 2).float()
    c, s = Q.int8_encode_v(v, seed=9, rounding=rounding)
    rel = (Q.int8_decode_v(c, s).double().sqrt() - v.double().sqrt()).abs() / v.double().sqrt()
    assert float(rel.max()) <= (1 / 32 if rounding == "nearest" else 1 / 16) * (1 + 1e-5)
    # an exp_avg_sq 1e-8 of its block's largest (its sqrt 1e-4) is still nonzero and within 1/32
    v = torch.tensor([1.0] + [1e-8] * 255)
    c, s = Q.int8_encode_v(v, rounding="nearest")
    d = Q.int8_decode_v(c, s)
    assert float((d[1:].sqrt() - 1e-4).abs().max()) <= 1e-4 / 32


def test_int8_version1_decoding():
    """Checkpoints of the version-1 power maps still decode (statestore convert reads them)."""
    codes = torch.tensor([127, -127, 64, 0, -1], dtype=torch.int8)
    d = Q.decode("int8", 0, codes, torch.tensor([2.0]), version=1)
    want = torch.tensor([127 * 127, -127 * 127, 64 * 64, 0, -1], dtype=torch.float64) / 127 ** 2 * 2
    assert torch.allclose(d.double(), want, rtol=1e-6, atol=0)
    codes = torch.tensor([255, 128, 0], dtype=torch.uint8)
    d = Q.decode("int8", 1, codes, torch.tensor([4.0]), version=1)
    want = (torch.tensor([255.0, 128.0, 0.0], dtype=torch.float64) / 255) ** 4 * 4
    assert torch.allclose(d.double(), want, rtol=1e-6, atol=0)
    # and the current version is not the old one
    assert not torch.allclose(Q.decode("int8", 0, codes.to(torch.int8).abs(), torch.tensor([4.0])),
                              Q.decode("int8", 0, codes.to(torch.int8).abs(), torch.tensor([4.0]),
                                       version=1))


@pytest.mark.parametrize("enc", ["m", "v"])
def test_int8_zeros_tiny_huge(enc):
    fenc = Q.int8_encode_m if enc == "m" else Q.int8_encode_v
    fdec = Q.int8_decode_m if enc == "m" else Q.int8_decode_v
    # all zeros: codes 0, scale 0, decodes to exact zeros
    c, s = fenc(torch.zeros(300))
    assert not c.any() and not s.any() and not fdec(c, s).any()
    # -0.0 decodes to zero
    c, s = fenc(torch.tensor([-0.0, 1.0]))
    assert fdec(c, s)[0] == 0
    # huge: the largest float32 survives and stays finite
    big = torch.tensor([torch.finfo(torch.float32).max, 1e38, 3e37], dtype=torch.float32)
    c, s = fenc(big, rounding="nearest")
    d = fdec(c, s)
    assert torch.isfinite(d).all() and float((d[0] - big[0]).abs() / big[0]) < 2.0 ** -20
    assert float((d[1] - big[1]).abs() / big[1]) < 0.07
    # tiny but normal blocks keep their relative precision
    tiny = torch.tensor([1e-30, 5e-31, 2e-37], dtype=torch.float32)
    c, s = fenc(tiny, rounding="nearest")
    d = fdec(c, s)
    assert float((d[0] - tiny[0]).abs() / tiny[0]) < 2.0 ** -20
    assert float((d[1] - tiny[1]).abs() / tiny[1]) < 0.07
    # an exp_avg block whose largest magnitude is below 2**-125 is stored as zeros
    # (documented); exp_avg_sq is encoded from its square root, normal for any float32 v > 0,
    # so a subnormal exp_avg_sq block keeps its largest value
    sub = torch.tensor([1e-40, 1e-42], dtype=torch.float32)
    c, s = fenc(sub)
    if enc == "m":
        assert not fdec(c, s).any() and not s.any()
    else:
        assert float((fdec(c, s)[0] - sub[0]).abs() / sub[0]) < 0.01


@pytest.mark.parametrize("enc", ["m", "v"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_int8_non_finite_poisons_only_its_block(enc, bad):
    fenc = Q.int8_encode_m if enc == "m" else Q.int8_encode_v
    fdec = Q.int8_decode_m if enc == "m" else Q.int8_decode_v
    x = sample(600, seed=5).abs()
    x[300] = bad                         # block 1 of 3
    c, s = fenc(x)
    d = fdec(c, s)
    assert torch.isnan(s[1]) and torch.isfinite(s[[0, 2]]).all()
    assert torch.isnan(d[256:512]).all()
    assert torch.isfinite(d[:256]).all() and torch.isfinite(d[512:]).all()
    assert not c[256:512].any()


def test_bf16_nearest_is_torch_rounding():
    x = sample(5000, seed=11)
    x[:4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0])
    c = Q.bf16_encode(x, rounding="nearest")
    assert torch.equal(c.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


def test_bf16_stochastic_bounds_and_specials():
    x = sample(20000, seed=12)
    c = Q.bf16_encode(x, seed=99)
    lo = x.to(torch.bfloat16).float()
    d = c.float()
    # the result is one of the two bf16 values around x
    down = torch.where(x.abs() >= lo.abs(), lo, torch.nextafter(lo, torch.zeros_like(lo)))
    ulp = (x.abs() * 2.0 ** -7)
    assert bool(((d - x).abs() <= ulp).all())
    exact = x.to(torch.bfloat16).float() == x
    assert torch.equal(d[exact], x[exact])           # representable values stay as they are
    sp = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0,
                       torch.finfo(torch.float32).max])
    out = Q.bf16_encode(sp, seed=1).float()
    assert out[0] == float("inf") and out[1] == float("-inf") and torch.isnan(out[2])
    assert out[3] == 0 and out[4] == 0
    assert out[5] >= 3.38e38           # rounds to the largest bf16 or to inf, never down far
    del down


@pytest.mark.parametrize("kind,which", [("bf16", 0), ("bf16", 1), ("int8", 0), ("int8", 1)])
def test_stochastic_rounding_is_unbiased(kind, which):
    """The mean over seeds of decoded values approaches the fp32 value: within 0.3% (bf16) /
    0.5% (int8: exp_avg_sq is rounded in sqrt(v), whose square adds a bias below gap**2)."""
    torch.manual_seed(0)
    x = (torch.rand(512) * 0.5 + 0.5) * (1.0 if which else torch.sign(torch.randn(512)))
    x[0] = 1.0                       # fix each block's scale
    x[256] = 1.0
    acc = torch.zeros(512, dtype=torch.float64)
    reps = 400
    for seed in range(reps):
        c, s = Q.encode(kind, which, x, seed=seed)
        acc += Q.decode(kind, which, c, s).double()
    rel = ((acc / reps - x.double()).abs() / x.double().abs())
    assert float(rel.mean()) < (0.003 if kind == "bf16" else 0.005)
    # and nearest rounding of the same values is biased for bf16 (what SR fixes): not tested


def test_random_bits_independent_of_cuts():
    """Encoding a tensor in pieces (at block boundaries, each with its offset) gives the same
    codes as encoding it whole: units and threads never change results."""
    x = sample(256 * 7 + 13, seed=21)
    for kind in ("bf16", "int8"):
        for which in (0, 1):
            xx = x.abs() if which else x
            whole, ws = Q.encode(kind, which, xx, seed=5)
            parts, ps = [], []
            for a, b in [(0, 512), (512, 1536), (1536, xx.numel())]:
                c, s = Q.encode(kind, which, xx[a:b], seed=5, offset=a)
                parts.append(c)
                ps.append(s)
            assert torch.equal(torch.cat(parts).view(torch.uint8), whole.view(torch.uint8))
            if ws is not None:
                assert torch.equal(torch.cat(ps), ws)


def test_seeds_differ_by_key_state_and_step():
    s = {Q.moment_seed(k, st, step) for k in ("0", "1", "w") for st in (0, 1) for step in (1, 2, 3)}
    assert len(s) == 18
    assert Q.moment_seed("layer.weight", 1, 7) == Q.moment_seed("layer.weight", 1, 7)


def test_hash_matches_plain_python():
    def h(seed, i):
        x = (i * 0x9E3779B1 + seed) & 0xFFFFFFFF
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)
    idx = torch.tensor([0, 1, 2, 255, 2 ** 31 + 5, 2 ** 32 - 1, 2 ** 40 + 3])
    got = Q.hash32(0xDEADBEEF, idx).tolist()
    assert got == [h(0xDEADBEEF, int(i) & 0xFFFFFFFF) for i in idx]


def test_bad_rounding_name():
    with pytest.raises(ValueError, match="rounding"):
        Q.int8_encode_m(torch.ones(3), rounding="up")
    assert math.isclose(Q.nblocks(257), 2)

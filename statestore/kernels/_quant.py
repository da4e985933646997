"""Encodings of compressed Adam moments (``moment_dtype="bf16"`` / ``"int8"``): the torch
reference of the compiled kernels (``csrc/adam_math.h``), bit for bit.

Every function here computes in float32 with the same operations, in the same order, as the
C++/CUDA code, so the reference, the SIMD paths and the CUDA kernel give the same codes for the
same fp32 moments (the tests check it). The format is specified in ``docs/moments.md``; in short:

``bf16``
    ``exp_avg`` and ``exp_avg_sq`` are bfloat16 tensors of the parameter's shape. Rounding is
    **stochastic** by default: 16 random bits (a counter-based hash of the element's index and
    a per-tensor, per-step seed, so a resumed run draws the same bits) are added to the fp32
    bits before truncation; ``"nearest"`` is round to nearest even (torch's ``.to()``).
    Why stochastic: with ``beta2=0.999`` an ``exp_avg_sq`` that should decay moves by 0.1% a
    step, below half a bf16 ulp (0.2-0.4%), so nearest rounding never lets it decrease
    (``docs/moments.md``, "Rounding").

``int8``
    Blockwise: each run of :data:`BLOCK` = 256 elements (counted from the parameter's first
    element) has one fp32 scale. Codes are 8-bit floating-point numbers relative to the
    scale (an exponent and a mantissa, no infinities), so every element keeps the same
    *relative* precision over a range of 2**14, whatever its size next to its block's
    largest: Adam divides ``exp_avg`` by ``sqrt(exp_avg_sq)``, so an element whose gradients
    are 1000x smaller than its block's largest moves its parameter as far as the largest one,
    and needs its moments as precise (``docs/moments.md`` says what chose this map). Encoding and decoding are bit operations on float32 (no square root, no
    table):

    * ``exp_avg``: int8 ``c`` in [-127, 127], ``k = |c| = 8 e + f`` (E4M3, bias 15): value
      ``sign(c) * val(k) * scale`` with ``val(k) = 2**(e - 15) * (1 + f / 8)`` for ``e >= 1``
      and ``f * 2**-17`` for ``e = 0`` (the subnormal step, continuous at ``k = 8``:
      ``2**-14``); ``val(127) = 1.875``; ``scale = absmax * 0x1.111110p-1`` (1/1.875
      rounded down to float32).
    * ``exp_avg_sq``: uint8 ``k = 16 e + f`` (E4M4, bias 15) encodes ``sqrt(exp_avg_sq)``
      (the root the update computes anyway): ``sqrt(v) = val(k) * scale`` with
      ``val(k) = 2**(e - 15) * (1 + f / 16)`` (``e >= 1``), ``f * 2**-18`` (``e = 0``),
      ``val(255) = 1.9375``, ``scale = max sqrt(v) * 0x1.08420ep-1`` (1/1.9375 rounded
      down); the value is
      ``(val(k) * scale)**2``. ``sqrt(v)`` keeps 1.6-3.1% over 2**14 of its block's
      largest, i.e. ``v`` over 2.7e8.

    Rounding (of ``r = |x| * (1 / scale)``): nearest (round half to even on the float's
    mantissa; the subnormal step ``floor(r * 2**17 + 0.5)``) or stochastic (20 random bits,
    resp. 19, added below the kept mantissa bits before truncation; the subnormal step
    ``floor(r * 2**17 + u)``). A block whose largest magnitude is below 2**-125 is stored as
    zeros (scale 0); a block holding inf or nan has scale nan and codes 0, so it decodes to
    nan (the whole block, as a non-finite moment would poison the update anyway).

    In an Adam step (:func:`int8_saturate`): a finite gradient whose square overflows
    float32 makes ``exp_avg_sq`` +inf, as in torch's AdamW, where the element's updates are
    0 from then on. In a block whose new ``exp_avg`` are all finite, such an ``exp_avg_sq`` is
    stored as the largest float32 and its ``exp_avg`` as 0 (later updates about 0), so a
    finite input never makes a block NaN.

    :data:`INT8_ENCODING` names this encoding (version 2) in checkpoints. Version 1, the
    power maps ``sign(c) (c/127)**2 scale`` / ``(c/255)**4 scale`` of earlier releases, can
    still be decoded (:func:`int8_decode_m_v1`, :func:`int8_decode_v_v1`: ``statestore
    convert`` reads such checkpoints); an optimizer does not resume from it.

Random bits: ``hash32(seed, i)`` of the element's index ``i`` in the parameter (its low 32
bits) and a seed from :func:`moment_seed` (parameter key, state, step count). They depend on
nothing else, so any cut of a parameter into pipeline units, any thread count and any ISA
draw the same bits.
"""
from __future__ import annotations

import zlib
from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = ["BLOCK", "M_LEVELS", "V_LEVELS", "ROUNDINGS", "INT8_ENCODING", "hash32",
           "moment_seed", "key_hash", "bf16_encode", "bf16_decode", "int8_encode_m",
           "int8_decode_m", "int8_encode_v", "int8_decode_v", "int8_saturate", "int8_decode_m_v1",
           "int8_decode_v_v1", "nblocks"]

#: Elements per int8 block (one fp32 scale each).
BLOCK = 256
M_LEVELS = 127          # exp_avg: int8 codes -127..127
V_LEVELS = 255          # exp_avg_sq: uint8 codes 0..255
ROUNDINGS = ("stochastic", "nearest")
#: the int8 encoding of this version (recorded in checkpoints)
INT8_ENCODING = {"version": 2, "exp_avg": "int8 e4m3 (bias 15, no inf/nan) * scale",
                 "exp_avg_sq": "uint8 e4m4 (bias 15, no inf/nan) of sqrt(v) * scale, squared"}
_SCALE_FLOOR = 2.0 ** -125       # a block's largest magnitude below this: stored as zeros
_M32 = 0xFFFFFFFF
_2M24 = 2.0 ** -24
# per moment (0: exp_avg E4M3, 1: exp_avg_sq E4M4): mantissa bits, largest code, the
# reciprocal of the largest code's value (1/1.875, 1/1.9375) as float32 rounded down (so that
# top * (1/top) <= 1 - 2**-24: the block's largest value decodes to at most itself and
# FLT_MAX stays finite), the subnormal step's exponent (2**-17, 2**-18)
_MBITS = (3, 4)
_KMAX = (127, 255)
_INV_TOP = (float.fromhex("0x1.111110p-1"), float.fromhex("0x1.08420ep-1"))
_SUB_EXP = (17, 18)
# float32 constants of the version-1 power maps, as the C++ code spelled them
_INV_M2 = torch.tensor(1.0 / (M_LEVELS * M_LEVELS), dtype=torch.float32)
_INV_V2 = torch.tensor(1.0 / (V_LEVELS * V_LEVELS), dtype=torch.float32)


def _sqrt(x: Tensor) -> Tensor:
    """float32 square root, correctly rounded (IEEE, as sqrtps / sqrtf / CUDA's sqrtf):
    computed in float64 and rounded once. (torch.sqrt of float32 on CPU is not always
    correctly rounded: its vectorized path differs in the last bit for ~17% of inputs here.)"""
    return torch.sqrt(x.to(torch.float64)).to(torch.float32)


def nblocks(n: int) -> int:
    """Number of int8 blocks (scales) of a tensor of ``n`` elements."""
    return (n + BLOCK - 1) // BLOCK


def _mul32(x: Tensor, c: int) -> Tensor:
    """``x * c mod 2**32`` for int64 tensors holding uint32 values (no int64 overflow)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def hash32(seed: int, idx: Tensor) -> Tensor:
    """The 32-bit counter hash of ``csrc/adam_math.h`` (``ss_hash32``) for element indices
    ``idx`` (int64), as int64 tensors holding uint32 values."""
    x = (_mul32(idx & _M32, 0x9E3779B1) + (seed & _M32)) & _M32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    x = x ^ (x >> 16)
    return x


def _hash_scalar(x: int) -> int:
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    x ^= x >> 16
    return x


def key_hash(key: str) -> int:
    """A parameter key's 32-bit hash (crc32 of its UTF-8 bytes): stable across processes."""
    return zlib.crc32(key.encode("utf-8")) & _M32


def moment_seed(key: str, state: int, step: int) -> int:
    """Seed of the random bits of state ``state`` (0: exp_avg, 1: exp_avg_sq) of parameter
    ``key`` at step count ``step`` (the count after the update)."""
    return _hash_scalar(key_hash(key) ^ _hash_scalar((int(step) * 2 + state) & _M32))


def _uniform(seed: int, idx: Tensor, stochastic: bool) -> Tensor:
    if not stochastic:
        return torch.full(idx.shape, 0.5, dtype=torch.float32)
    return (hash32(seed, idx) >> 8).to(torch.float32) * _2M24


# ---------------------------------------------------------------------------------- bf16
def bf16_encode(x: Tensor, *, seed: int = 0, offset: int = 0,
                rounding: str = "stochastic") -> Tensor:
    """fp32 ``x`` (flat, elements ``offset..``) to bfloat16, as the kernels round."""
    x = x.reshape(-1).to(torch.float32)
    if rounding == "nearest":
        return x.to(torch.bfloat16)
    _check_rounding(rounding)
    bits = x.view(torch.int32).to(torch.int64) & _M32
    idx = torch.arange(offset, offset + x.numel(), dtype=torch.int64)
    r = (bits + (hash32(seed, idx) >> 16)) >> 16
    r = torch.where(torch.isnan(x), torch.full_like(r, 0x7FC0), r & 0xFFFF)
    r = torch.where(r >= 0x8000, r - 0x10000, r)
    return r.to(torch.int16).view(torch.bfloat16)


def bf16_decode(c: Tensor) -> Tensor:
    return c.to(torch.float32)


# ---------------------------------------------------------------------------------- int8
def _check_rounding(rounding: str) -> None:
    if rounding not in ROUNDINGS:
        raise ValueError(f"moment rounding must be one of {ROUNDINGS}, got {rounding!r}")


def _blocks(x: Tensor) -> Tuple[Tensor, int]:
    """``x`` (flat fp32, starting at a block boundary) padded with zeros to whole blocks,
    as a (nblocks, BLOCK) view, and its length."""
    n = x.numel()
    nb = nblocks(n)
    if nb * BLOCK != n:
        x = torch.cat([x, x.new_zeros(nb * BLOCK - n)])
    return x.view(nb, BLOCK), n


def _f32(x: float) -> Tensor:
    return torch.tensor(x, dtype=torch.float32)


def _scales(a: Tensor, which: int) -> Tuple[Tensor, Tensor]:
    """Per block of magnitudes ``a`` (nb, BLOCK): the stored scale (the largest magnitude
    times 1/top, float32) and its reciprocal used to encode (0 for blocks stored as zeros
    and non-finite blocks)."""
    finite = (a <= torch.finfo(torch.float32).max).all(dim=1)
    absmax = torch.where(torch.isnan(a), torch.zeros_like(a), a).amax(dim=1)
    ok = finite & (absmax >= _SCALE_FLOOR)
    scale = torch.where(ok, absmax * _f32(_INV_TOP[which]), torch.zeros_like(absmax))
    scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    inv = torch.where(ok, 1.0 / torch.where(ok, scale, torch.ones_like(scale)),
                      torch.zeros_like(scale))
    return scale, inv


def _code(r: Tensor, idx: Tensor, seed: int, stochastic: bool, which: int) -> Tensor:
    """8-bit float code (int64, 0.._KMAX) of the non-negative ratios ``r`` (float32)."""
    mb, kmax, sub = _MBITS[which], _KMAX[which], _SUB_EXP[which]
    drop = 23 - mb
    bits = r.view(torch.int32).to(torch.int64) & _M32
    if stochastic:
        h = hash32(seed, idx)
        add = h >> (32 - drop)
        u = (h >> 8).to(torch.float32) * _2M24
    else:
        add = ((1 << (drop - 1)) - 1) + ((bits >> drop) & 1)
        u = torch.full_like(r, 0.5)
    k_norm = ((bits + add) >> drop) - ((127 - 15) << mb)
    k_sub = torch.floor(r * float(2 ** sub) + u).to(torch.int64)
    k = torch.where(r < 2.0 ** -14, k_sub, k_norm)
    return torch.clamp(k, max=kmax)


def _val(k: Tensor, which: int) -> Tensor:
    """float32 values ``val(k)`` of codes ``k`` (int64, 0.._KMAX)."""
    mb, sub = _MBITS[which], _SUB_EXP[which]
    normal = ((k + ((127 - 15) << mb)) << (23 - mb)).to(torch.int32).view(torch.float32)
    subn = k.to(torch.float32) * float(2.0 ** -sub)
    return torch.where(k < (1 << mb), subn, normal)


def _encode(x: Tensor, which: int, seed: int, offset: int, rounding: str
            ) -> Tuple[Tensor, Tensor]:
    _check_rounding(rounding)
    xb, n = _blocks(x.reshape(-1).to(torch.float32))
    a = xb.abs()
    if which == 1:
        a = _sqrt(a)                          # sqrt(v): the root the update computes anyway
    scale, inv = _scales(a, which)
    r = a * inv[:, None]
    idx = torch.arange(offset, offset + xb.numel(), dtype=torch.int64).view_as(xb)
    k = _code(r, idx, seed, rounding == "stochastic", which)
    k = torch.where((scale > 0)[:, None], k, torch.zeros_like(k))
    if which == 0:
        k = torch.where(xb < 0, -k, k)
        return k.to(torch.int8).reshape(-1)[:n], scale
    return k.to(torch.uint8).reshape(-1)[:n], scale


def int8_encode_m(x: Tensor, *, seed: int = 0, offset: int = 0,
                  rounding: str = "stochastic") -> Tuple[Tensor, Tensor]:
    """exp_avg (flat fp32; element 0 at index ``offset``, a multiple of :data:`BLOCK`) to
    (int8 codes, fp32 scales)."""
    return _encode(x, 0, seed, offset, rounding)


def int8_decode_m(codes: Tensor, scales: Tensor) -> Tensor:
    cb, n = _blocks(codes.reshape(-1).to(torch.int64))
    v = _val(cb.abs(), 0) * scales.to(torch.float32)[:, None]
    return torch.where(cb < 0, -v, v).reshape(-1)[:n]


def int8_encode_v(x: Tensor, *, seed: int = 0, offset: int = 0,
                  rounding: str = "stochastic") -> Tuple[Tensor, Tensor]:
    """exp_avg_sq (flat fp32, non-negative) to (uint8 codes, fp32 scales of its square
    root); magnitudes are encoded, so a negative input keeps only its size."""
    return _encode(x, 1, seed, offset, rounding)


def int8_decode_v(codes: Tensor, scales: Tensor) -> Tensor:
    cb, n = _blocks(codes.reshape(-1).to(torch.int64))
    t = _val(cb, 1) * scales.to(torch.float32)[:, None]
    return (t * t).reshape(-1)[:n]


def int8_saturate(m: Tensor, v: Tensor) -> None:
    """The overflow rule of an Adam step over int8 moments (``int8_saturate_block`` of
    ``csrc/adam_math.h``), in place on the new fp32 moments ``m``, ``v`` (flat, element 0 at
    a block boundary): in each block whose ``m`` are all finite, every ``v`` that is +inf (a
    finite gradient whose square overflowed float32) becomes the largest float32 and its
    ``m`` becomes +0, so the block is stored finite instead of as NaN. Other blocks are left
    as they are (a block stored finite before the rule is unchanged by it)."""
    n = m.numel()
    over = v.reshape(-1) > torch.finfo(torch.float32).max
    if n == 0 or not bool(over.any()):
        return
    nb = nblocks(n)
    m_ok = torch.ones(nb * BLOCK, dtype=torch.bool, device=m.device)
    m_ok[:n] = torch.isfinite(m.reshape(-1))
    block_ok = m_ok.view(nb, BLOCK).all(dim=1)
    hit = over & block_ok.repeat_interleave(BLOCK)[:n]
    v.reshape(-1)[hit] = torch.finfo(torch.float32).max
    m.reshape(-1)[hit] = 0.0


def int8_decode_m_v1(codes: Tensor, scales: Tensor) -> Tensor:
    """exp_avg of a version-1 int8 checkpoint: ``sign(c) (c/127)**2 scale``."""
    cb, n = _blocks(codes.reshape(-1).to(torch.float32))
    q = (cb * cb.abs()) * _INV_M2
    return (q * scales.to(torch.float32)[:, None]).reshape(-1)[:n]


def int8_decode_v_v1(codes: Tensor, scales: Tensor) -> Tensor:
    """exp_avg_sq of a version-1 int8 checkpoint: ``(c/255)**4 scale``."""
    cb, n = _blocks(codes.reshape(-1).to(torch.float32))
    q = (cb * cb) * _INV_V2
    return ((q * q) * scales.to(torch.float32)[:, None]).reshape(-1)[:n]


def encode(kind: str, which: int, x: Tensor, *, seed: int = 0, offset: int = 0,
           rounding: str = "stochastic") -> Tuple[Tensor, Optional[Tensor]]:
    """``(codes, scales or None)`` of moment ``which`` (0: exp_avg, 1: exp_avg_sq) in
    ``kind`` ("bf16" or "int8")."""
    if kind == "bf16":
        return bf16_encode(x, seed=seed, offset=offset, rounding=rounding), None
    if kind == "int8":
        f = int8_encode_m if which == 0 else int8_encode_v
        return f(x, seed=seed, offset=offset, rounding=rounding)
    raise ValueError(f"unknown moment encoding {kind!r}")


def decode(kind: str, which: int, codes: Tensor, scales: Optional[Tensor], *,
           version: int = 2) -> Tensor:
    """fp32 values of moment ``which`` from its codes (and scales); ``version``: of the int8
    encoding (1: the power maps of earlier releases)."""
    if kind == "bf16":
        return bf16_decode(codes).reshape(-1)
    if kind == "int8":
        if version == 1:
            return (int8_decode_m_v1 if which == 0 else int8_decode_v_v1)(codes, scales)
        return (int8_decode_m if which == 0 else int8_decode_v)(codes, scales)
    raise ValueError(f"unknown moment encoding {kind!r}")

"""Encodings of compressed Adam moments (``moment_dtype="bf16"`` / ``"int8"``): the torch
reference of the compiled kernels (``csrc/adam_math.h``), bit for bit.

Every function here computes in float32 with the same operations, in the same order, as the
C++/CUDA code, so the reference, the SIMD paths and the CUDA kernel give the same codes for the
same fp32 moments (the tests check it). The format is specified in ``docs/kernels.md``
("Compressed moments"); in short:

``bf16``
    ``exp_avg`` and ``exp_avg_sq`` are bfloat16 tensors of the parameter's shape. Rounding is
    **stochastic** by default: 16 random bits (a counter-based hash of the element's index and
    a per-tensor, per-step seed, so a resumed run draws the same bits) are added to the fp32
    bits before truncation; ``"nearest"`` is round to nearest even (torch's ``.to()``).
    Why stochastic: with ``beta2=0.999`` an ``exp_avg_sq`` that should decay moves by 0.1% a
    step, below half a bf16 ulp (0.2-0.4%), so nearest rounding never lets it decrease
    (``docs/kernels.md`` has the measurement).

``int8``
    Blockwise: each run of :data:`BLOCK` = 256 elements (counted from the parameter's first
    element) has one fp32 scale, its largest magnitude. Codes are power maps of the magnitude
    relative to the scale, so small values keep relative precision (the dynamic range Adam's
    ``exp_avg / sqrt(exp_avg_sq)`` needs) while encoding costs only square roots:

    * ``exp_avg``: int8 ``c`` in [-127, 127], value ``sign(c) * (c / 127)**2 * scale``
      (encode: ``c = sign(x) * round(127 * sqrt(|x| / scale))``);
    * ``exp_avg_sq``: uint8 ``c`` in [0, 255], value ``(c / 255)**4 * scale``
      (encode: ``c = round(255 * sqrt(sqrt(x) * (1 / sqrt(scale))))``, from the square root
      of ``x`` that the update computes for its denominator).

    Rounding of the code is stochastic (``floor(y + u)``, ``u`` uniform in [0, 1) from the same
    hash) or nearest (``floor(y + 0.5)``). A block whose scale is below 2**-126 (subnormal) is
    stored as zeros; a block holding inf or nan has scale nan and codes 0, so it decodes to
    nan (the whole block, as a non-finite moment would poison the update anyway).

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

__all__ = ["BLOCK", "M_LEVELS", "V_LEVELS", "ROUNDINGS", "hash32", "moment_seed", "key_hash",
           "bf16_encode", "bf16_decode", "int8_encode_m", "int8_decode_m", "int8_encode_v",
           "int8_decode_v", "nblocks"]

#: Elements per int8 block (one fp32 scale each).
BLOCK = 256
M_LEVELS = 127          # exp_avg: int8 codes -127..127
V_LEVELS = 255          # exp_avg_sq: uint8 codes 0..255
ROUNDINGS = ("stochastic", "nearest")
_FLT_MIN = 2.0 ** -126
_M32 = 0xFFFFFFFF
# float32 constants, as the C++ code spells them
_INV_M2 = torch.tensor(1.0 / (M_LEVELS * M_LEVELS), dtype=torch.float32)
_INV_V2 = torch.tensor(1.0 / (V_LEVELS * V_LEVELS), dtype=torch.float32)
_2M24 = 2.0 ** -24


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


def _scales(a: Tensor) -> Tuple[Tensor, Tensor]:
    """Per block of magnitudes ``a`` (nb, BLOCK): the stored scale and its reciprocal used to
    encode (0 for zero, subnormal and non-finite blocks)."""
    finite = (a <= torch.finfo(torch.float32).max).all(dim=1)
    absmax = torch.where(torch.isnan(a), torch.zeros_like(a), a).amax(dim=1)
    scale = torch.where(absmax < _FLT_MIN, torch.zeros_like(absmax), absmax)
    scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    inv = torch.where(scale > 0, 1.0 / torch.where(scale > 0, scale, torch.ones_like(scale)),
                      torch.zeros_like(scale))
    return scale, inv


def int8_encode_m(x: Tensor, *, seed: int = 0, offset: int = 0,
                  rounding: str = "stochastic") -> Tuple[Tensor, Tensor]:
    """exp_avg (flat fp32; element 0 at index ``offset``, a multiple of :data:`BLOCK`) to
    (int8 codes, fp32 scales)."""
    _check_rounding(rounding)
    xb, n = _blocks(x.reshape(-1).to(torch.float32))
    a = xb.abs()
    scale, inv = _scales(a)
    r = a * inv[:, None]
    y = _sqrt(r) * float(M_LEVELS)
    idx = torch.arange(offset, offset + xb.numel(), dtype=torch.int64).view_as(xb)
    y = y + _uniform(seed, idx, rounding == "stochastic")
    c = torch.clamp(torch.floor(y), max=float(M_LEVELS))
    ok = (scale > 0)[:, None]
    c = torch.where(ok, c, torch.zeros_like(c))
    c = torch.where(xb < 0, -c, c)
    return c.to(torch.int8).reshape(-1)[:n], scale


def int8_decode_m(codes: Tensor, scales: Tensor) -> Tensor:
    cb, n = _blocks(codes.reshape(-1).to(torch.float32))
    q = (cb * cb.abs()) * _INV_M2
    return (q * scales.to(torch.float32)[:, None]).reshape(-1)[:n]


def int8_encode_v(x: Tensor, *, seed: int = 0, offset: int = 0,
                  rounding: str = "stochastic") -> Tuple[Tensor, Tensor]:
    """exp_avg_sq (flat fp32, non-negative) to (uint8 codes, fp32 scales); magnitudes are
    encoded, so a negative input keeps only its size."""
    _check_rounding(rounding)
    xb, n = _blocks(x.reshape(-1).to(torch.float32))
    a = xb.abs()
    scale, _ = _scales(a)
    ok = scale > 0
    sinv = torch.where(ok, 1.0 / _sqrt(torch.where(ok, scale, torch.ones_like(scale))),
                       torch.zeros_like(scale))
    r = _sqrt(a) * sinv[:, None]              # sqrt(v): the root the update computes anyway
    y = _sqrt(r) * float(V_LEVELS)
    idx = torch.arange(offset, offset + xb.numel(), dtype=torch.int64).view_as(xb)
    y = y + _uniform(seed, idx, rounding == "stochastic")
    c = torch.clamp(torch.floor(y), max=float(V_LEVELS))
    c = torch.where((scale > 0)[:, None], c, torch.zeros_like(c))
    return c.to(torch.uint8).reshape(-1)[:n], scale


def int8_decode_v(codes: Tensor, scales: Tensor) -> Tensor:
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


def decode(kind: str, which: int, codes: Tensor, scales: Optional[Tensor]) -> Tensor:
    """fp32 values of moment ``which`` from its codes (and scales)."""
    if kind == "bf16":
        return bf16_decode(codes).reshape(-1)
    if kind == "int8":
        return (int8_decode_m if which == 0 else int8_decode_v)(codes, scales)
    raise ValueError(f"unknown moment encoding {kind!r}")

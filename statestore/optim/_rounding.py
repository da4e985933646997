"""Stochastic rounding of fp32 states into bf16, reproducible: what
``StoreOptimizer(..., state_dtype="bf16")`` writes back after each update.

A value ``x`` lies between two neighbouring bf16 values; it is rounded to the upper one (in
magnitude) with a probability equal to its distance from the lower one, over their gap, so
that the rounding is unbiased: an fp32 state drifting by less than a bf16 step per update
(Adam's second moment with ``beta2 = 0.999``) still moves on average, where rounding to
nearest would freeze it. In bits: 16 random bits are added to the low half of ``x``'s fp32
pattern (the half bf16 drops) and the low half is then dropped.

The random bits are not drawn from a generator: they are a hash of ``(seed, element
index)``, where the seed hashes the parameter's key, the state's name and the step being
written (:func:`seed_of`). The same state of the same parameter at the same step gets the
same bits however the store cut the parameter into units, in whatever order units run, and
after a resume from a checkpoint: a resumed run is bit for bit the uninterrupted one.
"""
from __future__ import annotations

import zlib

import torch
from torch import Tensor

__all__ = ["seed_of", "round_into"]

_MASK32 = 0xFFFFFFFF
#: odd multipliers below 2**31: a 32-bit value times one stays within int64
_M1, _M2, _M3 = 0x7FEB352D, 0x2C1B3C6D, 0x297A2D39


def seed_of(key: str, name: str, step: int) -> int:
    """The 32-bit seed of state ``name`` of parameter ``key`` written at step ``step``."""
    h = zlib.crc32(f"{key}/{name}".encode())
    return (h ^ ((step * 0x9E3779B1) & _MASK32)) & _MASK32


def _mix(h: Tensor) -> Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) of each element of ``h`` (int64,
    values below 2**32), computed without int64 overflow."""
    h = h ^ (h >> 16)
    h = (h * _M1) & _MASK32
    h = h ^ (h >> 15)
    h = (h * _M2) & _MASK32
    h = h ^ (h >> 16)
    h = (h * _M3) & _MASK32
    return h ^ (h >> 15)


def random_bits(seed: int, start: int, n: int, device) -> Tensor:
    """16 random bits (int32, in ``[0, 65536)``) for elements ``start .. start + n - 1``."""
    idx = torch.arange(start, start + n, dtype=torch.int64, device=device)
    h = _mix((idx * 2 + 1) & _MASK32 ^ (idx >> 31))
    h = _mix(h ^ seed)
    return (h & 0xFFFF).to(torch.int32)


def round_into(dst: Tensor, src: Tensor, seed: int, start: int) -> None:
    """Write ``src`` (floating, any dtype; as many elements as ``dst``) into bf16 tensor
    ``dst``, stochastically rounded with the bits of elements ``start ..`` under ``seed``.
    NaN stays NaN and infinities stay infinite; a finite value within a bf16 step of the
    largest may round up to infinity, as in any stochastic rounding."""
    x = src.detach().reshape(-1).to(device=dst.device, dtype=torch.float32)
    bits = x.view(torch.int32) + random_bits(seed, start, x.numel(), x.device)
    out = (bits >> 16).to(torch.int16).view(torch.bfloat16)
    out = torch.where(torch.isnan(x), x.to(torch.bfloat16), out)
    dst.copy_(out.view(dst.shape))

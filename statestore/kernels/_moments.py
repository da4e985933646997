"""Adam steps over compressed moments (``moment_dtype="bf16"`` / ``"int8"``).

:func:`adam_step_moments` updates parameters whose ``exp_avg``/``exp_avg_sq`` are stored in an
encoding of :mod:`statestore.kernels._quant`: the compiled kernels (C++ SIMD on CPU, CUDA on
GPU) decode, update and re-encode each element (int8: each block of 256) in one pass, with
no fp32 copy of a whole tensor. Where they cannot run (no extension, unusual tensors,
``STATESTORE_FORCE_REFERENCE=1``) the same algorithm runs as three steps: decode to fp32
(torch), the fp32 Adam update (:func:`adam_step`), encode (torch); the results are the same
bits, as the tests check.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _quant as Q
from ._dispatch import (AdamHyper, AdamTensors, adam_step, force_reference, load_extension,
                        run_op)

__all__ = ["adam_step_moments", "MomentCodes", "MOMENT_KINDS"]

#: the compressed encodings (the op's ``moments`` argument is "<kind>-<rounding>")
MOMENT_KINDS = ("bf16", "int8")


def _fused_ok(t: AdamTensors, i: int, amsgrad: bool, codes: "MomentCodes") -> bool:
    """True when the compiled kernels take tensor ``i`` of ``t`` (its codes in ``codes``)
    as it is."""
    kind, (ms, vs) = codes.kind, codes.scales(i)
    p, g, m, v = t.params[i], t.grads[i], t.exp_avgs[i], t.exp_avg_sqs[i]
    vmax, master = t.vmax(i) if amsgrad else None, t.master(i)
    w = master if master is not None else p
    n = p.numel()
    ts = [p, g, m, v, w] + ([vmax] if vmax is not None else [])
    for t in ts:
        if t.numel() != n or not t.is_contiguous() or t.device != p.device:
            return False
    if w.dtype != torch.float32 or (vmax is not None and vmax.dtype != torch.float32):
        return False
    if g.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return False
    if master is not None and p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return False
    if kind == "bf16":
        return m.dtype == torch.bfloat16 and v.dtype == torch.bfloat16
    nb = Q.nblocks(n)
    return (m.dtype == torch.int8 and v.dtype == torch.uint8 and ms is not None
            and vs is not None and ms.numel() == nb and vs.numel() == nb
            and ms.dtype == torch.float32 and vs.dtype == torch.float32
            and ms.is_contiguous() and vs.is_contiguous()
            and ms.device == p.device and vs.device == p.device)


class MomentCodes(NamedTuple):
    """How one Adam update's compressed moments are encoded, one entry per tensor:
    ``kind`` ("bf16": bfloat16 codes; "int8": int8 / uint8 codes with ``exp_avg_scales[i]``/
    ``exp_avg_sq_scales[i]``, one fp32 scale per block of 256), ``rounding`` ("stochastic"
    or "nearest"), ``seeds[i]`` = (exp_avg seed, exp_avg_sq seed) of the random bits
    (:func:`statestore.kernels._quant.moment_seed`), ``offsets[i]``: the parameter element
    the tensor's codes start at (a multiple of 256 for int8)."""
    kind: str
    rounding: str
    seeds: Sequence[Sequence[int]]
    offsets: Sequence[int]
    exp_avg_scales: Optional[Sequence[Tensor]] = None
    exp_avg_sq_scales: Optional[Sequence[Tensor]] = None

    def pick(self, idx: Sequence[int]) -> "MomentCodes":
        def sel(lst):
            return None if lst is None else [lst[i] for i in idx]
        return MomentCodes(self.kind, self.rounding, sel(self.seeds), sel(self.offsets),
                           sel(self.exp_avg_scales), sel(self.exp_avg_sq_scales))

    def scales(self, i: int) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """Tensor ``i``'s scales (int8), else ``(None, None)``."""
        if self.exp_avg_scales is None or self.kind != "int8":
            return None, None
        return self.exp_avg_scales[i], self.exp_avg_sq_scales[i]


def adam_step_moments(tensors: AdamTensors, hyper: AdamHyper, codes: MomentCodes) -> None:
    """One Adam/AdamW step in place over compressed moments: ``tensors.exp_avgs[i]``/
    ``exp_avg_sqs[i]`` hold the codes ``codes`` describes (flat, for elements
    ``codes.offsets[i]..`` of their parameter). Everything else as :func:`adam_step`.
    """
    t = tensors
    n = len(t.params)
    if n == 0:
        return
    t.check("adam_step_moments", hyper.amsgrad)
    _check_codes(n, codes)
    fused, slow = _split_fused(t, hyper, codes)
    with torch.no_grad():
        if fused:
            run_op(t.pick(fused), hyper, f"{codes.kind}-{codes.rounding}", codes.pick(fused))
        if slow:
            _unfused(t.pick(slow), hyper, codes.pick(slow))


def _check_codes(n: int, codes: MomentCodes) -> None:
    """:func:`adam_step_moments`' encoding, ``n`` entries in each of its lists (int8: with
    scales, and block-aligned offsets)."""
    kind = codes.kind
    if kind not in MOMENT_KINDS:
        raise ValueError(f"adam_step_moments: kind must be one of {sorted(MOMENT_KINDS)}, "
                         f"got {kind!r}")
    if codes.rounding not in Q.ROUNDINGS:
        raise ValueError(f"adam_step_moments: rounding must be one of {Q.ROUNDINGS}, got "
                         f"{codes.rounding!r}")
    for name, lst in (("seeds", codes.seeds), ("offsets", codes.offsets)):
        if len(lst) != n:
            raise ValueError(f"adam_step_moments: {name} has {len(lst)} entries, params has {n}")
    if kind == "int8":
        ms, vs = codes.exp_avg_scales, codes.exp_avg_sq_scales
        if ms is None or vs is None or len(ms) != n or len(vs) != n:
            raise ValueError("adam_step_moments: int8 needs exp_avg_scales and "
                             "exp_avg_sq_scales, one tensor per param")
        for i, off in enumerate(codes.offsets):
            if off % Q.BLOCK:
                raise ValueError(f"adam_step_moments: offsets[{i}] = {off} is not a multiple "
                                 f"of the int8 block ({Q.BLOCK})")


def _split_fused(t: AdamTensors, hyper: AdamHyper, codes: MomentCodes
                 ) -> Tuple[List[int], List[int]]:
    """The indices the compiled kernels update, and the others (:func:`_unfused`)."""
    ext = None if force_reference() else load_extension()
    fused, slow = [], []
    for i in range(len(t.params)):
        dev = t.params[i].device.type
        can = ext is not None and (
            dev == "cpu" or (dev == "cuda" and getattr(ext, "with_cuda", False)))
        if can and _fused_ok(t, i, hyper.amsgrad, codes):
            fused.append(i)
        else:
            slow.append(i)
    return fused, slow


def _unfused(t: AdamTensors, hyper: AdamHyper, codes: MomentCodes) -> None:
    """Decode to fp32, the fp32 update, encode: the fused kernels' algorithm in three passes."""
    kind = codes.kind
    ms_vs = [codes.scales(i) for i in range(len(t.params))]

    def decoded(which, lst):
        return [Q.decode(kind, which, x.reshape(-1).cpu(), None if sc[which] is None else
                         sc[which].reshape(-1).cpu()).to(p.device)
                for x, sc, p in zip(lst, ms_vs, t.params)]
    m32, v32 = decoded(0, t.exp_avgs), decoded(1, t.exp_avg_sqs)
    adam_step(AdamTensors(t.params, t.grads, m32, v32, t.steps, t.max_exp_avg_sqs, t.masters),
              hyper)
    for i in range(len(t.params)):
        if kind == "int8":
            Q.int8_saturate(m32[i], v32[i])
        for which, x, codes_t in ((0, m32[i], t.exp_avgs[i]), (1, v32[i], t.exp_avg_sqs[i])):
            c, s = Q.encode(kind, which, x.cpu(), seed=int(codes.seeds[i][which]),
                            offset=int(codes.offsets[i]), rounding=codes.rounding)
            codes_t.reshape(-1).copy_(c.view(codes_t.dtype) if c.dtype != codes_t.dtype else c)
            sc = ms_vs[i][which]
            if sc is not None:
                sc.reshape(-1).copy_(s)

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

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _quant as Q
from ._dispatch import AdamHyper, adam_step, force_reference, load_extension, run_op

__all__ = ["adam_step_moments", "MOMENT_KINDS"]

#: the compressed encodings (the op's ``moments`` argument is "<kind>-<rounding>")
MOMENT_KINDS = ("bf16", "int8")


def _fused_ok(kind, p, g, m, v, ms, vs, vmax, master) -> bool:
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


def adam_step_moments(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    kind: str,
    rounding: str,
    steps: Sequence[int],
    seeds: Sequence[Sequence[int]],
    offsets: Sequence[int],
    exp_avg_scales: Optional[Sequence[Tensor]] = None,
    exp_avg_sq_scales: Optional[Sequence[Tensor]] = None,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
    amsgrad: bool = False,
    max_exp_avg_sqs: Optional[Sequence[Tensor]] = None,
    masters: Optional[Sequence[Optional[Tensor]]] = None,
    maximize: bool = False,
    grad_scale: float = 1.0,
) -> None:
    """One Adam/AdamW step in place over compressed moments.

    ``exp_avgs[i]``/``exp_avg_sqs[i]`` hold the codes of ``kind`` ("bf16": bfloat16; "int8":
    int8 / uint8 with ``exp_avg_scales[i]``/``exp_avg_sq_scales[i]``, one fp32 scale per
    block of 256), flat, for elements ``offsets[i]..`` of their parameter (a multiple of 256
    for int8); ``seeds[i]`` = (exp_avg seed, exp_avg_sq seed) of the random bits
    (:func:`statestore.kernels._quant.moment_seed`); ``rounding``: "stochastic" or
    "nearest". Everything else as :func:`adam_step`.
    """
    n = len(params)
    if n == 0:
        return
    _check_lists(n, kind, rounding, (("grads", grads), ("exp_avgs", exp_avgs),
                                     ("exp_avg_sqs", exp_avg_sqs), ("steps", steps),
                                     ("seeds", seeds), ("offsets", offsets)),
                 offsets, exp_avg_scales, exp_avg_sq_scales)
    kw = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
              adamw_mode=adamw_mode, maximize=maximize, grad_scale=grad_scale)
    ms_l = list(exp_avg_scales) if exp_avg_scales is not None else [None] * n
    vs_l = list(exp_avg_sq_scales) if exp_avg_sq_scales is not None else [None] * n
    vmax_l = list(max_exp_avg_sqs) if amsgrad else [None] * n
    mas_l = list(masters) if masters is not None else [None] * n
    fused, slow = _split_fused(kind, params, grads, exp_avgs, exp_avg_sqs, ms_l, vs_l, vmax_l,
                               mas_l)
    with torch.no_grad():
        if fused:
            pick = lambda lst: [lst[i] for i in fused]  # noqa: E731
            run_op(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs),
                   steps=pick(steps), hyper=AdamHyper(**kw), moments=f"{kind}-{rounding}",
                   exp_avg_scales=pick(ms_l) if kind == "int8" else (),
                   exp_avg_sq_scales=pick(vs_l) if kind == "int8" else (),
                   max_exp_avg_sqs=pick(vmax_l) if amsgrad else (),
                   masters=pick(mas_l) if masters is not None else (),
                   seeds=pick(seeds), offsets=pick(offsets))
        if slow:
            _unfused(slow, params, grads, exp_avgs, exp_avg_sqs, ms_l, vs_l, vmax_l, mas_l,
                     kind, rounding, steps, seeds, offsets, amsgrad, masters is not None, kw)


def _check_lists(n: int, kind: str, rounding: str, lists, offsets: Sequence[int],
                 exp_avg_scales: Optional[Sequence[Tensor]],
                 exp_avg_sq_scales: Optional[Sequence[Tensor]]) -> None:
    """:func:`adam_step_moments`' encoding, and its ``(name, list)`` ``lists`` of ``n``
    entries each (int8: with scales, and block-aligned offsets)."""
    if kind not in MOMENT_KINDS:
        raise ValueError(f"adam_step_moments: kind must be one of {sorted(MOMENT_KINDS)}, "
                         f"got {kind!r}")
    if rounding not in Q.ROUNDINGS:
        raise ValueError(f"adam_step_moments: rounding must be one of {Q.ROUNDINGS}, got "
                         f"{rounding!r}")
    for name, lst in lists:
        if len(lst) != n:
            raise ValueError(f"adam_step_moments: {name} has {len(lst)} entries, params has {n}")
    if kind == "int8":
        if exp_avg_scales is None or exp_avg_sq_scales is None \
                or len(exp_avg_scales) != n or len(exp_avg_sq_scales) != n:
            raise ValueError("adam_step_moments: int8 needs exp_avg_scales and "
                             "exp_avg_sq_scales, one tensor per param")
        for i, off in enumerate(offsets):
            if off % Q.BLOCK:
                raise ValueError(f"adam_step_moments: offsets[{i}] = {off} is not a multiple "
                                 f"of the int8 block ({Q.BLOCK})")


def _split_fused(kind, params, grads, ms, vs, m_sc, v_sc, vmax, masters
                 ) -> Tuple[List[int], List[int]]:
    """The indices the compiled kernels update, and the others (:func:`_unfused`)."""
    ext = None if force_reference() else load_extension()
    fused, slow = [], []
    for i in range(len(params)):
        dev = params[i].device.type
        can = ext is not None and (
            dev == "cpu" or (dev == "cuda" and getattr(ext, "with_cuda", False)))
        if can and _fused_ok(kind, params[i], grads[i], ms[i], vs[i], m_sc[i], v_sc[i],
                             vmax[i], masters[i]):
            fused.append(i)
        else:
            slow.append(i)
    return fused, slow


def _unfused(idx: List[int], params, grads, ms, vs, m_sc, v_sc, vmax, masters, kind,
             rounding, steps, seeds, offsets, amsgrad, has_masters, kw) -> None:
    """Decode to fp32, the fp32 update, encode: the fused kernels' algorithm in three passes."""
    m32 = [Q.decode(kind, 0, ms[i].reshape(-1).cpu(), None if m_sc[i] is None else
                    m_sc[i].reshape(-1).cpu()).to(params[i].device) for i in idx]
    v32 = [Q.decode(kind, 1, vs[i].reshape(-1).cpu(), None if v_sc[i] is None else
                    v_sc[i].reshape(-1).cpu()).to(params[i].device) for i in idx]
    adam_step([params[i] for i in idx], [grads[i] for i in idx], m32, v32,
              steps=[steps[i] for i in idx], amsgrad=amsgrad,
              max_exp_avg_sqs=[vmax[i] for i in idx] if amsgrad else None,
              masters=[masters[i] for i in idx] if has_masters else None, **kw)
    for j, i in enumerate(idx):
        if kind == "int8":
            Q.int8_saturate(m32[j], v32[j])
        for which, x, codes, sc in ((0, m32[j], ms[i], m_sc[i]), (1, v32[j], vs[i], v_sc[i])):
            c, s = Q.encode(kind, which, x.cpu(), seed=int(seeds[i][which]),
                            offset=int(offsets[i]), rounding=rounding)
            codes.reshape(-1).copy_(c.view(codes.dtype) if c.dtype != codes.dtype else c)
            if sc is not None:
                sc.reshape(-1).copy_(s)

"""Dispatch of :func:`adam_step` and :func:`grads_finite` to the compiled kernels.

* CPU tensors: the C++ SIMD kernel of ``statestore._C_adam`` (AVX-512, AVX2 or scalar, chosen
  at run time; ``STATESTORE_SIMD`` or :func:`set_simd` forces one).
* CUDA tensors: the fused multi-tensor CUDA kernel of the same extension when it was built
  with CUDA; otherwise torch's own fused Adam (``torch._fused_adamw_`` / ``_fused_adam_``).
* Anything else, a missing extension, or ``STATESTORE_FORCE_REFERENCE=1``: the vectorized torch
  reference (:func:`adam_step_reference`).

The extension is imported once, on first use; the ``ImportError`` is kept and reported once,
in the warning that announces the fallback, and by :func:`kernels_info`. Tensors the
kernel cannot take as they are (not contiguous, unusual dtypes) go to the reference path,
tensor by tensor, silently: results are the same to float32 rounding.
"""
from __future__ import annotations

import math
import os
import threading
import warnings
from typing import List, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from .._signals import deferred_signals
from ._reference import adam_step_reference

__all__ = ["AdamHyper", "AdamTensors", "adam_step", "grads_finite", "kernels_info", "stream_copy_", "set_simd"]

_SIMD_NAMES = ("avx512", "avx2", "scalar", "auto")
_KERNEL_GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_lock = threading.Lock()
_state = {
    "loaded": False,     # load_extension() ran
    "ext": None,         # the module statestore._C_adam, or None
    "reason": None,      # why the reference path is used on CPU (str), or None
    "error": None,       # the ImportError, kept
    "warned": set(),     # fallback warnings already given, by key
}


def force_reference() -> bool:
    return os.environ.get("STATESTORE_FORCE_REFERENCE", "") not in ("", "0")


def _warn_once(key: str, message: str) -> None:
    with _lock:
        if key in _state["warned"]:
            return
        _state["warned"].add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _simd_ceiling() -> str:
    """STATESTORE_SIMD's path, or "" for none/auto/an unknown name."""
    want = os.environ.get("STATESTORE_SIMD", "").strip().lower()
    return want if want in ("avx512", "avx2", "scalar") else ""


def simd_supported() -> List[str]:
    """The CPU paths this process may use, best first, always ending in ``"scalar"``.

    The processor's paths, capped by ``STATESTORE_SIMD``: ``STATESTORE_SIMD=avx2`` on an
    AVX-512 host makes the process see the host as an AVX2 host (``avx2``, ``scalar``), and
    ``scalar`` as one without vector units. So the whole suite, benchmarks included, runs
    on an AVX-512 host as on the others (``make test-simd``)."""
    ext = load_extension()
    if ext is None:
        return []
    paths = list(ext.simd_supported())
    cap = _simd_ceiling()
    if cap and cap in paths:
        paths = paths[paths.index(cap):]
    return paths


def _apply_simd_env(ext) -> None:
    """Applies STATESTORE_SIMD, the best path the process may use (a ceiling, see
    :func:`simd_supported`): a path the processor lacks is clamped to the best it has, and
    an unknown name ignored, each with a warning (an environment variable shared by a
    heterogeneous cluster must not stop training)."""
    want = os.environ.get("STATESTORE_SIMD", "").strip().lower()
    if not want:
        return
    if want not in _SIMD_NAMES:
        warnings.warn(f"STATESTORE_SIMD={want!r} is not one of {', '.join(_SIMD_NAMES)}; "
                      f"using the best path this processor supports", RuntimeWarning, stacklevel=4)
        return
    supported = list(ext.simd_supported())
    if want != "auto" and want not in supported:
        warnings.warn(f"STATESTORE_SIMD={want!r}: this processor supports only "
                      f"{', '.join(supported)}; using {supported[0]!r}", RuntimeWarning,
                      stacklevel=4)
        want = supported[0]
    ext.set_simd(want)


def _register_fake() -> None:
    """Shape-only implementation of the mutating op, so that torch.compile / FakeTensor
    tracing (and ``torch.library.opcheck``) can see through it."""
    try:
        @torch.library.register_fake("statestore::adam_")
        def _(params, grads, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales,
              max_exp_avg_sqs, masters, steps, seeds, offsets, hyper, moments):
            return None
    except RuntimeError:  # already registered (module reloaded)
        pass


class AdamHyper(NamedTuple):
    """The scalar hyperparameters of one Adam update: what every kernel entry point takes
    (:func:`adam_step`, :func:`~statestore.kernels.adam_step_moments`,
    :func:`~statestore.kernels.adam_step_reference`), and, as it is, the op
    ``statestore::adam_``'s ``hyper`` argument: its nine numbers in this order are the C++
    struct ``AdamHyper`` (``csrc/adam_math.h``), flags as 0 or 1. :meth:`of_group` builds it
    from a param group of torch's keys."""
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    adamw_mode: bool = True
    maximize: bool = False
    grad_scale: float = 1.0
    amsgrad: bool = False

    @classmethod
    def of_group(cls, group: dict, grad_scale: float = 1.0) -> "AdamHyper":
        """A param group's hyperparameters (``lr`` a float or a one-element tensor,
        ``betas``, ``eps``, ``weight_decay``, ``adamw_mode``, ``maximize``, ``amsgrad``);
        gradients divided by ``grad_scale``."""
        lr = group["lr"]
        beta1, beta2 = group["betas"]
        return cls(float(lr.item() if isinstance(lr, Tensor) else lr), float(beta1),
                   float(beta2), float(group["eps"]), float(group["weight_decay"]),
                   bool(group["adamw_mode"]), bool(group["maximize"]), float(grad_scale),
                   bool(group["amsgrad"]))


class AdamTensors(NamedTuple):
    """The tensors of one Adam update, one entry per tensor: ``steps[i]`` is tensor ``i``'s
    step count after this update; ``max_exp_avg_sqs`` with ``amsgrad``, else None;
    ``masters[i]`` an fp32 master of a low-precision ``params[i]`` (or None), the list None
    where no tensor has one."""
    params: Sequence[Tensor]
    grads: Sequence[Tensor]
    exp_avgs: Sequence[Tensor]
    exp_avg_sqs: Sequence[Tensor]
    steps: Sequence[int]
    max_exp_avg_sqs: Optional[Sequence[Tensor]] = None
    masters: Optional[Sequence[Optional[Tensor]]] = None

    def pick(self, idx: Sequence[int]) -> "AdamTensors":
        """The entries ``idx``, in that order."""
        def sel(lst):
            return None if lst is None else [lst[i] for i in idx]
        return AdamTensors(*(sel(x) for x in self))

    def master(self, i: int) -> Optional[Tensor]:
        return None if self.masters is None else self.masters[i]

    def vmax(self, i: int) -> Optional[Tensor]:
        return None if self.max_exp_avg_sqs is None else self.max_exp_avg_sqs[i]

    def check(self, name: str, amsgrad: bool) -> None:
        """Every list of one entry per tensor (``name``: the entry point, for messages)."""
        n = len(self.params)
        for what, lst in (("grads", self.grads), ("exp_avgs", self.exp_avgs),
                          ("exp_avg_sqs", self.exp_avg_sqs), ("steps", self.steps)):
            if len(lst) != n:
                raise ValueError(f"{name}: {what} has {len(lst)} entries, params has {n}")
        if amsgrad and (self.max_exp_avg_sqs is None or len(self.max_exp_avg_sqs) != n):
            raise ValueError(f"{name}: amsgrad=True needs max_exp_avg_sqs, one tensor per param")
        if self.masters is not None and len(self.masters) != n:
            raise ValueError(f"{name}: masters has {len(self.masters)} entries, params has {n}")
        if n and min(int(s) for s in self.steps) < 1:
            i, s = next((i, int(s)) for i, s in enumerate(self.steps) if int(s) < 1)
            raise ValueError(f"{name}: steps[{i}] = {s}: step counts start at 1 (the count "
                             f"after this update)")


def run_op(t: AdamTensors, hyper: AdamHyper, moments: str = "fp32", codes=None) -> None:
    """One call of the compiled op ``statestore::adam_`` for tensors it takes as they are:
    ``moments`` is its encoding argument ("fp32", "bf16-nearest", "bf16-stochastic",
    "int8-nearest", "int8-stochastic"), ``codes`` the compressed moments' seeds, offsets and
    scales (:class:`~statestore.kernels._moments.MomentCodes`), None for fp32
    (``csrc/adam/adam_checks.h`` documents every argument)."""
    ms = vs = seeds = offsets = ()
    if codes is not None:
        seeds = [int(x) for pair in codes.seeds for x in pair]
        offsets = [int(o) for o in codes.offsets]
        if codes.kind == "int8":
            ms, vs = codes.exp_avg_scales, codes.exp_avg_sq_scales
    torch.ops.statestore.adam_(
        list(t.params), list(t.grads), list(t.exp_avgs), list(t.exp_avg_sqs), list(ms),
        list(vs), list(t.max_exp_avg_sqs) if hyper.amsgrad else [],
        list(t.masters) if t.masters is not None else [], [int(s) for s in t.steps], seeds,
        offsets, hyper, moments)


def load_extension():
    """Imports the extension once; returns it or None.

    The import runs with Ctrl-C deferred (:mod:`statestore._signals`): pybind11 turns an
    exception raised while the module initializes into ``ImportError("initialization
    failed")``, and a retry then fails too (its types are registered already); a Ctrl-C
    there would be lost and the process would step with the reference path, whose rounding
    differs from the kernel's, for the rest of its life (docs/reliability.md)."""
    if _state["loaded"]:
        return _state["ext"]
    with deferred_signals(), _lock:
        if _state["loaded"]:
            return _state["ext"]
        ext = None
        try:
            from statestore import _C_adam as ext  # noqa: N814
        except ImportError as e:  # missing, or built against another torch
            _state["error"] = e
            _state["reason"] = f"statestore._C_adam failed to import: {e}"
        if ext is not None:
            _register_fake()
            try:
                _apply_simd_env(ext)
            except Exception as e:  # noqa: BLE001 - keep the kernel, report the setting
                warnings.warn(f"STATESTORE_SIMD could not be applied: {e}", RuntimeWarning,
                              stacklevel=3)
        _state["ext"] = ext
        _state["loaded"] = True
        return ext


def set_simd(name: str) -> str:
    """Selects the CPU path for this process: ``"avx512"``, ``"avx2"``, ``"scalar"`` or
    ``"auto"`` (the best of :func:`simd_supported`). Raises :class:`RuntimeError` where the
    path is not in :func:`simd_supported` (the processor lacks it, or ``STATESTORE_SIMD``
    caps the process below it) or the extension is missing, :class:`ValueError` for an
    unknown name. Returns the path now used."""
    if name not in _SIMD_NAMES:
        raise ValueError(f"simd: unknown path {name!r}; expected one of {', '.join(_SIMD_NAMES)}")
    ext = load_extension()
    if ext is None:
        raise RuntimeError(f"simd: the C++ kernels are unavailable ({_state['reason']})")
    allowed = simd_supported()
    if name == "auto":
        name = allowed[0]
    elif name not in allowed and name in ext.simd_supported():
        raise RuntimeError(f"set_simd: STATESTORE_SIMD={_simd_ceiling()} caps this process at "
                           f"{', '.join(allowed)}; {name!r} is above it")
    return ext.set_simd(name)


def kernels_info() -> dict:
    """Which implementation :func:`adam_step` uses: ``cpu`` ("simd" or "reference"), ``simd``
    (path name), ``simd_width`` (bits), ``simd_supported``, ``cuda`` ("fused-cuda",
    "torch-fused", "reference" or "unavailable"), ``cuda_moments`` (the compressed-moment
    CUDA kernel's layout, "block" or "wide", with "fused-cuda"; else None), ``threads`` and
    ``reason`` (why a fallback is in use, else None)."""
    ext = load_extension()
    forced = force_reference()
    info = {"extension": ext is not None, "threads": torch.get_num_threads(),
            "reason": _state["reason"], "simd": None, "simd_width": None, "simd_supported": [],
            "cuda_moments": None}
    if ext is not None:
        name, width = ext.simd()
        info.update(simd=name, simd_width=width, simd_supported=simd_supported())
    if forced:
        info["reason"] = "STATESTORE_FORCE_REFERENCE is set"
    info["cpu"] = "simd" if ext is not None and not forced else "reference"
    if not torch.cuda.is_available():
        info["cuda"] = "unavailable"
    elif forced:
        info["cuda"] = "reference"
    elif ext is not None and getattr(ext, "with_cuda", False):
        info["cuda"] = "fused-cuda"
        info["cuda_moments"] = ext.cuda_moments()
    else:
        info["cuda"] = "torch-fused"
    return info


def _kernel_ok(t: AdamTensors, i: int, amsgrad: bool) -> bool:
    """True when the compiled kernel takes tensor ``i`` of ``t`` as it is."""
    p, g, m, v = t.params[i], t.grads[i], t.exp_avgs[i], t.exp_avg_sqs[i]
    vmax, master = t.vmax(i) if amsgrad else None, t.master(i)
    w = master if master is not None else p
    ts = (p, g, m, v, w) if vmax is None else (p, g, m, v, w, vmax)
    n = p.numel()
    for t in ts:
        if t.numel() != n or not t.is_contiguous() or t.device != p.device:
            return False
    if m.dtype != torch.float32 or v.dtype != torch.float32 or w.dtype != torch.float32:
        return False
    if vmax is not None and vmax.dtype != torch.float32:
        return False
    if g.dtype not in _KERNEL_GRAD_DTYPES:
        return False
    if master is not None and p.dtype not in _KERNEL_GRAD_DTYPES:
        return False
    return True


def _torch_fused_step(t: AdamTensors, hyper: AdamHyper) -> None:
    """torch's fused Adam for the tensors of ``t`` (the GPU fallback). The grads are never
    modified: torch's op unscales its grads in place, so an unscaled copy is passed."""
    by_dtype = {}
    for i in range(len(t.params)):
        master = t.master(i)
        w = master if master is not None else t.params[i]
        by_dtype.setdefault(w.dtype, []).append(i)
    op = torch._fused_adamw_ if hyper.adamw_mode else torch._fused_adam_
    for dtype, ids in by_dtype.items():
        s = t.pick(ids)
        ws = [m if m is not None else p for p, m in zip(s.params, s.masters or [None] * len(ids))]
        gs = []
        for g in s.grads:
            if hyper.grad_scale != 1.0:
                g = g.to(dtype) / hyper.grad_scale
            elif g.dtype != dtype:
                g = g.to(dtype)
            gs.append(g)
        st = [torch.tensor(float(x), dtype=torch.float32, device=ws[0].device) for x in s.steps]
        op(ws, gs, list(s.exp_avgs), list(s.exp_avg_sqs),
           list(s.max_exp_avg_sqs) if hyper.amsgrad else [], st, lr=hyper.lr,
           beta1=hyper.beta1, beta2=hyper.beta2, weight_decay=hyper.weight_decay,
           eps=hyper.eps, amsgrad=hyper.amsgrad, maximize=hyper.maximize)
        for p, w in zip(s.params, ws):
            if w is not p:
                p.copy_(w)


def adam_step(tensors: AdamTensors, hyper: AdamHyper) -> None:
    """Applies one Adam/AdamW step in place; same contract as :func:`adam_step_reference`.

    ``tensors`` are on one device. Where ``tensors.masters[i]`` is an fp32 tensor, it is
    updated and written back into ``params[i]`` (fp32, fp16 or bf16) in the same pass.
    """
    t = tensors
    if len(t.params) == 0:
        return
    t.check("adam_step", hyper.amsgrad)
    if not (hyper.grad_scale > 0 and math.isfinite(hyper.grad_scale)):
        raise ValueError(f"adam_step: grad_scale must be a positive finite number, got "
                         f"{hyper.grad_scale}")
    device = t.params[0].device
    ext = None if force_reference() else load_extension()
    if force_reference():
        _warn_once("forced", "statestore: STATESTORE_FORCE_REFERENCE is set; Adam steps use the "
                             "vectorized torch reference path")
    elif device.type == "cpu" and ext is None:
        _warn_once("cpu", f"statestore: using the vectorized torch Adam on CPU: "
                          f"{_state['reason']}")
    elif device.type == "cuda" and (ext is None or not getattr(ext, "with_cuda", False)):
        why = _state["reason"] or "statestore._C_adam was built without CUDA"
        _warn_once("cuda", f"statestore: using torch's fused Adam on CUDA: {why}")
        with torch.no_grad():
            _torch_fused_step(t, hyper)
        return
    if ext is None or device.type not in ("cpu", "cuda"):
        adam_step_reference(t, hyper)
        return
    fast, slow = [], []
    for i in range(len(t.params)):
        (fast if _kernel_ok(t, i, hyper.amsgrad) else slow).append(i)
    with torch.no_grad():
        if fast:
            run_op(t.pick(fast) if slow else t, hyper)
        if slow:
            adam_step_reference(t.pick(slow), hyper)


def grads_finite(grads: Sequence[Tensor]) -> bool:
    """True when every gradient is finite (no inf or nan); the optimizers skip a step
    otherwise. One pass over each gradient, multi-threaded and vectorized on CPU."""
    if len(grads) == 0:
        return True
    ext = None if force_reference() else load_extension()
    cpu = [g for g in grads if g.device.type == "cpu"]
    other = [g for g in grads if g.device.type != "cpu"]
    if cpu:
        if ext is not None:
            if not torch.ops.statestore.grads_finite(cpu):
                return False
        elif not all(bool(torch.isfinite(g).all()) for g in cpu):
            return False
    if other:
        flags = torch.stack([torch.isfinite(g).all() for g in other])
        return bool(flags.all())
    return True


# Below this, the call's overhead outweighs what streaming stores save.
STREAM_COPY_MIN_BYTES = 1 << 20


def stream_copy_(dst: Tensor, src: Tensor) -> Tensor:
    """``dst.copy_(src)`` for a host buffer headed to a device (a store's ring buffer about to
    be written to disk): with the SIMD path's non-temporal stores, which leave the caches
    alone and move 2 bytes over the memory bus per byte copied instead of 3. Falls back to
    ``dst.copy_(src)`` (with its conversions and broadcasting) unless both are contiguous CPU
    tensors of one dtype and size, at least ``STREAM_COPY_MIN_BYTES``, and the extension is
    available. Returns ``dst``."""
    ext = load_extension()
    if (ext is not None and dst.dtype == src.dtype and dst.shape == src.shape
            and dst.device.type == "cpu" and src.device.type == "cpu"
            and dst.is_contiguous() and src.is_contiguous()
            and not (src.is_conj() or src.is_neg())
            and src.numel() * src.element_size() >= STREAM_COPY_MIN_BYTES):
        ext.stream_copy(dst, src)
    else:
        dst.copy_(src)
    return dst

"""How an optimizer keeps ``exp_avg`` / ``exp_avg_sq`` in its store: ``moment_dtype``.

* ``"fp32"``: fp32 states ``exp_avg``, ``exp_avg_sq`` of the parameter's shape (torch's).
* ``"bf16"``: the same two states in bfloat16 (stochastic rounding by default).
* ``"int8"``: ``exp_avg`` (int8 codes) and ``exp_avg_sq`` (uint8 codes) of the parameter's
  shape, plus ``exp_avg_scale`` and ``exp_avg_sq_scale``: fp32 tensors of one scale per block
  of 256 elements (``ceil(numel / 256)``). Nearest rounding by default.

The encodings are :mod:`statestore.kernels._quant`'s (``docs/kernels.md``, "Compressed
moments"). ``max_exp_avg_sq`` (amsgrad) and the fp32 ``master`` stay fp32 in every format.
Every state is an ordinary store state, so every store, the pipeline, checkpoints (stock
safetensors: ``I8``/``U8``/``BF16``/``F32`` tensors) and sharding carry them unchanged; the
optimizer metadata saved with a checkpoint records the format (:meth:`MomentFormat.metadata`)
and a resume checks it.

Pipeline units: a unit covers elements ``[a, b)`` of a parameter; its scale slices cover
blocks ``[a // 256, ceil(b / 256))``, so cuts fall on block boundaries, and on disk stores at
elements whose every state slice starts on the store's alignment (for int8 scales on a
4096-byte store: multiples of 262144 elements) - see :meth:`MomentFormat.cut_elems`.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..errors import StateStoreValueError
from ..kernels._quant import (BLOCK, INT8_ENCODING, ROUNDINGS, decode, encode, moment_seed,
                              nblocks)

__all__ = ["MOMENT_DTYPES", "MomentFormat", "SCALE_OF", "export_fp32"]

MOMENT_DTYPES = ("fp32", "bf16", "int8")
#: the scale state of each int8 moment state
SCALE_OF = {"exp_avg": "exp_avg_scale", "exp_avg_sq": "exp_avg_sq_scale"}
_SCALES = tuple(SCALE_OF.values())
_DEFAULT_ROUNDING = {"fp32": "nearest", "bf16": "stochastic", "int8": "nearest"}
_DTYPES = {"fp32": (torch.float32, torch.float32), "bf16": (torch.bfloat16, torch.bfloat16),
           "int8": (torch.int8, torch.uint8)}
#: version of the bf16 encoding recorded in checkpoints; int8's is INT8_ENCODING["version"]
FORMAT_VERSION = 1


class MomentFormat:
    """``moment_dtype`` (and its rounding) of one optimizer."""

    def __init__(self, moment_dtype: str = "fp32", rounding: Optional[str] = None,
                 encoding: Optional[dict] = None):
        """``encoding``: a checkpoint's ``moment_encoding`` metadata, to decode the moments
        it holds (:meth:`to_fp32`; int8 version 1 decodes, see :meth:`encoding_mismatch`)."""
        if isinstance(moment_dtype, torch.dtype):
            moment_dtype = {torch.float32: "fp32", torch.bfloat16: "bf16",
                            torch.int8: "int8"}.get(moment_dtype, str(moment_dtype))
        aliases = {"float32": "fp32", "bfloat16": "bf16"}
        if isinstance(moment_dtype, str):
            moment_dtype = aliases.get(moment_dtype, moment_dtype)
        if moment_dtype not in MOMENT_DTYPES:
            raise StateStoreValueError(f"moment_dtype must be one of {MOMENT_DTYPES}, got "
                                       f"{moment_dtype!r}")
        if rounding is None:
            rounding = _DEFAULT_ROUNDING[moment_dtype]
        if rounding not in ROUNDINGS:
            raise StateStoreValueError(f"moment_rounding must be one of {ROUNDINGS} (or "
                                       f"None), got {rounding!r}")
        self.name = moment_dtype
        self.rounding = rounding
        self.version = _encoding_version(moment_dtype, encoding)

    @property
    def compressed(self) -> bool:
        return self.name != "fp32"

    def __repr__(self) -> str:
        return f"MomentFormat({self.name!r}, rounding={self.rounding!r})"

    # ------------------------------------------------------------------ states
    def stored_names(self, logical: Sequence[str]) -> List[str]:
        """Store states of the logical states ``logical`` (exp_avg, exp_avg_sq, ...)."""
        out = list(logical)
        if self.name == "int8":
            out += [SCALE_OF[n] for n in logical if n in SCALE_OF]
        return out

    def spec(self, name: str, shape: Tuple[int, ...]) -> Tuple[Tuple[int, ...], torch.dtype]:
        """(shape, dtype) of store state ``name`` of a parameter of ``shape``."""
        if name in _SCALES:
            return (nblocks(math.prod(shape)),), torch.float32
        if name == "exp_avg":
            return tuple(shape), _DTYPES[self.name][0]
        if name == "exp_avg_sq":
            return tuple(shape), _DTYPES[self.name][1]
        return tuple(shape), torch.float32

    def known(self, name: str) -> bool:
        return name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master") or \
            (self.name == "int8" and name in _SCALES)

    def state_range(self, name: str, a: int, b: int) -> Tuple[int, int]:
        """Elements of state ``name`` that hold parameter elements ``[a, b)``."""
        if name in _SCALES:
            return a // BLOCK, -(-b // BLOCK)
        return a, b

    def cut_elems(self, store, base_align: int) -> int:
        """Parameter elements at whose multiples a pipeline unit may cut a parameter on
        ``store``: ``base_align`` (the fp32 cut), also a multiple of the int8 block and of
        what every state's slice needs to start on the store's alignment."""
        need = max(1, base_align)
        if self.name == "fp32":
            return need
        align = store.alignment if not store.resident else 1
        item = 2 if self.name == "bf16" else 1
        need = _lcm(need, max(1, align // item))
        if self.name == "int8":
            need = _lcm(need, BLOCK)
            if align > 1:
                need = _lcm(need, BLOCK * max(1, align // 4))
        return need

    def unit_itemsize(self, names: Sequence[str]) -> Tuple[int, int]:
        """(itemsize, count) for :func:`statestore.pipeline.plan_units`: bytes an element of
        the states ``names`` takes, as ``count`` states of ``itemsize`` bytes (an upper
        bound: scales count as one byte an element)."""
        if not self.compressed:
            return 4, len(names)
        total = 0
        for n in names:
            if n in _SCALES:
                total += 1
            else:
                total += self.spec(n, (1,))[1].itemsize
        return 1, total

    def metadata(self) -> dict:
        """What the checkpoint's optimizer metadata records about the moments."""
        if self.name == "fp32":
            return {"moment_dtype": "fp32"}
        enc = {"version": FORMAT_VERSION, "rounding": self.rounding}
        if self.name == "bf16":
            enc.update(exp_avg="bf16", exp_avg_sq="bf16")
        else:
            enc.update(INT8_ENCODING, block=BLOCK, scales=dict(SCALE_OF))
        return {"moment_dtype": self.name, "moment_encoding": enc}

    def encoding_mismatch(self, meta: dict) -> Optional[str]:
        """Why this optimizer cannot step the moments a store's (checkpoint's) metadata
        ``meta`` describes, or None: int8 moments of another encoding version (version 1, the
        power maps of earlier releases) are refused by name; ``statestore convert`` still
        reads them, and loading that state dict re-quantizes."""
        if self.name != "int8" or meta.get("moment_dtype") != "int8":
            return None
        enc = meta.get("moment_encoding")
        ver = _encoding_version("int8", enc if isinstance(enc, dict) else None)
        if ver == INT8_ENCODING["version"]:
            return None
        old = enc if isinstance(enc, dict) else {}
        return (f"int8 moments of encoding version {ver} (exp_avg {old.get('exp_avg')!r}, "
                f"exp_avg_sq {old.get('exp_avg_sq')!r}) in the store's metadata; this "
                f"version of statestore steps int8 encoding version "
                f"{INT8_ENCODING['version']} (exp_avg {INT8_ENCODING['exp_avg']!r}): "
                f"convert the checkpoint (python -m statestore convert CKPT --to torch) and "
                f"load that state dict into the optimizer, which re-quantizes")

    # ------------------------------------------------------------------ conversions
    def to_fp32(self, name: str, codes: Tensor, scales: Optional[Tensor]) -> Tensor:
        """fp32 values (flat) of moment ``name`` from its stored codes (and scales)."""
        if not self.compressed:
            return codes.reshape(-1).float()
        which = 0 if name == "exp_avg" else 1
        return decode(self.name, which, codes.reshape(-1).cpu(),
                        None if scales is None else scales.reshape(-1).cpu(),
                        version=self.version).to(codes.device)

    def from_fp32(self, name: str, x: Tensor) -> Dict[str, Tensor]:
        """Store states (flat, on the CPU) encoding fp32 moment ``name``: ``{name: codes}``
        plus its scale for int8. Loading a state dict rounds to nearest (deterministic:
        the same state dict always gives the same codes)."""
        flat = x.detach().reshape(-1).float().cpu()
        if not self.compressed:
            return {name: flat}
        which = 0 if name == "exp_avg" else 1
        codes, scales = encode(self.name, which, flat, rounding="nearest")
        out = {name: codes}
        if scales is not None:
            out[SCALE_OF[name]] = scales
        return out

    def seeds(self, key: str, step: int) -> Tuple[int, int]:
        """Seeds of the random bits of (exp_avg, exp_avg_sq) of parameter ``key`` at step
        count ``step`` (after the update)."""
        return moment_seed(key, 0, step), moment_seed(key, 1, step)


def _encoding_version(moment_dtype: str, encoding: Optional[dict]) -> int:
    """The encoding version of ``moment_dtype`` a checkpoint's ``moment_encoding`` names
    (None: the current one)."""
    if moment_dtype != "int8":
        return FORMAT_VERSION
    if encoding is None:
        return INT8_ENCODING["version"]
    try:
        return int(encoding.get("version", 1))
    except (TypeError, ValueError):
        raise StateStoreValueError(f"moment_encoding version {encoding.get('version')!r} is "
                                   f"not an integer") from None


def _lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)



def _temp_mapped(store, nbytes: int) -> Tensor:
    """A uint8 tensor of ``nbytes`` mapped from an unlinked temporary file (next to the
    store's files where it has a directory): pages load on access and may be evicted."""
    import tempfile
    from .._snapshot import unlinked_buffer
    return unlinked_buffer(nbytes, getattr(store, "dir", None) or tempfile.gettempdir(),
                           ".state_dict-")


def export_fp32(store, fmt: MomentFormat, params: Sequence[Tuple[str, Tuple[int, ...]]]
                ) -> Dict:
    """fp32 ``exp_avg``/``exp_avg_sq`` of the parameters ``(key, shape)`` whose compressed
    moments ``store`` holds, for ``state_dict()``: decoded from resident stores directly;
    from disk stores chunk by chunk through the store's pipeline into a temporary file mapped
    into memory, so the call never holds every state in RAM."""
    from .._types import StateKey
    from ..store import CHUNK_BYTES
    todo = [(StateKey(k, n), shape) for k, shape in params for n in ("exp_avg", "exp_avg_sq")
            if StateKey(k, n) in store]
    out: Dict = {}
    if not todo:
        return out

    def scale_key(sk):
        return StateKey(sk.param, SCALE_OF[sk.state]) if fmt.name == "int8" else None

    if store.resident:
        for sk, shape in todo:
            sc = scale_key(sk)
            out[sk] = fmt.to_fp32(sk.state, store.get(sk),
                                  store.get(sc) if sc is not None else None).view(shape)
        return out
    store.sync()
    offsets, pos = [], 0
    for sk, shape in todo:
        offsets.append(pos)
        pos += 4 * math.prod(shape)
        pos += (-pos) % 64
    flat = _temp_mapped(store, pos)
    granule = fmt.cut_elems(store, 1)
    step = max(granule, (CHUNK_BYTES // 4) // granule * granule)
    for (sk, shape), off in zip(todo, offsets):
        n = math.prod(shape)
        dst = flat[off:off + 4 * n].view(torch.float32)
        for a, b, codes, scales in _stream_moment(store, fmt, sk, scale_key(sk), n, step):
            dst[a:b].copy_(fmt.to_fp32(sk.state, codes, scales))
        out[sk] = dst.view(shape)
    return out


def _stream_moment(store, fmt: MomentFormat, sk, sc, n: int, step: int):
    """Yield ``(a, b, codes, scales)`` for elements ``[a, b)`` of the ``n`` of moment ``sk``
    (and the blocks of its scale ``sc``, or None), ``step`` elements at a time, read through
    the store's pipeline: the one place this module streams a state in chunks."""
    from .._types import Slice
    ranges = [(a, min(n, a + step)) for a in range(0, n, step)]
    units = [[Slice(sk, a, b)] + ([Slice(sc, *fmt.state_range(sc.state, a, b))]
                                  if sc is not None else []) for a, b in ranges]
    with store.pipeline(units, mode="r") as pipe:
        for (a, b), ts in zip(ranges, pipe):
            yield a, b, ts[0], (ts[1] if sc is not None else None)

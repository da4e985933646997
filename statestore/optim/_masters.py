"""The fp32 weights an optimizer trains: the fp32 ``master`` copies it keeps in the store for
bf16/fp16 parameters, and the fp32 parameters themselves.

``state_dict()`` carries each low-precision parameter's ``master`` next to ``exp_avg`` and
``exp_avg_sq`` (torch's ``AdamW`` ignores it when it loads that state dict: only the bf16
weights go on from there). To publish or evaluate the fp32 weights, or to continue in fp32,
take them out as model weights: :func:`master_weights` returns ``{name: fp32 tensor}``;
:func:`save_master_weights` streams them into one safetensors file, one chunk at a time
through the store's pipeline budget, so a model larger than RAM can be written.
"""
from __future__ import annotations

import os
import uuid
from typing import Dict, List, Tuple

import torch
from torch import Tensor

from .._safetensors_layout import layout
from .._types import StateKey
from ..errors import StateStoreError
from ._dtensor import as_param_layout, is_dtensor, local, region_of

__all__ = ["master_weights", "save_master_weights"]

_CHUNK = 16 << 20


def _sources(table) -> List[Tuple[str, Tensor, object]]:
    """``(key, parameter, store or None)`` for every parameter this rank keeps (of the
    optimizer's :class:`~statestore.optim._table.ParamTable`): the store when it holds the
    parameter's master."""
    out = []
    for p in table.params:
        if p not in table.stores:            # another rank's shard
            continue
        key, store = table.keys[p], table.stores[p]
        out.append((key, p, store if StateKey(key, "master") in store else None))
    return out


def master_weights(table) -> Dict[str, Tensor]:
    """``{parameter key: fp32 tensor}`` of the optimizer's ``table`` (see
    :meth:`CPUAdam.master_weights <statestore.optim.CPUAdam.master_weights>`)."""
    out: Dict[str, Tensor] = {}
    for key, p, store in _sources(table):
        if store is None:
            t = local(p).detach().to("cpu", torch.float32, copy=True)
        else:
            t = store.get(StateKey(key, "master"))
            t = t.detach().to("cpu", copy=True) if store.resident else t
        if is_dtensor(p):       # FSDP2: a DTensor of the parameter's layout, as its state dict
            t = as_param_layout(p, t.to(local(p).device))
        out[key] = t
    return out


def _chunks(key: str, p: Tensor, store):
    """The fp32 values of ``key``, flat, a chunk at a time."""
    if store is None:
        flat = local(p).detach().reshape(-1)
        step = max(1, _CHUNK // 4)
        for a in range(0, flat.numel(), step):
            yield flat[a:a + step].to("cpu", torch.float32)
        return
    sk = StateKey(key, "master")
    if store.resident:
        yield store.get(sk).detach().reshape(-1).cpu()
        return
    with store.stream([sk], "r") as chunks:
        for _, t in chunks:
            yield t


def save_master_weights(table, path: str) -> None:
    """Stream :func:`master_weights` of the optimizer's ``table`` into one safetensors file
    at ``path`` (local or fsspec), written to a temporary name and moved into place."""
    import fsspec
    items = _sources(table)
    for key, p, _ in items:
        if region_of(p) is not None:
            raise StateStoreError(
                f"save_master_weights writes whole parameters, and this rank holds a shard of "
                f"{key!r} (FSDP2); take master_weights() (DTensors) through "
                f"torch.distributed.checkpoint (dcp.save) instead")
    fs, root = fsspec.core.url_to_fs(os.fspath(path))
    lay = layout([(key, torch.float32, tuple(p.shape)) for key, p, _ in items],
                 metadata={"format": "pt", "statestore": "fp32 master weights"})
    parent = root.rsplit("/", 1)[0] if "/" in root else ""
    tmp = (f"{parent}/" if parent else "") + f".{root.rsplit('/', 1)[-1]}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with fs.open(tmp, "wb") as f:
            f.write(lay.header)
            for key, p, store in items:
                for chunk in _chunks(key, p, store):
                    f.write(chunk.contiguous().view(torch.uint8).numpy().tobytes())
        fs.mv(tmp, root)
    except BaseException:
        try:
            fs.rm(tmp)
        except Exception:
            pass
        raise

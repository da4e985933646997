"""One checkpoint of an offloaded model's parameters and its optimizer's states.

Layout of ``path`` (a local directory or an fsspec URL)::

    path/manifest.parquet, path/shard-*.safetensors   the optimizer store's checkpoint, as
                                                      store.save_checkpoint(path) writes it
    path/model-<save id>.safetensors                  the model's state_dict (parameters from
                                                      the store, buffers), stock safetensors
    path/model.safetensors                            the same file (a hard link; a copy on
                                                      object stores), the name tools look for
    path/config.json                                  transformers models: their config

The manifest's metadata (the optimizer's) gains an ``"offload"`` entry naming the model file
and the xxh3-64 checksum of each of its tensors, so the model file is committed with the
manifest: a save that stops before the manifest is renamed leaves the previous checkpoint
(whose manifest names its own model file, kept until a later save commits) as it was; one
that stops after it leaves the new checkpoint complete, ``model.safetensors`` then pointing
to the previous save's file until the next save (loaders read the file the manifest names).

The model file's tensors are named as in ``model.state_dict()`` (tied weights under each of
their names), with ``{"format": "pt"}`` metadata: ``model.load_state_dict(
safetensors.torch.load_file(path + "/model.safetensors"))`` and transformers'
``from_pretrained(path)`` read it. Parameters are streamed from the store through its
pipeline (bounded RAM), checksummed as they are written.
"""
from __future__ import annotations

import os
import struct
import json
import uuid
from typing import Any, Dict, List, Tuple

import torch
import xxhash
from torch import Tensor

from .._safetensors_layout import layout
from .._types import dtype_from_name
from ..checkpoint import read_manifest
from ..checkpoint.filesystem import close_quietly as _close_quietly
from ..checkpoint.filesystem import commit as _commit
from ..checkpoint.filesystem import is_local as _is_local
from ..checkpoint.filesystem import join as _join
from ..checkpoint.filesystem import open_for_write as _open_for_write
from ..checkpoint.filesystem import prepare_root as _prepare_root
from ..errors import (CheckpointCorruptError, CheckpointError, CheckpointMismatchError,
                      StateStoreError, StateStoreIOError, StateStoreValueError)
from ._seam import OffloadSeam, handle_of

__all__ = ["save_checkpoint", "load_checkpoint", "MODEL_FILE", "OFFLOAD_META_VERSION"]

MODEL_FILE = "model.safetensors"
OFFLOAD_META_VERSION = 1


def _as_bytes(t: Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())


def _model_entries(handle: OffloadSeam) -> List[Tuple[str, Tensor]]:
    sd = handle.model.state_dict(keep_vars=True)
    return [(name, t) for name, t in sd.items() if isinstance(t, Tensor)]


def _write_model_file(handle: OffloadSeam, fs, root: str, name: str) -> Dict[str, str]:
    entries = _model_entries(handle)
    lay = layout([(n, t.dtype, tuple(t.shape)) for n, t in entries], align=64,
                 metadata={"format": "pt"})
    final, tmp = _join(root, name), _join(root, f".{name}.tmp")
    hashes: Dict[str, str] = {}
    f = _open_for_write(fs, tmp)
    try:
        f.write(lay.header)
        for n, t in entries:
            entry = lay.entries[n]
            if f.tell() < entry.offset:
                f.write(b"\0" * (entry.offset - f.tell()))
            h = xxhash.xxh3_64()
            if handle_of(t) is handle:
                for chunk in handle.chunks(t):
                    mv = _as_bytes(chunk)
                    h.update(mv)
                    f.write(mv)
            elif t.numel():
                mv = _as_bytes(t)
                h.update(mv)
                f.write(mv)
            hashes[n] = h.hexdigest()
        _commit(fs, f, tmp, final)
    except BaseException:
        _close_quietly(f)
        try:
            fs.rm(tmp)
        except Exception:
            pass
        raise
    return hashes


def _write_config(handle: OffloadSeam, fs, root: str) -> None:
    cfg = getattr(handle.model, "config", None)
    to_json = getattr(cfg, "to_json_string", None)
    if not callable(to_json):
        return
    text = to_json()
    tmp, final = _join(root, ".config.json.tmp"), _join(root, "config.json")
    with fs.open(tmp, "w") as f:
        f.write(text)
    fs.mv(tmp, final)


def save_checkpoint(handle: OffloadSeam, path: str, optimizer_store=None, **kwargs) -> None:
    """See :meth:`OffloadHandle.save_checkpoint`. ``kwargs`` go to the store's
    ``save_checkpoint`` (``shard_bytes``, ``progress``, ``link``)."""
    from ..store import StateStore
    if optimizer_store is not None and not isinstance(optimizer_store, StateStore):
        raise StateStoreValueError(f"save_checkpoint: optimizer_store must be a StateStore or "
                                   f"None, got {type(optimizer_store).__name__}")
    if "metadata" in kwargs:
        raise StateStoreValueError("save_checkpoint: metadata comes from the optimizer's store "
                                   "(and the handle); it cannot be overridden here")
    if handle.in_model_pass:
        raise StateStoreError("save_checkpoint called during the model's forward or backward")
    handle.sync()
    fs, root = _prepare_root(path)
    save_id = uuid.uuid4().hex[:12]
    name = f"model-{save_id}.safetensors"
    try:
        hashes = _write_model_file(handle, fs, root, name)
    except OSError as e:
        if isinstance(e, StateStoreError):
            raise
        raise StateStoreIOError(e.errno, f"saving checkpoint {path!r}: writing {name} "
                                         f"failed: {e}") from e
    own = None
    try:
        _write_config(handle, fs, root)
        store = optimizer_store
        if store is None:
            from ..backends.device import DeviceStore
            store = own = DeviceStore("cpu")
        meta = dict(store.metadata() or {})
        meta["offload"] = {
            "version": OFFLOAD_META_VERSION,
            "model_file": name,
            "checksum": "xxh3_64",
            "checksums": hashes,
            "params": {n: handle.names(p) for n, p in handle.parameters.items()},
        }
        store.save_checkpoint(path, metadata=meta, **kwargs)
    except BaseException:
        try:
            fs.rm(_join(root, name))        # not committed: the previous checkpoint stays
        except Exception:
            pass
        raise
    finally:
        if own is not None:
            own.close()
    # committed: give the file its usual name, then remove earlier saves' model files
    alias = _join(root, MODEL_FILE)
    if _is_local(fs):
        tmp = _join(root, f".{MODEL_FILE}.{save_id}.tmp")
        try:
            os.link(_join(root, name), tmp)
        except OSError:
            fs.copy(_join(root, name), tmp)
        os.replace(tmp, alias)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    else:
        fs.copy(_join(root, name), alias)
    for p in fs.ls(root, detail=False):
        base = p.rstrip("/").rsplit("/", 1)[-1]
        if (base.startswith("model-") and base.endswith(".safetensors") and base != name) \
                or (base.startswith(".model") and base.endswith(".tmp")):
            try:
                fs.rm(p)
            except Exception:
                pass


def _read_header(f, fpath: str) -> Tuple[dict, int]:
    raw = f.read(8)
    if len(raw) != 8:
        raise CheckpointCorruptError(f"{fpath}: truncated safetensors header")
    (n,) = struct.unpack("<Q", raw)
    if n > 100 << 20:
        raise CheckpointCorruptError(f"{fpath}: safetensors header of {n} bytes")
    body = f.read(n)
    if len(body) != n:
        raise CheckpointCorruptError(f"{fpath}: truncated safetensors header")
    try:
        header = json.loads(body)
    except ValueError as e:
        raise CheckpointCorruptError(f"{fpath}: unreadable safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointCorruptError(f"{fpath}: safetensors header is not an object")
    return header, 8 + n


def _pieces(f, start: int, nbytes: int, piece: int):
    f.seek(start)
    done = 0
    while done < nbytes:
        n = min(piece, nbytes - done)
        b = f.read(n)
        if len(b) != n:
            raise EOFError
        yield done, b
        done += n


def load_checkpoint(handle: OffloadSeam, path: str, optimizer_store=None) -> None:
    """See :meth:`OffloadHandle.load_checkpoint`."""
    if handle.in_model_pass:
        raise StateStoreError("load_checkpoint called during the model's forward or backward")
    m = read_manifest(path)
    off = m.metadata.get("offload") if isinstance(m.metadata, dict) else None
    if not isinstance(off, dict) or not isinstance(off.get("model_file"), str) \
            or not isinstance(off.get("checksums"), dict):
        raise CheckpointError(f"checkpoint {path!r} holds no model parameters (it was not "
                              f"written by OffloadHandle.save_checkpoint)")
    fs, root = m.fs, m.root
    fname = off["model_file"]
    if "/" in fname or fname.startswith("."):
        raise CheckpointCorruptError(f"checkpoint {path!r}: bad model file name {fname!r}")
    fpath = _join(root, fname)
    sums = off["checksums"]
    try:
        handle.release_all()
    except StateStoreError:
        raise StateStoreError("load_checkpoint: parameters are in use") from None
    entries = dict(_model_entries(handle))
    piece = max(1 << 20, min(handle.store.budget_bytes // 4, 64 << 20))
    try:
        f = fs.open(fpath, "rb")
    except (OSError, ValueError) as e:
        raise CheckpointCorruptError(f"{fpath}: model file missing or unreadable: {e}") from e
    try:
        header, data_start = _read_header(f, fpath)
        # 1. every tensor present, of the right shape and dtype, and intact
        plan = _plan_model_load(entries, header, data_start, fpath, path)
        _verify_model(f, plan, sums, piece, fpath)
        # 2. the optimizer's states, then the parameters and buffers
        if optimizer_store is not None:
            optimizer_store.load_checkpoint(path)
        _load_model(handle, f, plan, piece, fpath)
    finally:
        f.close()
    handle.store.sync()


def _plan_model_load(entries: Dict[str, Tensor], header: Dict[str, Any], data_start: int,
                     fpath: str, path: str) -> List[Tuple[str, Tensor, int, int]]:
    """``(name, tensor, file offset, bytes)`` of each of the model's tensors, once every one
    is in the model file with the model's shape and dtype (else one error listing them)."""
    plan = []
    problems = []
    for n, t in entries.items():
        h = header.get(n)
        if not isinstance(h, dict):
            problems.append(f"{n!r} is missing from the model file")
            continue
        try:
            dtype = dtype_from_name(h["dtype"])
            shape = tuple(int(d) for d in h["shape"])
            a, b = (int(x) for x in h["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointCorruptError(f"{fpath}: bad header entry for {n!r}") from None
        if shape != tuple(t.shape) or dtype != t.dtype:
            problems.append(f"{n!r}: {tuple(t.shape)} {t.dtype} in the model, {shape} "
                            f"{dtype} in the checkpoint")
            continue
        if b - a != t.numel() * t.dtype.itemsize:
            raise CheckpointCorruptError(f"{fpath}: tensor {n!r} has {b - a} bytes, "
                                         f"expected {t.numel() * t.dtype.itemsize}")
        plan.append((n, t, data_start + a, b - a))
    if problems:
        raise CheckpointMismatchError(f"checkpoint {path!r} does not match the model:\n  "
                                      + "\n  ".join(problems))
    return plan


def _verify_model(f, plan: List[Tuple[str, Tensor, int, int]], sums: Dict[str, Any],
                  piece: int, fpath: str) -> None:
    """Every planned tensor is whole in the model file and matches its checksum."""
    for n, t, start, nbytes in plan:
        h = xxhash.xxh3_64()
        try:
            for _, b in _pieces(f, start, nbytes, piece):
                h.update(b)
        except EOFError:
            raise CheckpointCorruptError(f"{fpath}: tensor {n!r} is truncated") from None
        if n in sums and h.hexdigest() != sums[n]:
            raise CheckpointCorruptError(f"{fpath}: tensor {n!r} fails its checksum (file "
                                         f"altered or damaged)")


def _load_model(handle: OffloadSeam, f, plan: List[Tuple[str, Tensor, int, int]],
                piece: int, fpath: str) -> None:
    """The planned tensors' bytes into the handle's parameters (through its store) and into
    the model's other tensors (in place)."""
    done = set()
    for n, t, start, nbytes in plan:
        if handle_of(t) is handle:
            if t in done:
                continue            # a tied weight's other name: the same parameter
            done.add(t)
            _load_param(handle, t, f, start, nbytes, piece)
        else:
            if not nbytes:
                continue
            f.seek(start)
            raw = bytearray(f.read(nbytes))
            if len(raw) != nbytes:
                raise CheckpointCorruptError(f"{fpath}: tensor {n!r} is truncated")
            with torch.no_grad():
                t.copy_(torch.frombuffer(raw, dtype=torch.uint8).view(t.dtype).view(t.shape))


def _load_param(handle: OffloadSeam, p: Tensor, f, start: int, nbytes: int, piece: int) -> None:
    """Write the file's bytes of ``p`` into the store through its pipeline (mode "w")."""
    store = handle.store
    size = p.dtype.itemsize
    slices = handle.slices(p)
    if not slices:
        return
    with store.pipeline([[s] for s in slices], mode="w", wait=False) as pipe:
        for s, (t,) in zip(slices, pipe):
            dst = t.reshape(-1).view(torch.uint8)
            f.seek(start + s.start * size)
            n = (s.stop - s.start) * size
            pos = 0
            while pos < n:
                k = min(piece, n - pos)
                b = f.read(k)
                if len(b) != k:
                    raise CheckpointCorruptError(f"model file: tensor {handle.names(p)[0]!r} "
                                                 "is truncated")
                dst[pos:pos + k].copy_(torch.frombuffer(bytearray(b), dtype=torch.uint8))
                pos += k

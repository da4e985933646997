"""Checkpoints of stores: safetensors shards plus a Parquet manifest, written atomically.

Format (version :data:`FORMAT_VERSION`; specified in ``docs/checkpoint-format.md``)::

    <path>/manifest.parquet                      one row per tensor; written last
    <path>/shard-<save id>-<n>.safetensors       tensors, stock safetensors files

The manifest's columns are ``key, param, state, file, offset, nbytes, shape, dtype,
checksum`` (``offset``: absolute byte offset of the tensor's data in ``file``; ``checksum``:
xxh3-64 of its bytes, hex). Its schema metadata holds the format name and version, the
statestore version, the checksum algorithm, the save id, the optimizer metadata (JSON: step
counts, param groups with hyperparameters, parameter names, shapes and dtypes) and the
manifest's own checksum.

Public functions: :func:`save_checkpoint`, :func:`load_checkpoint`, :func:`load_deferred`
(the function forms of the store's methods of those names), :func:`read_manifest`,
:func:`verify_checkpoint`. ``StateStore.save_checkpoint`` hands its states to a
:class:`CheckpointWriter`; ``StateStore.load_checkpoint`` hands its record to a
:class:`CheckpointReader`. The modules, each owning one concept:

========================  ==============================================================
:mod:`.format`            the manifest schema, :class:`ManifestRow`, :class:`Manifest`
:mod:`.metadata`          the optimizer metadata's required shape
:mod:`.manifest`          reading and validating a manifest (:func:`read_manifest`)
:mod:`.parquet_guard`     bounds on what decoding an untrusted manifest may cost
:mod:`.digest`            the manifest's own checksum
:mod:`.filesystem`        local and fsspec paths, atomic commit, clean-up, progress bars
:mod:`.stream`            states streamed through a store's pipeline (both chunk loops)
:mod:`.writer`            the steps of a save: shards, linked shards, manifest, clean-up;
                          :class:`SavedStates`, what a store hands a save
:mod:`.save`              :class:`CheckpointWriter` (a save's call order: set_up, plan,
                          write_data, finish), :func:`save_checkpoint`
:mod:`.collective`        a collective save over a ``torch.distributed`` group (the
                          writer's steps over a group: ``CollectiveSave``)
:mod:`.save_lock`         one save at a time per local checkpoint directory
:mod:`.shard_check`       shard headers and files checked against the manifest
:mod:`.reader`            parallel, hashed reads of shard byte ranges
:mod:`.linked_load`       a load that hard-links shards into an ``NVMeStore``
:mod:`.region_load`       regions (FSDP2 shards): which one a rank loads, and assembling
                          a region out of the saved ones
:mod:`.load`              :class:`CheckpointReader` (a load's call order),
                          :func:`load_checkpoint`, :func:`load_deferred`,
                          :func:`verify_checkpoint`, :class:`Deferred`
:mod:`.foreign`           what a directory without a manifest is (for the error message)
========================  ==============================================================

The shards of a local save are written by :class:`statestore.io.DirectWriter` (``O_DIRECT``).
Names are imported on first use: ``import statestore`` (whose ``StateStore`` checks tensor
ranks against :data:`.parquet_guard.MAX_NDIM`) does not load pyarrow.
"""
from __future__ import annotations

import importlib
from typing import Any, Dict

# the exceptions this package raises (statestore.errors), importable from here too
from ..errors import (CheckpointCorruptError, CheckpointError, CheckpointMismatchError,
                      CheckpointNotFoundError)

#: public name -> the module of this package that defines it
_EXPORTS: Dict[str, str] = {
    "FORMAT_NAME": "format", "FORMAT_VERSION": "format", "MANIFEST": "format",
    "CHECKSUM": "format", "SCHEMA": "format", "Manifest": "format", "ManifestRow": "format",
    "optimizer_metadata_problem": "metadata", "MAX_ROWS": "parquet_guard",
    "read_manifest": "manifest",
    "sealed": "digest",
    "DEFAULT_SHARD_BYTES": "writer", "SavedStates": "writer",
    "save_checkpoint": "save", "CheckpointWriter": "save",
    "load_checkpoint": "load", "load_deferred": "load", "verify_checkpoint": "load",
    "Deferred": "load", "CheckpointReader": "load",
    # the store's own entry point (StateStore.load_deferred hands it its record); not for
    # users: call the store's method or the function above
    "load_deferred_into": "load",
}

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "MANIFEST", "save_checkpoint", "load_checkpoint",
           "read_manifest", "verify_checkpoint", "Manifest", "ManifestRow", "CHECKSUM",
           "SCHEMA", "DEFAULT_SHARD_BYTES", "MAX_ROWS", "load_deferred", "Deferred",
           "optimizer_metadata_problem", "sealed", "CheckpointWriter", "SavedStates",
           "CheckpointReader",
           "CheckpointError", "CheckpointCorruptError",
           "CheckpointNotFoundError", "CheckpointMismatchError"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))

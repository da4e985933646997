"""Store classes by name, and the one factory that picks a class from an argument.

As fsspec's ``registry``: each name maps to a dotted path, imported on first use, and the
hint to show when what it needs is not installed. ``store_class(name)`` returns the class,
``make_store(name, *args, **kwargs)`` builds one, ``register_store`` adds a backend of
one's own. Every class is what its name says; nothing builds another class than the one
called.

:func:`nvme_store` is the explicit factory for "states on NVMe through engine X": the
in-place files of :class:`~statestore.NVMeStore` for statestore's engines, the keyed file
of :class:`~statestore.TensorNVMeStore` for ``engine="tensornvme"`` (TensorNVMe cannot write
NVMeStore's files in place; ``NVMeStore(engine="tensornvme")`` calls this factory). ``TieredStore.from_fraction`` and the optimizers' ``nvme_offload_dir`` build
their disk tier through it.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Dict, List, NamedTuple, Optional, Union

from ..errors import StateStoreError, StateStoreValueError

__all__ = ["StoreEntry", "known_stores", "register_store", "store_class", "make_store",
           "nvme_store", "available_stores"]

TENSORNVME_HINT = ("TensorNVMe is not installed: `make setup` builds it "
                   "(scripts/install_tensornvme.sh), or `pip install` it from its repository")


class StoreEntry(NamedTuple):
    """One backend: the dotted path of its class, the module it needs (checked before the
    class is built), and the hint naming how to install that module."""

    path: str
    requires: Optional[str] = None
    hint: Optional[str] = None


known_stores: Dict[str, StoreEntry] = {
    "device": StoreEntry("statestore.backends.device.DeviceStore"),
    "pinned": StoreEntry("statestore.backends.pinned.PinnedCPUStore"),
    "file": StoreEntry("statestore.backends.file.FileStore"),
    "nvme": StoreEntry("statestore.backends.nvme.NVMeStore"),
    "tensornvme": StoreEntry("statestore.backends.tensornvme.TensorNVMeStore", "tensornvme",
                             TENSORNVME_HINT),
    "tiered": StoreEntry("statestore.backends.tiered.TieredStore"),
}


def register_store(name: str, cls: Union[str, type], *, requires: Optional[str] = None,
                   hint: Optional[str] = None, clobber: bool = False) -> None:
    """Register a backend under ``name``: a class, or the dotted path of one (imported on
    first use). ``requires``: a module it needs, ``hint``: how to install it.

    Raises:
        StateStoreValueError: ``name`` is taken (pass ``clobber=True`` to replace it).
    """
    if not isinstance(name, str) or not name:
        raise StateStoreValueError(f"register_store: name must be a non-empty str, got {name!r}")
    if name in known_stores and not clobber:
        raise StateStoreValueError(f"register_store: {name!r} is registered already "
                                   f"({known_stores[name].path}); pass clobber=True to replace it")
    path = cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"
    known_stores[name] = StoreEntry(path, requires, hint)
    if not isinstance(cls, str):
        _loaded[path] = cls


_loaded: Dict[str, type] = {}


def store_class(name: str) -> type:
    """The store class registered under ``name``.

    Raises:
        StateStoreValueError: no store of that name (the message lists the names).
        StateStoreError: what it needs is not installed (the message gives the hint).
    """
    entry = known_stores.get(name) if isinstance(name, str) else None
    if entry is None:
        raise StateStoreValueError(f"no store named {name!r}; known: {sorted(known_stores)}")
    if entry.requires is not None and importlib.util.find_spec(entry.requires) is None:
        raise StateStoreError(f"store {name!r} needs the module {entry.requires!r}: "
                              f"{entry.hint or 'install it'}")
    cls = _loaded.get(entry.path)
    if cls is None:
        module, _, attr = entry.path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except ImportError as e:
            raise StateStoreError(f"store {name!r} ({entry.path}) cannot be imported: {e}"
                                  + (f"; {entry.hint}" if entry.hint else "")) from e
        _loaded[entry.path] = cls
    return cls


def make_store(name: str, *args: Any, **kwargs: Any):
    """``store_class(name)(*args, **kwargs)``: e.g. ``make_store("nvme", "/nvme/run1")``."""
    return store_class(name)(*args, **kwargs)


def nvme_store(dir: Optional[str] = None, engine: Any = "auto", **kwargs: Any):
    """States on NVMe through ``engine``, with :class:`~statestore.NVMeStore`'s arguments:
    an ``NVMeStore(dir, engine, **kwargs)``, or for ``engine="tensornvme"`` a
    :class:`~statestore.TensorNVMeStore` (a store of its own: keyed blocks in TensorNVMe's
    file, checkpoints by copy) with NVMeStore's arguments mapped to it: ``budget_bytes``,
    ``queue_depth``, ``pinned`` carry over, ``block_size`` and ``io_threads`` do not apply,
    ``direct=True`` and ``keep_files=True`` are refused.

    Raises:
        StateStoreValueError: a bad argument, or one the engine cannot honour.
        StateStoreError: TensorNVMe is not installed (with the hint).
    """
    if not (isinstance(engine, str) and engine == "tensornvme"):
        return make_store("nvme", dir, engine, **kwargs)
    direct = kwargs.pop("direct", None)
    if direct is True:
        raise StateStoreValueError("nvme_store: direct=True is impossible with engine "
                                   "'tensornvme' (TensorNVMe has no O_DIRECT: its I/O goes "
                                   "through the page cache, which sync() drops)")
    if direct not in (None, False):
        raise StateStoreValueError(f"nvme_store: direct must be None, True or False, got {direct!r}")
    if kwargs.pop("keep_files", False):
        raise StateStoreValueError("nvme_store: keep_files=True is impossible with engine "
                                   "'tensornvme' (its file holds keyed blocks, not safetensors, "
                                   "and TensorNVMe removes it at close); save a checkpoint")
    for arg in ("block_size", "io_threads"):
        v = kwargs.pop(arg, None)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise StateStoreValueError(f"nvme_store: {arg} must be a positive int, got {v!r}")
    return make_store("tensornvme", dir, **kwargs)


def available_stores() -> List[str]:
    """The registered names whose required module is installed."""
    return [n for n, e in known_stores.items()
            if e.requires is None or importlib.util.find_spec(e.requires) is not None]

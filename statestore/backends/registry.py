"""Store classes by name, and the one factory that picks a class from an argument.

As fsspec's ``registry``: each name maps to a dotted path, imported on first use, and the
hint to show when what it needs is not installed. ``store_class(name)`` returns the class,
``make_store(name, *args, **kwargs)`` builds one, ``register_store`` adds a backend of
one's own: a StateStore subclass, kept by identity, or the dotted path of one, checked when
registered (or, when the module it requires is missing, at first use). Every class is what
its name says; nothing builds another class than the one called, and nothing but a
StateStore subclass is ever called.

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

from .._types import short_repr
from ..errors import StateStoreError, StateStoreValueError

__all__ = ["StoreEntry", "known_stores", "register_store", "store_class", "make_store",
           "nvme_store", "available_stores"]

TENSORNVME_HINT = ("TensorNVMe is not installed: `make setup` builds it "
                   "(scripts/install_tensornvme.sh), or `pip install` it from its repository")

#: longest name, dotted path and hint a registration takes (messages quote them)
MAX_NAME = 64
MAX_PATH = 256
MAX_HINT = 500


class StoreEntry(NamedTuple):
    """One backend: the dotted path of its class (for a class registered as an object: where
    it says it comes from, shown in messages only), the module it needs (checked before the
    class is built), the hint naming how to install that module, and the class itself when
    it was registered as an object (then it is what the name gives, by identity: never
    looked up by its path)."""

    path: str
    requires: Optional[str] = None
    hint: Optional[str] = None
    cls: Optional[type] = None


known_stores: Dict[str, StoreEntry] = {
    "device": StoreEntry("statestore.backends.device.DeviceStore"),
    "pinned": StoreEntry("statestore.backends.pinned.PinnedCPUStore"),
    "file": StoreEntry("statestore.backends.file.FileStore"),
    "nvme": StoreEntry("statestore.backends.nvme.NVMeStore"),
    "tensornvme": StoreEntry("statestore.backends.tensornvme.TensorNVMeStore", "tensornvme",
                             TENSORNVME_HINT),
    "tiered": StoreEntry("statestore.backends.tiered.TieredStore"),
}
#: the names statestore itself registers
BUILTIN_STORES = frozenset(known_stores)


def _dotted(text: Any) -> bool:
    """True for ``a.b.c`` made of Python identifiers (at most :data:`MAX_PATH` characters)."""
    return (isinstance(text, str) and 0 < len(text) <= MAX_PATH
            and all(part.isidentifier() for part in text.split(".")))


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported (a missing parent package counts as missing)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _resolve(name: str, path: str, hint: Optional[str], error: type = StateStoreError) -> type:
    """The store class at dotted ``path`` (registered as ``name``), or ``error`` saying why
    not: any failure to import it, or anything there but a StateStore subclass."""
    from ..store import StateStore
    module, _, attr = path.rpartition(".")
    what = f"store {short_repr(name)} ({short_repr(path)})"
    if not module or not _dotted(path):
        raise error(f"{what}: not a dotted path 'package.module.Class'")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except Exception as e:     # ImportError, AttributeError, or what the module raised
        raise error(f"{what} cannot be imported: {type(e).__name__}: {short_repr(str(e))}"
                    + (f"; {hint}" if hint else "")) from e
    if not (isinstance(obj, type) and issubclass(obj, StateStore)):
        raise error(f"{what} is {short_repr(obj, 60)}, not a StateStore subclass")
    return obj


def register_store(name: str, cls: Union[str, type], *, requires: Optional[str] = None,
                   hint: Optional[str] = None, replace: bool = False) -> None:
    """Register a backend under ``name``: a :class:`~statestore.StateStore` subclass (kept
    by identity: ``store_class(name)`` returns that very class), or the dotted path of one.
    A path is imported and checked now, unless ``requires`` (a module it needs) is not
    installed: then at first use, where a missing module raises with ``hint`` (how to
    install it). Nothing but a StateStore subclass is ever registered or built.

    Raises:
        StateStoreValueError: a bad name, class, ``requires`` or ``hint``; a path that cannot
            be imported or gives no StateStore subclass; or ``name`` is taken (statestore's
            own names included): pass ``replace=True`` to replace it.
    """
    from ..store import StateStore
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or not name.isprintable():
        raise StateStoreValueError(f"register_store: name must be a non-empty printable str of "
                                   f"at most {MAX_NAME} characters, got {short_repr(name)}")
    if not isinstance(replace, bool):
        raise StateStoreValueError(f"register_store: replace must be a bool, got "
                                   f"{short_repr(replace)}")
    if requires is not None and not _dotted(requires):
        raise StateStoreValueError(f"register_store({name!r}): requires must be a module name "
                                   f"or None, got {short_repr(requires)}")
    if hint is not None and (not isinstance(hint, str) or len(hint) > MAX_HINT):
        raise StateStoreValueError(f"register_store({name!r}): hint must be a str of at most "
                                   f"{MAX_HINT} characters or None, got {short_repr(hint)}")
    if name in known_stores and not replace:
        kind = "one of statestore's own stores" if name in BUILTIN_STORES else "registered"
        raise StateStoreValueError(f"register_store: {name!r} is {kind} already "
                                   f"({short_repr(known_stores[name].path)}); pass replace=True "
                                   f"to replace it")
    if isinstance(cls, str):
        if not _dotted(cls) or "." not in cls:
            raise StateStoreValueError(f"register_store({name!r}): {short_repr(cls)} is not a "
                                       f"dotted path 'package.module.Class'")
        if requires is None or _installed(requires):
            # refuses 'os.system' and the like now
            _resolve(name, cls, hint, StateStoreValueError)
        entry = StoreEntry(cls, requires, hint)
    elif isinstance(cls, type) and issubclass(cls, StateStore):
        where = f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', '?')}"
        entry = StoreEntry(where[:MAX_PATH], requires, hint, cls)
    else:
        raise StateStoreValueError(f"register_store({name!r}): a StateStore subclass or the "
                                   f"dotted path of one is needed, got {short_repr(cls, 60)}")
    known_stores[name] = entry


def store_class(name: str) -> type:
    """The store class registered under ``name``.

    Raises:
        StateStoreValueError: no store of that name (the message lists the names).
        StateStoreError: what it needs is not installed (the message gives the hint), or its
            dotted path does not give a StateStore subclass.
    """
    entry = known_stores.get(name) if isinstance(name, str) else None
    if entry is None:
        raise StateStoreValueError(f"no store named {short_repr(name)}; known: "
                                   f"{short_repr(sorted(known_stores), 300)}")
    if entry.requires is not None and not _installed(entry.requires):
        raise StateStoreError(f"store {name!r} needs the module {entry.requires!r}: "
                              f"{entry.hint or 'install it'}")
    if entry.cls is not None:
        return entry.cls
    return _resolve(name, entry.path, entry.hint)


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
    return [n for n, e in known_stores.items() if e.requires is None or _installed(e.requires)]

"""Stores by name (``statestore.backends.registry``): every name gives the class exported under
it, a backend of one's own registers, a missing dependency is named with its install hint, and
the factory ``nvme_store`` picks the class by engine (each class is what it says)."""
from __future__ import annotations

import pytest

import statestore as ss
from statestore.backends import known_stores, make_store, nvme_store, register_store, store_class

EXPORTED = {"device": "DeviceStore", "pinned": "PinnedCPUStore", "file": "FileStore",
            "nvme": "NVMeStore", "tensornvme": "TensorNVMeStore", "tiered": "TieredStore"}


def test_every_name_gives_its_exported_class():
    assert set(EXPORTED) <= set(known_stores)
    for name, cls in EXPORTED.items():
        if known_stores[name].requires is None:
            assert store_class(name) is getattr(ss, cls)
    with make_store("device", "cpu") as s:
        assert type(s) is ss.DeviceStore


def test_register_and_missing_dependency(monkeypatch):
    monkeypatch.setitem(known_stores, "mine", known_stores["device"])
    with pytest.raises(ss.StateStoreValueError, match="replace=True"):
        register_store("mine", ss.PinnedCPUStore)
    register_store("mine", ss.PinnedCPUStore, replace=True)
    assert store_class("mine") is ss.PinnedCPUStore
    register_store("mine", "statestore.backends.device.DeviceStore", requires="no_such_mod_ss",
                   hint="pip install no-such-mod", replace=True)
    with pytest.raises(ss.StateStoreError, match="pip install no-such-mod"):
        store_class("mine")


def test_nvme_store_picks_the_class_by_engine(tmp_path):
    with nvme_store(str(tmp_path / "a"), engine="threads") as s:
        assert type(s) is ss.NVMeStore
    class Mine(ss.NVMeStore):
        pass
    with pytest.raises(ss.StateStoreValueError, match="TensorNVMeStore"):
        Mine(str(tmp_path / "b"), engine="tensornvme")   # only NVMeStore itself is the factory
    assert not issubclass(ss.TensorNVMeStore, ss.NVMeStore)


def _factory(tag):
    class Store(ss.DeviceStore):
        """Two calls make two classes of one ``__module__.__qualname__``."""
        kind = tag
    return Store


@pytest.fixture
def registry(monkeypatch):
    """Registrations undone after the test."""
    saved = dict(known_stores)
    yield
    known_stores.clear()
    known_stores.update(saved)


def test_classes_are_registered_by_identity(registry):
    """Two classes of one qualified name keep their own names; a class that claims a
    built-in's module and qualified name does not replace it."""
    alpha, beta = _factory("alpha"), _factory("beta")
    assert f"{alpha.__module__}.{alpha.__qualname__}" == f"{beta.__module__}.{beta.__qualname__}"
    register_store("alpha", alpha)
    register_store("beta", beta)
    assert store_class("alpha") is alpha and store_class("beta") is beta
    with make_store("alpha", "cpu") as s:
        assert type(s) is alpha

    class Impostor(ss.DeviceStore):
        pass
    Impostor.__module__, Impostor.__qualname__ = "statestore.backends.nvme", "NVMeStore"
    register_store("impostor", Impostor)
    assert store_class("nvme") is ss.NVMeStore and store_class("impostor") is Impostor


def test_builtin_names_need_replace(registry):
    for name in ("nvme", "device", "tiered"):
        with pytest.raises(ss.StateStoreValueError, match="statestore's own.*replace=True"):
            register_store(name, _factory(name))
        assert store_class(name) is getattr(ss, EXPORTED[name])
    mine = _factory("nvme")
    register_store("nvme", mine, replace=True)          # explicit: allowed
    assert store_class("nvme") is mine


@pytest.mark.parametrize("cls,words", [
    ("os.system", "not a StateStore subclass"),
    ("builtins.print", "not a StateStore subclass"),
    ("statestore.errors.StateStoreError", "not a StateStore subclass"),
    ("statestore.backends.device.NoSuchStore", "AttributeError"),
    ("no_such_package_ss.mod.Store", "ModuleNotFoundError"),
    ("nodots", "dotted path"),
    ("os..system", "dotted path"),
    ("os.system()", "dotted path"),
    (print, "StateStore subclass"),
    (int, "StateStore subclass"),
    (ss.StateStoreError, "StateStore subclass"),
])
def test_only_store_classes_register(registry, cls, words):
    """Anything but a StateStore subclass (or the path of one) is refused when registered,
    so make_store can never call it (``register_store("sys", "os.system")`` used to be
    accepted, and ``make_store("sys", "echo ...")`` ran the shell)."""
    with pytest.raises(ss.StateStoreValueError, match=words):
        register_store("sys", cls)
    assert "sys" not in known_stores


@pytest.mark.parametrize("path,words", [
    ("os.system", "not a StateStore subclass"),
    ("statestore.backends.device.NoSuchStore", "AttributeError"),
    ("nodots", "dotted path"),
    ("", "dotted path"),
])
def test_bad_paths_at_first_use_are_state_store_errors(registry, path, words):
    """A path registered for later (its required module missing) or written into
    ``known_stores`` directly is checked when used: StateStoreError, never a raw ValueError,
    ImportError or AttributeError, and never a call of what is not a store class."""
    known_stores["later"] = known_stores["device"]._replace(path=path)
    with pytest.raises(ss.StateStoreError, match=words) as e:
        make_store("later", "echo statestore-registry-test")
    assert type(e.value) is ss.StateStoreError


def test_registry_messages_are_bounded(registry):
    for call in (lambda: store_class("x" * 10 ** 6),
                 lambda: register_store("x" * 10 ** 6, ss.DeviceStore),
                 lambda: register_store("ok", "a" * 10 ** 6),
                 lambda: register_store("ok", "a." + "b" * 10 ** 6),
                 lambda: register_store("ok", ss.DeviceStore, hint="h" * 10 ** 6),
                 lambda: register_store("ok", ss.DeviceStore, requires="r" * 10 ** 6)):
        with pytest.raises(ss.StateStoreError) as e:
            call()
        assert len(str(e.value)) < 1000
    with pytest.raises(ss.StateStoreValueError, match="1000000 characters"):
        store_class("x" * 10 ** 6)

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
    with pytest.raises(ss.StateStoreValueError, match="clobber"):
        register_store("mine", ss.PinnedCPUStore)
    register_store("mine", ss.PinnedCPUStore, clobber=True)
    assert store_class("mine") is ss.PinnedCPUStore
    register_store("mine", "statestore.backends.device.DeviceStore", requires="no_such_mod_ss",
                   hint="pip install no-such-mod", clobber=True)
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

"""The checkpoint's two objects (docs/extending.md, "The checkpoint writer's call order"): a
save hands the store's states to a ``CheckpointWriter`` once and reaches the disk without
calling the store back; a load is a ``CheckpointReader`` driven in its documented order."""
from __future__ import annotations

import os
import sys

import pytest
import torch

import statestore as ss
from statestore.checkpoint import (CheckpointReader, CheckpointWriter, read_manifest,
                                   verify_checkpoint)

# the store's public methods (a save used to call back stream, pipeline, spec, keys, metadata)
_PUBLIC = ("stream", "pipeline", "spec", "keys", "metadata", "get", "put", "create_many",
           "clear", "delete", "prefetch", "cancel_prefetch", "stats", "sync", "load_checkpoint")
# who may still call one during a save: the store itself before the hand-over (its ``sync``),
# and the pipeline its PipelineAccess makes, which is given the store (``spec`` lookups, and
# the ``sync`` a finished pipeline makes: statestore/pipeline.py; its units checked once by
# statestore/_unit_cache.py)
_MAY_CALL = {"store.py": {"sync"}, "pipeline.py": {"spec", "sync"}, "_access.py": {"spec"},
             "_stream.py": {"spec"}, "_unit_cache.py": {"spec"}}


def _nvme(tmp_path):
    store = ss.NVMeStore(str(tmp_path / "store"), budget_bytes=64 << 10)
    for i in range(3):
        store.create(f"p{i}/exp_avg", (1000 + 7 * i,), init=torch.arange(1000.0 + 7 * i) + i)
    store.attach_metadata(lambda: {"round": 7})
    return store


@pytest.mark.parametrize("link", [False, True])
def test_a_save_reaches_the_disk_without_calling_the_store_back(tmp_path, monkeypatch, link):
    """Once ``save_checkpoint`` has handed its states over, no public method of the store
    runs: everything the writer reads comes from the ``SavedStates`` (before, a save entered
    ``stream``, ``pipeline``, ``keys`` and ``metadata`` again: 14 hops and 3 entries into
    store.py). Public methods still called: ``save_checkpoint``'s own ``sync`` before the
    hand-over, and the pipeline's catalogue lookups (``_MAY_CALL``)."""
    store = _nvme(tmp_path)
    calls = []

    def spy(name, real):
        def call(*a, **k):
            caller = sys._getframe(1).f_code.co_filename
            calls.append((os.path.basename(caller), name, caller))
            return real(*a, **k)
        return call
    for name in _PUBLIC:
        monkeypatch.setattr(store, name, spy(name, getattr(store, name)))
    ck = str(tmp_path / "ck")
    store.save_checkpoint(ck, progress=False, link=link)
    bad = [(c, n) for f, n, c in calls
           if n not in _MAY_CALL.get(f, ()) or os.sep + "checkpoint" + os.sep in c]
    assert bad == []
    assert [n for f, n, _ in calls if f == "store.py"] == ["sync"]
    monkeypatch.undo()
    assert verify_checkpoint(ck, progress=False) == []
    assert read_manifest(ck).metadata == {"round": 7}
    with ss.DeviceStore("cpu") as back:
        back.load_checkpoint(ck, progress=False)
        for k in store.keys():
            assert torch.equal(back.get(k), store.get(k))
    store.close()


def test_the_writer_and_reader_are_driven_in_their_documented_order(tmp_path, monkeypatch):
    """``save_checkpoint`` calls set_up, plan, write_data, finish; ``load_checkpoint`` calls
    set_up, read_metadata, read_data, finish."""
    order = []
    for cls, steps in ((CheckpointWriter, ("set_up", "plan", "write_data", "finish")),
                       (CheckpointReader, ("set_up", "read_metadata", "read_data", "finish"))):
        for step in steps:
            real = getattr(cls, step)
            monkeypatch.setattr(cls, step, lambda self, *a, _s=step, _r=real, _c=cls.__name__:
                                order.append((_c, _s)) or _r(self, *a))
    store = _nvme(tmp_path)
    ck = str(tmp_path / "ck")
    store.save_checkpoint(ck, progress=False)
    store.load_checkpoint(ck, progress=False)
    assert order == [("CheckpointWriter", s) for s in ("set_up", "plan", "write_data", "finish")] \
        + [("CheckpointReader", s) for s in ("set_up", "read_metadata", "read_data", "finish")]
    assert store.loaded_metadata == {"round": 7}
    store.close()


def test_a_failed_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """A writer step that fails (here ``write_data``, after the lock and the directory):
    leaving the writer removes what it wrote, the previous checkpoint verifies, the error is
    a StateStoreIOError naming the path."""
    store = _nvme(tmp_path)
    ck = str(tmp_path / "ck")
    store.save_checkpoint(ck, progress=False, link=False)
    before = read_manifest(ck).info["save_id"]
    real = CheckpointWriter.write_data

    def failing(self):
        real(self)
        raise OSError(5, "injected")
    monkeypatch.setattr(CheckpointWriter, "write_data", failing)
    with pytest.raises(ss.StateStoreIOError, match="ck"):
        store.save_checkpoint(ck, progress=False, link=False)
    monkeypatch.undo()
    assert read_manifest(ck).info["save_id"] == before
    assert verify_checkpoint(ck, progress=False) == []
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()
                  if p.name.startswith(("shard-", ".shard-"))) \
        == sorted({r.file for r in read_manifest(ck).rows})
    store.save_checkpoint(ck, progress=False)       # the lock was released
    store.close()

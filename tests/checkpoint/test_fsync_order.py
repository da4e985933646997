"""Power-loss ordering of a save (docs/checkpoint-io.md, "Saving: the atomic commit
protocol"): every name a manifest depends on is durable before the manifest's rename, found by
recording the order of ``mkdir``, ``fsync``, ``link`` and ``rename`` calls during a save."""
from __future__ import annotations

import os

import pytest
import torch

import statestore as ss


def _record(monkeypatch):
    events = []
    real = {n: getattr(os, n) for n in ("fsync", "rename", "mkdir", "link")}

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real["fsync"](fd)

    def rename(src, dst, *a, **k):
        real["rename"](src, dst, *a, **k)
        events.append(("rename", os.path.abspath(src), os.path.abspath(dst)))

    def mkdir(path, *a, **k):
        real["mkdir"](path, *a, **k)
        events.append(("mkdir", os.path.abspath(path)))

    def link(src, dst, *a, **k):
        real["link"](src, dst, *a, **k)
        events.append(("link", os.path.abspath(src), os.path.abspath(dst)))

    for name, fn in (("fsync", fsync), ("rename", rename), ("mkdir", mkdir), ("link", link)):
        monkeypatch.setattr(os, name, fn)
    return events


def _index(events, pred, start=0):
    for i in range(start, len(events)):
        if pred(events[i]):
            return i
    return None


@pytest.mark.parametrize("kind,link", [("device", True), ("nvme", True), ("nvme", False)],
                         ids=["copy", "nvme-linked", "nvme-copy"])
def test_names_are_durable_before_the_manifest(tmp_path, monkeypatch, kind, link):
    store = ss.DeviceStore("cpu") if kind == "device" else ss.NVMeStore(str(tmp_path / "store"))
    with store:
        for i in range(3):
            store.create(f"p{i}/exp_avg", (1000 + i,), init=torch.randn(1000 + i))
        root = str((tmp_path / "new" / "deeper" / "ckpt").resolve())
        events = _record(monkeypatch)
        store.save_checkpoint(root, shard_bytes=4096, link=link)
        monkeypatch.undo()
    manifest = os.path.join(root, "manifest.parquet")
    commit = _index(events, lambda e: e[0] == "rename" and e[2] == manifest)
    assert commit is not None
    # each directory the save created is durable in its parent before the commit
    made = [e[1] for e in events if e[0] == "mkdir"]
    assert made == [str(tmp_path / "new"), str(tmp_path / "new" / "deeper"), root]
    for d in made:
        at = _index(events, lambda e: e == ("mkdir", d))
        synced = _index(events, lambda e: e == ("fsync", os.path.dirname(d)), at)
        assert synced is not None and synced < commit, f"parent of {d} not fsynced"
    # each shard: its data durable before its rename (copies), then every shard's name
    # durable (the directory fsynced) after the last shard's rename and before the commit
    shards = [i for i, e in enumerate(events[:commit]) if e[0] == "rename"
              and os.path.basename(e[2]).startswith("shard-")]
    assert shards
    for i in shards:
        src = events[i][1]
        if not any(e[0] == "link" and e[2] == src for e in events[:i]):
            assert ("fsync", src) in events[:i], f"{src} renamed before its fsync"
    assert _index(events, lambda e: e == ("fsync", root), shards[-1]) < commit
    # the manifest itself: its bytes before its rename, its name after
    assert any(e[0] == "fsync" and ".manifest.parquet." in e[1] for e in events[:commit])
    assert _index(events, lambda e: e == ("fsync", root), commit) is not None

"""Checkpoint guarantees (docs/api.md, "Checkpoint guarantees"; docs/checkpoint-format.md).

Every guarantee has a test that fails when it is broken: exact (resume in a new process,
across stores), immutable, atomic (real ``kill -9`` of saving processes), verified (each kind
of damage names its file and tensor), bounded memory, mismatch, stock tools, torch interop.
Stores: every kind in ``helpers.ckpt.STORE_KINDS`` (NVMeStore included when present); paths:
a local directory and ``memory://``.
"""
from __future__ import annotations

import copy
import io
import json
import os
import random
import signal
import sys
import time
import uuid

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import statestore as ss
from statestore import checkpoint as ckpt_mod

from helpers import ckpt as H  # noqa: E402
from helpers.ckpt import CONFIGS, STORE_KINDS, make_store  # noqa: E402

PATH_KINDS = ["local", "memory"]


def _ckpt_path(kind: str, tmp_path, name: str = "ckpt") -> str:
    if kind == "local":
        return str(tmp_path / name)
    return f"memory://statestore-tests/{uuid.uuid4().hex}/{name}"


@pytest.fixture(autouse=True)
def _clean_memory_fs():
    yield
    fs = fsspec.filesystem("memory")
    if fs.exists("/statestore-tests"):
        fs.rm("/statestore-tests", recursive=True)


def _other(kind: str) -> str:
    return STORE_KINDS[(STORE_KINDS.index(kind) + 1) % len(STORE_KINDS)]


def _params_equal(a, b) -> None:
    for (na, pa_), (nb, pb) in zip(a, b):
        assert na == nb
        assert pa_.dtype == pb.dtype
        assert torch.equal(pa_.detach(), pb.detach()), f"parameter {na} differs"


def _files(path: str):
    fs, root = fsspec.core.url_to_fs(path)
    return fs, root, sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))


def _small_store(kind: str, tmp_path, n: int = 3):
    s = make_store(kind, str(tmp_path / f"store-{uuid.uuid4().hex[:6]}"))
    g = torch.Generator().manual_seed(7)
    s.create_many([(f"w{i}/exp_avg", (1000 + 37 * i,), torch.float32,
                    torch.randn(1000 + 37 * i, generator=g)) for i in range(n)]
                  + [("w0/exp_avg_sq", (5, 3), torch.float32, torch.rand(5, 3, generator=g))])
    return s


# ------------------------------------------------------------------------------ exact
K, N = 3, 4     # steps before the save, steps after


_SAVED_RUNS: dict = {}


def _saved_run(kind, cfg, tmp_path_factory):
    """On store ``kind``: K steps, the checkpoint and weights saved, N more steps (the
    uninterrupted run). Once per (kind, cfg) in a test process: the same-store and
    other-store resumes read the same checkpoint and compare with the same run."""
    if (kind, cfg) not in _SAVED_RUNS:
        d = tmp_path_factory.mktemp(f"saved-{kind}-{cfg}")
        c = CONFIGS[cfg]
        named = H.make_params(c)
        params = [p for _, p in named]
        ckpt, weights = str(d / "ckpt"), str(d / "w.safetensors")
        with make_store(kind, str(d / "a")) as store:
            opt = H.make_opt(c, named, store)
            H.train(opt, params, 0, K)
            store.save_checkpoint(ckpt, progress=False)
            H.save_weights(named, weights)
            H.train(opt, params, K, N)                  # the uninterrupted run
        _SAVED_RUNS[kind, cfg] = ckpt, weights, named
    return _SAVED_RUNS[kind, cfg]


@pytest.mark.parametrize("cfg", ["mixed", "bf16"])
@pytest.mark.parametrize("same", [True, False], ids=["same-store", "other-store"])
@pytest.mark.parametrize("kind", STORE_KINDS)
def test_exact_resume_in_new_process(kind, same, cfg, tmp_path, tmp_path_factory, zygote):
    """Train K steps on store A, save; a NEW process loads into store B, rebuilds the
    optimizer over the saved weights and trains N more: bit-identical to never stopping."""
    c = CONFIGS[cfg]
    ckpt, weights, named = _saved_run(kind, cfg, tmp_path_factory)
    out = str(tmp_path / "out.safetensors")
    kind_b = kind if same else _other(kind)
    zygote.run("resume", str(tmp_path / "child.log"), cfg=cfg, kind=kind_b,
               store_dir=str(tmp_path / "b"), ckpt=ckpt, weights=weights, start=K, n=N, out=out)
    resumed = H.make_params(c, seed=99)
    H.load_weights(resumed, out)
    _params_equal(named, resumed)


@pytest.mark.parametrize("cfg", ["mixed", "bf16"])
@pytest.mark.parametrize("kind", STORE_KINDS)
def test_exact_resume_memory_fs(kind, cfg, tmp_path):
    """Same through ``memory://`` (one process: the memory filesystem is per process), into
    a fresh store of the next kind and a fresh optimizer over fresh parameter objects."""
    c = CONFIGS[cfg]
    named = H.make_params(c)
    params = [p for _, p in named]
    path = _ckpt_path("memory", tmp_path)
    with make_store(kind, str(tmp_path / "a")) as a, make_store(_other(kind), str(tmp_path / "b")) as b:
        opt = H.make_opt(c, named, a)
        H.train(opt, params, 0, K)
        a.save_checkpoint(path, progress=False)
        named2 = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in named]
        H.train(opt, params, K, N)
        b.load_checkpoint(path, progress=False)
        opt2 = H.make_opt(c, named2, b)
        assert opt2._steps == {k: K for k in opt2._steps} and len(opt2._steps) == 4
        H.train(opt2, [p for _, p in named2], K, N)
    _params_equal(named, named2)


# ------------------------------------------------------------------------------ immutable
@pytest.mark.parametrize("path_kind", PATH_KINDS)
@pytest.mark.parametrize("kind", STORE_KINDS)
def test_immutable_after_training_on(kind, path_kind, tmp_path):
    c = CONFIGS["mixed"]
    named = H.make_params(c)
    params = [p for _, p in named]
    path = _ckpt_path(path_kind, tmp_path)
    with make_store(kind, str(tmp_path / "a")) as store:
        opt = H.make_opt(c, named, store)
        H.train(opt, params, 0, 2)
        store.save_checkpoint(path, progress=False)
        fs, root, names = _files(path)
        before = {n: fs.cat(f"{root}/{n}") for n in names}
        H.train(opt, params, 2, 3)
        store.sync()
        store.save_checkpoint(_ckpt_path(path_kind, tmp_path, "other"), progress=False)
        _, _, names_after = _files(path)
        assert names_after == names
        for n in names:
            assert fs.cat(f"{root}/{n}") == before[n], f"{n} changed after training on"
        # and the checkpoint still holds the step-2 states, not the live ones
        assert ckpt_mod.verify_checkpoint(path, progress=False) == []
        assert ckpt_mod.read_manifest(path).metadata["steps"] == {n: 2 for n, _ in named}


# ------------------------------------------------------------------------------ atomic
def _check_consistent(path: str) -> int:
    """Load ``path`` and check it is one whole save: every state holds the save's round
    number; returns it."""
    with ss.DeviceStore("cpu") as s:
        s.load_checkpoint(path, progress=False)
        v = s.loaded_metadata["round"]
        assert len(s) == 8
        for k in s.keys():
            assert torch.equal(s.get(k), torch.full(s.spec(k).shape, float(v))), \
                f"{path}: state {k} is not from round {v}: a torn checkpoint"
    assert ckpt_mod.verify_checkpoint(path, progress=False) == []
    return v


@pytest.mark.slow
def test_atomic_under_kill_9(tmp_path, zygote):
    """Kill -9 a process doing repeated saves (to a new path, and re-saving to the same
    path) at random moments, 10 times (a count, not a time limit: timing decides where the
    kills land, never whether the test passes): the previous checkpoint always loads and
    verifies; the new one is complete or refused with CheckpointNotFoundError."""
    base, new = str(tmp_path / "base"), str(tmp_path / "new")
    rng = random.Random(1234)
    ready = str(tmp_path / "ready")
    kills = outcomes_new = 0
    saw_refused = saw_complete = False
    for i in range(1, 11):
        kind = STORE_KINDS[(i - 1) % len(STORE_KINDS)]
        pid = zygote.start("save_loop", str(tmp_path / f"loop{i}.log"), kind=kind,
                           store_dir=str(tmp_path / f"s{i}"), base=base, new=new, ready=ready,
                           shard_bytes=1 << 20)
        if kills == 0:               # the first run establishes the previous checkpoint
            t0 = time.monotonic()
            while not os.path.exists(ready):
                assert time.monotonic() - t0 < 60, "the saving process never finished a save"
                time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.6))
        os.kill(pid, signal.SIGKILL)
        rc = zygote.wait()
        if rc != -signal.SIGKILL:
            with open(tmp_path / f"loop{i}.log") as f:
                pytest.fail(f"saving process ended by itself (rc={rc}):\n{f.read()}")
        kills += 1
        _check_consistent(base)                          # the previous one stays valid
        try:
            _check_consistent(new)
            saw_complete = True
        except ss.CheckpointNotFoundError:
            saw_refused = True
        outcomes_new += 1
    assert kills == 10
    assert saw_complete or saw_refused
    # leftovers of killed saves never confuse a later save: it cleans them up
    with _small_store("device-cpu", tmp_path) as s:
        s.save_checkpoint(base, progress=False, metadata={"round": 0})
    names = sorted(os.listdir(base))
    assert "manifest.parquet" in names and all(n.startswith("shard-") for n in names if n != "manifest.parquet")


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_resave_same_path_interrupted_keeps_old(kind, tmp_path, monkeypatch):
    """A re-save to the SAME path that fails midway (after some new shards are written)
    leaves the old checkpoint loadable and byte-identical, and no new files behind."""
    path = str(tmp_path / "ckpt")
    with _small_store(kind, tmp_path) as s:
        s.save_checkpoint(path, shard_bytes=4096, progress=False, metadata={"round": 1})
        before = H.file_hashes(path)
        s.put("w1/exp_avg", torch.zeros(1037))
        from statestore.checkpoint import writer
        real = writer.commit
        calls = []

        def dying_commit(fs, f, tmp, final, then=None):
            calls.append(final)
            if len(calls) == 2:
                raise KeyboardInterrupt("killed midway")
            real(fs, f, tmp, final, then)

        monkeypatch.setattr(writer, "commit", dying_commit)
        with pytest.raises(KeyboardInterrupt):
            s.save_checkpoint(path, shard_bytes=4096, progress=False, metadata={"round": 2})
        monkeypatch.setattr(writer, "commit", real)
        assert H.file_hashes(path) == before
        with ss.DeviceStore("cpu") as d:
            d.load_checkpoint(path, progress=False)
            assert d.loaded_metadata == {"round": 1}
            assert not torch.equal(d.get("w1/exp_avg"), torch.zeros(1037))
        # a completed re-save replaces the old one and removes its shards
        s.save_checkpoint(path, shard_bytes=4096, progress=False, metadata={"round": 3})
        after = H.file_hashes(path)
        assert not set(after) - {"manifest.parquet"} & set(before)
        assert ckpt_mod.read_manifest(path).metadata == {"round": 3}


# ------------------------------------------------------------------------------ verified
def _shard(path: str, i: int = 0) -> str:
    m = ckpt_mod.read_manifest(path)
    return m.files[i]


def _first_row(path: str, shard: str):
    return min((r for r in ckpt_mod.read_manifest(path).rows if r["file"] == shard),
               key=lambda r: r["offset"])


def _rewrite(fs, p: str, fn) -> None:
    data = bytearray(fs.cat(p))
    fs.pipe(p, bytes(fn(data)))


def _truncate(fs, root, path):
    name = _shard(path, 1)
    _rewrite(fs, f"{root}/{name}", lambda d: d[:-100])
    key = max((r for r in ckpt_mod.read_manifest(path).rows if r["file"] == name),
              key=lambda r: r["offset"])["key"]
    return ss.CheckpointCorruptError, [name, key, "truncated"]


def _flip(fs, root, path):
    name = _shard(path, 0)
    r = _first_row(path, name)

    def flip(d):
        d[r["offset"] + 17] ^= 0x10
        return d
    _rewrite(fs, f"{root}/{name}", flip)
    return ss.CheckpointCorruptError, [name, r["key"], "checksum mismatch"]


def _missing(fs, root, path):
    name = _shard(path, 1)
    key = _first_row(path, name)["key"]
    fs.rm(f"{root}/{name}")
    return ss.CheckpointCorruptError, [name, key, "missing"]


def _no_manifest(fs, root, path):
    fs.rm(f"{root}/manifest.parquet")
    return ss.CheckpointNotFoundError, ["manifest.parquet", "no complete checkpoint"]


def _other_version(fs, root, path):
    with fs.open(f"{root}/manifest.parquet", "rb") as f:
        table = pq.read_table(f)
    meta = dict(table.schema.metadata)
    meta[b"statestore.format_version"] = b"99"
    with fs.open(f"{root}/manifest.parquet", "wb") as f:
        pq.write_table(table.replace_schema_metadata(meta), f)
    return ss.CheckpointError, ["manifest.parquet", "format version 99"]


def _garbage_manifest(fs, root, path):
    fs.pipe(f"{root}/manifest.parquet", b"PAR1 this is not a parquet file")
    return ss.CheckpointCorruptError, ["manifest.parquet", "unreadable manifest"]


def _header_edit(fs, root, path):
    """The shard's header says another dtype than the manifest."""
    name = _shard(path, 0)
    key = _first_row(path, name)["key"]

    def edit(d):
        n = int.from_bytes(d[:8], "little")
        h = json.loads(bytes(d[8:8 + n]))
        h[key]["dtype"] = "I32"             # same length: the header keeps its size
        raw = json.dumps(h, separators=(",", ":")).encode().ljust(n)
        assert len(raw) == n
        d[8:8 + n] = raw
        return d
    _rewrite(fs, f"{root}/{name}", edit)
    return ss.CheckpointCorruptError, [name, key, "disagrees"]


DAMAGES = [_truncate, _flip, _missing, _no_manifest, _other_version, _garbage_manifest,
           _header_edit]
#: damages found only while the tensors stream in (the store is then emptied); every other
#: one is refused before the store changes
FOUND_WHILE_LOADING = (_flip,)


@pytest.mark.parametrize("path_kind", PATH_KINDS)
@pytest.mark.parametrize("damage", DAMAGES, ids=[d.__name__.strip("_") for d in DAMAGES])
def test_verified_load_names_the_damage(damage, path_kind, tmp_path):
    path = _ckpt_path(path_kind, tmp_path)
    with _small_store("device-cpu", tmp_path) as s:
        s.save_checkpoint(path, shard_bytes=4096, progress=False)
    assert len(ckpt_mod.read_manifest(path).files) >= 2
    fs, root = fsspec.core.url_to_fs(path)
    err, words = damage(fs, root, path)
    for kind in STORE_KINDS:
        with _small_store(kind, tmp_path) as target:       # holds other states already
            before = {str(k): target.get(k).clone() for k in target.keys()}
            with pytest.raises(err) as ei:
                target.load_checkpoint(path, progress=False)
            assert isinstance(ei.value, ss.StateStoreError)
            for w in words:
                assert w in str(ei.value), f"{w!r} not in {ei.value}"
            if damage in FOUND_WHILE_LOADING:
                assert len(target) == 0 and target.stats()["nbytes"] == 0, "half-loaded store"
                assert target.load_error is not None
            else:       # refused before any tensor was read: the store is as it was
                after = {str(k): target.get(k) for k in target.keys()}
                assert after.keys() == before.keys(), "the refused load changed the store"
                assert all(torch.equal(after[k], before[k]) for k in before)
                assert target.load_error is None
            assert target.loaded_metadata is None
    problems = ckpt_mod.verify_checkpoint(path, progress=False)
    assert problems and all(w in "\n".join(problems) for w in words[:1])


def test_load_of_missing_path_and_bad_arguments(tmp_path):
    with ss.DeviceStore("cpu") as s:
        with pytest.raises(ss.CheckpointNotFoundError, match="no checkpoint"):
            s.load_checkpoint(str(tmp_path / "nothing"))
        with pytest.raises(FileNotFoundError):
            s.load_checkpoint("memory://statestore-tests/none")
        with pytest.raises(ss.StateStoreValueError, match="shard_bytes"):
            s.save_checkpoint(str(tmp_path / "c"), shard_bytes=0)
        with pytest.raises(ss.StateStoreValueError, match="checkpoint path"):
            s.save_checkpoint(123)
        (tmp_path / "afile").write_text("x")
        with pytest.raises(ss.StateStoreValueError, match="not a directory"):
            s.save_checkpoint(str(tmp_path / "afile"))
    s.close()
    with pytest.raises(ss.StateStoreClosedError):
        s.save_checkpoint(str(tmp_path / "c"))


# ------------------------------------------------------------------------------ bounded
@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status")
def test_bounded_memory_save_and_load(tmp_path, zygote):
    """Peak RSS growth while saving, then loading, ~768 MiB of on-disk (NVMe) states
    stays under 300 MiB (the store's budget is 256 MiB). Without NVMeStore: FileStore,
    measuring anonymous RSS (its states are file-backed mapped pages by design)."""
    kind = "nvme" if "nvme" in STORE_KINDS else "file"
    out = str(tmp_path / "rss.json")
    zygote.run("bounded", str(tmp_path / "bounded.log"), kind=kind, store_dir=str(tmp_path / "s"),
               ckpt=str(tmp_path / "ckpt"), nbytes=768 * 1024 ** 2, out=out)
    with open(out) as f:
        r = json.load(f)
    assert r["nbytes"] >= 760 * 1024 ** 2
    limit = 300 * 1024
    assert r["save_kib"] < limit, f"saving grew {r['field']} by {r['save_kib'] / 1024:.0f} MiB"
    assert r["load_kib"] < limit, f"loading grew {r['field']} by {r['load_kib'] / 1024:.0f} MiB"


# ------------------------------------------------------------------------------ mismatch
def _checkpoint_of(cfg, tmp_path, kind="device-cpu"):
    c = CONFIGS[cfg]
    named = H.make_params(c)
    path = str(tmp_path / "ckpt")
    with make_store(kind, str(tmp_path / "a")) as s:
        opt = H.make_opt(c, named, s)
        H.train(opt, [p for _, p in named], 0, 2)
        s.save_checkpoint(path, progress=False)
    return c, named, path


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_mismatch_lists_differences(kind, tmp_path):
    c, named, path = _checkpoint_of("mixed", tmp_path)
    cases = {
        "shape": ([(n, torch.nn.Parameter(torch.zeros(3, 3, dtype=p.dtype)) if i == 0 else p)
                   for i, (n, p) in enumerate(named)],
                  ["'layer0.weight'", "(33, 17)", "(3, 3)"]),
        "count": (named[:3], ["unexpected parameter 'layer3.weight'"]),
        "names": ([(n.replace("layer", "block"), p) for n, p in named],
                  ["unexpected parameter 'layer0.weight'", "'layer3.weight'"]),
        "dtype": ([(n, torch.nn.Parameter(p.detach().float())) for n, p in named],
                  ["'layer1.weight'", "master"]),
    }
    for what, (params, words) in cases.items():
        with make_store(kind, str(tmp_path / f"b-{what}")) as s:
            s.load_checkpoint(path, progress=False)
            with pytest.raises(ss.CheckpointMismatchError) as ei:
                H.make_opt(c, params, s)
            for w in words:
                assert w in str(ei.value), f"{what}: {w!r} not in {ei.value}"


def test_mismatch_extra_parameter(tmp_path):
    """A parameter the checkpoint's metadata never listed is a difference too (it does not
    silently start fresh). Fixed in adam.py by f3bb881; was an xfail here."""
    c, named, path = _checkpoint_of("mixed", tmp_path)
    extra = named + [("layer4.weight", torch.nn.Parameter(torch.zeros(5)))]
    with ss.DeviceStore("cpu") as s:
        s.load_checkpoint(path, progress=False)
        with pytest.raises(ss.CheckpointMismatchError, match="layer4.weight"):
            H.make_opt(c, extra, s)


# ------------------------------------------------------------------------------ stock tools
@pytest.mark.parametrize("path_kind", PATH_KINDS)
@pytest.mark.parametrize("kind", STORE_KINDS)
def test_stock_tools_read_the_checkpoint(kind, path_kind, tmp_path):
    from safetensors import safe_open
    path = _ckpt_path(path_kind, tmp_path)
    with _small_store(kind, tmp_path) as s:
        s.save_checkpoint(path, shard_bytes=4096, progress=False, metadata={"hello": [1, 2]})
        live = {str(k): s.get(k).clone() for k in s.keys()}
    fs, root, names = _files(path)
    with fs.open(f"{root}/manifest.parquet", "rb") as f:
        table = pq.read_table(f)
    assert table.column_names == ["key", "param", "state", "file", "offset", "nbytes", "shape",
                                  "dtype", "checksum"]
    md = {k.decode(): v.decode() for k, v in table.schema.metadata.items()}
    assert md["statestore.format"] == "statestore-checkpoint"
    assert md["statestore.format_version"] == str(ckpt_mod.FORMAT_VERSION) == "1"
    assert md["statestore.checksum"] == "xxh3_64"
    assert json.loads(md["statestore.metadata"]) == {"hello": [1, 2]}
    rows = table.to_pylist()
    assert sorted(r["key"] for r in rows) == sorted(live)
    seen = {}
    for name in sorted({r["file"] for r in rows}):
        local = str(tmp_path / name)
        with open(local, "wb") as f:
            f.write(fs.cat(f"{root}/{name}"))
        with safe_open(local, framework="pt") as f:
            for k in f.keys():
                seen[k] = f.get_tensor(k)
    assert sorted(seen) == sorted(live)
    for k, t in live.items():
        assert torch.equal(seen[k], t)
    import xxhash
    for r in rows:
        raw = fs.cat_file(f"{root}/{r['file']}", start=r["offset"], end=r["offset"] + r["nbytes"])
        assert xxhash.xxh3_64(raw).hexdigest() == r["checksum"]


# ------------------------------------------------------------------------------ torch interop
def _twin_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(17, 9), (1000,), (3,)]]


def _train_plain(opt, params, start, n):
    H.train(opt, params, start, n)


HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01, amsgrad=True)


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_state_dict_into_torch_adamw(kind, tmp_path):
    from statestore.optim import CPUAdam
    ours_p = _twin_params()
    with make_store(kind, str(tmp_path / "s")) as s:
        ours = CPUAdam(ours_p, state_store=s, **HYPER)
        _train_plain(ours, ours_p, 0, 3)
        buf = io.BytesIO()                  # as a user moves it: torch.save / torch.load
        torch.save(ours.state_dict(), buf)
        buf.seek(0)
        sd = torch.load(buf)
        torch_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
        ref = torch.optim.AdamW(torch_p, **HYPER)
        ref.load_state_dict(sd)
        assert ref.state[torch_p[0]]["step"].item() == 3
        _train_plain(ours, ours_p, 3, 4)
        _train_plain(ref, torch_p, 3, 4)
    for a, b in zip(ours_p, torch_p):
        # float32 rounding: the SIMD kernel and torch order a few operations differently
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_load_state_dict_from_torch_adamw(kind, tmp_path):
    from statestore.optim import CPUAdam
    torch_p = _twin_params()
    ref = torch.optim.AdamW(torch_p, **HYPER)
    _train_plain(ref, torch_p, 0, 3)
    ours_p = [torch.nn.Parameter(p.detach().clone()) for p in torch_p]
    with make_store(kind, str(tmp_path / "s")) as s:
        ours = CPUAdam(ours_p, state_store=s, lr=0.5)
        ours.load_state_dict(copy.deepcopy(ref.state_dict()))
        assert ours.param_groups[0]["lr"] == HYPER["lr"]
        _train_plain(ours, ours_p, 3, 4)
        _train_plain(ref, torch_p, 3, 4)
        # and the store now checkpoints what came from torch
        s.save_checkpoint(str(tmp_path / "ckpt"), progress=False)
        assert ckpt_mod.read_manifest(str(tmp_path / "ckpt")).metadata["steps"] == \
            {"0": 7, "1": 7, "2": 7}
    for a, b in zip(ours_p, torch_p):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------ metadata
def test_manifest_metadata_and_layout(tmp_path):
    c, named, path = _checkpoint_of("mixed", tmp_path)
    m = ckpt_mod.read_manifest(path)
    assert m.info["format_version"] == 1 and m.info["checksum"] == "xxh3_64"
    meta = m.metadata
    assert meta["optimizer"] == "CPUAdam"
    assert meta["steps"] == {n: 2 for n, _ in named}
    assert [g["params"] for g in meta["param_groups"]] == [[n for n, _ in named[:2]],
                                                         [n for n, _ in named[2:]]]
    assert meta["params"]["layer1.weight"] == {"shape": [1000], "dtype": "bfloat16"}
    states = {(r["param"], r["state"]) for r in m.rows}
    assert ("layer1.weight", "master") in states and ("layer0.weight", "master") not in states
    first = {}
    for r in m.rows:
        first[r["file"]] = min(first.get(r["file"], r["offset"]), r["offset"])
        assert r["offset"] % 4 == 0             # fp32 states, packed after a 64-aligned start
        assert r["file"].startswith("shard-") and r["file"].endswith(".safetensors")
    assert all(off % 64 == 0 for off in first.values())


def test_load_into_tiered_store_with_a_small_disk_budget(tmp_path):
    """A tensor larger than the disk tier's RAM budget loads in chunks that tier can take
    (the tiered store used to cut by its own, larger budget: BudgetError)."""
    src = ss.DeviceStore("cpu")
    big = torch.randn(300_000)
    src.create_many([("w/exp_avg", big.shape, torch.float32, big),
                     ("b/exp_avg", (10,), torch.float32, torch.ones(10))])
    ck = str(tmp_path / "ck")
    src.save_checkpoint(ck)
    dst = ss.TieredStore([(ss.DeviceStore("cpu"), 0.01),
                          (ss.NVMeStore(str(tmp_path / "n"), budget_bytes=64 << 10), 0.99)])
    dst.load_checkpoint(ck)
    assert isinstance(dst.tier_of("w/exp_avg"), ss.NVMeStore)
    assert torch.equal(dst.get("w/exp_avg"), big)
    dst.close()


def test_manifest_rows_are_frozen_records(tmp_path):
    """read_manifest's rows are ManifestRow records: the nine columns as attributes (also
    read as a mapping, as the rows were before), the parsed spec and key, the region (a
    version-1 row: the whole tensor), and no way to change one after validation."""
    import dataclasses
    path = str(tmp_path / "ckpt")
    with ss.DeviceStore("cpu") as s:
        s.create("w/exp_avg", (2, 3), torch.float32)
        s.create("b/master", (4,), torch.bfloat16)
        s.put("w/exp_avg", torch.arange(6, dtype=torch.float32).view(2, 3))
        s.save_checkpoint(path, progress=False)
    m = ckpt_mod.read_manifest(path)
    by_key = {r.key: r for r in m.rows}
    r = by_key["w/exp_avg"]
    assert isinstance(r, ckpt_mod.ManifestRow) and isinstance(m, ckpt_mod.Manifest)
    assert (r.param, r.state, r.shape, r.dtype, r.nbytes) == ("w", "exp_avg", (2, 3), "F32", 24)
    assert r.spec == ss.StateSpec((2, 3), torch.float32) and r.state_key == ss.StateKey("w",
                                                                                         "exp_avg")
    assert r["file"] == r.file and dict(r)["checksum"] == r.checksum
    assert set(r) == set(ckpt_mod.SCHEMA.names) | {"spec", "state_key", "global_shape",
                                                    "offsets"}
    assert (r.global_shape, r.offsets, r.region.is_whole) == ((2, 3), (0, 0), True)
    assert by_key["b/master"].dtype == "BF16" and by_key["b/master"].spec.dtype == torch.bfloat16
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.offset = 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.rows = []


def test_import_statestore_does_not_load_the_checkpoint_package():
    """The checkpoint package's names load on first use: importing statestore (whose stores
    check tensor ranks against the manifest's limit) does not import pyarrow."""
    import subprocess
    code = ("import sys, statestore\n"
            "assert 'pyarrow' not in sys.modules, 'pyarrow imported'\n"
            "from statestore.checkpoint import save_checkpoint, read_manifest, FORMAT_VERSION\n"
            "assert 'pyarrow' in sys.modules and FORMAT_VERSION == 1\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert r.returncode == 0, r.stderr[-2000:]


def test_save_never_commits_a_key_the_loader_refuses(tmp_path):
    """Keys are checked where they enter a store; a backend that bypassed that (here: a
    catalogue entry made directly) still cannot make a save replace a good checkpoint with
    one its loader refuses: the save checks every key before writing a byte."""
    from statestore._types import StateKey, StateSpec
    path = str(tmp_path / "ck")
    s = ss.DeviceStore("cpu")
    s.create("a/x", (3,), init=torch.arange(3.0))
    s.save_checkpoint(path)
    with pytest.raises(ss.StateStoreValueError, match="state name is empty"):
        s.create(("a", ""), (3,))
    bad, spec = StateKey("a", ""), StateSpec((3,), torch.float32)
    s._allocate([(bad, spec)])
    s._specs[bad] = spec
    with pytest.raises(ss.StateStoreValueError, match=r"state key \('a', ''\)"):
        s.save_checkpoint(path)
    ss.checkpoint.verify_checkpoint(path)
    t = ss.DeviceStore("cpu")
    t.load_checkpoint(path)
    assert torch.equal(t.get("a/x"), torch.arange(3.0)) and len(t) == 1

"""Hostile checkpoints cost bounded work and memory and are refused with short messages
(docs/errors.md, "Untrusted bytes"): a shard header entry of 10^5 dimensions, a manifest of
more rows than a manifest may list, a huge string in the optimizer metadata, and names that
would drive a terminal (control and bidi characters) printed by ``inspect``."""
from __future__ import annotations

import gc
import json
import os
import struct
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import statestore as ss
from statestore import checkpoint as ckpt
from statestore.__main__ import main
from statestore.checkpoint import parquet_guard
from statestore.errors import CheckpointCorruptError, CheckpointError


def _save(tmp_path, name="ckpt", keys=("a/exp_avg", "b/exp_avg")) -> str:
    path = str(tmp_path / name)
    with ss.DeviceStore("cpu") as s:
        for i, k in enumerate(keys):
            s.create(k, (8,), init=torch.full((8,), float(i)))
        s.save_checkpoint(path, progress=False)
    return path


def _rewrite_manifest(path: str, rows=None, metadata=None) -> None:
    """Replace the manifest's rows (a list of dicts) or schema metadata entries, and seal it
    again (as a tool that rewrites a manifest on purpose does): only the change is wrong."""
    mpath = os.path.join(path, ckpt.MANIFEST)
    table = pq.read_table(mpath)
    meta = dict(table.schema.metadata)
    if rows is not None:
        table = pa.Table.from_pylist(rows, schema=table.schema)
    if metadata is not None:
        meta.update({k.encode(): v.encode() for k, v in metadata.items()})
    pq.write_table(ckpt.sealed(table.replace_schema_metadata(meta)), mpath)


def test_unlisted_header_entry_of_many_dimensions_is_refused(tmp_path):
    """An entry the manifest does not list, shape [1] * 10^5: its product is 1 byte, so the
    file was accepted (and with dimensions of 2 the product took quadratic time)."""
    path = _save(tmp_path)
    m = ckpt.read_manifest(path)
    shard = os.path.join(path, m.rows[0].file)
    with open(shard, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    header["extra/x"] = {"dtype": "U8", "shape": [1] * 100_000,
                         "data_offsets": [len(data), len(data) + 1]}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(shard, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data + b"\0")
    shift = len(raw) - n
    _rewrite_manifest(path, rows=[dict(r, offset=r["offset"] + shift, shape=list(r["shape"]))
                                  for r in pq.read_table(os.path.join(path, ckpt.MANIFEST))
                                  .to_pylist()])
    problems = ckpt.verify_checkpoint(path, progress=False)
    assert len(problems) == 1 and "bad shape" in problems[0] and "100000 dimensions" in problems[0]
    assert len(problems[0]) < 600
    with ss.DeviceStore("cpu") as s, pytest.raises(CheckpointCorruptError, match="bad shape"):
        s.load_checkpoint(path, progress=False)


def _pad_header(path, entries, data_extra=b""):
    """Add ``entries`` (JSON text of header entries, each starting with a comma) to the
    shard of the checkpoint at ``path`` and ``data_extra`` after its data; shift the
    manifest's offsets to match and seal it again."""
    m = ckpt.read_manifest(path)
    shard = os.path.join(path, m.rows[0].file)
    with open(shard, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        text = f.read(n).decode().rstrip()
        data = f.read()
    raw = (text[:-1] + entries + "}").encode()
    raw += b" " * (-len(raw) % 8)
    with open(shard, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data + data_extra)
    shift = len(raw) - n
    _rewrite_manifest(path, rows=[dict(r, offset=r["offset"] + shift, shape=list(r["shape"]))
                                  for r in pq.read_table(os.path.join(path, ckpt.MANIFEST))
                                  .to_pylist()])
    return len(raw)


@pytest.mark.parametrize("size", [0, 1])
def test_shard_header_of_many_unlisted_entries_is_refused_before_decoding(tmp_path, size):
    """A header of more entries than its manifest rows and data bytes can account for (a real
    shard: the listed tensors, deleted states of at least 64 bytes or empty ones up to
    MAX_UNLISTED_EMPTY, one pad each) is refused before it is decoded: a 99 MiB header of 1.7
    million empty entries took 28 s and 1.05 GiB to verify. Tried here with 140,000 entries
    of 0 and of 1 byte (their data present): refused at a small multiple of the header's
    bytes, in time far below decoding it."""
    from statestore.checkpoint import shard_check
    path = _save(tmp_path)
    n = 140_000
    bound = getattr(shard_check, "max_header_entries", None)
    assert bound is None or bound(2, 64 + n * size) < n
    data_len = 64                                      # the two 8-float tensors
    entries = "".join(',"z%07d/x":{"dtype":"U8","shape":[%d],"data_offsets":[%d,%d]}'
                      % (i, size, data_len + i * size, data_len + (i + 1) * size)
                      for i in range(n))
    hbytes = _pad_header(path, entries, b"\0" * (n * size))
    gc.collect()
    tracemalloc.start()
    try:
        problems = ckpt.verify_checkpoint(path, progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(problems) == 1 and "refused before decoding" in problems[0], problems
    assert f"up to {n + 3} tensors" in problems[0] and len(problems[0]) < 600   # + 2 + metadata
    assert peak < 3 * hbytes, (peak, hbytes)          # decoding took ~50x the header
    with ss.DeviceStore("cpu") as s, pytest.raises(CheckpointCorruptError,
                                                    match="refused before decoding"):
        s.load_checkpoint(path, progress=False)


def test_shard_header_within_the_bound_is_accepted(tmp_path):
    """Unlisted entries a real linked shard may hold (empty ones, here 1000) still verify."""
    path = _save(tmp_path)
    entries = "".join(',"z%05d/x":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}' % i
                      for i in range(1000))
    _pad_header(path, entries)
    assert ckpt.verify_checkpoint(path, progress=False) == []


def test_shard_header_entries_cost_few_hundred_bytes(tmp_path):
    """Checking a shard of 20000 listed tensors peaks at under 600 bytes of Python memory an
    entry (713 before: a dict and two lists an entry as json decodes them, and the header's
    bytes beside its text; now 508: entries of the usual form are small records sharing
    their dtypes and shapes, and the bytes are freed before the JSON is decoded)."""
    from statestore.checkpoint.shard_check import by_file, check_shard_header
    path = str(tmp_path / "many")
    n = 20_000
    with ss.DeviceStore("cpu") as s:
        s.create_many([(f"model.layers.{i}.mlp.experts.{i % 64}.w/exp_avg", (4,),
                        torch.float32, None) for i in range(n)])
        s.save_checkpoint(path, progress=False)
    m = ckpt.read_manifest(path)
    groups = by_file(m.rows)
    gc.collect()
    tracemalloc.start()
    try:
        for name, rows in groups.items():
            check_shard_header(m, name, rows)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak / n < 600, peak / n


def test_manifest_rows_are_bounded(tmp_path, monkeypatch):
    """More rows than MAX_ROWS: refused from the Parquet footer, before a row is decoded;
    a save that would write such a manifest is refused before it writes anything."""
    assert ckpt.MAX_ROWS == parquet_guard.MAX_ROWS >= 1_000_000
    path = _save(tmp_path, keys=[f"p{i}/exp_avg" for i in range(30)])
    monkeypatch.setattr(parquet_guard, "MAX_ROWS", 29)
    with pytest.raises(CheckpointCorruptError, match="lists 30 tensors, more than the 29"):
        ckpt.read_manifest(path)
    assert "more than the 29" in ckpt.verify_checkpoint(path, progress=False)[0]
    from statestore.checkpoint import save as save_mod
    monkeypatch.setattr(save_mod, "MAX_ROWS", 29)
    with ss.DeviceStore("cpu") as s:
        s.create_many([(f"q{i}/exp_avg", (2,), torch.float32, None) for i in range(30)])
        with pytest.raises(CheckpointError, match="30 states, more than the 29"):
            s.save_checkpoint(str(tmp_path / "too-many"), progress=False)
    assert not (tmp_path / "too-many").exists()


def test_manifest_rows_cost_few_hundred_bytes(tmp_path):
    """Reading a manifest of 20000 rows peaks at under 700 bytes of Python memory a row, and
    its rows keep under 360 (1703 at the peak before per-row dicts, instance dicts and the
    checksum's whole JSON text went; a 5M-row manifest took 6.9 GB; then 763 and 416: a
    list a row for each shape, a tuple a row in the duplicate check, a list a row in the
    tiling check, and the key's strings held twice a row). Rows of empty tensors, as the
    issue-47 attack's 400,000 (tensors of 16 zeros measure the same)."""
    path = str(tmp_path / "many")
    n, shape = 20_000, (0,)
    with ss.DeviceStore("cpu") as s:
        s.create_many([(f"model.layers.{i}.mlp.experts.{i % 64}.w/exp_avg", shape,
                        torch.float32, None) for i in range(n)])
        s.save_checkpoint(path, progress=False)
    gc.collect()
    tracemalloc.start()
    try:
        m = ckpt.read_manifest(path)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(m.rows) == n
    assert peak / n < 700, peak / n
    assert kept / n < 360, kept / n
    r = m.rows[5]
    assert (r.key, r.param, r.state) == ("model.layers.5.mlp.experts.5.w/exp_avg",
                                         "model.layers.5.mlp.experts.5.w", "exp_avg")
    assert r["key"] == r.key and r.shape == shape and dict(r)["param"] == r.param


def test_huge_string_in_metadata_is_not_repeated(tmp_path):
    """A 4 MB string as a group's lr: the error names it, cut, with its length."""
    path = _save(tmp_path)
    meta = {"optimizer": "CPUAdam", "param_groups": [{"lr": "x" * (4 << 20), "params": []}]}
    _rewrite_manifest(path, metadata={"statestore.metadata": json.dumps(meta)})
    with pytest.raises(CheckpointCorruptError, match="must be a number") as e:
        ckpt.read_manifest(path)
    assert len(str(e.value)) < 1000 and f"({4 << 20} characters)" in str(e.value)
    bad_key = {"optimizer": "CPUAdam", "steps": {"k" * (4 << 20): -1}}
    _rewrite_manifest(path, metadata={"statestore.metadata": json.dumps(bad_key)})
    with pytest.raises(CheckpointCorruptError, match="non-negative int") as e:
        ckpt.read_manifest(path)
    assert len(str(e.value)) < 1000


def test_inspect_escapes_control_and_bidi_characters(tmp_path, capsys):
    name = "evil\x1b[2J\nforged line\u202etxt.exe\u2066"
    path = _save(tmp_path, keys=(f"{name}/exp_avg", "plain/exp_avg"))
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    for c in ("\x1b", "\u202e", "\u2066"):
        assert c not in out
    assert "forged line" not in out.split("\n")[-1] and "\\x1b[2J\\nforged line\\u202etxt" in out
    assert sum("plain/exp_avg" in line for line in out.splitlines()) == 1

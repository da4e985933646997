"""Fuzzing of everything that parses untrusted checkpoint bytes (hypothesis, bounded).

The targets and the oracle are in ``fuzz_targets.py`` (shared with the long-run target,
``fuzz/fuzz_checkpoint.py``): a valid checkpoint's manifest bytes, its schema metadata and
optimizer metadata JSON, its rows (offsets, nbytes, shapes, dtypes, file names with ``../``
and absolute paths, aliased tensors), and its shards' safetensors headers (length prefix,
JSON) and data are damaged; ``read_manifest``, ``verify_checkpoint``, ``load_checkpoint``,
``statestore inspect`` and ``to_torch_state_dict`` must then succeed with the right data or
raise a ``CheckpointError``, agree with each other, never ask the store for more bytes than
the checkpoint's files hold, keep pyarrow's allocations within a bound of the manifest's
size, and never read outside a file.

Examples are derandomized (the same ones on every run; long runs explore); ``deadline=None``:
timing never decides.
"""
from __future__ import annotations

import gc
import os
import shutil
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import statestore as ss
from statestore import checkpoint as ckpt
from statestore.errors import CheckpointCorruptError

from helpers import forked, paths
from helpers import fuzz_targets as F
from helpers.parquet_bytes import page_bomb

SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])


@pytest.fixture(scope="module", autouse=True)
def _template():
    F.template()


def test_template_is_valid():
    """The undamaged template passes every check (the oracle can say yes)."""
    out = F.oracle(F.template())
    assert out == {"manifest_ok": True, "loaded": True}


@pytest.mark.slow
@pytest.mark.parametrize("target,examples", [("manifest_bytes", 150), ("manifest_metadata", 150),
                                             ("manifest_rows", 200), ("shard_header", 200),
                                             ("shard_bytes", 80)])
def test_fuzz_target(target, examples):
    @settings(max_examples=examples, **SETTINGS)
    @given(st.data())
    def run(data):
        F.run_target(target, data)
    run()


# ------------------------------------------------------------------------------ bombs
def _copy(tmp_path) -> str:
    dst = str(tmp_path / "ckpt")
    shutil.copytree(F.template(), dst)
    return dst


def test_manifest_page_bomb_is_refused_before_pyarrow_allocates(tmp_path):
    """A page header claiming 2 GiB: refused by the bounds check; pyarrow's peak stays
    small (it allocated 2 GiB before the check existed)."""
    path = _copy(tmp_path)
    mpath = os.path.join(path, ckpt.MANIFEST)
    with open(mpath, "rb") as f:
        raw = f.read()
    with open(mpath, "wb") as f:
        f.write(page_bomb(raw))
    with F.arrow_peak() as arrow:
        with pytest.raises(CheckpointCorruptError, match="uncompressed"):
            ckpt.read_manifest(path)
    assert arrow["peak"] < 1 << 20
    F.oracle(path)


def _dictionary_bomb(path: str, rows: int, width: int) -> int:
    """A manifest whose ``file`` column holds one ``width``-byte string on ``rows`` rows
    (dictionary-encoded: stored once). Returns its size."""
    table = pq.read_table(os.path.join(path, ckpt.MANIFEST))
    base = table.to_pylist()[0]
    long_name = ("q" * width)
    new = [dict(base, key=f"p{i}/exp_avg", param=f"p{i}", state="exp_avg", file=long_name)
           for i in range(rows)]
    t = pa.Table.from_pylist(new, schema=table.schema).replace_schema_metadata(
        table.schema.metadata)
    mpath = os.path.join(path, ckpt.MANIFEST)
    pq.write_table(t, mpath)
    return os.path.getsize(mpath)


def test_manifest_dictionary_bomb_is_not_expanded(tmp_path):
    """One 20 KB string on 1000 rows: 20 MB if expanded per row. Strings are read
    dictionary-encoded and shared, so decoding stays within a few MB (Python and pyarrow)."""
    path = _copy(tmp_path)
    size = _dictionary_bomb(path, rows=1000, width=20_000)
    assert size < 100_000
    gc.collect()
    tracemalloc.start()
    try:
        with F.arrow_peak() as arrow:
            with pytest.raises(CheckpointCorruptError, match="bad file name"):
                ckpt.read_manifest(path)
        _, py_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert arrow["peak"] < 4 << 20, arrow
    assert py_peak < 8 << 20, py_peak
    F.oracle(path)


def test_aliased_tensors_are_refused(tmp_path):
    """Fifty manifest rows and header entries on the bytes of one 16 KB tensor: loading
    would allocate 50 times the tensor from a few KB of header; refused as overlapping."""
    path = _copy(tmp_path)

    class Fixed:                    # a stand-in for hypothesis' data: fixed draws
        def draw(self, strategy, label=None):
            return "exp_avg"
    F._alias(path, 50, Fixed())
    store = F._CountingStore()
    with pytest.raises(CheckpointCorruptError, match="overlaps"):
        store.load_checkpoint(path, progress=False)
    assert store.requested == 0 and len(store) == 0
    F.oracle(path)


def test_large_valid_manifest_is_accepted(tmp_path):
    """The bounds leave room for real manifests: 5000 small tensors with long names."""
    path = str(tmp_path / "big")
    with ss.DeviceStore("cpu") as s:
        s.create_many([(f"model.layers.{i}.mlp.down_proj.weight/exp_avg", (2,), torch.float32,
                        None) for i in range(5000)])
        s.save_checkpoint(path, progress=False)
    m = ckpt.read_manifest(path)
    assert len(m.rows) == 5000
    assert os.path.getsize(os.path.join(path, ckpt.MANIFEST)) // len(m.rows) >= 4
    with ss.DeviceStore("cpu") as s:
        s.load_checkpoint(path, progress=False)
        assert len(s) == 5000


PARQUET_VARIANTS = {
    "pages-v2": dict(data_page_version="2.0"), "zstd-22": dict(compression="zstd",
                                                               compression_level=22),
    "gzip": dict(compression="gzip"), "brotli": dict(compression="brotli"),
    "lz4": dict(compression="lz4"), "uncompressed": dict(compression="none"),
    "no-dictionary": dict(use_dictionary=False), "page-index": dict(write_page_index=True),
    "tiny-pages": dict(data_page_size=64), "row-groups-of-7": dict(row_group_size=7),
    "no-statistics": dict(write_statistics=False), "page-crc": dict(write_page_checksum=True),
    "byte-stream-split": dict(use_byte_stream_split=["offset", "nbytes"],
                              use_dictionary=["key"]),
}


@pytest.mark.parametrize("variant", sorted(PARQUET_VARIANTS))
def test_valid_manifest_written_other_ways_is_accepted(variant, tmp_path):
    """The bounds on page headers accept manifests written by other Parquet settings
    (another writer may choose them): same rows, verify finds nothing, load works."""
    path = _copy(tmp_path)
    mpath = os.path.join(path, ckpt.MANIFEST)
    pq.write_table(pq.read_table(mpath), mpath, **PARQUET_VARIANTS[variant])
    assert len(ckpt.read_manifest(path).rows) == len(ckpt.read_manifest(F.template()).rows)
    assert F.oracle(path) == {"manifest_ok": True, "loaded": True}


def test_convert_verifies_checksums_of_empty_tensors(tmp_path):
    """Found by the long run: to_torch_state_dict skipped the checksum of zero-size tensors,
    accepting a manifest that verify_checkpoint and load_checkpoint refuse."""
    path = _copy(tmp_path)
    mpath = os.path.join(path, ckpt.MANIFEST)
    table = pq.read_table(mpath)
    rows = table.to_pylist()
    empty = next(r for r in rows if r["nbytes"] == 0)
    empty["checksum"] = "0123456789abcdef"
    from statestore.checkpoint.digest import sealed
    pq.write_table(sealed(pa.Table.from_pylist(rows, schema=table.schema)
                          .replace_schema_metadata(table.schema.metadata)), mpath)
    from statestore.__main__ import to_torch_state_dict
    with pytest.raises(CheckpointCorruptError, match=repr(empty["key"])):
        to_torch_state_dict(path)
    assert ckpt.verify_checkpoint(path, progress=False)
    F.oracle(path)


def test_damaged_footer_does_not_abort_the_interpreter(tmp_path):
    """Found by the long run: this manifest's footer (a size-statistics histogram of the wrong
    length) made pyarrow's ``RowGroupMetaData.column()`` throw a C++ exception that Cython
    does not catch: ``terminate called``, the interpreter aborted. The bounds check now reads
    the footer itself. Run in a process of its own, since a regression kills the process."""
    path = _copy(tmp_path)
    shutil.copy(os.path.join(paths.DATA,
                             "manifest-abort-size-statistics.parquet"),
                os.path.join(path, ckpt.MANIFEST))
    code = ("import sys\nfrom statestore import checkpoint as c\n"
            "try:\n    c.read_manifest(sys.argv[1])\nexcept c.CheckpointCorruptError as e:\n"
            "    print('refused:', e)\n")
    r = forked.run(code, path)
    assert r.returncode == 0, f"rc={r.returncode}: {r.stderr[-2000:]}"
    assert "refused:" in r.stdout and "manifest.parquet" in r.stdout

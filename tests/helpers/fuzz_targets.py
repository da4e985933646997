"""Fuzz targets of the checkpoint reader, shared by ``tests/reliability/test_fuzz.py`` (bounded, in the
suite) and ``fuzz/fuzz_checkpoint.py`` (long runs).

Each target takes a valid checkpoint (a copy of :func:`template`), damages one part of it with
values drawn from hypothesis (``data.draw``), then runs :func:`oracle`, which calls every
reader of untrusted bytes (``read_manifest``, ``verify_checkpoint``, ``load_checkpoint``,
``statestore inspect`` and ``to_torch_state_dict``) and checks:

* each either succeeds or raises a :class:`~statestore.errors.CheckpointError`; nothing else
  (no ``TypeError``, ``RecursionError``, ``OverflowError``, ``OSError`` ...) escapes;
* ``verify_checkpoint`` and ``load_checkpoint`` agree: load succeeds exactly when verify
  finds no problem; a successful load holds exactly the manifest's tensors, each equal to the
  bytes the manifest points at in its shard (read here independently) with a matching
  checksum; a failed load leaves the store empty;
* **allocation**: the state bytes the loader asks the store for never exceed the total size
  of the checkpoint's files (a manifest claiming huge shapes must be refused first), and
  pyarrow's allocations while decoding the manifest stay within
  ``ARROW_BOUND_FACTOR * size + ARROW_BOUND_SLACK`` (measured with a proxy memory pool);
* **reads**: every read through the checkpoint's filesystem stays inside its file (the
  filesystem is wrapped; a read that asks for bytes past the end fails the example).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import struct
import tempfile
from typing import Any, Callable, Dict, List, Optional

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import xxhash
from hypothesis import strategies as st

import statestore as ss
from statestore import checkpoint as ckpt
from statestore.__main__ import main as cli_main, to_torch_state_dict
from statestore.errors import CheckpointError, StateStoreError
from statestore.optim import CPUAdam

__all__ = ["TARGETS", "template", "oracle", "Violation", "ARROW_BOUND_FACTOR",
           "ARROW_BOUND_SLACK"]

ARROW_BOUND_FACTOR = 256
ARROW_BOUND_SLACK = 1 << 20


class Violation(AssertionError):
    """The reader broke one of the rules of the module docstring."""


# ------------------------------------------------------------------------------ template
_TEMPLATE: Dict[str, str] = {}


def template() -> str:
    """A valid checkpoint (built once per process): CPUAdam metadata, fp32 and bf16
    parameters (fp32 masters), amsgrad states, a scalar and an empty parameter, tensors of
    other dtypes from a bare store, three shards."""
    if "path" in _TEMPLATE:
        return _TEMPLATE["path"]
    root = tempfile.mkdtemp(prefix="statestore-fuzz-template-")
    path = os.path.join(root, "ckpt")
    g = torch.Generator().manual_seed(0)
    named = [("w", torch.nn.Parameter(torch.randn(7, 5, generator=g))),
             ("b", torch.nn.Parameter(torch.randn(9, generator=g).to(torch.bfloat16))),
             ("s", torch.nn.Parameter(torch.randn((), generator=g))),
             ("e", torch.nn.Parameter(torch.randn(0, 3, generator=g)))]
    with ss.DeviceStore("cpu") as s:
        opt = CPUAdam([{"params": named[:2], "lr": 1e-2}, {"params": named[2:]}],
                      amsgrad=True, state_store=s)
        for _ in range(2):
            for _, p in named:
                p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
            opt.step()
        s.create_many([("x/ints", (6,), torch.int64, torch.arange(6)),
                       ("x/flags", (5,), torch.bool, torch.tensor([1, 0, 1, 1, 0]).bool()),
                       ("x/half", (2, 2), torch.float16, torch.ones(2, 2)),
                       ("x/big", (1024, 4), torch.float32, torch.randn(1024, 4, generator=g))])
        meta = s.metadata()
        meta["param_groups"][-1]["params"].append("x")     # so that convert numbers x too
        s.save_checkpoint(path, shard_bytes=200, progress=False, metadata=meta)
    _TEMPLATE["path"] = path
    return path


def fresh_copy(workdir: str) -> str:
    dst = os.path.join(workdir, "ckpt")
    shutil.copytree(template(), dst)
    return dst


# ------------------------------------------------------------------------------ guards
class _GuardFile:
    """A file of the checkpoint, refusing reads that ask for bytes past its end."""

    def __init__(self, f, path: str, size: int, log: List[str]):
        self._f, self._path, self._size, self._log = f, path, size, log

    def _check(self, n: int) -> None:
        pos = self._f.tell()
        if n is not None and n >= 0 and pos + n > self._size:
            self._log.append(f"read of {n} bytes at {pos} in {self._path} of {self._size} bytes")

    def read(self, n: int = -1):
        self._check(n)
        return self._f.read(n)

    def readinto(self, b):
        self._check(len(memoryview(b).cast("B")))
        return self._f.readinto(b)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


class _GuardFS:
    """An fsspec filesystem whose files check every read (see :class:`_GuardFile`)."""

    def __init__(self, fs, log: List[str]):
        self._fs, self._log = fs, log

    def open(self, path, mode="rb", **kw):
        f = self._fs.open(path, mode, **kw)
        if "r" in mode:
            return _GuardFile(f, path, self._fs.size(path), self._log)
        return f

    def __getattr__(self, name):
        return getattr(self._fs, name)


class _CountingStore(ss.DeviceStore):
    """A CPU store counting the state bytes asked of it."""

    def __init__(self):
        super().__init__("cpu")
        self.requested = 0

    def create_many(self, entries):
        entries = list(entries)
        for _, shape, dtype, _ in entries:
            self.requested += ss.StateSpec(tuple(shape), dtype).nbytes
        return super().create_many(entries)


@contextlib.contextmanager
def _guarded_fs(log: List[str]):
    from statestore.checkpoint import manifest as ckpt_manifest
    orig = ckpt_manifest.resolve

    def guarded(path):
        fs, root = orig(path)
        return _GuardFS(fs, log), root
    ckpt_manifest.resolve = guarded
    try:
        yield
    finally:
        ckpt_manifest.resolve = orig


_POOLS: List[Any] = []      # proxy pools must outlive every buffer they allocated


@contextlib.contextmanager
def arrow_peak():
    """Measure pyarrow's peak allocation in the block: yields a dict filled with
    ``{"peak": bytes}`` at exit. Arrow objects made in the block must not outlive it."""
    parent = pa.default_memory_pool()
    pool = pa.proxy_memory_pool(parent)
    _POOLS.append(pool)
    out: Dict[str, int] = {}
    pa.set_memory_pool(pool)
    try:
        yield out
    finally:
        pa.set_memory_pool(parent)
        out["peak"] = pool.max_memory()


def _dir_bytes(path: str) -> int:
    total = 0
    for name in os.listdir(path):
        p = os.path.join(path, name)
        if os.path.isfile(p):
            total += os.path.getsize(p)
    return total


def _expect_checkpoint_error(what: str, fn: Callable[[], Any]):
    """``(result, None)`` or ``(None, CheckpointError)``; anything else is a violation."""
    try:
        return fn(), None
    except CheckpointError as e:
        return None, e
    except StateStoreError as e:
        raise Violation(f"{what}: {type(e).__name__} is not a CheckpointError: {e}") from e
    except Violation:
        raise
    except Exception as e:
        raise Violation(f"{what} raised {type(e).__name__}: {e}") from e


# ------------------------------------------------------------------------------ oracle
def oracle(path: str, *, convert: bool = True) -> Dict[str, Any]:
    """Run every reader on the checkpoint at ``path`` and check the rules of the module
    docstring; raises :class:`Violation`. Returns what happened (for statistics)."""
    reads: List[str] = []
    mpath = os.path.join(path, ckpt.MANIFEST)
    msize = os.path.getsize(mpath) if os.path.isfile(mpath) else 0
    files_bytes = _dir_bytes(path)
    with _guarded_fs(reads):
        with arrow_peak() as arrow:
            m, merr = _expect_checkpoint_error("read_manifest", lambda: ckpt.read_manifest(path))
        if msize and arrow["peak"] > ARROW_BOUND_FACTOR * msize + ARROW_BOUND_SLACK:
            raise Violation(f"decoding a manifest of {msize} bytes allocated {arrow['peak']} "
                            f"bytes in pyarrow")
        try:
            problems = ckpt.verify_checkpoint(path, progress=False)
        except Exception as e:
            raise Violation(f"verify_checkpoint raised {type(e).__name__}: {e}") from e
        if not isinstance(problems, list) or not all(isinstance(p, str) for p in problems):
            raise Violation(f"verify_checkpoint returned {problems!r}")
        store = _CountingStore()
        try:
            _, lerr = _expect_checkpoint_error(
                "load_checkpoint", lambda: store.load_checkpoint(path, progress=False))
            if store.requested > files_bytes:
                raise Violation(f"the loader asked for {store.requested} bytes of states; the "
                                f"checkpoint's files hold {files_bytes}")
            if (lerr is None) != (not problems):
                raise Violation(f"verify and load disagree: verify {problems[:2]}, load {lerr!r}")
            if lerr is not None:
                if len(store) or store.loaded_metadata is not None:
                    raise Violation("a failed load left states in the store")
            else:
                _check_loaded(store, m, path)
        finally:
            store.close()
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            try:
                code = cli_main(["inspect", path])
            except Exception as e:
                raise Violation(f"statestore inspect raised {type(e).__name__}: {e}") from e
        if code != (0 if merr is None else 1):
            raise Violation(f"statestore inspect exited {code}; read_manifest "
                            f"{'failed' if merr else 'succeeded'}")
        if convert and m is not None:
            sd, cerr = _expect_checkpoint_error("to_torch_state_dict",
                                                lambda: to_torch_state_dict(path, verify=True))
            if cerr is None and problems:
                raise Violation(f"to_torch_state_dict accepted a checkpoint verify refuses: "
                                f"{problems[:2]}")
            del sd
    if reads:
        raise Violation(f"reads outside the file: {reads[:3]}")
    return {"manifest_ok": merr is None, "loaded": lerr is None}


def _check_loaded(store, m, path: str) -> None:
    if m is None:
        raise Violation("load succeeded where read_manifest failed")
    want = {r["key"]: r for r in m.rows}
    got = {str(k) for k in store.keys()}
    if got != set(want):
        raise Violation(f"loaded keys {sorted(got)[:5]} differ from the manifest's")
    for key, r in want.items():
        spec = store.spec(key)
        if spec.shape != tuple(r["shape"]) or ss._types.dtype_name(spec.dtype) != r["dtype"]:
            raise Violation(f"tensor {key}: loaded {spec}, manifest says {r['shape']} "
                            f"{r['dtype']}")
        t = store.get(key)
        data = bytes(t.contiguous().view(-1).view(torch.uint8).numpy()) if t.numel() else b""
        with open(os.path.join(path, r["file"]), "rb") as f:
            f.seek(r["offset"])
            raw = f.read(r["nbytes"])
        if data != raw:
            raise Violation(f"tensor {key}: loaded bytes differ from the file's")
        if xxhash.xxh3_64(raw).hexdigest() != r["checksum"]:
            raise Violation(f"tensor {key}: loaded despite a checksum mismatch")


# ------------------------------------------------------------------------------ strategies
def _json_values(max_leaves: int = 12):
    leaves = (st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70)
              | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
    return st.recursive(leaves, lambda kids: st.lists(kids, max_size=4)
                        | st.dictionaries(st.text(max_size=6), kids, max_size=4),
                        max_leaves=max_leaves)


_BIG_INTS = st.sampled_from([0, 1, -1, 7, 63, 64, 4096, 2 ** 31 - 1, 2 ** 31, 2 ** 32,
                             2 ** 40, 2 ** 62, 2 ** 63 - 1, -2 ** 63])
_INTS = _BIG_INTS | st.integers(-2 ** 63, 2 ** 63 - 1) | st.integers(-10, 10_000)
_NAMES = st.sampled_from(["", ".", "..", "../x", "/etc/passwd", "a\x00b", "x" * 300,
                          "manifest.parquet", "sub/dir", "\\evil", "shard", "é", "\udcff"]) \
    | st.text(max_size=20)
_DTYPES = st.sampled_from(["F32", "F16", "BF16", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL",
                           "F8", "", "f32", "complex"]) | st.text(max_size=5)
_SHAPES = st.lists(_INTS, max_size=5) | st.lists(st.integers(0, 3), min_size=60, max_size=70) \
    | st.just([2 ** 40, 2 ** 40]) | st.just([0, 2 ** 62])


def _manifest_rows(path: str) -> pa.Table:
    return pq.read_table(os.path.join(path, ckpt.MANIFEST))


def _write_manifest(path: str, table: pa.Table) -> None:
    # Resealed (the manifest's own checksum recomputed): the checks behind it stay fuzzed.
    from statestore.checkpoint.digest import sealed
    pq.write_table(sealed(table), os.path.join(path, ckpt.MANIFEST))


def _shards(path: str) -> List[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))


# ------------------------------------------------------------------------------ targets
def target_manifest_bytes(data, path: str) -> None:
    """Raw byte damage to manifest.parquet: flips, overwrites, truncation, insertion."""
    mpath = os.path.join(path, ckpt.MANIFEST)
    with open(mpath, "rb") as f:
        b = bytearray(f.read())
    for _ in range(data.draw(st.integers(1, 6), label="n_mutations")):
        op = data.draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete",
                                        "varint"]), label="op")
        i = data.draw(st.integers(0, max(len(b) - 1, 0)), label="at")
        if op == "flip" and b:
            b[i] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set" and b:
            b[i] = data.draw(st.integers(0, 255))
        elif op == "truncate":
            del b[i:]
        elif op == "insert":
            b[i:i] = data.draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del b[i:i + data.draw(st.integers(1, 16))]
        elif op == "varint" and b:        # a large Thrift varint where one byte was
            b[i:i + 1] = bytes([0xFF, 0xFF, 0xFF, 0xFF, 0x0F])
    with open(mpath, "wb") as f:
        f.write(b)


_META_KEYS = ["statestore.format", "statestore.format_version", "statestore.checksum",
              "statestore.metadata", "statestore.save_id", "statestore.version"]


def target_manifest_metadata(data, path: str) -> None:
    """The schema metadata: format fields, and the optimizer metadata JSON (replaced, or
    one of its fields set to an arbitrary JSON value, or the text damaged)."""
    table = _manifest_rows(path)
    meta = {k.decode(): v.decode() for k, v in table.schema.metadata.items()}
    how = data.draw(st.sampled_from(["field", "json-field", "json-replace", "json-text",
                                     "deep"]), label="how")
    if how == "field":
        k = data.draw(st.sampled_from(_META_KEYS), label="key")
        if data.draw(st.booleans(), label="delete"):
            meta.pop(k, None)
        else:
            meta[k] = data.draw(st.text(max_size=20) | st.sampled_from(["1", "2", "0", "01",
                                                                         "xxh3_64"]))
    elif how == "json-field":
        obj = json.loads(meta["statestore.metadata"])
        field = data.draw(st.sampled_from(["steps", "params", "param_groups", "optimizer",
                                           "version"]), label="field")
        sub = data.draw(st.sampled_from(["replace", "inner"]), label="sub")
        if sub == "replace" or not isinstance(obj.get(field), (dict, list)) or not obj[field]:
            obj[field] = data.draw(_json_values(), label="value")
        else:
            container = obj[field]
            if isinstance(container, dict):
                k = data.draw(st.sampled_from(sorted(container)), label="inner key")
            else:
                k = data.draw(st.integers(0, len(container) - 1), label="inner index")
            inner = container[k]
            if isinstance(inner, dict) and inner and data.draw(st.booleans()):
                inner[data.draw(st.sampled_from(sorted(inner)))] = data.draw(_json_values())
            else:
                container[k] = data.draw(_json_values(), label="inner value")
        meta["statestore.metadata"] = json.dumps(obj)
    elif how == "json-replace":
        meta["statestore.metadata"] = json.dumps(data.draw(_json_values(20)))
    elif how == "json-text":
        text = meta["statestore.metadata"]
        i = data.draw(st.integers(0, len(text)), label="at")
        meta["statestore.metadata"] = text[:i] + data.draw(st.text(max_size=5)) + \
            text[i + data.draw(st.integers(0, 5)):]
    else:
        depth = data.draw(st.sampled_from([900, 5000, 100_000]), label="depth")
        meta["statestore.metadata"] = "[" * depth + "]" * depth
    _write_manifest(path, table.replace_schema_metadata(meta))


_COLUMN_VALUES = {"key": st.text(max_size=10) | _NAMES, "param": st.text(max_size=10),
                  "state": st.text(max_size=10), "file": _NAMES, "offset": _INTS,
                  "nbytes": _INTS, "shape": _SHAPES, "dtype": _DTYPES,
                  "checksum": st.text(max_size=16)}


def target_manifest_rows(data, path: str) -> None:
    """Manifest rows: fields set to hostile values of the right type (huge offsets, nbytes
    and shapes, ``../`` and absolute file names, unknown dtypes), consistent huge tensors,
    rows dropped, duplicated or mixed; or the schema changed (columns dropped, retyped,
    duplicated)."""
    table = _manifest_rows(path)
    meta = table.schema.metadata
    rows = table.to_pylist()
    how = data.draw(st.sampled_from(["fields", "huge", "drop", "dup", "swap", "schema",
                                     "nulls", "many", "alias"]), label="how")
    if how == "fields":
        for _ in range(data.draw(st.integers(1, 4))):
            r = data.draw(st.integers(0, len(rows) - 1), label="row")
            col = data.draw(st.sampled_from(sorted(_COLUMN_VALUES)), label="column")
            rows[r][col] = data.draw(_COLUMN_VALUES[col], label="value")
    elif how == "huge":                  # self-consistent manifest claims of a huge tensor
        r = data.draw(st.integers(0, len(rows) - 1), label="row")
        n = data.draw(st.sampled_from([2 ** 20, 2 ** 30, 2 ** 40, 2 ** 60 // 4]), label="numel")
        rows[r]["shape"], rows[r]["dtype"], rows[r]["nbytes"] = [n], "F32", 4 * n
    elif how == "drop":
        del rows[data.draw(st.integers(0, len(rows) - 1))]
    elif how == "dup":
        rows.append(dict(rows[data.draw(st.integers(0, len(rows) - 1))]))
    elif how == "swap":
        a, b = (data.draw(st.integers(0, len(rows) - 1)) for _ in range(2))
        col = data.draw(st.sampled_from(sorted(_COLUMN_VALUES)))
        rows[a][col], rows[b][col] = rows[b][col], rows[a][col]
    elif how == "nulls":
        r = data.draw(st.integers(0, len(rows) - 1))
        col = data.draw(st.sampled_from(sorted(_COLUMN_VALUES)))
        rows[r][col] = None if col != "shape" or data.draw(st.booleans()) else [None, 2]
    elif how == "many":                  # many rows, absent from the shard headers
        k = data.draw(st.integers(2, 200), label="copies")
        base = rows[0]
        rows += [dict(base, key=f"{base['param']}{i}/{base['state']}",
                      param=f"{base['param']}{i}") for i in range(k)]
    elif how == "alias":                 # many tensors on the same bytes, headers agreeing
        _alias(path, data.draw(st.integers(1, 60), label="aliases"), data)
        return
    if how == "schema":
        cols = {n: table.column(n) for n in table.column_names}
        op = data.draw(st.sampled_from(["drop", "retype", "dup", "extra"]), label="schema op")
        name = data.draw(st.sampled_from(sorted(cols)), label="column")
        arrays = list(cols.values())
        names = list(cols)
        i = names.index(name)
        if op == "drop":
            del arrays[i], names[i]
        elif op == "retype":
            arrays[i] = pa.array([json.dumps(v) for v in cols[name].to_pylist()]) \
                if data.draw(st.booleans()) else pa.array([len(str(v)) for v in
                                                           cols[name].to_pylist()])
        elif op == "dup":
            arrays.append(arrays[i])
            names.append(name)
        else:
            arrays.append(pa.array([data.draw(st.integers(-5, 5))] * len(table)))
            names.append("extra")
        new = pa.Table.from_arrays(arrays, names=names)
    else:
        try:
            new = pa.Table.from_pylist(rows, schema=table.schema)
        except (pa.ArrowException, OverflowError, TypeError, ValueError):
            return                        # not representable: nothing to test
    _write_manifest(path, new.replace_schema_metadata(meta))


def _alias(path: str, k: int, data) -> None:
    """``k`` more tensors listed in the manifest AND the shard header at the bytes of the
    largest tensor (offsets re-based for the larger header): a loader that allowed
    overlapping tensors would allocate ``k`` times the tensor's size from a few bytes of
    header each."""
    table = _manifest_rows(path)
    rows = table.to_pylist()
    base = max(rows, key=lambda r: r["nbytes"])
    p = os.path.join(path, base["file"])
    with open(p, "rb") as f:
        b = f.read()
    (n,) = struct.unpack("<Q", b[:8])
    header = json.loads(b[8:8 + n])
    entry = header[base["key"]]
    state = data.draw(st.sampled_from(["exp_avg", "copy"]), label="alias state")
    for i in range(k):
        header[f"alias{i}/{state}"] = dict(entry)
    raw = json.dumps(header).encode()
    raw += b" " * ((-(8 + len(raw))) % 8)
    delta = len(raw) - n
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b[8 + n:])
    for r in rows:
        if r["file"] == base["file"]:
            r["offset"] += delta          # base included
    rows += [dict(base, key=f"alias{i}/{state}", param=f"alias{i}", state=state)
             for i in range(k)]
    _write_manifest(path, pa.Table.from_pylist(rows, schema=table.schema)
                    .replace_schema_metadata(table.schema.metadata))


def target_shard_header(data, path: str) -> None:
    """A shard's safetensors header: the length prefix, the JSON (an entry's dtype, shape or
    data_offsets set to arbitrary JSON, entries removed, the whole header replaced, deep
    nesting), or raw bytes of the header region."""
    name = data.draw(st.sampled_from(_shards(path)), label="shard")
    p = os.path.join(path, name)
    with open(p, "rb") as f:
        b = bytearray(f.read())
    (n,) = struct.unpack("<Q", b[:8])
    header = json.loads(bytes(b[8:8 + n]))
    body = b[8 + n:]
    how = data.draw(st.sampled_from(["prefix", "entry", "remove", "replace", "deep", "raw",
                                     "offsets"]), label="how")
    if how == "prefix":
        new_n = data.draw(st.sampled_from([0, 1, 7, n - 1, n + 1, len(b), len(b) - 8,
                                           2 ** 63, 2 ** 64 - 1]) | st.integers(0, 2 ** 64 - 1))
        b[:8] = struct.pack("<Q", new_n % 2 ** 64)
    elif how in ("entry", "remove", "offsets"):
        keys = sorted(k for k in header if k != "__metadata__")
        k = data.draw(st.sampled_from(keys), label="tensor")
        if how == "remove":
            del header[k]
        elif how == "offsets":
            header[k]["data_offsets"] = data.draw(
                st.lists(_INTS | st.floats() | st.text(max_size=3), max_size=3), label="offsets")
        else:
            field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))
            header[k][field] = data.draw(_json_values(), label="value")
        b = _pack(header, body, n, data)
    elif how == "replace":
        b = _pack(data.draw(_json_values(16), label="header"), body, n, data)
    elif how == "deep":
        raw = b"[" * 50_000 + b"]" * 50_000
        b = bytearray(struct.pack("<Q", len(raw)) + raw + body)
    else:
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, 8 + n - 1))
            b[i] = data.draw(st.integers(0, 255))
    with open(p, "wb") as f:
        f.write(b)


def _pack(header, body: bytes, n: int, data) -> bytearray:
    raw = json.dumps(header).encode()
    if data.draw(st.booleans(), label="keep header size") and len(raw) <= n:
        raw = raw.ljust(n)             # data keeps its offsets
    return bytearray(struct.pack("<Q", len(raw)) + raw + body)


def target_shard_bytes(data, path: str) -> None:
    """A shard truncated, extended or with flipped data bytes; or a shard removed."""
    name = data.draw(st.sampled_from(_shards(path)), label="shard")
    p = os.path.join(path, name)
    with open(p, "rb") as f:
        b = bytearray(f.read())
    how = data.draw(st.sampled_from(["truncate", "extend", "flip", "remove", "empty"]))
    if how == "truncate":
        del b[data.draw(st.integers(0, len(b) - 1)):]
    elif how == "extend":
        b += data.draw(st.binary(min_size=1, max_size=64))
    elif how == "flip":
        i = data.draw(st.integers(0, len(b) - 1))
        b[i] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "empty":
        b = bytearray()
    if how == "remove":
        os.unlink(p)
        return
    with open(p, "wb") as f:
        f.write(b)


TARGETS: Dict[str, Callable[[Any, str], None]] = {
    "manifest_bytes": target_manifest_bytes,
    "manifest_metadata": target_manifest_metadata,
    "manifest_rows": target_manifest_rows,
    "shard_header": target_shard_header,
    "shard_bytes": target_shard_bytes,
}


def run_target(name: str, data, *, convert: bool = True,
               keep: Optional[str] = None) -> Dict[str, Any]:
    """One example of target ``name``: a fresh copy of the template, damaged, checked.
    ``keep``: copy the damaged checkpoint there first (replacing it), so that an example
    that aborts the interpreter can be replayed."""
    with tempfile.TemporaryDirectory(prefix="statestore-fuzz-") as work:
        path = fresh_copy(work)
        TARGETS[name](data, path)
        if keep is not None:
            shutil.rmtree(keep, ignore_errors=True)
            shutil.copytree(path, keep)
        return oracle(path, convert=convert)

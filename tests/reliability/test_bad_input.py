"""The bad input table of ``docs/errors.md``: one parametrized test per row.

``ROWS`` is the table: each row names what is passed (``input``), the exception expected
(a class, ``Exit(code)`` for the CLI, or ``ACCEPTED`` where the input is valid and the test
checks the result instead) and the words its message must contain (the argument, file or
tensor at fault; ``{name}`` placeholders are filled from the row's context, e.g. the
temporary path it used). Rows marked ``per_backend`` run on every store of
``helpers.stores.BACKENDS``. ``test_docs_table_matches_rows`` keeps ``docs/errors.md`` and this list
in step: every row id is in the doc's table with the same exception, and nothing else is.

Everything runs in this process: an input that crashed the interpreter would end the run.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

import statestore as ss
from statestore import Slice, StateKey
from statestore import checkpoint as ckpt
from statestore.__main__ import main as cli_main
from statestore.distributed import partition
from statestore.errors import (CheckpointCorruptError, CheckpointError, CheckpointMismatchError,
                               CheckpointNotFoundError, StateKeyError, StateStoreClosedError,
                               StateStoreError, StateStoreIOError, StateStoreValueError)
from statestore.optim import CPUAdam, HybridAdam

from helpers import paths
from helpers.parquet_bytes import page_bomb
from helpers.stores import BACKEND_NAMES, make_store, wait_for_prefetch

DOC = os.path.join(paths.ROOT, "docs", "errors.md")
K = StateKey


# ============================================================================ the row type
@dataclass(frozen=True)
class Exit:
    """The CLI exits with ``code``; the words must be in its stderr."""
    code: int

    @property
    def __name__(self) -> str:            # the doc table's exception column
        return f"exit {self.code}"


class _Accepted:
    """Valid input: no exception; the row's function checks the result itself."""
    __name__ = "accepted"


ACCEPTED = _Accepted()


@dataclass(frozen=True)
class Row:
    id: str
    input: str
    exc: Any
    words: Tuple[str, ...]
    run: Callable[["Ctx"], Any]
    per_backend: bool = False
    skip: Optional[Callable[[], Optional[str]]] = None   # returns a reason to skip, or None


# ============================================================================ context
class Ctx:
    """What a row needs: a temporary directory, the backend under test, helpers; ``vars``
    fills the ``{placeholders}`` of the row's words."""

    def __init__(self, tmp_path, backend: str = "device-cpu"):
        self.tmp = tmp_path
        self.backend = backend
        self.vars: Dict[str, str] = {"tmp": str(tmp_path)}
        self._cleanup: List[Callable[[], None]] = []
        self._n = 0

    def new_store(self) -> ss.StateStore:
        self._n += 1
        d = self.tmp / f"store{self._n}"
        d.mkdir()
        s = make_store(self.backend, d)
        self._cleanup.append(lambda: _close_quietly(s))
        return s

    def path(self, name: str) -> str:
        p = str(self.tmp / name)
        self.vars[name] = p
        return p

    def a_file(self) -> str:
        p = self.path("afile")
        with open(p, "w") as f:
            f.write("not a directory")
        return p

    def readonly_dir(self) -> str:
        """A directory nobody may write into, this process included: ``chmod 555`` for a
        normal user, ``chattr +i`` (immutable) for root, who ignores permission bits.
        Skips the row where neither takes effect."""
        p = self.path("readonly")
        os.mkdir(p)
        if os.geteuid() == 0:
            r = subprocess.run(["chattr", "+i", p], capture_output=True, text=True) \
                if shutil.which("chattr") else None
            if r is None or r.returncode != 0:
                pytest.skip("running as root and chattr +i is unavailable here: no directory "
                            "is read-only to this process")
            self._cleanup.append(lambda: subprocess.run(["chattr", "-i", p], check=True))
        else:
            os.chmod(p, 0o555)
            self._cleanup.append(lambda: os.chmod(p, 0o755))
        try:
            fd = os.open(os.path.join(p, "probe"), os.O_CREAT | os.O_WRONLY, 0o644)
        except OSError:
            return p
        os.close(fd)
        os.unlink(os.path.join(p, "probe"))
        pytest.skip("could not make a directory read-only here")

    def checkpoint(self, name: str = "ckpt", dtype=torch.float32, names=("a", "b"),
                   shapes=((4, 3), (5,)), shard_bytes: int = 4096) -> str:
        """A checkpoint of a CPUAdam over ``names`` after one step, saved from a CPU store."""
        path = self.path(name)
        params = [(n, nn.Parameter(torch.randn(*s).to(dtype))) for n, s in zip(names, shapes)]
        with ss.DeviceStore("cpu") as s:
            opt = CPUAdam(params, state_store=s)
            for _, p in params:
                p.grad = torch.randn(p.shape).to(dtype)
            opt.step()
            s.save_checkpoint(path, shard_bytes=shard_bytes, progress=False)
        m = ckpt.read_manifest(path)
        r = m.rows[0]
        self.vars.update(shard=os.path.join(path, r["file"]), key=r["key"],
                         manifest=os.path.join(path, "manifest.parquet"))
        return path

    def states_checkpoint(self, entries, metadata=None, name="sckpt") -> str:
        """A checkpoint of a bare store holding ``entries`` (create_many's arguments)."""
        path = self.path(name)
        with ss.DeviceStore("cpu") as s:
            s.create_many(entries)
            s.save_checkpoint(path, metadata=metadata, progress=False)
        return path

    def close(self) -> None:
        for f in reversed(self._cleanup):
            f()
        self._cleanup = []


def _close_quietly(s) -> None:
    try:
        s.close()
    except StateStoreError:
        pass


def _param(*shape, dtype=torch.float32) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape).to(dtype))


def _rewrite_manifest(path: str, rows_fn=None, meta_fn=None) -> None:
    mpath = os.path.join(path, "manifest.parquet")
    table = pq.read_table(mpath)
    meta = dict(table.schema.metadata)
    if rows_fn is not None:
        table = pa.Table.from_pylist(rows_fn(table.to_pylist()), schema=table.schema)
    if meta_fn is not None:
        meta_fn(meta)
    # Resealed: the manifest's own checksum is recomputed, so each row reaches the check it
    # is about (an altered manifest that is not resealed is refused by its checksum).
    from statestore.checkpoint.digest import sealed
    pq.write_table(sealed(table.replace_schema_metadata(meta)), mpath)


def _set_metadata(path: str, meta_obj) -> None:
    def f(meta):
        meta[b"statestore.metadata"] = json.dumps(meta_obj).encode()
    _rewrite_manifest(path, meta_fn=f)


def _edit_bytes(p: str, fn) -> None:
    with open(p, "rb") as f:
        data = bytearray(f.read())
    data = fn(data)
    with open(p, "wb") as f:
        f.write(data)


def _step(opt, params, grads=None) -> None:
    for i, p in enumerate(params):
        p.grad = grads[i] if grads is not None else torch.randn(p.shape).to(p.dtype)
    opt.step()


def _cli(*argv) -> Tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli_main(list(argv))
        except SystemExit as e:        # argparse usage errors
            code = e.code
    return code, err.getvalue()


class _KeyedEngine(ss.io.IOEngine):
    """An engine that does not write at the offsets asked (as TensorNVMe's keyed bytes)."""
    name = "keyed"
    writes_in_place = False

    def _submit(self, *a):      # pragma: no cover - never reached
        raise AssertionError("a keyed engine got a (file, offset) request")

    def _close(self):
        pass


def _no_tensornvme() -> Optional[str]:
    reason = ss.io.probe_engine("tensornvme")
    return None if reason is None else f"tensornvme: {reason}"


def _no_cuda() -> Optional[str]:
    return "CUDA is available here" if torch.cuda.is_available() else None


def _missing_fsspec_protocol() -> Optional[str]:
    """A protocol fsspec knows whose implementation is not installed here (None if all are);
    s3 or gcs where possible."""
    import importlib.util
    from fsspec.registry import known_implementations
    order = ["s3", "gcs", "abfs"] + sorted(known_implementations)
    for proto in order:
        spec = known_implementations.get(proto, {})
        mod = spec.get("class", "").split(".")[0]
        if mod and "err" in spec and importlib.util.find_spec(mod) is None:
            return proto
    return None


class OtherDeviceGrad(nn.Parameter):
    """A parameter reporting its gradient on another device. torch refuses to assign such a
    gradient (``p.grad = t`` checks the device, and ``p.grad.data = t`` needs compatible
    tensor types), so without CUDA this stands in for a parameter on one device and its
    gradient on another: the optimizer sees exactly what it would see with CUDA."""

    @property
    def grad(self):
        return self.__dict__.get("_other_grad")

    @grad.setter
    def grad(self, v):
        self.__dict__["_other_grad"] = v


def _grad_on_other_device(ctx):
    """With CUDA: a CPU parameter whose gradient's data was moved to the GPU; without (or
    where torch refuses that), the :class:`OtherDeviceGrad` stand-in with a meta gradient."""
    store = ctx.new_store()
    if torch.cuda.is_available():
        w = _param(4)
        opt = CPUAdam([("w", w)], state_store=store)
        w.grad = torch.randn(4)
        try:
            w.grad.data = torch.randn(4, device="cuda")
            ctx.vars["other"] = "cuda"
            opt.step()
            return
        except RuntimeError as e:
            if "set_data" not in str(e) and "incompatible" not in str(e):
                raise
    w = OtherDeviceGrad(torch.randn(4))
    opt = CPUAdam([("w", w)], state_store=store)
    w.grad = torch.empty(4, device="meta")
    ctx.vars["other"] = "meta"
    opt.step()


def _stepped(ctx):
    """An optimizer whose parameter has a gradient (a step would change it)."""
    w = _param(4)
    w.grad = torch.ones(4)
    return CPUAdam([w], state_store=ctx.new_store())


def _in_backward_misuse(ctx, what):
    """update_in_backward: a second backward before step(), a gradient clipped after
    backward applied it, or step(div_scale=...)."""
    store = ctx.new_store()
    w = _param(4)
    opt = CPUAdam([("w", w)], state_store=store, update_in_backward=True)
    (w * w).sum().backward()
    if what == "second-backward":
        (w * w).sum().backward()
    opt.step()
    if what == "div-scale":
        opt.zero_grad()
        (w * w).sum().backward()
        opt.step(div_scale=2.0)
    if what == "clipped":
        opt.zero_grad()
        store.sync()        # the prefetch arrives before backward ends, so the hook updates
        store.pump()
        wait_for_prefetch(store)
        (w * w).sum().backward()
        w.grad.mul_(0.5)
        opt.step()




def _grad_changed(ctx, new):
    """A gradient whose shape or dtype differs from the parameter's (``.data`` bypasses the
    setter's checks, as code that swaps tensors in place does)."""
    store = ctx.new_store()
    w = _param(4)
    opt = CPUAdam([("w", w)], state_store=store)
    w.grad = torch.randn(4)
    w.grad.data = new
    opt.step()


def _noncontiguous_grad_matches_torch(ctx):
    store = ctx.new_store()
    w = _param(5, 3)
    ref = nn.Parameter(w.detach().clone())
    opt = CPUAdam([w], state_store=store, weight_decay=0.01)
    topt = torch.optim.AdamW([ref], weight_decay=0.01, foreach=False)
    for _ in range(3):
        g = torch.randn(3, 5).t()                  # a transposed view: not contiguous
        assert not g.is_contiguous()
        w.grad, ref.grad = g, g.clone()
        opt.step()
        topt.step()
    torch.testing.assert_close(w.detach(), ref.detach(), rtol=1e-5, atol=1e-6)


def _group_added_after_states(ctx):
    """add_param_group after a step created states: new parameters start fresh, old ones
    keep theirs; the result equals torch.optim.AdamW doing the same."""
    store = ctx.new_store()
    a, b = _param(6), _param(4, 2)
    ra, rb = nn.Parameter(a.detach().clone()), nn.Parameter(b.detach().clone())
    opt = CPUAdam([a], state_store=store, lr=1e-2)
    topt = torch.optim.AdamW([ra], lr=1e-2, weight_decay=0.0, foreach=False)
    g = torch.Generator().manual_seed(3)
    for step in range(4):
        if step == 2:
            opt.add_param_group({"params": [b], "lr": 3e-3})
            topt.add_param_group({"params": [rb], "lr": 3e-3})
            assert K("0", "exp_avg") in store and K("1", "exp_avg") not in store
        params, refs = ([a], [ra]) if step < 2 else ([a, b], [ra, rb])
        for p, r in zip(params, refs):
            p.grad = torch.randn(p.shape, generator=g)
            r.grad = p.grad.clone()
        opt.step()
        topt.step()
    assert opt._steps == {"0": 4, "1": 2}
    for p, r in zip((a, b), (ra, rb)):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-5, atol=1e-6)


def _add_group_fails(ctx, opt_params, group):
    """add_param_group raises, and the optimizer is left as it was (still steps)."""
    store = ctx.new_store()
    opt = CPUAdam(opt_params, state_store=store)
    before = (len(opt.param_groups), dict(opt._keys))
    try:
        opt.add_param_group(group)
    finally:
        assert (len(opt.param_groups), dict(opt._keys)) == before, "the bad group stayed"
        _step(opt, [p for g in opt.param_groups for p in g["params"]])


def _add_group_with_process_group(ctx):
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{ctx.tmp}/pg-init", rank=0,
                            world_size=1)
    try:
        opt = CPUAdam([_param(3)], state_store=ctx.new_store(), process_group=dist.group.WORLD)
        try:
            opt.add_param_group({"params": [_param(2)]})
        finally:
            assert len(opt.param_groups) == 1
    finally:
        dist.destroy_process_group()


def _lsd(ctx, mutate, n_params: int = 2):
    """load_state_dict of a mutated state dict: raises, and nothing changed."""
    store = ctx.new_store()
    params = [_param(4), _param(3)][:n_params]
    opt = CPUAdam(params, state_store=store)
    _step(opt, params)
    sd = opt.state_dict()
    sd = {"state": {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
                    for i, st in sd["state"].items()},
          "param_groups": [dict(g) for g in sd["param_groups"]]}
    before = {str(k): store.get(k).clone() for k in store.keys()}
    lrs = [g["lr"] for g in opt.param_groups]
    for st in sd["state"].values():               # a change a half-applied load would show
        st["exp_avg"] = st["exp_avg"] + 1
    sd["param_groups"][0]["lr"] = 0.5
    mutate(sd)
    try:
        opt.load_state_dict(sd)
    finally:
        assert [g["lr"] for g in opt.param_groups] == lrs, "hyperparameters changed"
        assert sorted(before) == sorted(str(k) for k in store.keys())
        for k, v in before.items():
            assert torch.equal(store.get(k).cpu(), v.cpu()), f"state {k} changed"


def _resume(ctx, path, params):
    store = ctx.new_store()
    store.load_checkpoint(path, progress=False)
    CPUAdam(params, state_store=store)


# ============================================================================ the table
def _stores() -> List[Row]:
    return [
        Row("device-bad-device", 'DeviceStore("bogus")', StateStoreValueError, ("bogus",),
            lambda c: ss.DeviceStore("bogus")),
        Row("device-none", "DeviceStore(None)", StateStoreValueError, ("device", "None"),
            lambda c: ss.DeviceStore(None)),
        Row("device-meta", 'DeviceStore("meta")', StateStoreValueError, ("meta",),
            lambda c: ss.DeviceStore("meta")),
        Row("device-cuda-absent", 'DeviceStore("cuda") without CUDA', StateStoreValueError,
            ("cuda", "not available"), lambda c: ss.DeviceStore("cuda"), skip=_no_cuda),
        Row("device-cuda-index", 'DeviceStore("cuda:99")', StateStoreValueError, ("99",),
            lambda c: ss.DeviceStore("cuda:99")),
        Row("store-budget-type", 'DeviceStore("cpu", budget_bytes="1M")', StateStoreValueError,
            ("budget_bytes", "'1M'"), lambda c: ss.DeviceStore("cpu", budget_bytes="1M")),
        Row("store-budget-zero", "PinnedCPUStore(budget_bytes=0)", StateStoreValueError,
            ("budget_bytes",), lambda c: ss.PinnedCPUStore(budget_bytes=0)),
        Row("store-unknown-kwarg", "PinnedCPUStore(bogus=1)", TypeError, ("bogus",),
            lambda c: ss.PinnedCPUStore(bogus=1)),
        Row("file-dir-type", "FileStore(123)", StateStoreValueError, ("dir", "123"),
            lambda c: ss.FileStore(123)),
        Row("file-dir-is-file", "FileStore(a file)", StateStoreValueError,
            ("{afile}", "not a directory"), lambda c: ss.FileStore(c.a_file())),
        Row("file-dir-readonly", "FileStore(read-only dir)", StateStoreIOError,
            ("{readonly}", "not writable"), lambda c: ss.FileStore(c.readonly_dir())),
        Row("file-dir-uncreatable", "FileStore(read-only dir/sub)", StateStoreIOError,
            ("{readonly}/sub",), lambda c: ss.FileStore(c.readonly_dir() + "/sub")),
        Row("nvme-dir-is-file", "NVMeStore(a file)", StateStoreValueError,
            ("{afile}", "not a directory"), lambda c: ss.NVMeStore(c.a_file())),
        Row("nvme-dir-readonly", "NVMeStore(read-only dir)", StateStoreIOError,
            ("{readonly}", "not writable"), lambda c: ss.NVMeStore(c.readonly_dir())),
        Row("nvme-engine-unknown", 'NVMeStore(engine="bogus")', StateStoreValueError,
            ("engine", "bogus"), lambda c: ss.NVMeStore(c.path("n"), engine="bogus")),
        Row("nvme-engine-type", "NVMeStore(engine=1)", StateStoreValueError, ("engine",),
            lambda c: ss.NVMeStore(c.path("n"), engine=1)),
        Row("nvme-queue-depth", "NVMeStore(queue_depth=0)", StateStoreValueError,
            ("queue_depth",), lambda c: ss.NVMeStore(c.path("n"), queue_depth=0)),
        Row("nvme-block-size", "NVMeStore(block_size=1000)", StateStoreValueError,
            ("block_size", "1000"), lambda c: ss.NVMeStore(c.path("n"), block_size=1000)),
        Row("nvme-io-threads", 'NVMeStore(io_threads="8")', StateStoreValueError,
            ("io_threads",), lambda c: ss.NVMeStore(c.path("n"), io_threads="8")),
        Row("nvme-budget-small", "NVMeStore(budget_bytes=100)", StateStoreValueError,
            ("budget_bytes", "100"), lambda c: ss.NVMeStore(c.path("n"), budget_bytes=100)),
        Row("nvme-direct", 'NVMeStore(direct="yes")', StateStoreValueError, ("direct",),
            lambda c: ss.NVMeStore(c.path("n"), direct="yes")),
        Row("nvme-engine-keyed", "NVMeStore(engine=an IOEngine with writes_in_place=False)",
            StateStoreValueError, ("does not write in place", "TensorNVMeStore"),
            lambda c: ss.NVMeStore(c.path("n"), engine=_KeyedEngine())),
        Row("nvme-engine-tensornvme", 'NVMeStore(engine="tensornvme")',
            StateStoreValueError, ("cannot write NVMeStore's files", "TensorNVMeStore(dir)"),
            lambda c: ss.NVMeStore(c.path("n"), engine="tensornvme")),
        Row("tensornvme-direct", 'nvme_store(engine="tensornvme", direct=True)',
            StateStoreValueError, ("direct", "O_DIRECT"),
            lambda c: ss.backends.nvme_store(c.path("n"), engine="tensornvme", direct=True),
            skip=_no_tensornvme),
        Row("tensornvme-keep-files", 'nvme_store(engine="tensornvme", keep_files=True)',
            StateStoreValueError, ("keep_files",),
            lambda c: ss.backends.nvme_store(c.path("n"), engine="tensornvme", keep_files=True),
            skip=_no_tensornvme),
        Row("store-unknown-name", 'make_store("nvm")', StateStoreValueError,
            ("nvm", "known", "nvme"), lambda c: ss.backends.make_store("nvm")),
        Row("tensornvme-block-bytes", "TensorNVMeStore(block_bytes=5000)", StateStoreValueError,
            ("block_bytes", "5000"), lambda c: ss.TensorNVMeStore(c.path("n"), block_bytes=5000),
            skip=_no_tensornvme),
        Row("io-make-engine-tensornvme", 'statestore.io.make_engine("tensornvme")',
            StateStoreValueError, ("keyed", "TensorNVMeStore"),
            lambda c: ss.io.make_engine("tensornvme")),
        Row("tiered-not-sequence", "TieredStore(None)", StateStoreValueError, ("tiers",),
            lambda c: ss.TieredStore(None)),
        Row("tiered-empty", "TieredStore([])", StateStoreValueError, ("tiers",),
            lambda c: ss.TieredStore([])),
        Row("tiered-not-store", "TieredStore([(object(), 1.0)])", StateStoreValueError,
            ("tiers[0]", "StateStore"), lambda c: ss.TieredStore([(object(), 1.0)])),
        Row("tiered-fraction", "TieredStore([(store, 1.5)])", StateStoreValueError,
            ("tiers[0]", "fraction", "1.5"),
            lambda c: ss.TieredStore([(ss.DeviceStore("cpu"), 1.5)])),
        Row("tiered-sum", "fractions summing to 0.8", StateStoreValueError, ("sum to 1", "0.8"),
            lambda c: ss.TieredStore([(ss.DeviceStore("cpu"), 0.5),
                                      (ss.DeviceStore("cpu"), 0.3)])),
        Row("tiered-nested", "a TieredStore as a tier", StateStoreValueError, ("tiers[0]",),
            lambda c: ss.TieredStore([(ss.TieredStore([(ss.DeviceStore("cpu"), 1.0)]), 1.0)])),
        Row("tiered-nonempty", "a tier that holds states", StateStoreValueError,
            ("tiers[1]", "empty"), lambda c: _tiered_nonempty()),
        Row("tiered-duplicate", "the same store twice", StateStoreValueError, ("twice",),
            lambda c: _tiered_twice()),
        Row("tiered-closed", "a closed store as a tier", StateStoreClosedError,
            ("tiers[0]", "closed"), lambda c: _tiered_closed()),
        Row("tiered-device", 'TieredStore(tiers, device="bogus")', StateStoreValueError,
            ("device", "bogus"),
            lambda c: ss.TieredStore([(ss.DeviceStore("cpu"), 1.0)], device="bogus")),
        Row("tiered-tier-of-unknown", 'TieredStore.tier_of("b/m")', StateKeyError, ("b/m",),
            lambda c: ss.TieredStore([(ss.DeviceStore("cpu"), 1.0)]).tier_of("b/m")),
        Row("nvme-location-unknown", 'NVMeStore.location("b/m")', StateKeyError, ("b/m",),
            lambda c: ss.NVMeStore(c.path("n")).location("b/m")),
        Row("from-fraction-range", "TieredStore.from_fraction(1.5)", StateStoreValueError,
            ("fraction", "1.5"), lambda c: ss.TieredStore.from_fraction(1.5)),
        Row("from-fraction-ram-store", "from_fraction(0.5, ram_store=1)",
            StateStoreValueError, ("ram_store",),
            lambda c: ss.TieredStore.from_fraction(0.5, c.path("t"), ram_store=1)),
        Row("from-fraction-dir-file", "from_fraction(0.5, a file)", StateStoreValueError,
            ("{afile}",), lambda c: ss.TieredStore.from_fraction(0.5, c.a_file())),
        Row("from-fraction-kwarg", "from_fraction(0.5, bogus=1)", TypeError, ("bogus",),
            lambda c: ss.TieredStore.from_fraction(0.5, c.path("t"), bogus=1)),
    ]


def _tiered_nonempty():
    full = ss.DeviceStore("cpu")
    full.create("a/m", (2,))
    return ss.TieredStore([(ss.DeviceStore("cpu"), 0.5), (full, 0.5)])


def _tiered_twice():
    s = ss.DeviceStore("cpu")
    return ss.TieredStore([(s, 0.5), (s, 0.5)])


def _tiered_closed():
    s = ss.DeviceStore("cpu")
    s.close()
    return ss.TieredStore([(s, 1.0)])


def _with_state(c, shape=(2, 3)):
    s = c.new_store()
    s.create("a/m", shape)
    return s


def _short(f, *args):
    """``f(*args)``, checking that the error it raises has a bounded message."""
    try:
        f(*args)
    except ss.StateStoreError as e:
        assert len(str(e)) < 1000, f"a {len(str(e))}-character message"
        raise


def _closed(c):
    s = c.new_store()
    s.close()
    c.vars["cls"] = type(s).__name__
    return s


def _closed_ops(c):
    """Every operation on a closed store raises StateStoreClosedError; the last one is the
    row's."""
    s = _closed(c)
    ops = [lambda: s.create("a/m", (2,)), lambda: s.put("a/m", torch.zeros(2)),
           lambda: s.pipeline([]), lambda: s.delete([]), lambda: s.clear(),
           lambda: s.load_checkpoint(c.path("none")), lambda: s.__enter__()]
    for op in ops:
        with pytest.raises(StateStoreClosedError):
            op()
    s.save_checkpoint(c.path("c"))


def _store_methods() -> List[Row]:
    a = K("a", "m")
    return [
        Row("create-negative-dim", 'create("a/m", (-1, 2))', StateStoreValueError,
            ("a/m", "negative"), lambda c: c.new_store().create("a/m", (-1, 2)), True),
        Row("create-shape-type", 'create("a/m", None)', StateStoreValueError, ("a/m", "shape"),
            lambda c: c.new_store().create("a/m", None), True),
        Row("create-dtype", 'create("a/m", (2,), torch.complex64)', StateStoreValueError,
            ("a/m", "dtype"), lambda c: c.new_store().create("a/m", (2,), torch.complex64), True),
        Row("create-too-many-dims", 'create("a/m", (1,) * 65)', StateStoreValueError,
            ("a/m", "65 dimensions"), lambda c: c.new_store().create("a/m", (1,) * 65), True),
        Row("create-too-large", 'create("a/m", (2**62,))', StateStoreValueError,
            ("a/m", "too large"), lambda c: c.new_store().create("a/m", (2 ** 62,)), True),
        Row("create-init-shape", 'create("a/m", (2,), init=torch.zeros(3))',
            StateStoreValueError, ("a/m", "(3,)"),
            lambda c: c.new_store().create("a/m", (2,), init=torch.zeros(3)), True),
        Row("create-init-meta", "init on the meta device", StateStoreValueError,
            ("a/m", "meta"),
            lambda c: c.new_store().create("a/m", (2,), init=torch.empty(2, device="meta")), True),
        Row("create-init-sparse", "a sparse init", StateStoreValueError, ("a/m", "sparse"),
            lambda c: c.new_store().create("a/m", (2,), init=torch.zeros(2).to_sparse()), True),
        Row("create-duplicate", "a key that exists", StateKeyError, ("a/m", "exists"),
            lambda c: _with_state(c).create("a/m", (2, 3)), True),
        Row("create-bad-key", "create(123, (2,))", StateStoreValueError, ("123",),
            lambda c: c.new_store().create(123, (2,)), True),
        Row("create-key-no-slash", 'create("noslash", (2,))', StateStoreValueError,
            ("noslash",), lambda c: c.new_store().create("noslash", (2,)), True),
        # every form of a key passes the checkpoint reader's rules at the door (issue 47)
        Row("create-key-empty-state", 'create(("a", ""), (2,))', StateStoreValueError,
            ("('a', '')", "state name is empty"),
            lambda c: c.new_store().create(("a", ""), (2,)), True),
        Row("create-statekey-empty-state", 'create(StateKey("a", ""), (2,))',
            StateStoreValueError, ("('a', '')", "state name is empty"),
            lambda c: c.new_store().create(K("a", ""), (2,)), True),
        Row("create-key-empty-param", 'create(("", "m"), (2,))', StateStoreValueError,
            ("('', 'm')", "parameter name is empty"),
            lambda c: c.new_store().create(("", "m"), (2,)), True),
        Row("create-key-slash-in-state", 'create(("a", "b/m"), (2,))', StateStoreValueError,
            ("('a', 'b/m')", "cannot contain '/'"),
            lambda c: c.new_store().create(("a", "b/m"), (2,)), True),
        Row("create-key-surrogate", 'create(("a", "\\ud800"), (2,))', StateStoreValueError,
            ("UTF-8",), lambda c: c.new_store().create(("a", "\ud800"), (2,)), True),
        Row("create-key-huge", 'create(("a", "x/" * 10**6), (2,))', StateStoreValueError,
            ("2000000 characters", "cannot contain '/'"),
            lambda c: _short(c.new_store().create, ("a", "x/" * 10 ** 6), (2,)), True),
        Row("get-key-empty-state", 'get(("a", ""))', StateStoreValueError,
            ("state name is empty",), lambda c: _with_state(c).get(("a", "")), True),
        Row("create-many-not-iterable", "create_many(None)", StateStoreValueError,
            ("entries",), lambda c: c.new_store().create_many(None), True),
        Row("create-many-bad-entry", 'create_many([("a/m", (2,))])', StateStoreValueError,
            ("(key, shape, dtype, init)",),
            lambda c: c.new_store().create_many([("a/m", (2,))]), True),
        Row("get-unknown", 'get("b/m")', StateKeyError, ("b/m",),
            lambda c: _with_state(c).get("b/m"), True),
        Row("get-bad-key", "get(None)", StateStoreValueError, ("None",),
            lambda c: _with_state(c).get(None), True),
        Row("spec-unknown", 'spec("b/m")', StateKeyError, ("b/m",),
            lambda c: _with_state(c).spec("b/m"), True),
        Row("contains-bad-key", "123 in store", StateStoreValueError, ("123",),
            lambda c: 123 in _with_state(c), True),
        Row("put-shape", 'put("a/m", torch.zeros(3, 2)) for a (2, 3) state',
            StateStoreValueError, ("a/m", "(3, 2)"),
            lambda c: _with_state(c).put("a/m", torch.zeros(3, 2)), True),
        Row("put-not-tensor", 'put("a/m", [[0.0] * 3] * 2)', StateStoreValueError,
            ("a/m", "tensor"), lambda c: _with_state(c).put("a/m", [[0.0] * 3] * 2), True),
        Row("put-meta", "a value on the meta device", StateStoreValueError, ("a/m", "meta"),
            lambda c: _with_state(c).put("a/m", torch.empty(2, 3, device="meta")), True),
        Row("put-sparse", "a sparse value", StateStoreValueError, ("a/m", "sparse"),
            lambda c: _with_state(c).put("a/m", torch.zeros(2, 3).to_sparse()), True),
        Row("delete-unknown", 'delete(["a/m", "b/m"])', StateKeyError, ("b/m",),
            lambda c: _with_state(c).delete(["a/m", "b/m"]), True),
        Row("delete-not-iterable", "delete(None)", StateStoreValueError, ("keys",),
            lambda c: _with_state(c).delete(None), True),
        Row("pipeline-mode", 'pipeline(units, mode="x")', StateStoreValueError,
            ("mode", "'x'"), lambda c: _with_state(c).pipeline([], mode="x"), True),
        Row("pipeline-units-not-iterable", "pipeline(None)", StateStoreValueError,
            ("units",), lambda c: _with_state(c).pipeline(None), True),
        Row("pipeline-unit-is-slice", "pipeline([Slice(...)])", StateStoreValueError,
            ("unit 0", "Slice"), lambda c: _with_state(c).pipeline([Slice(a, 0, 2)]), True),
        Row("pipeline-not-slice", 'pipeline([["a/m"]])', StateStoreValueError, ("Slice",),
            lambda c: _with_state(c).pipeline([["a/m"]]), True),
        Row("pipeline-slice-range", "Slice(a/m, 0, 99) of a 6-element state",
            StateStoreValueError, ("a/m", "out of range"),
            lambda c: _with_state(c).pipeline([[Slice(a, 0, 99)]]), True),
        Row("pipeline-slice-float", "Slice(a/m, 0.5, 2)", StateStoreValueError,
            ("a/m", "ints"), lambda c: _with_state(c).pipeline([[Slice(a, 0.5, 2)]]), True),
        Row("pipeline-slice-unknown", "Slice(b/m, 0, 1)", StateKeyError, ("b/m",),
            lambda c: _with_state(c).pipeline([[Slice(K("b", "m"), 0, 1)]]), True),
        Row("attach-metadata-not-callable", "attach_metadata(42)", StateStoreValueError,
            ("provider",), lambda c: c.new_store().attach_metadata(42), True),
        Row("closed-store", "create/put/pipeline/delete/clear/load/save on a closed store",
            StateStoreClosedError, ("{cls}", "closed"), _closed_ops, True),
        Row("save-path-type", "save_checkpoint(123)", StateStoreValueError,
            ("checkpoint path", "123"), lambda c: _with_state(c).save_checkpoint(123), True),
        Row("save-path-is-file", "save_checkpoint(a file)", StateStoreValueError,
            ("{afile}", "not a directory"),
            lambda c: _with_state(c).save_checkpoint(c.a_file()), True),
        Row("save-dir-readonly", "save_checkpoint(read-only dir)", StateStoreIOError,
            ("{readonly}",), lambda c: _with_state(c).save_checkpoint(c.readonly_dir()), True),
        Row("save-dir-uncreatable", "save_checkpoint(read-only dir/sub)", StateStoreIOError,
            ("{readonly}/sub",),
            lambda c: _with_state(c).save_checkpoint(c.readonly_dir() + "/sub"), True),
        Row("save-unknown-protocol", 'save_checkpoint("nosuchfs://bucket/ckpt")',
            StateStoreValueError, ("nosuchfs",),
            lambda c: _with_state(c).save_checkpoint("nosuchfs://bucket/ckpt"), True),
        Row("save-protocol-not-installed", "an fsspec URL whose filesystem is not installed",
            StateStoreValueError, ("{proto}://",), lambda c: _save_uninstalled(c), True,
            skip=lambda: None if _missing_fsspec_protocol() else
            "every fsspec filesystem is installed here"),
        Row("save-shard-bytes", "save_checkpoint(path, shard_bytes=0)", StateStoreValueError,
            ("shard_bytes",),
            lambda c: _with_state(c).save_checkpoint(c.path("c"), shard_bytes=0), True),
        Row("save-metadata-type", "save_checkpoint(path, metadata=[1])", StateStoreValueError,
            ("metadata",),
            lambda c: _with_state(c).save_checkpoint(c.path("c"), metadata=[1]), True),
        Row("save-metadata-json", "metadata={'a': {1}}", StateStoreValueError,
            ("metadata", "JSON"),
            lambda c: _with_state(c).save_checkpoint(c.path("c"), metadata={"a": {1}}), True),
        Row("save-metadata-shape", 'metadata={"steps": "x"}', StateStoreValueError,
            ("metadata", "steps"),
            lambda c: _with_state(c).save_checkpoint(c.path("c"), metadata={"steps": "x"}), True),
    ]


def _save_uninstalled(c):
    proto = _missing_fsspec_protocol()
    c.vars["proto"] = proto
    _with_state(c).save_checkpoint(f"{proto}://bucket/ckpt")


def _load(c, path, while_loading: bool = False):
    """A load that fails: refused before the store changes (it keeps its state), or, when
    the damage shows only ``while_loading`` the tensors, leaving it empty (never half-loaded),
    ``load_error`` saying why."""
    s = c.new_store()
    s.create("old/m", (3,))
    try:
        s.load_checkpoint(path, progress=False)
    finally:
        assert s.loaded_metadata is None
        if while_loading:
            assert len(s) == 0 and s.load_error, "half-loaded store"
        else:
            assert s.keys() == [ss.StateKey("old", "m")] and s.load_error is None, \
                "a load refused up front changed the store"


def _damaged(c, damage) -> str:
    path = c.checkpoint()
    damage(c, path)
    return path


def _truncate(c, path):
    _edit_bytes(c.vars["shard"], lambda d: d[:-7])


def _flip(c, path):
    r = ckpt.read_manifest(path).rows[0]

    def f(d):
        d[r["offset"] + 1] ^= 0x40
        return d
    _edit_bytes(c.vars["shard"], f)


def _header_len(c, path):
    def f(d):
        d[:8] = (len(d) * 2).to_bytes(8, "little")
        return d
    _edit_bytes(c.vars["shard"], f)


def _huge_row(c, path):
    def rows(rs):
        rs[0]["shape"] = [2 ** 40]
        rs[0]["nbytes"] = 2 ** 42
        return rs
    _rewrite_manifest(path, rows_fn=rows)


def _parent_file_name(c, path):
    def rows(rs):
        rs[0]["file"] = "../" + rs[0]["file"]
        return rs
    _rewrite_manifest(path, rows_fn=rows)


def _absolute_file_name(c, path):
    def rows(rs):
        rs[0]["file"] = c.vars["shard"]
        return rs
    _rewrite_manifest(path, rows_fn=rows)


def _other_version(c, path):
    _rewrite_manifest(path, meta_fn=lambda m: m.__setitem__(b"statestore.format_version", b"99"))


def _other_format(c, path):
    _rewrite_manifest(path, meta_fn=lambda m: m.__setitem__(b"statestore.format", b"other"))


def _garbage_manifest(c, path):
    with open(c.vars["manifest"], "wb") as f:
        f.write(b"PAR1 this is not a parquet file PAR1")


def _page_bomb(c, path):
    _edit_bytes(c.vars["manifest"], lambda d: bytearray(page_bomb(bytes(d))))


def _bad_metadata(c, path):
    _set_metadata(path, {"steps": {"a": "many"}})


def _no_manifest(c, path):
    os.unlink(c.vars["manifest"])


def _trainer_folder(c) -> str:
    """A folder as transformers' Trainer writes it: no statestore manifest."""
    path = c.path("trainer")
    os.makedirs(path)
    for name in ("trainer_state.json", "optimizer.pt", "scheduler.pt", "model.safetensors"):
        with open(os.path.join(path, name), "wb") as f:
            f.write(b"{}")
    return path


def _missing_shard(c, path):
    os.unlink(c.vars["shard"])


def _checkpoint_rows() -> List[Row]:
    return [
        Row("load-missing", "load_checkpoint(a path with nothing)", CheckpointNotFoundError,
            ("{none}", "no checkpoint"), lambda c: _load(c, c.path("none")), True),
        Row("load-path-is-file", "load_checkpoint(a file)", CheckpointNotFoundError,
            ("{afile}", "is a file"), lambda c: _load(c, c.a_file()), True),
        Row("load-incomplete", "a directory without manifest.parquet", CheckpointNotFoundError,
            ("{ckpt}", "no complete checkpoint"),
            lambda c: _load(c, _damaged(c, _no_manifest)), True),
        Row("load-foreign-folder", "load_checkpoint(a transformers Trainer checkpoint folder)",
            CheckpointNotFoundError, ("{trainer}", "not a statestore checkpoint", "Trainer"),
            lambda c: _load(c, _trainer_folder(c)), True),
        Row("load-unknown-protocol", 'load_checkpoint("nosuchfs://bucket/ckpt")',
            StateStoreValueError, ("nosuchfs",),
            lambda c: _load(c, "nosuchfs://bucket/ckpt"), True),
        Row("load-other-version", "manifest format_version 99", CheckpointError,
            ("{manifest}", "version 99"), lambda c: _load(c, _damaged(c, _other_version)), True),
        Row("load-other-format", "manifest of another format", CheckpointCorruptError,
            ("{manifest}", "not a statestore"),
            lambda c: _load(c, _damaged(c, _other_format)), True),
        Row("load-garbage-manifest", "manifest.parquet that is not Parquet",
            CheckpointCorruptError, ("{manifest}", "unreadable"),
            lambda c: _load(c, _damaged(c, _garbage_manifest)), True),
        Row("load-manifest-page-bomb", "a page header claiming 2 GiB uncompressed",
            CheckpointCorruptError, ("{manifest}", "uncompressed"),
            lambda c: _load(c, _damaged(c, _page_bomb)), True),
        Row("load-bad-metadata", 'optimizer metadata {"steps": {"a": "many"}}',
            CheckpointCorruptError, ("{manifest}", "steps"),
            lambda c: _load(c, _damaged(c, _bad_metadata)), True),
        Row("load-huge-shape", "a manifest row with shape [2**40]", CheckpointCorruptError,
            ("{shard}", "{key}"), lambda c: _load(c, _damaged(c, _huge_row)), True),
        Row("load-parent-file-name", 'a manifest file name "../shard..."',
            CheckpointCorruptError, ("{manifest}", "{key}", "bad file name"),
            lambda c: _load(c, _damaged(c, _parent_file_name)), True),
        Row("load-absolute-file-name", "an absolute manifest file name",
            CheckpointCorruptError, ("{manifest}", "{key}", "bad file name"),
            lambda c: _load(c, _damaged(c, _absolute_file_name)), True),
        Row("load-missing-shard", "a shard file removed", CheckpointCorruptError,
            ("{shard}", "missing"), lambda c: _load(c, _damaged(c, _missing_shard)), True),
        Row("load-header-length", "shard header length prefix beyond the file",
            CheckpointCorruptError, ("{shard}", "header length"),
            lambda c: _load(c, _damaged(c, _header_len)), True),
        Row("load-truncated-shard", "a shard cut short", CheckpointCorruptError,
            ("{shard}", "truncated"), lambda c: _load(c, _damaged(c, _truncate)), True),
        Row("load-checksum", "one tensor byte flipped", CheckpointCorruptError,
            ("{shard}", "{key}", "checksum"),
            lambda c: _load(c, _damaged(c, _flip), while_loading=True), True),
        Row("ckpt-save-store-type", "checkpoint.save_checkpoint(object(), path)",
            StateStoreValueError, ("store",),
            lambda c: ckpt.save_checkpoint(object(), c.path("c"))),
        Row("ckpt-load-store-type", "checkpoint.load_checkpoint(None, path)",
            StateStoreValueError, ("store",),
            lambda c: ckpt.load_checkpoint(None, c.checkpoint())),
        Row("ckpt-read-manifest-path-type", "checkpoint.read_manifest(None)",
            StateStoreValueError, ("checkpoint path", "None"),
            lambda c: ckpt.read_manifest(None)),
        Row("ckpt-verify-path-type", "checkpoint.verify_checkpoint(123)",
            StateStoreValueError, ("checkpoint path", "123"),
            lambda c: ckpt.verify_checkpoint(123)),
        Row("ckpt-verify-damaged", "verify_checkpoint(damaged checkpoint)", ACCEPTED, (),
            lambda c: _verify_lists_problem(c)),
    ]


def _verify_lists_problem(c):
    """verify_checkpoint reports damage as a list of problems (it raises only for bad
    arguments); each names the shard and tensor."""
    path = _damaged(c, _flip)
    problems = ckpt.verify_checkpoint(path, progress=False)
    assert len(problems) == 1
    assert c.vars["shard"] in problems[0] and repr(c.vars["key"]) in problems[0]


def _opt_rows() -> List[Row]:
    P = lambda: [_param(2)]  # noqa: E731
    return [
        Row("optim-lr-negative", "lr=-1.0", ValueError, ("Invalid learning rate: -1.0",),
            lambda c: c.opt(P(), lr=-1.0)),
        Row("optim-lr-type", 'lr="x"', TypeError, ("learning rate", "'x'"),
            lambda c: c.opt(P(), lr="x")),
        Row("optim-betas-range", "betas=(1.0, 0.999)", ValueError,
            ("beta parameter at index 0",), lambda c: c.opt(P(), betas=(1.0, 0.999))),
        Row("optim-betas-type", "betas=0.9", ValueError, ("betas", "0.9"),
            lambda c: c.opt(P(), betas=0.9)),
        Row("optim-betas-elem-type", 'betas=(0.9, "x")', TypeError,
            ("beta parameter at index 1", "'x'"), lambda c: c.opt(P(), betas=(0.9, "x"))),
        Row("optim-eps", "eps=-1e-8", ValueError, ("Invalid epsilon value",),
            lambda c: c.opt(P(), eps=-1e-8)),
        Row("optim-weight-decay", "weight_decay=-0.1", ValueError, ("weight_decay",),
            lambda c: c.opt(P(), weight_decay=-0.1)),
        Row("optim-weight-decay-type", "weight_decay=None", TypeError, ("weight_decay",),
            lambda c: c.opt(P(), weight_decay=None)),
        Row("optim-numpy-scalars", "numpy, 1-element tensor and int hyperparameters", ACCEPTED, (),
            _numpy_hyperparameters),
        Row("optim-group-lr", '[{"params": [p], "lr": -1.0}]', ValueError,
            ("Invalid learning rate: -1.0",), lambda c: c.opt([{"params": P(), "lr": -1.0}])),
        Row("optim-empty-params", "params=[]", ValueError, ("empty parameter list",),
            lambda c: c.opt([])),
        Row("optim-params-not-tensors", "params=[1]", TypeError, ("int",),
            lambda c: c.opt([1])),
        Row("optim-int-param", "an int64 parameter", TypeError, ("'0'", "int64"),
            lambda c: c.opt([torch.zeros(2, dtype=torch.int64)])),
        Row("optim-meta-param", "a parameter on the meta device", StateStoreValueError,
            ("'0'", "meta"), lambda c: c.opt([nn.Parameter(torch.empty(2, device="meta"))])),
        Row("optim-duplicate-param", "one parameter in two groups", ValueError,
            ("more than one parameter group",), lambda c: _dup_param(c)),
        Row("optim-name-slash", '("a/b", p) in named_parameters', ValueError, ("'a/b'",),
            lambda c: c.opt([("a/b", _param(2))])),
        Row("optim-name-duplicate", 'two parameters named "a"', ValueError, ("'a'", "unique"),
            lambda c: c.opt([("a", _param(2)), ("a", _param(1))])),
        Row("optim-state-store-type", "state_store=object()", TypeError, ("state_store",),
            lambda c: c.opt(P(), state_store=object())),
        Row("optim-state-store-closed", "state_store=a closed store", StateStoreClosedError,
            ("state_store", "closed"), lambda c: c.opt(P(), state_store=_closed(c))),
        Row("optim-store-and-fraction", "state_store=s, nvme_offload_fraction=0.5",
            ValueError, ("state_store", "nvme_offload_fraction"),
            lambda c: c.opt(P(), state_store=ss.DeviceStore("cpu"), nvme_offload_fraction=0.5)),
        Row("optim-offload-fraction", "nvme_offload_fraction=1.5", ValueError,
            ("nvme_offload_fraction", "1.5"), lambda c: c.opt(P(), nvme_offload_fraction=1.5)),
        Row("optim-offload-dir-file", "nvme_offload_dir=a file", StateStoreValueError,
            ("{afile}",),
            lambda c: c.opt(P(), nvme_offload_fraction=1.0, nvme_offload_dir=c.a_file())),
        Row("optim-offload-dir-readonly", "nvme_offload_dir=read-only dir",
            StateStoreIOError, ("{readonly}",),
            lambda c: c.opt(P(), nvme_offload_fraction=1.0, nvme_offload_dir=c.readonly_dir())),
        Row("optim-process-group", "process_group without torch.distributed", StateStoreError,
            ("process_group",), lambda c: c.opt(P(), process_group=object())),
        Row("optim-bias-correction", "bias_correction=False", ValueError, ("bias_correction",),
            lambda c: c.opt(P(), bias_correction=False)),
        Row("optim-unknown-kwarg", "no_such_arg=1", TypeError, ("no_such_arg",),
            lambda c: c.opt(P(), no_such_arg=1)),
        Row("optim-update-in-backward-type", "update_in_backward=1", TypeError,
            ("update_in_backward", "1"), lambda c: c.opt(P(), update_in_backward=1)),
        Row("optim-update-in-backward-skip", "update_in_backward=True, skip_nonfinite=True",
            ValueError, ("update_in_backward", "skip_nonfinite"),
            lambda c: c.opt(P(), update_in_backward=True, skip_nonfinite=True)),
        Row("optim-update-in-backward-group", "update_in_backward=True, process_group=pg",
            ValueError, ("update_in_backward", "process_group"),
            lambda c: c.opt(P(), update_in_backward=True, process_group=object())),
        Row("optim-release-grads-alone", "release_grads=True", ValueError,
            ("release_grads", "update_in_backward"), lambda c: c.opt(P(), release_grads=True)),
        Row("optim-release-grads-type", "update_in_backward=True, release_grads=1", TypeError,
            ("release_grads", "1"),
            lambda c: c.opt(P(), update_in_backward=True, release_grads=1)),
    ]


def _numpy_hyperparameters(c):
    """numpy scalars are numbers: accepted as torch accepts them, and saved in checkpoints
    as plain JSON numbers (a save used to fail on them)."""
    import numpy as np
    p, q = _param(3), _param(2)
    store = c.new_store()
    opt = c.opt([{"params": [p]},
                 {"params": [q], "amsgrad": 1, "weight_decay": torch.tensor(0.25)}],
                lr=np.float32(1e-3), betas=(np.float64(0.9), np.float32(0.99)),
                eps=np.float32(1e-8), state_store=store)
    _step(opt, [p, q])
    store.save_checkpoint(c.path("c"), progress=False)
    g0, g1 = ckpt.read_manifest(c.path("c")).metadata["param_groups"]
    assert g0["lr"] == float(np.float32(1e-3)) and g0["betas"] == [0.9, float(np.float32(0.99))]
    assert g1["amsgrad"] is True and g1["weight_decay"] == 0.25


def _dup_param(c):
    p = _param(2)
    c.opt([{"params": [p]}, {"params": [p]}])


def _sparse_grad(c):
    emb = nn.Embedding(10, 3, sparse=True)
    opt = CPUAdam(emb.named_parameters(), state_store=c.new_store())
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()


def _step_closed_store(c):
    s = c.new_store()
    p = _param(3)
    opt = CPUAdam([p], state_store=s)
    s.close()
    c.vars["cls"] = type(s).__name__
    _step(opt, [p])


def _step_rows() -> List[Row]:
    return [
        Row("step-grad-other-device", "a gradient on another device than its parameter",
            StateStoreValueError, ("'w'", "cpu", "{other}", "p.grad = p.grad.to(p.device)"),
            _grad_on_other_device, True),
        Row("step-grad-shape", "a gradient of another shape", StateStoreValueError,
            ("'w'", "(5,)"), lambda c: _grad_changed(c, torch.randn(5)), True),
        Row("step-grad-dtype", "an int32 gradient", TypeError,
            ("'w'", "int32", "cast it", "accepts float32, float16 and bfloat16 gradients"),
            lambda c: _grad_changed(c, torch.ones(4, dtype=torch.int32)), True),
        Row("step-grad-sparse", "a sparse gradient (nn.Embedding(sparse=True))", RuntimeError,
            ("'weight'", "sparse"), _sparse_grad, True),
        Row("step-grad-noncontiguous", "a non-contiguous gradient", ACCEPTED, (),
            _noncontiguous_grad_matches_torch, True),
        Row("step-closure", "step(closure=3)", TypeError, ("closure",),
            lambda c: CPUAdam([_param(2)], state_store=c.new_store()).step(closure=3), True),
        Row("step-div-scale", 'step(div_scale="x")', TypeError, ("div_scale",),
            lambda c: CPUAdam([_param(2)], state_store=c.new_store()).step(div_scale="x"), True),
        Row("step-div-scale-nan", "step(div_scale=float('nan'))", StateStoreValueError,
            ("div_scale must be a finite", "nan"),
            lambda c: _stepped(c).step(div_scale=float("nan")), True),
        Row("step-div-scale-inf", "step(div_scale=float('inf'))", StateStoreValueError,
            ("div_scale must be a finite", "inf"),
            lambda c: _stepped(c).step(div_scale=float("inf")), True),
        Row("step-store-closed", "the store closed after the optimizer was built",
            StateStoreClosedError, ("{cls}", "closed"), _step_closed_store, True),
        Row("apg-after-states", "add_param_group after states were created", ACCEPTED, (),
            _group_added_after_states, True),
        Row("step-in-backward-twice", "update_in_backward: a second backward before step()",
            StateStoreError, ("'w'", "second gradient before step()"),
            lambda c: _in_backward_misuse(c, "second-backward"), True),
        Row("step-in-backward-clipped", "update_in_backward: a gradient changed after backward",
            StateStoreError, ("'w'", "changed after backward"),
            lambda c: _in_backward_misuse(c, "clipped"), True),
        Row("step-in-backward-div-scale", "update_in_backward: step(div_scale=2.0)",
            StateStoreValueError, ("div_scale",),
            lambda c: _in_backward_misuse(c, "div-scale"), True),
        Row("apg-duplicate-param", "add_param_group with a parameter already optimized",
            ValueError, ("more than one parameter group",),
            lambda c: _apg_dup(c), True),
        Row("apg-name-collision", 'add_param_group({"params": [("a", q)]}) where "a" exists',
            ValueError, ("'a'", "unique"),
            lambda c: _add_group_fails(c, [("a", _param(4))], {"params": [("a", _param(3))]}),
            True),
        Row("apg-bad-lr", 'add_param_group({"params": [q], "lr": -1.0})', ValueError,
            ("Invalid learning rate: -1.0",),
            lambda c: _add_group_fails(c, [_param(4)], {"params": [_param(3)], "lr": -1.0}),
            True),
        Row("apg-not-dict", "add_param_group([q])", TypeError, ("param_group",),
            lambda c: _add_group_fails(c, [_param(4)], [_param(3)]), True),
        Row("apg-process-group", "add_param_group with a process_group", StateStoreError,
            ("process_group",), _add_group_with_process_group),
    ]


def _apg_dup(c):
    p = _param(4)
    _add_group_fails(c, [p], {"params": [p]})


def _lsd_rows() -> List[Row]:
    def drop(k, i=1):
        return lambda sd: sd["state"][i].pop(k)
    return [
        Row("lsd-not-dict", 'load_state_dict({"bogus": 1})', ValueError, ("state_dict",),
            lambda c: _lsd(c, lambda sd: (sd.clear(), sd.update(bogus=1))), True),
        Row("lsd-group-count", "a state dict with 2 groups for 1", CheckpointMismatchError,
            ("parameter groups",),
            lambda c: _lsd(c, lambda sd: sd["param_groups"].append(dict(sd["param_groups"][0]))),
            True),
        Row("lsd-group-size", "a group with 1 parameter for 2", CheckpointMismatchError,
            ("group 0",),
            lambda c: _lsd(c, lambda sd: sd["param_groups"][0].__setitem__("params", [0])), True),
        Row("lsd-group-type", "param_groups=None", TypeError, ("param_groups",),
            lambda c: _lsd(c, lambda sd: sd.__setitem__("param_groups", None)), True),
        Row("lsd-unknown-param", "state for parameter 7", ValueError, ("unknown parameter", "7"),
            lambda c: _lsd(c, lambda sd: sd["state"].__setitem__(7, dict(sd["state"][0]))), True),
        Row("lsd-missing-state", "parameter 1 without exp_avg_sq", ValueError,
            ("'1'", "exp_avg_sq"), lambda c: _lsd(c, drop("exp_avg_sq")), True),
        Row("lsd-state-shape", "exp_avg of another shape", ValueError, ("'1'", "exp_avg", "shape"),
            lambda c: _lsd(c, lambda sd: sd["state"][1].__setitem__("exp_avg", torch.zeros(9))),
            True),
        Row("lsd-state-type", 'exp_avg="x"', TypeError, ("'1'", "exp_avg"),
            lambda c: _lsd(c, lambda sd: sd["state"][1].__setitem__("exp_avg", "x")), True),
        Row("lsd-state-meta", "exp_avg on the meta device", TypeError, ("'1'", "meta"),
            lambda c: _lsd(c, lambda sd: sd["state"][1].__setitem__(
                "exp_avg", torch.empty(3, device="meta"))), True),
        Row("lsd-bad-step", 'step="x"', ValueError, ("'1'", "step"),
            lambda c: _lsd(c, lambda sd: sd["state"][1].__setitem__("step", "x")), True),
        Row("lsd-bad-lr", "a saved group with lr=-1", ValueError, ("Invalid learning rate",),
            lambda c: _lsd(c, lambda sd: sd["param_groups"][0].__setitem__("lr", -1.0)), True),
    ]


def _resume_rows() -> List[Row]:
    def named(names=("a", "b"), shapes=((4, 3), (5,)), dtype=torch.float32):
        return [(n, _param(*s, dtype=dtype)) for n, s in zip(names, shapes)]
    return [
        Row("resume-other-model", "a checkpoint of parameters a, b into parameters x, y",
            CheckpointMismatchError, ("'a'", "'x'"),
            lambda c: _resume(c, c.checkpoint(), named(names=("x", "y"))), True),
        Row("resume-other-shapes", "parameter a of shape (3, 4) for a saved (4, 3)",
            CheckpointMismatchError, ("'a'", "(3, 4)", "(4, 3)"),
            lambda c: _resume(c, c.checkpoint(), named(shapes=((3, 4), (5,)))), True),
        Row("resume-dtype-to-bf16", "fp32 checkpoint, bf16 parameters",
            CheckpointMismatchError, ("'a'", "bfloat16", "float32"),
            lambda c: _resume(c, c.checkpoint(), named(dtype=torch.bfloat16)), True),
        Row("resume-dtype-to-fp32", "bf16 checkpoint (fp32 masters), fp32 parameters",
            CheckpointMismatchError, ("'a'", "master"),
            lambda c: _resume(c, c.checkpoint(dtype=torch.bfloat16), named()), True),
        Row("resume-state-dtype", "an exp_avg stored as float16", CheckpointMismatchError,
            ("'a'", "exp_avg", "float16"),
            lambda c: _resume(c, c.states_checkpoint(
                [("a/exp_avg", (4, 3), torch.float16, None),
                 ("a/exp_avg_sq", (4, 3), torch.float32, None)]),
                named(names=("a",), shapes=((4, 3),))), True),
        Row("resume-unknown-state", "a state momentum_buffer (another optimizer)",
            CheckpointMismatchError, ("'a'", "momentum_buffer"),
            lambda c: _resume(c, c.states_checkpoint(
                [("a/momentum_buffer", (4, 3), torch.float32, None)]),
                named(names=("a",), shapes=((4, 3),))), True),
    ]


def _dist_rows() -> List[Row]:
    return [
        Row("partition-world-size", "partition([1, 2], 0)", StateStoreValueError,
            ("world_size", "0"), lambda c: partition([1, 2], 0)),
        Row("partition-world-size-type", 'partition([1, 2], "2")', StateStoreValueError,
            ("world_size", "'2'"), lambda c: partition([1, 2], "2")),
        Row("partition-numels-type", "partition(5, 2)", StateStoreValueError,
            ("numels", "5"), lambda c: partition(5, 2)),
        Row("partition-numels-negative", "partition([3, -1], 2)", StateStoreValueError,
            ("numels[1]", "-1"), lambda c: partition([3, -1], 2)),
    ]


def _cli_rows() -> List[Row]:
    def no_meta(c):
        return c.states_checkpoint([("a/exp_avg", (3,), torch.float32, None)])
    return [
        Row("cli-inspect-missing", "statestore inspect NOTHING", Exit(1), ("{none}",),
            lambda c: _cli("inspect", c.path("none"))),
        Row("cli-inspect-is-file", "statestore inspect A_FILE", Exit(1), ("{afile}", "is a file"),
            lambda c: _cli("inspect", c.a_file())),
        Row("cli-inspect-unknown-protocol", "statestore inspect nosuchfs://x", Exit(1),
            ("nosuchfs",), lambda c: _cli("inspect", "nosuchfs://x")),
        Row("cli-inspect-bad-metadata", "inspect a manifest with malformed metadata", Exit(1),
            ("{manifest}", "steps"), lambda c: _cli("inspect", _damaged(c, _bad_metadata))),
        Row("cli-verify-damaged", "statestore verify DAMAGED", Exit(1),
            ("{shard}", "{key}", "checksum"), lambda c: _cli("verify", "-q", _damaged(c, _flip))),
        Row("cli-convert-no-metadata", "convert a bare store's checkpoint", Exit(1),
            ("param_groups",),
            lambda c: _cli("convert", no_meta(c), "--to", "torch", c.path("o.pt"))),
        Row("cli-convert-out-is-dir", "convert ... OUT where OUT is a directory", Exit(1),
            ("{tmp}", "is a directory"),
            lambda c: _cli("convert", c.checkpoint(), "--to", "torch", str(c.tmp))),
        Row("cli-convert-out-no-dir", "convert ... OUT in a missing directory", Exit(1),
            ("{tmp}/nodir", "does not exist"),
            lambda c: _cli("convert", c.checkpoint(), "--to", "torch", c.path("nodir") + "/o.pt")),
        Row("cli-usage", "statestore convert CKPT --to jax OUT", Exit(2), ("jax",),
            lambda c: _cli("convert", c.path("x"), "--to", "jax", "y")),
    ]


ROWS: List[Row] = (_stores() + _store_methods() + _checkpoint_rows() + _opt_rows() + _step_rows()
                   + _lsd_rows() + _resume_rows() + _dist_rows() + _cli_rows())
assert len({r.id for r in ROWS}) == len(ROWS), "duplicate row ids"


# ============================================================================ the tests
def _cases():
    for r in ROWS:
        if r.per_backend:
            for b in BACKEND_NAMES:
                yield pytest.param(r, b, id=f"{r.id}[{b}]")
        else:
            yield pytest.param(r, "device-cpu", id=r.id)


def _check(row: Row, ctx: Ctx, opt_cls=CPUAdam) -> None:
    ctx.opt = lambda params, **kw: opt_cls(params, **kw)
    if row.exc is ACCEPTED:
        row.run(ctx)
        return
    if isinstance(row.exc, Exit):
        code, err = row.run(ctx)
        assert code == row.exc.code, f"exit status {code}, stderr: {err}"
        message = err
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)    # pinned: no CUDA, one warning
            with pytest.raises(BaseException) as ei:
                row.run(ctx)
        e = ei.value
        if isinstance(e, (AssertionError, pytest.skip.Exception)):
            raise e
        # exactly the documented class: the table names the most specific one raised
        assert type(e) is row.exc, \
            f"{row.id}: expected {row.exc.__name__}, got {type(e).__name__}: {e}"
        message = str(e)
    for w in row.words:
        w = w.format(**ctx.vars)
        assert w in message, f"{row.id}: {w!r} not in the message: {message}"


@pytest.mark.parametrize("row,backend", list(_cases()))
def test_bad_input(row: Row, backend: str, tmp_path):
    reason = row.skip() if row.skip else None
    if reason:
        pytest.skip(reason)
    ctx = Ctx(tmp_path, backend)
    try:
        _check(row, ctx)
    finally:
        ctx.close()


@pytest.mark.parametrize("row", [r for r in ROWS if r.id.startswith("optim-")],
                         ids=lambda r: r.id)
def test_bad_input_hybrid_adam(row: Row, tmp_path):
    """The constructor rows hold for HybridAdam as well as CPUAdam."""
    ctx = Ctx(tmp_path)
    try:
        _check(row, ctx, opt_cls=HybridAdam)
    finally:
        ctx.close()


# ============================================================================ docs in step
_DOC_ID = re.compile(r"^`([a-z0-9-]+)`$")


def _doc_table() -> Dict[str, str]:
    """``{row id: exception}`` from the table rows of docs/errors.md
    (``| `id` | input | exception | message names |``)."""
    out: Dict[str, str] = {}
    with open(DOC) as f:
        for line in f:
            cells = [x.strip() for x in line.strip().strip("|").split("|")]
            m = _DOC_ID.match(cells[0]) if len(cells) >= 4 else None
            if m:
                assert m.group(1) not in out, f"row {m.group(1)} twice in docs/errors.md"
                out[m.group(1)] = cells[2].strip("`")
    return out


def _exc_name(exc) -> str:
    return exc.__name__


def test_docs_table_matches_rows():
    """docs/errors.md lists exactly these rows, each with the exception the test expects."""
    doc = _doc_table()
    missing = [r.id for r in ROWS if r.id not in doc]
    assert not missing, f"rows missing from docs/errors.md: {missing}"
    extra = sorted(set(doc) - {r.id for r in ROWS})
    assert not extra, f"docs/errors.md rows with no test: {extra}"
    wrong = [(r.id, doc[r.id], _exc_name(r.exc)) for r in ROWS if doc[r.id] != _exc_name(r.exc)]
    assert not wrong, f"exception differs between docs/errors.md and the test: {wrong}"


def test_every_exception_of_the_table_is_documented_in_the_hierarchy():
    with open(DOC) as f:
        text = f.read()
    for name in ss.errors.__all__:
        assert f"`{name}`" in text, f"{name} missing from the hierarchy in docs/errors.md"

"""torch.profiler traces show the pipeline: per unit a read wait, the compute (the update op
inside it) and the write-back's submission, on the caller's thread; the I/O engine's thread
completes requests in spans of its own; nothing is recorded, and nothing allocated, when no
profiler runs."""
from __future__ import annotations

import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import statestore as ss
from statestore import Slice, StateKey, _trace
from statestore.optim import CPUAdam

CPU = [ProfilerActivity.CPU]


def _all_threads():
    try:
        from torch._C._profiler import _ExperimentalConfig
        return _ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # a torch without the option
        pytest.skip("this torch's profiler cannot record other threads")


def _spans(trace_path):
    events = json.load(open(trace_path))["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and e["name"].startswith("statestore::")]


def test_spans_cost_nothing_without_a_profiler():
    assert not _trace.tracing()
    assert _trace.span("statestore::compute") is _trace.span("statestore::read_wait")  # shared no-op
    assert _trace.begin("statestore::compute") is None
    _trace.end(None)


def test_a_streaming_pipeline_shows_read_compute_write_per_unit(tmp_path):
    with ss.NVMeStore(str(tmp_path / "s"), budget_bytes=256 << 10) as store:
        keys = [StateKey(str(i), "exp_avg") for i in range(5)]
        store.create_many([(k, (16 * 1024,), torch.float32, None) for k in keys])
        units = [[Slice(k, 0, 16 * 1024)] for k in keys]
        with profile(activities=CPU, experimental_config=_all_threads()) as prof:
            with store.pipeline(units, mode="rw") as pipe:
                for tensors in pipe:
                    tensors[0].add_(1.0)
        prof.export_chrome_trace(str(tmp_path / "trace.json"))
        spans = _spans(tmp_path / "trace.json")
        main = next(e["tid"] for e in spans if e["name"] == "statestore::compute")
        names = [e["name"] for e in sorted(spans, key=lambda e: e["ts"]) if e["tid"] == main]
        for name in ("read_wait", "compute", "write_submit", "read_submit"):
            assert names.count(f"statestore::{name}") == len(units), (name, names)
        # per unit, in this order: wait for its reads, compute, hand it back
        seq = [n for n in names if n in ("statestore::read_wait", "statestore::compute",
                                         "statestore::write_submit")]
        assert seq == ["statestore::read_wait", "statestore::compute",
                       "statestore::write_submit"] * len(units)
        assert "statestore::write_wait" in names        # close() waits for the write-backs
        # the engine's thread: its completions, in spans of its own
        assert any(e["name"] == "statestore::io_complete" and e["tid"] != main for e in spans)
        assert {e["name"] for e in spans} <= set(_trace.SPANS)
        assert torch.equal(store.get(keys[0]), torch.ones(16 * 1024))


def test_an_optimizer_step_shows_the_update_inside_each_compute_span(tmp_path):
    params = [torch.nn.Parameter(torch.randn(4096)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p)
    with ss.DeviceStore("cpu") as store:
        opt = CPUAdam(params, state_store=store)
        opt.step()
        with profile(activities=CPU) as prof:
            opt.step()
        prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.load(open(tmp_path / "trace.json"))["traceEvents"]
    compute = [e for e in events if e.get("name") == "statestore::compute"]
    # the update: the op (statestore::adam_, recorded by the dispatcher) on the general way,
    # a planned step's native call (statestore::adam_plan) once the step repeats
    ops = [e for e in events if e.get("name", "").startswith("statestore::adam")]
    assert compute and ops
    for op in ops:      # every kernel call falls inside a compute span
        assert any(c["ts"] <= op["ts"] and op["ts"] + op["dur"] <= c["ts"] + c["dur"]
                   for c in compute)
    # a resident store has no reads or writes to show
    assert not [e for e in events if e.get("name") in ("statestore::read_wait",
                                                       "statestore::write_submit")]

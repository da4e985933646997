"""Draw the documentation's figures (``docs/img/*.svg``) from statestore itself.

    PYTHONPATH=. .venv/bin/python scripts/draw_docs.py            # rewrite docs/img/*.svg
    PYTHONPATH=. .venv/bin/python scripts/draw_docs.py --check    # exit 1 if one is out of date

Each figure comes from running the library, so it changes when the code does:

* ``pipeline.svg``: one optimizer step's read / compute / write schedule on a disk store. The
  units are what ``CPUAdam`` plans on an ``NVMeStore`` (``plan_units`` with the store's
  ``unit_bytes``, a quarter of its budget) and the read-ahead follows the pipeline's rule
  (a unit's reads are submitted while the ring of ``budget_bytes`` has room; its buffer is
  freed when its write-back completes). Durations come from stated rates (``RATES``), not a
  measurement: the figure shows the shape of the overlap, not a speed.
* ``offload.svg``: which modules' parameters are in memory at each moment of a training
  iteration with ``offload_parameters(model, NVMeStore, prefetch=2)``, read from the
  parameters themselves (a released parameter is a zero-stride view) at every module hook of a
  real run.
* ``checkpoint.svg``: the files of a real checkpoint (``save_checkpoint`` of a small model's
  optimizer in a temporary directory), drawn from its manifest: each shard's header and
  tensors at their offsets, and the manifest's rows.

Only the standard library and statestore's own dependencies: the SVG is written as text.
The output is deterministic (seeded data, the random save id replaced by ``<save id>``), so
``--check`` compares bytes.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from html import escape
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import torch
from torch import nn

import statestore as ss
from statestore.checkpoint import read_manifest
from statestore.optim import CPUAdam, HybridAdam
from statestore.pipeline import plan_units

OUT = Path(__file__).resolve().parent.parent / "docs" / "img"
FONT = "font-family='DejaVu Sans, Arial, sans-serif'"
COLORS = {"read": "#4e79a7", "compute": "#59a14f", "write": "#f28e2b", "wait": "#e15759",
          "idle": "#eeeeee", "held": "#9fc5e8", "active": "#1f5f99", "header": "#bab0ac",
          "pad": "#f1f1f1", "master": "#76b7b2", "exp_avg": "#59a14f", "exp_avg_sq": "#edc948",
          "other": "#b07aa1"}


class Svg:
    """A few SVG primitives, written as text with fixed number formatting."""

    def __init__(self, width: int, height: int):
        self.w, self.h, self.items = width, height, []

    def rect(self, x, y, w, h, fill, stroke="none", title=None):
        t = f"<title>{escape(title)}</title>" if title else ""
        self.items.append(f"<rect x='{x:.1f}' y='{y:.1f}' width='{max(w, 0.5):.1f}' "
                          f"height='{h:.1f}' fill='{fill}' stroke='{stroke}'>{t}</rect>")

    def text(self, x, y, s, size=12, anchor="start", weight="normal", fill="#222"):
        self.items.append(f"<text x='{x:.1f}' y='{y:.1f}' font-size='{size}' "
                          f"text-anchor='{anchor}' font-weight='{weight}' fill='{fill}' {FONT}>"
                          f"{escape(str(s))}</text>")

    def line(self, x1, y1, x2, y2, stroke="#888", dash=None):
        d = f" stroke-dasharray='{dash}'" if dash else ""
        self.items.append(f"<line x1='{x1:.1f}' y1='{y1:.1f}' x2='{x2:.1f}' y2='{y2:.1f}' "
                          f"stroke='{stroke}'{d}/>")

    def render(self) -> str:
        return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{self.w}' height='{self.h}' "
                f"viewBox='0 0 {self.w} {self.h}'>\n<rect width='100%' height='100%' "
                f"fill='white'/>\n" + "\n".join(self.items) + "\n</svg>\n")


# ------------------------------------------------------------------ the pipeline of a step
#: stated rates of the schedule (bytes/s; parameters/s): of the order of the development
#: host's virtual disk and of its loaded CPU's Adam kernel (benchmarks/RESULTS.md), so that
#: reads, the update and writes take comparable times, as in an offloaded step
RATES = {"read": 2.0e9, "write": 1.5e9, "compute": 0.3e9}
MiB = 1 << 20


def pipeline_schedule(numels: Sequence[int], budget: int):
    """(units, events): the units CPUAdam plans on an NVMeStore of ``budget`` bytes, and a
    simulated schedule ``[(lane, unit, start, end)]`` of one step over them."""
    with tempfile.TemporaryDirectory(prefix="statestore-draw-") as d:
        store = ss.NVMeStore(d, budget_bytes=budget)
        unit_bytes, align = store.unit_bytes, store.alignment
        store.close()
    groups = [[("p", "exp_avg"), ("p", "exp_avg_sq")] for _ in numels]
    units = plan_units(groups, list(numels), 4, unit_bytes, slice_round=align)
    nbytes = [sum(2 * 4 * (b - a) for _, a, b in u) for u in units]
    nparams = [sum(b - a for _, a, b in u) for u in units]
    ev: List[Tuple[str, int, float, float]] = []
    disk_free = 0.0          # one disk serving requests in submission order
    ring_used, ring_free_at = 0, []     # (time a unit's buffer is freed, bytes)
    read_done: Dict[int, float] = {}
    t = 0.0                  # the caller's clock
    submitted = 0

    def submit_reads(now: float) -> None:
        nonlocal submitted, ring_used, disk_free
        while submitted < len(units):
            for tf, nb in sorted(ring_free_at):
                if tf <= now:
                    ring_free_at.remove((tf, nb))
                    ring_used -= nb
            if ring_used + nbytes[submitted] > budget:
                return
            ring_used += nbytes[submitted]
            start = max(disk_free, now)
            disk_free = start + nbytes[submitted] / RATES["read"]
            read_done[submitted] = disk_free
            ev.append(("read", submitted, start, disk_free))
            submitted += 1

    submit_reads(t)
    for i in range(len(units)):
        while i >= submitted:            # the ring is full: wait for the oldest write-back
            tf, _ = min(ring_free_at)
            ev.append(("wait", i, t, tf))
            t = tf
            submit_reads(t)
        if read_done[i] > t:
            ev.append(("wait", i, t, read_done[i]))
            t = read_done[i]
        end = t + nparams[i] / RATES["compute"]
        ev.append(("compute", i, t, end))
        t = end
        start = max(disk_free, t)
        disk_free = start + nbytes[i] / RATES["write"]
        ev.append(("write", i, start, disk_free))
        ring_free_at.append((disk_free, nbytes[i]))
        submit_reads(t)
    if disk_free > t:
        ev.append(("wait", len(units), t, disk_free))
    return units, nbytes, ev


def draw_pipeline() -> str:
    numels = [4 * MiB, 1 * MiB, 4 * MiB, 2 * MiB]      # four parameters, 11M elements
    budget = 64 * MiB
    units, nbytes, ev = pipeline_schedule(numels, budget)
    end = max(e for *_, e in ev)
    lanes = [("read", "disk: reads (read-ahead)"), ("compute", "caller: compute (the update)"),
             ("write", "disk: write-backs"), ("wait", "caller: waits for the disk")]
    left, top, width, lane_h = 230, 70, 620, 34
    svg = Svg(left + width + 30, top + lane_h * len(lanes) + 110)
    svg.text(20, 26, "One optimizer step on a disk store: read ahead, compute, write behind",
             15, weight="bold")
    svg.text(20, 46, f"{len(numels)} parameters, {sum(numels) / MiB:.0f}M fp32 elements; "
             f"budget_bytes {budget // MiB} MiB, so {len(units)} units of at most "
             f"{max(nbytes) / MiB:.0f} MiB of exp_avg + exp_avg_sq", 12)
    scale = width / end
    for row, (lane, label) in enumerate(lanes):
        y = top + row * lane_h
        svg.text(left - 10, y + 21, label, 12, anchor="end")
        svg.rect(left, y + 4, width, lane_h - 8, COLORS["idle"])
        for kind, u, a, b in ev:
            if kind != lane or b <= a:
                continue
            svg.rect(left + a * scale, y + 4, (b - a) * scale, lane_h - 8, COLORS[kind],
                     stroke="white", title=f"{kind} unit {u}: {a * 1e3:.1f}-{b * 1e3:.1f} ms")
            if (b - a) * scale > 18 and kind != "wait":
                svg.text(left + (a + b) / 2 * scale, y + 22, f"u{u}", 11, "middle",
                         fill="white", weight="bold")
    axis_y = top + lane_h * len(lanes) + 8
    svg.line(left, axis_y, left + width, axis_y)
    step = next(s for s in (1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0)
                if end / s <= 8)
    k = 0
    while k * step <= end + 1e-12:
        x = left + k * step * scale
        svg.line(x, axis_y, x, axis_y + 4)
        svg.text(x, axis_y + 17, f"{k * step * 1e3:.0f} ms", 10, "middle")
        k += 1
    notes = ["Units as CPUAdam plans them on NVMeStore (a quarter of the budget each); a unit's "
             "reads start while the ring has room,",
             "its buffer is freed when its write-back ends; one disk serves requests in order.",
             f"Stated rates, not measured: read {RATES['read'] / 1e9:g} GB/s, write "
             f"{RATES['write'] / 1e9:g} GB/s, update {RATES['compute'] / 1e9:g} G params/s. "
             "Drawn by scripts/draw_docs.py."]
    for k, note in enumerate(notes):
        svg.text(20, axis_y + 44 + 16 * k, note, 11)
    return svg.render()


# ------------------------------------------------------------- parameter offload's timeline
def offload_timeline(layers: int = 6, prefetch: int = 2):
    """Run two iterations of a ``layers``-deep MLP with parameters offloaded to an
    NVMeStore and return, for each moment of the second, the state of every layer:
    ``(labels, states)``, ``states[column][layer]`` one of ``"computing"`` (its parameters
    in memory: the module computes), ``"ahead"`` (in a read-ahead window the handle opened
    on the store, not yet taken), ``"step"`` (read and written back by ``opt.step()``) or
    ``"released"``. The handle's reads are seen through the store's public ``pipeline``."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(layers)])
    log: List[Tuple[str, object]] = []
    on = [False]

    def held() -> set:
        # DisableTorchFunction: the handle's TorchFunctionMode would fetch what we look at
        with torch._C.DisableTorchFunction():
            return {i for i, m in enumerate(model) if m.weight.data.stride() != (0, 0)}

    def sample(label: str) -> None:
        if on[0]:
            log.append(("sample", (label, held())))

    x = torch.randn(8, 256, requires_grad=True)
    with tempfile.TemporaryDirectory(prefix="statestore-draw-") as d:
        pstore = ss.NVMeStore(os.path.join(d, "params"), budget_bytes=4 * MiB)
        pipeline = pstore.pipeline

        def logged_pipeline(units, *args, **kwargs):
            mode = kwargs.get("mode", args[0] if args else "rw")
            if on[0]:
                log.append((mode, {int(s.key[0].split(".")[0]) for u in units for s in u}))
            return pipeline(units, *args, **kwargs)

        pstore.pipeline = logged_pipeline
        sstore = ss.DeviceStore("cpu")
        with ss.offload_parameters(model, pstore, prefetch=prefetch):
            for i, m in enumerate(model):      # after the handle's hooks: the module is held
                m.register_forward_pre_hook(lambda mod, inp, i=i: sample(f"F{i}"))
                m.register_full_backward_hook(lambda mod, gi, go, i=i: sample(f"B{i}"))
            opt = HybridAdam(model.named_parameters(), lr=1e-3, state_store=sstore)
            for it in range(2):          # the first records the order, the second replays it
                on[0] = it == 1
                model(x).square().mean().backward()
                if on[0]:
                    log.append(("step-begin", None))
                opt.step()
                if on[0]:
                    log.append(("step-end", None))
                opt.zero_grad()
                sample("next")
                on[0] = False
        pstore.close()
        sstore.close()
    labels, states, ahead, in_step, stepped = [], [], set(), False, set()
    for kind, val in log:
        if kind == "step-begin":
            in_step = True
        elif kind == "step-end":
            in_step = False
            labels.append("step")
            states.append(["step" if i in stepped else "released" for i in range(layers)])
        elif kind == "sample":
            label, now = val
            ahead -= now
            labels.append(label)
            states.append(["computing" if i in now else "ahead" if i in ahead else "released"
                           for i in range(layers)])
        elif kind == "r":
            (stepped if in_step else ahead).update(val)
    return labels, states


def draw_offload() -> str:
    layers, prefetch = 6, 2
    labels, states = offload_timeline(layers, prefetch)
    colors = {"computing": COLORS["active"], "ahead": COLORS["held"],
              "step": COLORS["compute"], "released": COLORS["idle"]}
    words = {"computing": "parameters in memory: the module computes",
             "ahead": "being read ahead into the store's ring",
             "step": "read, updated and written back by opt.step()",
             "released": "released: only in the store"}
    left, top, cw, rh = 90, 78, 38, 26
    svg = Svg(max(left + cw * len(labels) + 30, 700), top + rh * layers + 110)
    svg.text(20, 26, "Parameter offload: where each layer's parameters are, moment by moment",
             15, weight="bold")
    svg.text(20, 46, f"nn.Sequential of {layers} Linear(256, 256); offload_parameters(model, "
             f"NVMeStore, prefetch={prefetch}); HybridAdam on its own store; a steady iteration",
             12)
    for e, label in enumerate(labels):
        svg.text(left + e * cw + cw / 2, top - 8, label, 11, "middle", weight="bold")
    for i in range(layers):
        y = top + i * rh
        svg.text(left - 10, y + 17, f"layer {i}", 12, anchor="end")
        for e, col in enumerate(states):
            svg.rect(left + e * cw + 1, y + 1, cw - 2, rh - 2, colors[col[i]],
                     title=f"{labels[e]}: layer {i}: {words[col[i]]}")
    y = top + rh * layers + 20
    for k, state in enumerate(("computing", "ahead", "step", "released")):
        x = 20 + (k % 2) * 330
        yy = y + (k // 2) * 20
        svg.rect(x, yy, 14, 14, colors[state])
        svg.text(x + 20, yy + 12, words[state], 11)
    svg.text(20, y + 58, "F<i>: layer i's forward; B<i>: its backward; step: opt.step(); "
             "next: after zero_grad(), the next iteration's first window.", 11)
    svg.text(20, y + 74, "Read from a real run: the parameters (released = zero-stride view) "
             "and the store's pipelines. Drawn by scripts/draw_docs.py.", 11)
    return svg.render()


# ------------------------------------------------------------------- a checkpoint's files
def checkpoint_manifest():
    """Save a small model's optimizer and return its manifest rows (plain dicts) and the
    shard files' sizes, the random save id replaced by ``<save id>``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))
    with tempfile.TemporaryDirectory(prefix="statestore-draw-") as d:
        store = ss.DeviceStore("cpu")
        opt = CPUAdam(model.named_parameters(), lr=1e-3, state_store=store)
        for p in model.parameters():     # seeded gradients: the same bits on every machine
            p.grad = torch.randn_like(p)
        opt.step()
        path = os.path.join(d, "ckpt")
        store.save_checkpoint(path)
        rows = [{k: r[k] for k in ("key", "param", "state", "file", "offset", "nbytes",
                                   "shape", "dtype", "checksum")}
                for r in read_manifest(path).rows]
        sizes = {f: os.path.getsize(os.path.join(path, f)) for f in {r["file"] for r in rows}}
        store.close()

    def anon(name: str) -> str:          # shard-<save id>-<n>.safetensors
        parts = name.split("-")
        return "-".join([parts[0], "<save id>"] + parts[2:])

    for r in rows:
        r["file"] = anon(r["file"])
    return rows, {anon(f): n for f, n in sizes.items()}


def draw_checkpoint() -> str:
    rows, sizes = checkpoint_manifest()
    left, width = 20, 860
    svg = Svg(left * 2 + width, 230 + 130 * len(sizes) + 18 * len(rows))
    svg.text(left, 26, "A checkpoint directory: manifest.parquet + safetensors shards",
             15, weight="bold")
    svg.text(left, 46, "CPUAdam over Linear(64, 64), ReLU, Linear(64, 16) after one step, "
             "store.save_checkpoint(path); drawn from its manifest", 12)
    y = 78
    for f in sorted(sizes):
        size, mine = sizes[f], sorted((r for r in rows if r["file"] == f),
                                      key=lambda r: r["offset"])
        svg.text(left, y, f"path/{f}: {size} bytes (to scale)", 12, weight="bold")
        y += 8
        scale = width / size
        first = mine[0]["offset"]
        svg.rect(left, y, first * scale, 26, COLORS["header"],
                 title=f"8-byte header length + JSON header: bytes 0-{first - 1}")
        for r in mine:
            svg.rect(left + r["offset"] * scale, y, r["nbytes"] * scale, 26,
                     COLORS.get(r["state"], COLORS["other"]), "white",
                     title=f"{r['key']}: offset {r['offset']}, {r['nbytes']} bytes")
        # the same tensors, one box each, joined to their place in the file
        bw = width / (len(mine) + 1)
        by = y + 70
        boxes = [("header", "8 + JSON", 0, first, COLORS["header"])] + [
            (r["param"], r["state"], r["offset"], r["nbytes"],
             COLORS.get(r["state"], COLORS["other"])) for r in mine]
        for k, (top_label, sub, off, nb, fill) in enumerate(boxes):
            x = left + k * bw
            svg.line(left + (off + nb / 2) * scale, y + 26, x + bw / 2, by, "#999")
            svg.rect(x + 2, by, bw - 4, 46, fill, "white")
            svg.text(x + bw / 2, by + 14, top_label, 10, "middle", weight="bold")
            svg.text(x + bw / 2, by + 27, sub, 10, "middle")
            svg.text(x + bw / 2, by + 40, f"@{off}, {nb} B", 9, "middle")
        y = by + 80
    svg.text(left, y, "path/manifest.parquet: one row per tensor; its schema metadata holds "
             "the optimizer's metadata, the format version and its own checksum", 12,
             weight="bold")
    y += 20
    cols = [("key", 0), ("file", 160), ("offset", 440), ("nbytes", 500), ("shape", 570),
            ("dtype", 650), ("checksum", 710)]
    for name, dx in cols:
        svg.text(left + dx, y, name, 11, weight="bold")
    for r in rows:
        y += 18
        for name, dx in cols:
            v = r[name]
            if name == "shape":
                v = "[" + ", ".join(str(s) for s in v) + "]"
            svg.text(left + dx, y, v, 10)
    svg.text(left, y + 30, "Drawn by scripts/draw_docs.py from a checkpoint it saves; "
             "the format: docs/checkpoint-format.md.", 11)
    return svg.render()


FIGURES = {"pipeline.svg": draw_pipeline, "offload.svg": draw_offload,
           "checkpoint.svg": draw_checkpoint}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="compare with the files in --out instead of writing them")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    stale = []
    for name, draw in FIGURES.items():
        text = draw()
        path = a.out / name
        if a.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            a.out.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"out of date: {', '.join(stale)} (run scripts/draw_docs.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m statestore`` (also installed as ``statestore``): checkpoint tools.

Commands::

    statestore inspect CKPT                   a table of tensors, sizes, dtypes; steps; groups
    statestore verify CKPT                    every checksum; exit 1 on damage
    statestore convert CKPT --to torch OUT.pt a torch.optim.AdamW-loadable state dict

``CKPT`` is a local path or any fsspec URL. Exit status: 0 success, 1 a damaged or missing
checkpoint (problems printed on stderr), 2 a usage error. The commands draw tqdm progress
bars on stderr when it is a terminal (cleared when done); piped or redirected, or with
``-q``, they draw none.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["main", "to_torch_state_dict"]


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _shown(text: Any) -> str:
    """``text`` safe to print on a terminal: control characters (ESC, newline...), format
    characters (the bidi overrides U+202A-202E and U+2066-2069, zero-width ones),
    separators and unassigned code points are written as escapes (``\\x1b``, ``\\n``,
    ``\\u202e``), as ``repr`` writes them; a name then cannot rewrite the terminal, forge a
    line or reorder what follows it."""
    text = str(text)
    if text.isprintable():      # the common case: no character to escape
        return text
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)


def _table(rows: List[List[str]], header: List[str]) -> str:
    header = [_shown(x) for x in header]
    rows = [[_shown(x) for x in r] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*map(str, r)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def _progress(args) -> bool:
    """Progress bars on a terminal (cleared when done); never when stderr is piped or
    redirected, or with ``-q``."""
    return not getattr(args, "quiet", False) and sys.stderr.isatty()


# ------------------------------------------------------------------------------ inspect
def _cmd_inspect(args) -> int:
    from .checkpoint import read_manifest
    m = read_manifest(args.ckpt, progress=_progress(args))
    meta = m.metadata
    steps = meta.get("steps", {}) if isinstance(meta.get("steps"), dict) else {}
    out = [f"checkpoint   {args.ckpt}",
           f"format       {m.info['format']} v{m.info['format_version']} "
           f"(written by statestore {m.info['statestore_version']}, save id {m.info['save_id']})",
           f"checksum     {m.info['checksum']}",
           f"tensors      {len(m.rows)} in {len(m.files)} shard(s), {_human(m.nbytes)} "
           f"({m.nbytes} bytes)"]
    if meta.get("optimizer"):
        out.append(f"optimizer    {meta['optimizer']} (metadata v{meta.get('version')})")
    if steps:
        vals = sorted(set(int(v) for v in steps.values()))
        out.append(f"step         {vals[0] if len(vals) == 1 else f'{vals[0]}..{vals[-1]}'} "
                   f"({len(steps)} parameters with state)")
    print("\n".join(_shown(line) for line in out))
    groups = meta.get("param_groups") or []
    if groups:
        print()
        hyper = [k for k in groups[0] if k != "params"]
        rows = [[str(i), str(len(g.get("params", [])))] + [json.dumps(g.get(k)) for k in hyper]
                for i, g in enumerate(groups)]
        print(_table(rows, ["group", "params"] + hyper))
    print()
    rows = [[r["key"], r["dtype"], "x".join(map(str, r["shape"])) or "()", _human(r["nbytes"]),
             str(steps.get(r["param"], "-")), r["file"], str(r["offset"])]
            for r in m.rows]
    print(_table(rows, ["tensor", "dtype", "shape", "size", "step", "file", "offset"]))
    return 0


# ------------------------------------------------------------------------------ verify
def _cmd_verify(args) -> int:
    from .checkpoint import read_manifest, verify_checkpoint
    problems = verify_checkpoint(args.ckpt, progress=_progress(args))
    if problems:
        for p in problems:
            print(f"FAILED: {_shown(p)}", file=sys.stderr)
        print(f"{args.ckpt}: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    m = read_manifest(args.ckpt, progress=_progress(args))
    print(f"OK: {args.ckpt}: {len(m.rows)} tensors in {len(m.files)} shard(s), "
          f"{_human(m.nbytes)}, every {m.info['checksum']} checksum matches")
    return 0


# ------------------------------------------------------------------------------ convert
def _open_tensor(m, r, verify: bool, bar=None):
    """The tensor of manifest row ``r``: mapped copy-on-write from local shards (pages load
    on access and stay evictable page cache), read into RAM from other filesystems."""
    import numpy as np
    import torch
    import xxhash
    from .checkpoint.filesystem import is_local, join
    from .errors import CheckpointCorruptError
    fpath = join(m.root, r["file"])
    spec = r["spec"]
    if spec.nbytes == 0:
        if verify and xxhash.xxh3_64(b"").hexdigest() != r["checksum"]:
            raise CheckpointCorruptError(f"{fpath}: checksum mismatch in tensor {r['key']!r}")
        return torch.empty(spec.shape, dtype=spec.dtype)
    if is_local(m.fs):
        raw = np.memmap(fpath, dtype=np.uint8, mode="c", offset=r["offset"], shape=(spec.nbytes,))
    else:
        raw = np.frombuffer(bytearray(m.fs.cat_file(fpath, start=r["offset"],
                                                    end=r["offset"] + spec.nbytes)), dtype=np.uint8)
    if verify and xxhash.xxh3_64(memoryview(raw)).hexdigest() != r["checksum"]:
        raise CheckpointCorruptError(f"{fpath}: checksum mismatch in tensor {r['key']!r}")
    if bar is not None:
        bar.update(spec.nbytes)
    return torch.from_numpy(raw).view(spec.dtype).view(spec.shape)


def to_torch_state_dict(path: str, verify: bool = True,
                        progress: Optional[bool] = False) -> Dict[str, Any]:
    """The checkpoint at ``path`` as ``torch.optim.AdamW``'s ``state_dict()``.

    Parameters are numbered in the order of the optimizer metadata's ``param_groups`` (torch's
    numbering); tensors of local checkpoints are memory-mapped, so only the pages being
    written out are in RAM. ``verify`` checks every checksum on the way. Compressed moments
    (metadata ``moment_dtype`` "bf16"/"int8") are decoded to fp32 tensors (in RAM).
    ``progress``: bars over the manifest and the bytes checked (True always, None for work
    over a second, False never).
    """
    from .checkpoint import read_manifest
    from .checkpoint.filesystem import progress as progress_bar
    from .checkpoint.shard_check import by_file, check_shard_header
    from .optim import StateStoreOptimizer
    from .optim._torch_format import checkpoint_groups, checkpoint_states
    m = read_manifest(path, progress=progress)
    index, groups, layout = checkpoint_groups(
        path, m.metadata, lambda md: StateStoreOptimizer.checkpoint_layout(path, md))
    for name, rows in by_file(m.rows).items():
        check_shard_header(m, name, rows)
    with progress_bar(m.nbytes, "checksums", progress if verify else False) as bar:
        state = checkpoint_states(path, m.metadata, layout, index, m.rows,
                                  lambda r: _open_tensor(m, r, verify, bar))
    return {"state": state, "param_groups": groups}


class _CountingFile:
    """A file object that counts the bytes written through it on a progress bar."""

    def __init__(self, f, bar):
        self._f, self._bar = f, bar

    def write(self, data) -> int:
        n = self._f.write(data)
        self._bar.update(len(memoryview(data).cast("B")))
        return n

    def flush(self) -> None:
        self._f.flush()


def _cmd_convert(args) -> int:
    import torch
    from .errors import StateStoreIOError, StateStoreValueError
    if args.to != "torch":
        raise StateStoreValueError(f"--to: unknown target {args.to!r} (supported: torch)")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if os.path.isdir(args.out):
        raise StateStoreValueError(f"output {args.out!r} is a directory; name a file")
    if not os.path.isdir(out_dir):
        raise StateStoreValueError(f"output {args.out!r}: directory {out_dir!r} does not exist")
    from .checkpoint.filesystem import progress as progress_bar
    sd = to_torch_state_dict(args.ckpt, verify=not args.no_verify, progress=_progress(args))
    total = sum(t.nbytes for st in sd["state"].values() for t in st.values()
                if isinstance(t, torch.Tensor))
    tmp = f"{args.out}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f, progress_bar(total, f"write {os.path.basename(args.out)}",
                                                _progress(args)) as bar:
            torch.save(sd, _CountingFile(f, bar))
        os.replace(tmp, args.out)
    except (OSError, RuntimeError) as e:
        raise StateStoreIOError(getattr(e, "errno", None) or 0,
                                f"writing {args.out!r} failed: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    n = sum(len(v) - 1 for v in sd["state"].values())
    print(f"wrote {args.out}: {len(sd['state'])} parameters, {n} state tensors, "
          f"{len(sd['param_groups'])} param group(s); load it with torch.optim.AdamW(...)"
          f".load_state_dict(torch.load({args.out!r}))")
    return 0


# ------------------------------------------------------------------------------ main
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="statestore", description="statestore checkpoint tools")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("inspect", help="list the tensors, steps and param groups of a checkpoint")
    a.add_argument("ckpt", help="checkpoint path or fsspec URL")
    a.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    a = sub.add_parser("verify", help="check every checksum of a checkpoint (exit 1 on damage)")
    a.add_argument("ckpt")
    a.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    a = sub.add_parser("convert", help="write a checkpoint in another format")
    a.add_argument("ckpt")
    a.add_argument("--to", required=True, choices=["torch"], help="target format")
    a.add_argument("out", help="output file (torch: a .pt file for torch.load)")
    a.add_argument("--no-verify", action="store_true", help="skip the checksums")
    a.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one command of the ``statestore`` CLI (``inspect``, ``verify``, ``convert``).

    Args:
        argv: the command line without the program name (None: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 success, 1 a damaged or missing checkpoint or any other
        :class:`~statestore.StateStoreError` (printed on stderr as ``statestore CMD: error:
        ...``).

    Raises:
        SystemExit: with status 2 on a usage error (argparse), or 0 for ``--help``.
    """
    args = _parser().parse_args(argv)
    from .errors import StateStoreError
    cmd = {"inspect": _cmd_inspect, "verify": _cmd_verify, "convert": _cmd_convert}[args.cmd]
    try:
        return cmd(args)
    except StateStoreError as e:
        print(f"statestore {args.cmd}: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:         # `statestore inspect X | head`
        return 0


def _run_and_exit() -> None:
    """Run the CLI, flush its output and leave at once: the work is done, and skipping the
    interpreter's teardown of native extensions avoids a rare abort ("terminate called
    without an active exception") seen at exit on this machine, which turned a successful
    command's exit status into 134."""
    rc = main()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:
        pass
    os._exit(rc)


if __name__ == "__main__":
    _run_and_exit()

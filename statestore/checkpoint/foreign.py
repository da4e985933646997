"""What a directory without a statestore manifest is, for :func:`read_manifest`'s message.

A user pointing ``load_checkpoint`` at a folder written by another tool (a transformers
``Trainer`` checkpoint, a ``torch.distributed.checkpoint`` folder, a Lightning or plain
``torch.save`` directory) must be told so, not that a save never finished; a folder holding
our own temporaries (``.shard-*.tmp``, ``shard-*``, ``.manifest.parquet.*``) is an unfinished
save; a subfolder that holds a manifest is named.
"""
from __future__ import annotations

from typing import List

__all__ = ["missing_manifest_message"]

#: file names that tell which tool wrote a folder
_SIGNS = (
    (".metadata", "a torch.distributed.checkpoint folder (load it with dcp.load)"),
    ("trainer_state.json", "a transformers Trainer checkpoint folder"),
    ("optimizer.pt", "a folder of torch.save files (optimizer.pt: load it with "
                     "torch.load and optimizer.load_state_dict)"),
    ("model.safetensors", "a folder of model weights"),
    ("pytorch_model.bin", "a folder of model weights"),
    ("config.json", "a model folder"),
)


def missing_manifest_message(fs, root: str, path: str, manifest: str) -> str:
    """Why ``root`` (an existing directory) holds no checkpoint."""
    try:
        entries = fs.ls(root, detail=True)
    except Exception:                    # cannot list it: say only what is certain
        return f"{path!r} holds no complete checkpoint ({manifest} is missing)"
    names: List[str] = []
    subdirs: List[str] = []
    for e in entries:
        base = str(e.get("name", "")).rstrip("/").rsplit("/", 1)[-1]
        names.append(base)
        if e.get("type") == "directory":
            subdirs.append(base)
    ours = [n for n in names if n.startswith(("shard-", ".shard-", f".{manifest}."))]
    if ours:
        return (f"{path!r} holds no complete checkpoint ({manifest} is missing but "
                f"{ours[0]!r} of a statestore save is there: a save that never finished?)")
    for d in sorted(subdirs):
        try:
            if fs.exists(f"{root.rstrip('/')}/{d}/{manifest}"):
                return (f"{path!r} is not a statestore checkpoint, but its subfolder {d!r} "
                        f"is: load {path.rstrip('/')}/{d}")
        except Exception:
            continue
    if not names:
        return f"{path!r} is an empty directory, not a statestore checkpoint"
    kind = next((what for sign, what in _SIGNS if sign in names), "written by another tool")
    shown = ", ".join(repr(n) for n in sorted(names)[:4])
    more = f" and {len(names) - 4} more" if len(names) > 4 else ""
    return (f"{path!r} is not a statestore checkpoint: it has no {manifest} and holds "
            f"{shown}{more} ({kind}); a statestore checkpoint is a folder written by "
            f"store.save_checkpoint")

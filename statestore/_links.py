"""The checkpoint-link seam of a store: how a linked checkpoint save (and a ``state_dict()``
snapshot) takes the store's files as shards by hard link instead of copying their states, and
how a linked load takes a checkpoint's shards as the store's files (docs/scale.md).

Every store holds a :class:`FileLinks` object as ``store.links``: the default links nothing
(every store but those with files copies); NVMeStore holds an ``NVMeLinks``
(``backends/_nvme_links.py``), TieredStore one over its tiers. A linked save asks
``store.links.linkable(...)`` (through the ``SavedStates`` the store hands the save); a linked
load calls the adopt operation ``StateStore.load_checkpoint`` hands it (the store's
``_adopt_file``), which asks ``store.links.adopt(...)`` and registers the states in the
store's catalogue."""
from __future__ import annotations

from typing import List, Sequence, Tuple

from ._types import LinkableFile, StateKey, StateSpec

__all__ = ["FileLinks", "NO_LINKS"]


class FileLinks:
    """What a store's files offer checkpoints. This base offers nothing: no file to link,
    no shard adopted (the states are copied)."""

    def linkable(self, keys: Sequence[StateKey], root: str,
                 shard_bytes: int) -> List[LinkableFile]:
        """The files a checkpoint in the local directory ``root`` may hard-link as shards;
        each holds only states of ``keys``, at most ``shard_bytes`` of them or one state."""
        return []

    def adopt(self, path: str, rows: Sequence[Tuple[StateKey, StateSpec, int, str]],
              names: Sequence[str]) -> bool:
        """Take the checkpoint shard at ``path`` as one of the store's files, its states
        ``rows`` placed in it; False where it cannot (nothing changed)."""
        return False


#: The links of a store without files to link.
NO_LINKS = FileLinks()

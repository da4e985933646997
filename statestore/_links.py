"""The checkpoint-link seam of a store: how a linked checkpoint save (and a ``state_dict()``
snapshot) takes the store's files as shards by hard link instead of copying their states, and
how a linked load takes a checkpoint's shards as the store's files (docs/scale.md). Backends
with files implement the two hooks (NVMeStore); every other store copies."""
from __future__ import annotations

from typing import List, Sequence, Tuple

from ._types import LinkableFile, StateKey, StateSpec

__all__ = ["LinkSeam"]


class LinkSeam:
    """Part of :class:`~statestore.StateStore`: the public seam checkpoints call, and the
    backend hooks behind it."""

    def _linkable(self, keys: Sequence[StateKey], root: str, shard_bytes: int) -> List["LinkableFile"]:
        """Backend hook of :meth:`linkable_files`. Default: none."""
        return []

    def _adopt(self, path: str, rows: Sequence[Tuple[StateKey, StateSpec, int, str]],
               names: Sequence[str]) -> bool:
        """Backend hook of :meth:`adopt_file`: take the file. Default: False (cannot)."""
        return False

    def linkable_files(self, keys: Sequence[StateKey], root: str,
                       shard_bytes: int) -> List[LinkableFile]:
        """For checkpoint saves and ``state_dict()`` snapshots (call after :meth:`sync`):
        the store's files that a checkpoint in the local directory ``root`` may hard-link as
        shards instead of copying their states; each holds only states of ``keys``, at most
        ``shard_bytes`` of them or a single state.

        Returns:
            :class:`~statestore._types.LinkableFile` records (none for most stores).
        """
        return self._linkable(keys, root, shard_bytes)

    def adopt_file(self, path: str, rows: Sequence[Tuple[StateKey, StateSpec, int, str]],
                   names: Sequence[str]) -> bool:
        """For linked loads: take the checkpoint shard at the local ``path`` as one of the
        store's files (a hard link, never written: copy-on-write) instead of copying its
        states, and register them. ``rows``: ``(key, spec, data offset, checksum)`` of the
        states it holds; ``names``: every tensor in it but pads.

        Returns:
            True when the states are now in the store (the caller verifies their checksums);
            False where the store cannot, and nothing changed.
        """
        self._check_open()
        self.cancel_prefetch()
        if any(k in self._specs for k, _, _, _ in rows) or not self._adopt(path, rows, names):
            return False
        for k, spec, _, _ in rows:
            self._specs[k] = spec
            self._aligned_bytes += self._ring_bytes(spec)
            self._in_flight.repaired(k)
        return True


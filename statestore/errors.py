"""The ``StateStoreError`` family: every error statestore raises on purpose derives from it;
and :class:`ResumeWarning`, the category of its warnings about what a checkpoint replaced.

Subclasses also derive from the built-in exception that fits, so callers catching
``ValueError``/``KeyError``/``OSError`` keep working.
"""
from __future__ import annotations

__all__ = [
    "StateStoreError",
    "StateStoreValueError",
    "StateKeyError",
    "StateStoreClosedError",
    "StateStoreIOError",
    "BudgetError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "RankLostError",
    "ExtensionMismatchError",
    "ResumeWarning",
]


class StateStoreError(Exception):
    """Base class of every statestore error."""


class StateStoreValueError(StateStoreError, ValueError):
    """An argument has a wrong value or type; the message names the argument."""


class StateKeyError(StateStoreError, KeyError):
    """A state key is unknown to the store (or already exists where a new one was asked)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class StateStoreClosedError(StateStoreError, RuntimeError):
    """The store was closed; no further operation is possible."""


class StateStoreIOError(StateStoreError, OSError):
    """Reading or writing a store file failed; the message names the file and the cause."""


class BudgetError(StateStoreError, ValueError):
    """A request does not fit in the configured RAM budget."""


class CheckpointError(StateStoreError):
    """Base class of checkpoint errors."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No complete checkpoint at the given path (absent, a save that never finished, or a
    folder written by another tool: the message says which)."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file or tensor is truncated, altered or missing; the message names it."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A checkpoint does not match the parameters it is applied to; the message lists the
    differences."""


class RankLostError(CheckpointError):
    """A collective save or load over a process group lost a rank (killed, crashed, its
    connection broken); the message names it where this rank can tell which, and says what
    became of the checkpoint. ``ranks``: the ranks known lost (empty when none could be told).
    """

    def __init__(self, message: str, ranks=()):
        super().__init__(message)
        self.ranks = tuple(ranks)


class ExtensionMismatchError(StateStoreError, ImportError):
    """statestore's compiled extensions were built against another torch (or CUDA) release
    than the one installed, or carry no record of it; raised by ``import statestore`` before
    anything is loaded. The message names both releases and the rebuild command."""


class ResumeWarning(UserWarning):
    """A checkpoint loaded into a live optimizer replaced what the caller had set: the states
    and step counts of an optimizer that had already stepped, or a hyperparameter given to its
    constructor. The checkpoint's values are applied (as ``load_state_dict`` does); the
    message names what was replaced and how to keep it. Filter it with
    ``warnings.filterwarnings("ignore", category=statestore.ResumeWarning)``."""

"""The repository's folders, and the environment of a process a test starts (it imports the
statestore under test and these helpers, whatever its working directory)."""
from __future__ import annotations

import os
from typing import Dict

import statestore

#: ``tests/``
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the repository's root (``benchmarks/``, ``examples/``, ``docs/``, ``scripts/``)
ROOT = os.path.dirname(TESTS)
#: ``tests/data``: checked-in checkpoints and files the tests read
DATA = os.path.join(TESTS, "data")
#: the folder holding the ``statestore`` package the tests import
SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(statestore.__file__)))


def env(**extra: str) -> Dict[str, str]:
    """``os.environ`` with ``PYTHONPATH`` naming the statestore under test and ``tests/``
    first (so ``import statestore`` and ``import helpers`` work in the child), plus ``extra``."""
    path = [SOURCE, TESTS] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path), **extra)

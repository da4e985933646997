"""Garbage collections that walk only what a test makes.

A full ``gc.collect()`` in a test process walks every object that torch, dynamo, pyarrow and
the suite's modules hold (~300k: 0.4-0.8 s each on the development host). A test that
collects in a loop (a store dropped without ``close()``) needs only
the objects it makes: inside :func:`new_objects_only` what existed before is frozen
(``gc.freeze``) and each ``gc.collect()`` walks the rest. A cycle of objects made inside is
found as before; an old object is skipped (one that turns into garbage inside the block is
collected after it)."""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def new_objects_only():
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()

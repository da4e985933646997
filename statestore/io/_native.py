"""Imports ``statestore._C_io`` once and keeps the reason when it is missing."""
from __future__ import annotations

import os

__all__ = ["native", "native_error"]

native = None
native_error: str | None = None

if os.environ.get("STATESTORE_NO_NATIVE_IO") == "1":
    native_error = "disabled by STATESTORE_NO_NATIVE_IO=1"
else:
    try:
        from statestore import _C_io as native  # type: ignore[no-redef]
    except ImportError as e:  # not built: the pure-Python thread engine stands in
        native = None
        native_error = (f"statestore._C_io is not built ({e}); build it with "
                        "`STATESTORE_EXT=io python setup.py build_ext --inplace`")

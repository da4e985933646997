"""Imports ``statestore._C_io`` once and keeps the reason when it is missing."""
from __future__ import annotations

import os

__all__ = ["native", "native_error"]

native = None
native_error: str | None = None

if os.environ.get("STATESTORE_NO_NATIVE_IO") == "1":
    native_error = "disabled by STATESTORE_NO_NATIVE_IO=1"
else:
    # Ctrl-C deferred while the module initializes: pybind11 turns an exception there into
    # ImportError, which would leave the process on the thread engine for its life (the
    # compiled kernels' import, kernels/_dispatch.load_extension, does the same)
    from .._signals import deferred_signals
    try:
        with deferred_signals():
            from statestore import _C_io as native  # type: ignore[no-redef]
    except ImportError as e:  # not built: the pure-Python thread engine stands in
        native = None
        native_error = (f"statestore._C_io is not built ({e}); build it with "
                        "`STATESTORE_EXT=io python setup.py build_ext --inplace`")

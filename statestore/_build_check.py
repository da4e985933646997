"""Checks, before any compiled extension is loaded, that it was built against the torch now
installed.

setup.py compiles ``csrc/build_info.cpp`` into each extension: a string
``statestore-build-info:torch=X.Y.Z;cuda=N;end`` (the torch release of the headers compiled
against; ``cuda`` is ``CUDART_VERSION`` where the CUDA kernels were compiled in, else ``none``).
:func:`check_extensions` reads it from the files, without loading them, and raises
:class:`~statestore.errors.ExtensionMismatchError` where the release (or CUDA) differs from the
installed torch's, or where a file carries no record: loading C++ code built against another
torch's ABI fails in unpredictable ways (undefined symbols at best).
"""
from __future__ import annotations

import json
import mmap
import os
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from typing import Dict, List, Optional, Tuple

import torch

from .errors import ExtensionMismatchError

__all__ = ["EXTENSIONS", "build_info", "check_extensions", "extension_files", "rebuild_hint"]

EXTENSIONS = ("_C_adam", "_C_io")
_MARK = b"statestore-build-info:"
_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def extension_files(package_dir: str = _PACKAGE) -> List[Tuple[str, str]]:
    """``(name, path)`` of each compiled extension present, the file Python would import."""
    found = []
    for name in EXTENSIONS:
        for suffix in EXTENSION_SUFFIXES:
            path = os.path.join(package_dir, name + suffix)
            if os.path.isfile(path):
                found.append((name, path))
                break
    return found


def build_info(path: str) -> Optional[Dict[str, str]]:
    """The record of what the extension at ``path`` was built against (``{"torch": "2.13.0",
    "cuda": "12080" or "none"}``), or None when the file has none."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return None
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            i = m.find(_MARK)
            if i < 0:
                return None
            j = m.find(b";end", i, i + 256)
            if j < 0:
                return None
            text = m[i + len(_MARK):j].decode("ascii", "replace")
    return dict(kv.split("=", 1) for kv in text.split(";") if "=" in kv)


def _cuda_major(version) -> str:
    """"13.2" -> "13"; None (a torch without CUDA) stays None."""
    return None if version is None else str(version).split(".")[0]


def _cuda_name(cudart: str) -> str:
    """CUDART_VERSION ("12080") as torch.version.cuda writes it ("12.8")."""
    try:
        v = int(cudart)
    except ValueError:
        return cudart
    return f"{v // 1000}.{(v % 1000) // 10}"


def rebuild_hint(package_dir: str = _PACKAGE) -> str:
    """The command that rebuilds the extensions against the installed torch, as precise as
    this installation allows (a source checkout, an install from a directory, a wheel)."""
    py = sys.executable or "python"
    root = os.path.dirname(package_dir)
    if os.path.isfile(os.path.join(root, "setup.py")):
        return f"`cd {root} && {py} setup.py build_ext --inplace`"
    source = None
    try:
        from importlib.metadata import PackageNotFoundError, distribution
        try:
            url = json.loads(distribution("statestore").read_text("direct_url.json") or "{}")
        except PackageNotFoundError:
            url = {}
        if url.get("url", "").startswith("file://") and "dir_info" in url:
            source = url["url"][len("file://"):]
    except (ValueError, OSError):
        pass
    return (f"`{py} -m pip install --no-build-isolation --force-reinstall --no-deps "
            f"{source or '<the statestore source directory>'}`")


def check_extensions(package_dir: str = _PACKAGE) -> None:
    """Raises :class:`ExtensionMismatchError` when an extension in ``package_dir`` was built
    against another torch release or CUDA version than the installed torch's, or carries no
    record of it. Nothing is loaded."""
    running = torch.__version__.split("+")[0]
    running_cuda = torch.version.cuda
    bad, built = [], set()
    for name, path in extension_files(package_dir):
        rel = os.path.join("statestore", os.path.basename(path))
        try:
            info = build_info(path)
        except OSError as e:
            raise ExtensionMismatchError(f"statestore: cannot read {path}: {e}") from e
        if info is None or "torch" not in info:
            bad.append(f"{rel} carries no record of the torch it was built against (built by "
                       f"an older statestore)")
            built.add(None)
            continue
        cuda = info.get("cuda", "none")
        what = f"torch {info['torch']}" + (f" with CUDA {_cuda_name(cuda)}" if cuda != "none" else "")
        if info["torch"] != running:
            bad.append(f"{rel} was built against {what}")
            built.add(info["torch"])
        elif cuda != "none" and _cuda_major(_cuda_name(cuda)) != _cuda_major(running_cuda):
            # CUDA's minor-version compatibility: kernels built with toolkit 13.0 run on
            # torch's 13.2 runtime; another major version does not
            bad.append(f"{rel} was built against {what}, and this torch has "
                       + (f"CUDA {running_cuda}" if running_cuda else "no CUDA"))
            built.add(None)
    if not bad:
        return
    only = next(iter(built)) if len(built) == 1 else None
    head = (f"statestore's compiled extensions were built against torch {only}, but torch "
            f"{torch.__version__} is installed" if only else
            f"statestore's compiled extensions do not match the installed torch "
            f"{torch.__version__}")
    other = f", or install the torch they were built for: `pip install torch=={only}`" if only else ""
    files = (", ".join(os.path.join("statestore", os.path.basename(p))
                       for _, p in extension_files(package_dir)) if only else "; ".join(bad))
    raise ExtensionMismatchError(
        f"{head}. Rebuild them against the installed torch: {rebuild_hint(package_dir)}{other}. "
        f"({files}.)")

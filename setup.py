"""Builds statestore's C++ extensions with torch's cpp_extension.

Two extensions, built independently so that a failure in one never removes the other:

* ``statestore._C_adam``: the SIMD CPU Adam kernel (``csrc/adam``), plus the fused CUDA
  kernel (``csrc/cuda``) when the installed torch has CUDA and nvcc is found.
* ``statestore._C_io``: the asynchronous I/O engines (``csrc/io``); io_uring and libaio are
  compiled in when Debian's liburing-dev / libaio-dev are installed, the thread-pool engine
  always.

``STATESTORE_EXT=adam`` (or ``io``) builds only that extension, for quick iteration
(``STATESTORE_EXT=io python setup.py build_ext --inplace``).

Set ``STATESTORE_NO_EXT=1`` to install the pure-Python package only (the optimizers then use
the vectorized torch path and warn once).
"""
import glob
import os
import shutil
import subprocess
import sys
import tempfile

from setuptools import setup


def _has_lib(header, lib):
    """True when ``#include <header>`` compiles and links against ``-l<lib>``."""
    cc = os.environ.get("CC", "cc")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "t.c")
        with open(src, "w") as f:
            f.write(f"#include <{header}>\nint main(void){{return 0;}}\n")
        r = subprocess.run([cc, src, f"-l{lib}", "-o", os.path.join(d, "t")],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return r.returncode == 0


def _extensions():
    if os.environ.get("STATESTORE_NO_EXT") == "1":
        return [], {}
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, CUDA_HOME

    here = os.path.dirname(os.path.abspath(__file__))
    csrc = os.path.join(here, "csrc")
    cxx = ["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno"]
    exts = []
    only = os.environ.get("STATESTORE_EXT", "")

    adam_src = sorted(glob.glob(os.path.join("csrc", "adam", "*.cpp")))
    cuda_src = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
    want_cuda = (torch.version.cuda is not None and CUDA_HOME is not None
                 and os.environ.get("STATESTORE_NO_CUDA") != "1" and cuda_src)
    if adam_src and only in ("", "adam"):
        # -ffp-contract=off: the kernels fuse multiply-adds only where csrc/adam_math.h says
        # so, so that SIMD bodies and scalar tails give the same bits.
        adam_cxx = cxx + ["-ffp-contract=off"]
        common = dict(include_dirs=[csrc], extra_link_args=["-fopenmp"])
        if want_cuda:
            cuda_bind = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cpp")))
            exts.append(CUDAExtension(
                "statestore._C_adam", adam_src + cuda_src + cuda_bind,
                define_macros=[("STATESTORE_WITH_CUDA", "1")],
                # no --use_fast_math: it swaps IEEE sqrt/div for approximations
                extra_compile_args={"cxx": adam_cxx, "nvcc": ["-O3", "-std=c++17", "--fmad=false"]},
                **common))
        else:
            exts.append(CppExtension("statestore._C_adam", adam_src,
                                     extra_compile_args=adam_cxx, **common))

    io_src = sorted(glob.glob(os.path.join("csrc", "io", "*.cpp")))
    if io_src and only in ("", "io"):
        macros, libs = [], []
        if _has_lib("liburing.h", "uring"):
            macros.append(("STATESTORE_WITH_URING", "1"))
            libs.append("uring")
        else:
            print("statestore: liburing not found, io_uring engine disabled", file=sys.stderr)
        if _has_lib("libaio.h", "aio"):
            macros.append(("STATESTORE_WITH_AIO", "1"))
            libs.append("aio")
        else:
            print("statestore: libaio not found, libaio engine disabled", file=sys.stderr)
        exts.append(CppExtension("statestore._C_io", io_src, include_dirs=[csrc],
                                 define_macros=macros, libraries=libs + ["pthread"],
                                 extra_compile_args=["-O2", "-std=c++17"]))
    return exts, {"build_ext": BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)

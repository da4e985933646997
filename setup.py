"""Builds statestore's C++ extensions against the installed torch (torch.utils.cpp_extension).

Two extensions, built independently so that a failure in one never removes the other:

* ``statestore._C_adam``: the SIMD CPU Adam kernel (``csrc/adam``), plus the fused CUDA
  kernel (``csrc/cuda``) when the installed torch has CUDA and nvcc is found.
* ``statestore._C_io``: the asynchronous I/O engines (``csrc/io``); io_uring and libaio are
  compiled in when Debian's liburing-dev / libaio-dev are installed, the thread-pool engine
  always.

Each extension records the torch (and CUDA) it was compiled against (``csrc/build_info.cpp``);
``import statestore`` reads that record before loading anything and refuses a build for another
torch with one error that names both versions and the rebuild command. The package's run-time
requirement is the same torch release (``torch==X.Y.Z``), so pip never pairs a wheel with
another torch. Build against your own torch with ``pip install --no-build-isolation .``: with
build isolation pip builds against the ``torch`` of pyproject.toml's ``build-system.requires``
in a temporary environment, and this script stops when the environment being installed into
already has another torch (installing would replace it).

Environment:

* ``STATESTORE_EXT=adam`` (or ``io``) builds only that extension, for quick iteration
  (``STATESTORE_EXT=io python setup.py build_ext --inplace``).
* ``STATESTORE_NO_EXT=1`` installs the pure-Python package only (the optimizers then use the
  vectorized torch path and warn once; the requirement is then any ``torch>=2.1``).
* ``STATESTORE_NO_CUDA=1`` builds the CPU kernels only, even where nvcc is found.
* ``STATESTORE_DEBUG=1`` keeps debug information (``-g``) and symbols; release builds (the
  default) have neither.
* ``MAX_JOBS=N``: parallel compile jobs (torch's setting; default: ninja's, cores + 2).
"""
import glob
import os
import subprocess
import sys
import tempfile
import time

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
DEBUG = os.environ.get("STATESTORE_DEBUG") == "1"


def _say(msg):
    print(f"statestore build: {msg}", file=sys.stderr, flush=True)


def _fail(msg):
    _say(f"FAILED: {msg}")
    sys.exit(1)


def _public(version):
    """'2.13.0+cpu' -> '2.13.0' (the release, without a local label)."""
    return version.split("+")[0]


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


def _check_isolated_torch(torch):
    """Under pip's build isolation the torch imported here is the temporary environment's.
    When the environment pip installs into (the interpreter running this script, without
    pip's overlay) has another torch release, stop: the wheel would require the build's
    torch and pip would replace the user's."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    r = subprocess.run([sys.executable, "-c", "import torch, os; "
                        "print(torch.__version__, os.path.realpath(torch.__file__))"],
                       env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True)
    if r.returncode != 0 or not r.stdout.strip():
        return  # no torch there: pip installs the one the build used
    theirs, where = r.stdout.split(maxsplit=1)
    if os.path.realpath(torch.__file__) == where.strip():
        return  # the same torch: no isolation
    if _public(theirs) != _public(torch.__version__):
        _fail(f"this environment has torch {theirs}, but pip's isolated build environment has "
              f"torch {torch.__version__}; extensions built there would need torch=="
              f"{_public(torch.__version__)} and pip would replace yours. Build against your "
              f"torch instead: pip install --no-build-isolation {HERE} "
              f"(with setuptools and ninja installed: pip install setuptools ninja)")
    _say(f"building in pip's isolated environment against its torch {torch.__version__} "
         f"(yours: {theirs}, the same release); --no-build-isolation uses yours directly")


def _find_ninja():
    """torch's BuildExtension runs `ninja` from PATH; a venv's ninja (pip install ninja) is
    not on PATH when the venv is not activated: put the interpreter's bin directory first."""
    bindir = os.path.dirname(sys.executable)
    if os.path.exists(os.path.join(bindir, "ninja")):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    from shutil import which
    return which("ninja")


def _toolkit(home):
    """True when ``home`` is a CUDA toolkit: ``bin/nvcc`` and ``include/cuda_runtime_api.h``."""
    return bool(home) and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK) and \
        os.path.isfile(os.path.join(home, "include", "cuda_runtime_api.h"))


def _cuda_home(found):
    """The CUDA toolkit to build with: torch's choice (``CUDA_HOME``, ``CUDA_PATH``, the
    ``nvcc`` on PATH, ``/usr/local/cuda``) where it is one; else the toolkit the ``nvcc`` on
    PATH belongs to, which it names itself (``nvcc --dryrun``: ``TOP=``) when it is a wrapper
    script or a link outside the toolkit (``/usr/local/bin/nvcc`` -> ``exec
    /usr/local/cuda-X/bin/nvcc``: torch takes ``/usr/local`` and finds no CUDA headers)."""
    if found is None or _toolkit(found):
        return found
    from shutil import which
    nvcc = which("nvcc")
    if nvcc:
        r = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                           capture_output=True, text=True)
        for line in (r.stdout + r.stderr).splitlines():
            if line.startswith("#$ TOP="):
                top = os.path.realpath(line.split("=", 1)[1].strip())
                if _toolkit(top):
                    return top
    for home in ("/usr/local/cuda",):
        if _toolkit(home):
            return home
    _fail(f"CUDA_HOME {found} is not a CUDA toolkit (no bin/nvcc and include/"
          f"cuda_runtime_api.h there), and no other was found: set CUDA_HOME to one, or "
          f"STATESTORE_NO_CUDA=1 for the CPU kernels only")


def _cuda_arch_list(torch):
    """The CUDA architectures the kernels are compiled for, and where that choice came from.

    ``TORCH_CUDA_ARCH_LIST`` wins; else, with GPUs visible, torch's own choice (each visible
    card's); else (a Docker build, a CI runner: no GPU to ask) the architectures the installed
    torch was built for, ``torch.cuda.get_arch_list()`` (``sm_90`` -> ``9.0``, ``sm_90a`` ->
    ``9.0a``, a ``compute_XY`` entry adds ``+PTX`` to ``X.Y``), exported as
    ``TORCH_CUDA_ARCH_LIST`` for torch's BuildExtension, which would otherwise stop with an
    IndexError (torch >= 2.14) or guess."""
    given = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if given and given != "native":
        return given, "TORCH_CUDA_ARCH_LIST"
    try:
        visible = torch.cuda.device_count()
    except Exception:  # a driver that cannot be initialized counts as no GPU
        visible = 0
    if visible:
        caps = sorted({"%d.%d" % torch.cuda.get_device_capability(i) for i in range(visible)})
        return ";".join(caps), f"the {visible} visible GPU(s)"
    sm, ptx = [], set()
    for arch in torch.cuda.get_arch_list():
        kind, _, num = arch.partition("_")
        if not num[:2].isdigit():
            continue
        ver = f"{num[:-1]}.{num[-1]}" if num.isdigit() else f"{num[:-2]}.{num[-2:]}"
        if kind == "sm":
            sm.append(ver)
        elif kind == "compute":
            ptx.add(ver)
    if not sm and not ptx:
        _fail("no GPU is visible, TORCH_CUDA_ARCH_LIST is not set and the installed torch "
              f"{torch.__version__} names no CUDA architectures (torch.cuda.get_arch_list() is "
              "empty): set TORCH_CUDA_ARCH_LIST (e.g. '9.0') or STATESTORE_NO_CUDA=1")
    archs = [v + ("+PTX" if v in ptx else "") for v in sm] + sorted(ptx - set(sm))
    os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(archs)
    return os.environ["TORCH_CUDA_ARCH_LIST"], "torch.cuda.get_arch_list() (no GPU visible)"


def _extensions():
    if os.environ.get("STATESTORE_NO_EXT") == "1":
        _say("STATESTORE_NO_EXT=1: no C++ extensions (the pure-Python package)")
        return [], {}, "torch>=2.1"
    try:
        import torch
        from torch.utils.cpp_extension import (BuildExtension, CppExtension, CUDAExtension,
                                               CUDA_HOME)
    except ImportError as e:
        _fail(f"torch is not importable ({e}): statestore compiles its extensions against the "
              f"installed torch. Install torch first (pip install torch), then pip install "
              f"--no-build-isolation {HERE}; or STATESTORE_NO_EXT=1 for the "
              f"pure-Python package")
    _check_isolated_torch(torch)

    csrc = os.path.join(HERE, "csrc")
    # Release: no debug information (-g0 overrides the -g of Python's own CFLAGS), stripped
    # at link (-s). The heavy part of each binding file is torch's headers: the bindings
    # include only the ones they use.
    debug = ["-g"] if DEBUG else ["-g0"]
    link = [] if DEBUG else ["-s"]
    # -fvisibility=hidden: only PyInit_* is exported (pybind11's advice; no visibility warnings)
    # No -std: torch's BuildExtension adds the standard its own headers need (C++17 headers
    # up to torch 2.13, C++20 from 2.14: std::strong_ordering, `requires`), for g++ and nvcc.
    cxx = ["-O3", "-fopenmp", "-fno-math-errno", "-fvisibility=hidden"] + debug
    exts = []
    only = os.environ.get("STATESTORE_EXT", "")
    # what each extension was compiled against, read back before import (_build_check.py)
    info_src = [os.path.join("csrc", "build_info.cpp")]

    adam_src = sorted(glob.glob(os.path.join("csrc", "adam", "*.cpp")))
    cuda_src = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
    if torch.version.cuda is not None and CUDA_HOME is not None \
            and os.environ.get("STATESTORE_NO_CUDA") != "1":
        home = _cuda_home(CUDA_HOME)
        if home != CUDA_HOME:   # torch's include and library paths follow its module global
            _say(f"CUDA toolkit: {home} (torch guessed {CUDA_HOME}, which has no CUDA headers)")
            import torch.utils.cpp_extension as cpp_ext
            cpp_ext.CUDA_HOME = CUDA_HOME = home
            os.environ["CUDA_HOME"] = home
    want_cuda = (torch.version.cuda is not None and CUDA_HOME is not None
                 and os.environ.get("STATESTORE_NO_CUDA") != "1" and cuda_src)
    want_cuda = bool(want_cuda and adam_src and only in ("", "adam"))
    arch_list, arch_from = _cuda_arch_list(torch) if want_cuda else (None, None)
    if adam_src and only in ("", "adam"):
        # -ffp-contract=off: the kernels fuse multiply-adds only where csrc/adam_math.h says
        # so, so that SIMD bodies and scalar tails give the same bits.
        adam_cxx = cxx + ["-ffp-contract=off"]
        common = dict(include_dirs=[csrc], extra_link_args=["-fopenmp"] + link)
        if want_cuda:
            cuda_bind = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cpp")))
            exts.append(CUDAExtension(
                "statestore._C_adam", adam_src + cuda_src + cuda_bind + info_src,
                define_macros=[("STATESTORE_WITH_CUDA", "1")],
                # no --use_fast_math: it swaps IEEE sqrt/div for approximations
                extra_compile_args={"cxx": adam_cxx,
                                    "nvcc": ["-O3", "--fmad=false"]
                                    + (["-g"] if DEBUG else [])},
                **common))
        else:
            exts.append(CppExtension("statestore._C_adam", adam_src + info_src,
                                     extra_compile_args=adam_cxx, **common))

    io_src = sorted(glob.glob(os.path.join("csrc", "io", "*.cpp")))
    if io_src and only in ("", "io"):
        macros, libs = [], []
        if _has_lib("liburing.h", "uring"):
            macros.append(("STATESTORE_WITH_URING", "1"))
            libs.append("uring")
        else:
            _say("liburing not found, io_uring engine disabled (apt-get install liburing-dev)")
        if _has_lib("libaio.h", "aio"):
            macros.append(("STATESTORE_WITH_AIO", "1"))
            libs.append("aio")
        else:
            _say("libaio not found, libaio engine disabled (apt-get install libaio-dev)")
        exts.append(CppExtension("statestore._C_io", io_src + info_src, include_dirs=[csrc],
                                 define_macros=macros, libraries=libs + ["pthread"],
                                 extra_compile_args=["-O2", "-fvisibility=hidden"] + debug,
                                 extra_link_args=link))

    ninja = _find_ninja()
    jobs = os.environ.get("MAX_JOBS") or f"ninja's default ({os.cpu_count()} cores + 2)"
    cuda = (f"CPU and CUDA {torch.version.cuda} (nvcc in {CUDA_HOME}; architectures "
            f"{arch_list} from {arch_from})" if want_cuda
            else "CPU only" + (f" (torch has CUDA {torch.version.cuda}, but no nvcc was found: "
                               "set CUDA_HOME)" if torch.version.cuda and not CUDA_HOME else ""))
    _say(f"torch {torch.__version__} ({os.path.dirname(torch.__file__)}), {cuda}; "
         f"{'debug (-g, not stripped)' if DEBUG else 'release (no debug information, stripped)'}; "
         + (f"ninja, {jobs} jobs" if ninja else
            "ninja not found: one file at a time (pip install ninja builds in parallel)"))

    class Build(BuildExtension):
        """torch's BuildExtension, saying what it compiles and how long it took; each
        extension in a build directory of its own (csrc/build_info.cpp is in both)."""

        def build_extension(self, ext):
            files = ", ".join(os.path.relpath(s, HERE) if os.path.isabs(s) else s
                              for s in ext.sources)
            _say(f"compiling {ext.name} ({len(ext.sources)} files: {files})")
            base, t0 = self.build_temp, time.monotonic()
            self.build_temp = os.path.join(base, ext.name.rsplit(".", 1)[-1])
            try:
                super().build_extension(ext)
            finally:
                self.build_temp = base
            out = self.get_ext_fullpath(ext.name)
            size = os.path.getsize(out) / 1e6 if os.path.exists(out) else 0.0
            _say(f"{ext.name}: built in {time.monotonic() - t0:.0f} s ({size:.1f} MB)")

    return (exts, {"build_ext": Build.with_options(use_ninja=ninja is not None)},
            f"torch=={_public(torch.__version__)}")


# pyproject.toml's run-time requirements are dynamic: torch (the release the extensions were
# built against) and these (scripts/gpu_test.sh reads this list)
REQUIRES = ["safetensors>=0.4", "fsspec>=2023.1", "pyarrow>=12", "tqdm>=4.60", "xxhash>=3",
            "numpy"]

ext_modules, cmdclass, torch_requirement = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass, install_requires=[torch_requirement] + REQUIRES)

"""The build and its record: each compiled extension names the torch it was built against,
``import statestore`` refuses extensions built for another torch (one error naming both
releases and the rebuild command, nothing loaded), the version is written once."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest
import torch

from statestore._build_check import build_info, check_extensions, extension_files
from statestore.errors import ExtensionMismatchError, StateStoreError

from helpers import paths

ROOT = Path(__file__).resolve().parent.parent
RELEASE = torch.__version__.split("+")[0]
BUILT = extension_files()


def _fake_extension(folder: Path, name: str, record: bytes | None) -> Path:
    path = folder / (name + EXTENSION_SUFFIXES[0])
    body = b"\x7fELF" + os.urandom(4096)
    if record is not None:
        body += b"\0statestore-build-info:" + record + b";end\0" + os.urandom(512)
    path.write_bytes(body)
    return path


@pytest.mark.skipif(not BUILT, reason="no compiled extension in statestore/")
def test_each_extension_records_the_torch_it_was_built_against():
    for name, path in BUILT:
        info = build_info(path)
        assert info is not None, f"{path} has no build record"
        assert info["torch"] == RELEASE, (name, info)
        assert info["cuda"] == "none" or torch.version.cuda, (name, info)
    check_extensions()  # the installed torch: nothing to say


@pytest.mark.skipif(not BUILT, reason="no compiled extension in statestore/")
def test_import_under_another_torch_is_one_clear_error():
    # a fake version bump: installing a second torch costs gigabytes
    code = ("import torch; torch.__version__ = '2.99.1+cpu'\n"
            "import statestore\n")
    # the statestore under test: the checkout's (make test) or an installed one (make test-torch;
    # cwd elsewhere than the checkout, whose sources `python -c` would import first)
    r = subprocess.run([sys.executable, "-c", code], cwd=paths.SOURCE, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": paths.SOURCE})
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("statestore.errors.ExtensionMismatchError: "), r.stderr[-2000:]
    assert f"built against torch {RELEASE}, but torch 2.99.1+cpu is installed" in last
    # the rebuild command of a checkout, or of an installed package
    assert ("setup.py build_ext --inplace" in last
            or "pip install --no-build-isolation --force-reinstall" in last), last
    assert f"pip install torch=={RELEASE}" in last
    # the fix comes before the list of files
    assert last.index("Rebuild") < last.index("_C_")
    # refused before anything was loaded: no extension in the process
    assert "_C_adam" not in r.stdout


def test_a_file_without_a_record_is_refused(tmp_path):
    _fake_extension(tmp_path, "_C_adam", None)
    with pytest.raises(ExtensionMismatchError, match="carries no record of the torch") as e:
        check_extensions(str(tmp_path))
    assert isinstance(e.value, ImportError) and isinstance(e.value, StateStoreError)


def test_records_are_compared_by_release_and_cuda(tmp_path, monkeypatch):
    _fake_extension(tmp_path, "_C_io", f"torch={RELEASE};cuda=none".encode())
    check_extensions(str(tmp_path))     # a CPU build loads under any variant of its release
    _fake_extension(tmp_path, "_C_adam", f"torch={RELEASE};cuda=12080".encode())
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    check_extensions(str(tmp_path))
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ExtensionMismatchError, match=r"with CUDA 12\.8, and this torch has no CUDA"):
        check_extensions(str(tmp_path))
    monkeypatch.setattr(torch.version, "cuda", "12.9")     # the same major version: it loads
    check_extensions(str(tmp_path))                         # (CUDA's minor compatibility)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.raises(ExtensionMismatchError, match=r"this torch has CUDA 13\.0"):
        check_extensions(str(tmp_path))


def test_another_release_names_both(tmp_path, monkeypatch):
    _fake_extension(tmp_path, "_C_adam", b"torch=2.13.0;cuda=none")
    monkeypatch.setattr(torch, "__version__", "2.14.1+cpu")
    with pytest.raises(ExtensionMismatchError) as e:
        check_extensions(str(tmp_path))
    msg = str(e.value)
    assert "built against torch 2.13.0, but torch 2.14.1+cpu is installed" in msg
    assert "--no-build-isolation" in msg or "build_ext --inplace" in msg
    assert "pip install torch==2.13.0" in msg


def test_the_requirement_is_the_torch_built_against(tmp_path):
    """The metadata of a build requires the release it compiles against (a wheel built
    against 2.13.0 never resolves torch 2.14.1); without extensions any torch>=2.1. setup.py
    runs in a process forked from one that imported torch (helpers/warm.py; it reads its
    environment when it runs)."""
    from helpers import warm

    def requires(**env):
        r = warm.run_script(str(ROOT / "setup.py"), ["-q", "egg_info", "--egg-base", str(tmp_path)],
                            cwd=str(ROOT), timeout=300, env=env)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        return (tmp_path / "statestore.egg-info" / "requires.txt").read_text().splitlines()
    assert f"torch=={RELEASE}" in requires()
    assert "torch>=2.1" in requires(STATESTORE_NO_EXT="1")


def test_one_version_string():
    tomllib = pytest.importorskip("tomllib")
    import statestore
    from statestore._version import __version__
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert statestore.__version__ == __version__


def test_one_torch_pin_policy():
    """The Makefile names the torch releases (TORCH: make test's and the build pin;
    TORCH_NEWEST: make test-torch's); pyproject's build pin follows TORCH, and the scripts
    read it rather than repeat it, so a new release is a one-line change there."""
    tomllib = pytest.importorskip("tomllib")
    make = (ROOT / "Makefile").read_text()
    pins = dict(re.findall(r"^(TORCH|TORCH_NEWEST)\s*:=\s*(\S+)\s*$", make, re.M))
    assert set(pins) == {"TORCH", "TORCH_NEWEST"}, pins
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert f"torch=={pins['TORCH']}" in build
    for script in ("gpu_test.sh", "gpu_session.sh", "gpu_wheelhouse.sh", "install_tensornvme.sh",
                   "test_torch.sh"):
        text = (ROOT / "scripts" / script).read_text()
        assert not re.search(r"torch==\d", text), f"scripts/{script} repeats a torch pin"
    readme = (ROOT / "README.md").read_text()
    for v in pins.values():
        assert v in readme, f"README.md does not name torch {v}"

"""Shared fixtures. Nothing here downloads anything."""
from __future__ import annotations

import os
import shutil

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of tiny models (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``): one torch
    thread runs them faster than two, and a second thread's spin-waits and barriers cost seconds on a busy
    machine. The thread count is restored after the module."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def sd15_folder(tmp_path_factory):
    """A full-size SD 1.5 diffusers folder (fp32, random weights at the real shapes), built once per session
    (tests.reference.write_sd15_folder)."""
    from tests.reference import write_sd15_folder

    folder = tmp_path_factory.mktemp("sd15")
    _SESSION_DIRS.add(folder)
    return write_sd15_folder(folder / "sd15")


# Folders made under the session's base temporary directory by session fixtures, which outlive every module
_SESSION_DIRS: set = set()
# Modules with a failed test or fixture: their folders stay, as pytest keeps a failed test's tmp_path
_FAILED_MODULES: set = set()


@pytest.fixture(scope="module", autouse=True)
def _module_files(request, tmp_path_factory):
    """Remove what a module's fixtures wrote under the base temporary directory when the module is done, unless
    one of its tests failed. pytest removes a passed test's ``tmp_path`` at once, but the folders of module
    fixtures (full-size checkpoints among them) stay until the session ends; together they outgrew the disk of a
    CI machine. Session fixtures' folders (``_SESSION_DIRS``) stay."""
    base = tmp_path_factory.getbasetemp()
    before = set(base.iterdir())
    yield
    if getattr(request.module, "__name__", None) in _FAILED_MODULES:
        return
    for path in set(base.iterdir()) - before - _SESSION_DIRS:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        _FAILED_MODULES.add(getattr(item.module, "__name__", None))
    return report


def pytest_collection_modifyitems(config, items):
    """Mark the tests of one-thread modules ``one_thread``: `make test` runs them two modules at a time (each on
    one core) and the rest, which use both cores themselves, one at a time."""
    for item in items:
        if "one_torch_thread" in getattr(item, "fixturenames", ()):
            item.add_marker("one_thread")

"""Shared fixtures. Nothing here downloads anything."""
from __future__ import annotations

import os

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

    return write_sd15_folder(tmp_path_factory.mktemp("sd15") / "sd15")


def pytest_collection_modifyitems(config, items):
    """Mark the tests of one-thread modules ``one_thread``: `make test` runs them two modules at a time (each on
    one core) and the rest, which use both cores themselves, one at a time."""
    for item in items:
        if "one_torch_thread" in getattr(item, "fixturenames", ()):
            item.add_marker("one_thread")

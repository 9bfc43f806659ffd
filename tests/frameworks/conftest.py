"""The server every framework test talks to, one for the folder (support/framework_server.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from framework_server import serve_for_frameworks
from running_server import RunningServer
from server_tools import LoopThread


@pytest.fixture(scope="package")
def loop() -> Iterator[LoopThread]:
    """The folder's event loop thread: the server below outlives each module."""
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="package")
def server(
    loop: LoopThread, tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    running = serve_for_frameworks(loop, tiny_bundle, tmp_path_factory.mktemp("frameworks"))
    yield running
    running.stop()

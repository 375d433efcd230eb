"""Fixtures of the end-to-end suite: one real ComfyUI server per test module.

The server log is attached to the report of every failing test that used the server.
"""

from __future__ import annotations

import logging

import pytest

from comfy_server import ComfyServer, comfyui_path

log = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def comfy_server(tmp_path_factory, request):
    comfy_dir = comfyui_path()
    if comfy_dir is None:
        pytest.skip("ComfyUI not found: set COMFYUI_PATH to a ComfyUI checkout (or clone it to ~/ComfyUI)")
    root = tmp_path_factory.mktemp(f"comfy_{request.module.__name__.rsplit('.', 1)[-1]}")
    server = ComfyServer(root, comfy_dir)
    try:
        server.start()
    except Exception:
        server.stop()
        raise
    log.info("ComfyUI started in %.1f s (%s)", server.startup_seconds, server.url)
    yield server
    server.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    server = getattr(item, "funcargs", {}).get("comfy_server")
    if report.failed and isinstance(server, ComfyServer):
        report.sections.append(("ComfyUI server log (last 150 lines)", server.log_tail(150)))

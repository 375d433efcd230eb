"""A real, headless ComfyUI server for end-to-end tests, driven over its HTTP API.

:class:`ComfyServer` starts ``python main.py --cpu`` from a ComfyUI checkout as a subprocess, with
every directory it writes (models, output, input, temp, user) under one temporary folder, and the
LowBit pack installed as a user would: a folder named ``ComfyUI-LowBit`` (a symlink to this
repository) inside a ``custom_nodes`` directory listed in an ``extra_model_paths.yaml``.

Workflows go in through ``POST /prompt`` and results come back from ``GET /history/<id>``, exactly as
the UI does it. Nothing here imports ComfyUI.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

REPO_ROOT = Path(__file__).resolve().parents[2]
PACK_NAME = "ComfyUI-LowBit"
#: test-only nodes (see ``tests/e2e/comfy_test_nodes/__init__.py``), installed next to the pack
TEST_NODES_DIR = Path(__file__).resolve().parent / "comfy_test_nodes"
TEST_NODES_NAME = "lowbit_e2e_test_nodes"


def comfyui_path() -> Path | None:
    """The ComfyUI checkout to run: ``$COMFYUI_PATH``, else ``~/ComfyUI``; ``None`` when absent."""
    candidate = Path(os.environ.get("COMFYUI_PATH") or Path.home() / "ComfyUI").expanduser()
    return candidate if (candidate / "main.py").is_file() else None


def import_node_module(name: str):
    """``lowbit.nodes.<name>``, imported in-process on the CPU (its module needs ComfyUI's ``comfy_api``)."""
    import importlib

    comfy = comfyui_path()
    if str(comfy) not in sys.path:
        sys.path.insert(0, str(comfy))
    import comfy.cli_args

    comfy.cli_args.args.cpu = True
    return importlib.import_module(f"lowbit.nodes.{name}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerError(RuntimeError):
    """The server did not start, died, or answered something unexpected; carries its log tail."""


@dataclass
class PromptResult:
    """What one queued workflow produced."""

    prompt_id: str | None
    status: str  # "success", "error", or "rejected" (refused at POST /prompt by validation)
    outputs: dict[str, Any] = field(default_factory=dict)  # node id -> its "ui" dict
    messages: list = field(default_factory=list)  # [[event, data], ...] from the history entry
    rejection: dict | None = None  # the 400 body of POST /prompt
    #: validation errors of outputs POST /prompt dropped while queueing the rest (ComfyUI runs the valid part)
    node_errors: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "success"

    @property
    def execution_error(self) -> dict | None:
        """The ``execution_error`` event's data (node_id, node_type, exception_message, ...), if any."""
        for event, data in self.messages:
            if event == "execution_error":
                return data
        return None

    def error_text(self) -> str:
        """A human-readable account of why the workflow failed (empty when it succeeded)."""
        if self.rejection is not None:
            return json.dumps(self.rejection, indent=1)
        if self.node_errors:
            return "outputs dropped at validation: " + json.dumps(self.node_errors, indent=1)
        err = self.execution_error
        if err is not None:
            return (f"{err.get('node_type')} (node {err.get('node_id')}): {err.get('exception_type')}: "
                    f"{err.get('exception_message')}\n{''.join(err.get('traceback') or [])}")
        return "" if self.ok else f"status {self.status}, messages {self.messages}"


class ComfyServer:
    """One ComfyUI server process with its own temporary directories.

    Layout under ``root``::

        base/                   --base-directory (models, input, temp, user; ComfyUI's defaults)
        output/                 --output-directory
        extra/custom_nodes/     ComfyUI-LowBit -> this repository (+ the test-only nodes)
        extra/diffusion_models/ model files written by the tests
        extra/loras/            LoRA files written by the tests
        extra_model_paths.yaml  lists the extra/ folders and output/diffusion_models/
        server.log              the server's stdout and stderr
    """

    def __init__(self, root: Path, comfy_dir: Path, *, extra_args: tuple[str, ...] = (),
                 with_test_nodes: bool = True):
        self.root = Path(root)
        self.comfy_dir = Path(comfy_dir)
        self.extra_args = tuple(extra_args)
        self.with_test_nodes = with_test_nodes
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.output_dir = self.root / "output"
        self.diffusion_models_dir = self.root / "extra" / "diffusion_models"
        self.loras_dir = self.root / "extra" / "loras"
        self.custom_nodes_dir = self.root / "extra" / "custom_nodes"
        self.log_path = self.root / "server.log"
        self.startup_seconds: float | None = None
        self._proc: subprocess.Popen | None = None
        self._log_file = None

    # ---- lifecycle --------------------------------------------------------------------------
    def _prepare(self) -> Path:
        for folder in (self.root / "base" / "custom_nodes", self.output_dir / "diffusion_models", self.diffusion_models_dir,
                       self.loras_dir, self.custom_nodes_dir):
            folder.mkdir(parents=True, exist_ok=True)
        pack = self.custom_nodes_dir / PACK_NAME
        if not pack.exists():
            pack.symlink_to(REPO_ROOT, target_is_directory=True)
        if self.with_test_nodes and not (self.custom_nodes_dir / TEST_NODES_NAME).exists():
            shutil.copytree(TEST_NODES_DIR, self.custom_nodes_dir / TEST_NODES_NAME,
                            ignore=shutil.ignore_patterns("__pycache__"))
        extra = self.root / "extra"
        yaml_path = self.root / "extra_model_paths.yaml"
        # The same keys a user's extra_model_paths.yaml uses; saved models (output/diffusion_models)
        # are listed too, so UNETLoader can load what Save Quantized Model wrote.
        yaml_path.write_text(
            "lowbit_e2e:\n"
            f"  base_path: {extra}\n"
            "  custom_nodes: custom_nodes/\n"
            "  diffusion_models: |\n"
            "    diffusion_models/\n"
            f"    {self.output_dir / 'diffusion_models'}\n"
            "  loras: loras/\n",
            encoding="utf-8",
        )
        return yaml_path

    def start(self, timeout: float = 180.0) -> "ComfyServer":
        yaml_path = self._prepare()
        cmd = [
            sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
            "--base-directory", str(self.root / "base"),
            "--output-directory", str(self.output_dir),
            "--extra-model-paths-config", str(yaml_path),
            "--database-url", "sqlite:///:memory:",
            "--disable-api-nodes", "--disable-auto-launch",
            # The CPU default (sub-quadratic attention) sizes its chunks by free memory, so two runs of one
            # workflow can differ in the last float bits, which an INT8 activation rounding then amplifies.
            "--use-pytorch-cross-attention",
            *self.extra_args,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._log_file = open(self.log_path, "wb")
        started = time.monotonic()
        self._proc = subprocess.Popen(cmd, cwd=self.comfy_dir, stdout=self._log_file, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        while time.monotonic() - started < timeout:
            if self._proc.poll() is not None:
                raise ServerError(f"ComfyUI exited with code {self._proc.returncode} while starting.\n{self.log_tail()}")
            try:
                self.get("/system_stats", timeout=2)
                self.startup_seconds = time.monotonic() - started
                return self
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.25)
        self.stop()
        raise ServerError(f"ComfyUI did not answer /system_stats within {timeout:.0f} s.\n{self.log_tail()}")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 120) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    # ---- HTTP ---------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: Any = None, timeout: float = 30) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode("utf-8")
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as err:
            raw = err.read()
            try:
                return err.code, json.loads(raw)
            except json.JSONDecodeError:
                return err.code, raw.decode("utf-8", errors="replace")

    def get(self, path: str, timeout: float = 30) -> Any:
        status, body = self._request("GET", path, timeout=timeout)
        if status != 200:
            raise ServerError(f"GET {path} answered {status}: {body}")
        return body

    def object_info(self) -> dict:
        return self.get("/object_info")

    # ---- workflows ----------------------------------------------------------------------------
    def queue(self, graph: Mapping, extra_pnginfo: Mapping | None = None) -> tuple[str | None, dict]:
        """POST an API-format workflow: ``(prompt_id, node_errors)`` when queued, ``(None, body)`` when rejected."""
        payload: dict[str, Any] = {"prompt": dict(graph), "client_id": "lowbit-e2e"}
        if extra_pnginfo is not None:
            payload["extra_data"] = {"extra_pnginfo": dict(extra_pnginfo)}
        status, body = self._request("POST", "/prompt", payload)
        if status == 200:
            return body["prompt_id"], body.get("node_errors") or {}
        if status == 400 and isinstance(body, dict):
            return None, body
        raise ServerError(f"POST /prompt answered {status}: {body}\n{self.log_tail()}")

    def wait(self, prompt_id: str, timeout: float = 300.0) -> PromptResult:
        """Poll ``/history/<id>`` until the workflow has finished (successfully or not)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            entry = self.get(f"/history/{prompt_id}").get(prompt_id)
            if entry:
                status = entry.get("status") or {}
                if status.get("completed") or status.get("status_str") == "error":
                    return PromptResult(prompt_id, status.get("status_str", "error"), entry.get("outputs", {}),
                                        status.get("messages", []))
            if not self.alive:
                raise ServerError(f"ComfyUI died while running prompt {prompt_id}.\n{self.log_tail()}")
            time.sleep(0.1)
        raise ServerError(f"prompt {prompt_id} did not finish within {timeout:.0f} s.\n{self.log_tail()}")

    def run(self, graph: Mapping, *, extra_pnginfo: Mapping | None = None, timeout: float = 300.0) -> PromptResult:
        """Queue ``graph`` and wait for it; a validation rejection comes back as status ``rejected``."""
        prompt_id, answer = self.queue(graph, extra_pnginfo)
        if prompt_id is None:
            return PromptResult(None, "rejected", rejection=answer)
        result = self.wait(prompt_id, timeout)
        result.node_errors = answer
        return result

    def run_ok(self, graph: Mapping, **kwargs) -> PromptResult:
        """:meth:`run`, failing with the node error and the server log when any part of the workflow did
        not run (an output dropped at validation counts as a failure)."""
        result = self.run(graph, **kwargs)
        if not result.ok or result.node_errors:
            raise AssertionError(f"workflow failed: {result.error_text()}\n--- server log ---\n{self.log_tail(60)}")
        return result

    def output_file(self, ui_entry: Mapping) -> Path:
        """The file a node reported in its ``ui`` output (``{"filename", "subfolder", "type"}``)."""
        if ui_entry.get("type", "output") != "output":
            raise ServerError(f"expected an output file, got {ui_entry}")
        return self.output_dir / ui_entry.get("subfolder", "") / ui_entry["filename"]

"""A JupyterLab server for the browser tests, serving a copy of workbook/ in quick mode.

The copy matters: JupyterLab autosaves open notebooks, and with executed widgets a saved
notebook grows by megabytes; the repository's notebooks must stay stripped.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 60
# Settings Lab reads from JUPYTERLAB_SETTINGS_DIR: no news or update checks (no network here,
# and their pop-ups cover the page), and every cell attached to the DOM so the test can see
# the prompts and outputs of cells outside the viewport.
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}


@dataclass
class LabServer:
    url: str
    token: str
    root: Path
    runs: Path
    log: Path

    def api(self, path: str, method: str = "GET"):
        """Call the JupyterLab server this fixture started on 127.0.0.1 (its REST API: status,
        kernels). Loopback only: nothing is fetched from outside the machine."""
        port = int(self.url.removeprefix("http://127.0.0.1:"))  # ValueError if not loopback
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            conn.request(method, path, headers={"Authorization": f"token {self.token}"})
            r = conn.getresponse()
            body = r.read()
        finally:
            conn.close()
        if r.status >= 400:  # an OSError, as a refused connection is: _wait_ready retries
            raise ConnectionError(f"{method} {path}: HTTP {r.status}")
        return json.loads(body) if body else None

    def notebook_url(self, rel: str) -> str:
        # ?reset: start from an empty workspace, not the tabs a previous session left open
        return f"{self.url}/lab/tree/{rel}?reset&token={self.token}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_settings(settings: Path):
    for rel, value in LAB_SETTINGS.items():
        path = settings / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))


def _wait_ready(server: LabServer, proc: subprocess.Popen):
    deadline = time.time() + STARTUP_TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with {proc.returncode}:\n"
                               f"{server.log.read_text()[-3000:]}")
        try:
            server.api("/api/status")
            return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"jupyter lab did not answer within {STARTUP_TIMEOUT_S} s:\n"
                       f"{server.log.read_text()[-3000:]}")


def _descendants(pid: int) -> list:
    import psutil
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _shutdown(server: LabServer, proc: subprocess.Popen):
    """Kernels first (through the API, so they end their ranks), then the server, then any
    process of ours still alive, each by its pid."""
    children = _descendants(proc.pid)  # kernels and their ranks, recorded before they go
    try:
        for k in server.api("/api/kernels"):
            server.api(f"/api/kernels/{k['id']}", method="DELETE")
    except OSError:
        pass
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    for child in children:
        try:
            if child.is_running():
                child.kill()
        except Exception:  # noqa: BLE001 - gone already
            pass


@pytest.fixture(scope="module")
def lab_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("lab")
    shutil.copytree(REPO / "workbook", root / "workbook",
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    _write_settings(root / ".lab-settings")
    port, token = _free_port(), secrets.token_hex(16)
    server = LabServer(url=f"http://127.0.0.1:{port}", token=token, root=root,
                       runs=root / "runs", log=root / "jupyter-lab.log")
    env = {**os.environ, "WORKBOOK_QUICK": "1", "DISTLAB_RUNS": str(server.runs),
           "JUPYTERLAB_SETTINGS_DIR": str(root / ".lab-settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(root / ".lab-workspaces")}
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1",
           f"--port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={root}",
           # kernels on Unix sockets, not TCP ports a rank's gloo socket could take first
           "--KernelManager.transport=ipc",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    with open(server.log, "w") as log:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_ready(server, proc)
        yield server
    finally:
        _shutdown(server, proc)


@pytest.fixture(scope="module")
def shots_dir(tmp_path_factory) -> Path:
    """Where screenshots go: $DISTLAB_SHOTS, or a fresh temporary folder."""
    path = Path(os.environ.get("DISTLAB_SHOTS") or tmp_path_factory.mktemp("shots"))
    path.mkdir(parents=True, exist_ok=True)
    return path

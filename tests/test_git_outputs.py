"""distlab.lab.git_outputs: after a Run All (outputs, execution counts, the kernel's metadata),
git still sees every notebook exactly as committed; an edited cell still shows."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import nbformat
import pytest

from distlab.lab.git_outputs import install, post_save

WORKBOOK = pathlib.Path(__file__).resolve().parent.parent / "workbook"


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t",
                           *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def checkout(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    _git(tmp_path, "init", "-q")
    shutil.copy(WORKBOOK / "01_collectives.ipynb", tmp_path / "nb.ipynb")
    shutil.copy(WORKBOOK / "01_collectives.py", tmp_path / "nb.py")  # its jupytext pair
    (tmp_path / ".gitignore").write_text(".ipynb_checkpoints/\n")  # as the repository's
    _git(tmp_path, "add", "nb.ipynb", "nb.py", ".gitignore")
    _git(tmp_path, "commit", "-qm", "as committed")
    return tmp_path


def _run_all(path):
    """What a Run All and a save in JupyterLab change in the file."""
    nb = nbformat.read(path, 4)
    for i, c in enumerate(x for x in nb.cells if x.cell_type == "code"):
        c.execution_count = i + 1
        c.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"step {i}\n")]
        c.metadata["scrolled"] = True
    nb.metadata["language_info"].update(version="3.11.7", mimetype="text/x-python",
                                        file_extension=".py", pygments_lexer="ipython3",
                                        codemirror_mode={"name": "ipython", "version": 3},
                                        nbconvert_exporter="python")
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    nbformat.write(nb, path)


def test_outputs_do_not_dirty_the_tree_but_edits_do(checkout, tmp_path_factory):
    """One checkout for every case: each git call runs the filter, a Python process (~1 s)."""
    nb = checkout / "nb.ipynb"
    _run_all(nb)
    assert _git(checkout, "status", "--porcelain").strip() == "M nb.ipynb"  # no filter yet
    prefix = tmp_path_factory.mktemp("venv")
    install(str(checkout), prefix=str(prefix))
    install(str(checkout), prefix=str(prefix))  # twice: adds nothing
    attributes = (checkout / ".git" / "info" / "attributes").read_text().splitlines()
    assert attributes.count("*.ipynb filter=nbstripout") == 1
    hook = prefix / "etc" / "jupyter" / "jupyter_server_config.json"
    assert "distlab.lab.git_outputs.post_save" in hook.read_text()
    assert post_save(os_path=str(nb))  # what JupyterLab runs after the save: outputs only
    assert _git(checkout, "status", "--porcelain") == ""
    assert _git(checkout, "diff", "--cached") == ""  # and nothing was staged
    assert "step 0" in nb.read_text()  # the outputs are still in the file, for a reload
    new = checkout / "mine.ipynb"  # a notebook of the user's own, untracked: never added
    shutil.copy(nb, new)
    assert not post_save(os_path=str(new))
    doc = nbformat.read(nb, 4)
    doc.cells[1].source += "\n# an edit"
    nbformat.write(doc, nb)
    assert not post_save(os_path=str(nb))  # an edit is the user's to stage
    assert _git(checkout, "status", "--porcelain").splitlines() == [" M nb.ipynb",
                                                                   "?? mine.ipynb"]
    assert _git(checkout, "diff", "--cached") == ""


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_readme_command_then_a_save_in_the_server_leaves_git_clean(checkout, tmp_path_factory):
    """The README's step as a user runs it (`python -m distlab.lab.git_outputs` in the
    checkout), then a Jupyter server saves the notebook with outputs through its contents API,
    as JupyterLab's save does: `git status` stays clean. Before the fix the command wrote the
    hook as "__main__.post_save", which the server cannot import, and every saved notebook
    showed as modified, and wrote it into jupyter_server_config.d, whose other sections the
    server drops (issue 25; the test above calls the functions directly and missed both)."""
    import json
    import os
    import sys
    import http.client
    import time
    prefix = tmp_path_factory.mktemp("prefix")
    env = {**os.environ, "DISTLAB_JUPYTER_PREFIX": str(prefix)}
    subprocess.run([sys.executable, "-m", "distlab.lab.git_outputs"], cwd=checkout, env=env,
                   check=True, capture_output=True, text=True)
    assert '"distlab.lab.git_outputs.post_save"' in (
        prefix / "etc" / "jupyter" / "jupyter_server_config.json").read_text()
    port, token = _free_port(), "t0ken"
    server_env = {**os.environ, "JUPYTER_CONFIG_PATH": str(prefix / "etc" / "jupyter"),
                  "JUPYTER_RUNTIME_DIR": str(tmp_path_factory.mktemp("runtime"))}
    cmd = [sys.executable, "-m", "jupyter", "server", "--no-browser", "--ip=127.0.0.1",
           f"--port={port}", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={checkout}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    server = subprocess.Popen(cmd, env=server_env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    def call(method: str, body: bytes | None = None, timeout: float = 30) -> int:
        """The local server's contents API (127.0.0.1 only; nothing leaves the machine)."""
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        try:
            conn.request(method, f"/api/contents/nb.ipynb?token={token}", body=body,
                         headers={"Content-Type": "application/json"})
            return conn.getresponse().status
        finally:
            conn.close()

    try:
        for _ in range(60):  # until the server answers
            try:
                call("GET", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        _run_all(checkout / "nb.ipynb")  # the outputs a Run All leaves, then JupyterLab's save:
        body = json.dumps({"type": "notebook", "format": "json",
                           "content": nbformat.read(checkout / "nb.ipynb", 4)}).encode()
        assert call("PUT", body) == 200
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert _git(checkout, "status", "--porcelain") == "", _git(checkout, "status")

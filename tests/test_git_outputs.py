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
    _git(tmp_path, "add", "nb.ipynb")
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
    hook = prefix / "etc" / "jupyter" / "jupyter_server_config.d" / "distlab.json"
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

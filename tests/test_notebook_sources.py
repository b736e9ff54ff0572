"""Each workbook notebook is a jupytext pair: workbook/NN_name.py (py:percent, the source that
is reviewed, edited and linted) and workbook/NN_name.ipynb (what nbval and JupyterLab run).

These checks are static and fast: no kernel, no notebook execution. They fail when a pair is
missing a side, when the two sides disagree on a cell, when an .ipynb carries outputs, or when
a .py is not valid Python. After editing either side, run:

    jupytext --sync workbook/*.py
"""

from __future__ import annotations

import ast
import pathlib

import nbformat
import pytest

WORKBOOK = pathlib.Path(__file__).resolve().parent.parent / "workbook"
FORMATS = "ipynb,py:percent"
STEMS = sorted({p.stem for p in WORKBOOK.glob("*.ipynb")} | {p.stem for p in WORKBOOK.glob("*.py")})


def _rel(path: pathlib.Path) -> str:
    return f"workbook/{path.name}"


def _read_ipynb(stem: str) -> nbformat.NotebookNode:
    path = WORKBOOK / f"{stem}.ipynb"
    if not path.exists():
        pytest.skip(f"{_rel(path)} missing (reported by test_pair_exists)")
    return nbformat.read(path, as_version=4)


def _py(stem: str) -> pathlib.Path:
    path = WORKBOOK / f"{stem}.py"
    if not path.exists():
        pytest.skip(f"{_rel(path)} missing (reported by test_pair_exists)")
    return path


def _tags(cell) -> list:
    return list(cell.get("metadata", {}).get("tags", []))


def test_workbook_has_notebooks():
    assert STEMS, f"no notebooks found in {WORKBOOK}"


@pytest.mark.parametrize("stem", STEMS)
def test_pair_exists(stem):
    ipynb, py = WORKBOOK / f"{stem}.ipynb", WORKBOOK / f"{stem}.py"
    assert py.exists(), (f"{_rel(ipynb)} has no paired {_rel(py)}; "
                         f"run: jupytext --set-formats {FORMATS} {_rel(ipynb)}")
    assert ipynb.exists(), (f"{_rel(py)} has no paired {_rel(ipynb)}; "
                            f"run: jupytext --sync {_rel(py)}")


@pytest.mark.parametrize("stem", STEMS)
def test_ipynb_declares_pairing(stem):
    nb = _read_ipynb(stem)
    formats = nb.metadata.get("jupytext", {}).get("formats")
    assert formats == FORMATS, (
        f"workbook/{stem}.ipynb metadata jupytext.formats is {formats!r}, not {FORMATS!r}; "
        f"run: jupytext --set-formats {FORMATS} workbook/{stem}.ipynb")
    nbformat.validate(nb)


@pytest.mark.parametrize("stem", STEMS)
def test_py_is_python(stem):
    """What ruff, mypy and editors read: the .py must parse as Python on its own."""
    path = _py(stem)
    try:
        ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except SyntaxError as e:
        pytest.fail(f"{_rel(path)} is not valid Python (line {e.lineno}: {e.msg}); fix that cell "
                    f"in the .py, then run: jupytext --sync {_rel(path)}")


@pytest.mark.parametrize("stem", STEMS)
def test_ipynb_has_no_outputs(stem):
    nb = _read_ipynb(stem)
    dirty = [cell.get("id", i) for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
             and (cell.get("outputs") or cell.get("execution_count") is not None)]
    assert not dirty, (f"workbook/{stem}.ipynb has outputs or execution counts in cells {dirty}; "
                       f"run: nbstripout --keep-id workbook/{stem}.ipynb")


@pytest.mark.parametrize("stem", STEMS)
def test_pair_in_sync(stem):
    try:
        import jupytext
    except ImportError:
        pytest.fail("jupytext is not installed; run: pip install -e '.[test]'")
    nb = _read_ipynb(stem)
    path = _py(stem)
    text = jupytext.read(path)
    fix = f"run: jupytext --sync {_rel(path)} (the newer of the two files wins)"
    assert text.metadata.get("jupytext", {}).get("formats") == FORMATS, (
        f"{_rel(path)} header lacks jupytext formats {FORMATS!r}; "
        f"run: jupytext --set-formats {FORMATS} workbook/{stem}.ipynb")
    assert len(text.cells) == len(nb.cells), (
        f"{_rel(path)} has {len(text.cells)} cells, workbook/{stem}.ipynb has {len(nb.cells)}; {fix}")
    for i, (a, b) in enumerate(zip(text.cells, nb.cells)):
        where = f"cell {i} (id {b.get('id', '?')!r}) of workbook/{stem}"
        assert a.cell_type == b.cell_type, (
            f"{where}: {a.cell_type} in the .py, {b.cell_type} in the .ipynb; {fix}")
        assert a.source == b.source, (
            f"{where}: source differs between the .py and the .ipynb; {fix}\n"
            f"--- .py:\n{a.source}\n--- .ipynb:\n{b.source}")
        assert _tags(a) == _tags(b), (
            f"{where}: tags {_tags(a)} in the .py, {_tags(b)} in the .ipynb; {fix}")


@pytest.mark.parametrize("stem", STEMS)
def test_ipynb_metadata_is_what_a_save_writes(stem):
    """A notebook committed without language_info (10-13 were) gains lines at its first save,
    and git shows it modified (issue 25)."""
    meta = _read_ipynb(stem).metadata
    assert meta.get("language_info", {}).get("name") == "python", (
        f"workbook/{stem}.ipynb has no language_info.name: copy 00's notebook metadata")
    assert meta.get("kernelspec", {}).get("name") == "python3", stem


def test_start_here_names_every_notebook_that_comes_next():
    """00's "Coming next" stopped at LoRA while five notebooks followed (issue 25)."""
    text = _py("00_start_here").read_text()
    missing = [s for s in STEMS if s != "00_start_here" and f"`{s}`" not in text]
    assert not missing, f"00_start_here does not name {missing} in its 'Coming next'"

"""What every notebook generator in tools/ shares: cells with fixed ids (so regenerating an
unchanged notebook gives an unchanged file) and writing the stripped notebook."""

from __future__ import annotations

import textwrap

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook


def md(cell_id: str, text: str):
    cell = new_markdown_cell(textwrap.dedent(text).strip())
    cell.id = cell_id
    return cell


def code(cell_id: str, text: str, tags: tuple = ()):
    cell = new_code_cell(textwrap.dedent(text).strip())
    cell.id = cell_id
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def build(cells) -> nbformat.NotebookNode:
    nb = new_notebook(cells=cells)
    nb.metadata = {
        "kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)",
                       "language": "python"},
        "language_info": {"name": "python"},
    }
    return nb


def write_notebook(cells, out) -> None:
    nb = build(cells)
    nbformat.validate(nb)
    out.parent.mkdir(exist_ok=True)
    nbformat.write(nb, out)
    print(f"wrote {out} ({len(nb.cells)} cells)")

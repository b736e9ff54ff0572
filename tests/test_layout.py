"""The package's shape: the runtime (everything in distlab but distlab.lab) imports nothing of
the workbook layer and no widget package, and its imports have no cycle.

Why it matters: `torchrun -m distlab` on a cluster installs only torch and numpy (the README's
[lab] extra is for the notebooks), so one stray import of plotly in a rank would fail there.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

LIB = pathlib.Path(__file__).resolve().parent.parent / "lib"
WIDGET_PACKAGES = ("plotly", "ipywidgets", "anywidget", "IPython", "psutil", "distlab.lab")


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for f in (LIB / "distlab").rglob("*.py"):
        parts = list(f.relative_to(LIB).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _imports(f: pathlib.Path) -> set[str]:
    """Every module named by an import anywhere in the file (function-level imports too)."""
    names = set()
    for n in ast.walk(ast.parse(f.read_text())):
        if isinstance(n, ast.ImportFrom):
            assert n.level == 0, f"{f}: relative import; distlab imports by absolute name"
            names.add(n.module)
            names.update(f"{n.module}.{a.name}" for a in n.names)
        elif isinstance(n, ast.Import):
            names.update(a.name for a in n.names)
    return names


def _runtime() -> dict[str, pathlib.Path]:
    return {m: f for m, f in _modules().items()
            if m != "distlab.lab" and not m.startswith("distlab.lab.")}


def test_runtime_source_never_names_the_workbook_layer():
    bad = {m: sorted(n for n in _imports(f)
                     if any(n == w or n.startswith(w + ".") for w in WIDGET_PACKAGES))
           for m, f in _runtime().items()}
    bad = {m: n for m, n in bad.items() if n}
    assert not bad, f"runtime modules import workbook-layer packages: {bad}"


def test_importing_every_runtime_module_loads_no_widget_package():
    """The same, as Python sees it: import all of the runtime in a fresh interpreter and look
    at sys.modules (this also catches a widget package pulled in by a dependency)."""
    code = ("import importlib, sys\n"
            f"for m in {sorted(_runtime())!r}: importlib.import_module(m)\n"
            f"print(sorted(k for k in sys.modules if k.split('.')[0] in {WIDGET_PACKAGES!r} "
            "or k.startswith('distlab.lab')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()
    assert out == "[]", f"importing the runtime loaded: {out}"


def test_no_import_cycle():
    """Module-level and function-level imports alike: a cycle hidden in a function is still a
    cycle in the design (it once ran checkpoint -> launch -> train -> checkpoint)."""
    mods = _modules()
    graph = {m: {n for n in _imports(f) if n in mods and n != m} for m, f in mods.items()}
    # a package's __init__ re-exporting its children is not a cycle of the children
    for m in graph:
        graph[m] = {n for n in graph[m] if not n.startswith(m + ".")}
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])

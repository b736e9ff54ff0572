"""The package's shape: the runtime (everything in distlab but distlab.lab) imports nothing of
the workbook layer and no widget package, and its imports have no cycle.

Why it matters: `torchrun -m distlab` on a cluster installs only torch and numpy (the README's
[lab] extra is for the notebooks), so one stray import of plotly in a rank would fail there.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

LIB = pathlib.Path(__file__).resolve().parent.parent / "lib"
# what only the workbook layer may import (psutil: the fault drills check for leftover processes;
# optuna: the search section's studies)
WORKBOOK_PACKAGES = ("plotly", "ipywidgets", "anywidget", "IPython", "psutil", "optuna",
                     "distlab.lab")


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for f in (LIB / "distlab").rglob("*.py"):
        parts = list(f.relative_to(LIB).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _imports(f: pathlib.Path) -> set[str]:
    """Every module named by an import anywhere in the file (function-level imports too);
    `from pkg import name` names pkg.name when that is a module, else pkg."""
    mods = _modules()
    names = set()
    for n in ast.walk(ast.parse(f.read_text())):
        if isinstance(n, ast.ImportFrom):
            assert n.level == 0, f"{f}: relative import; distlab imports by absolute name"
            for a in n.names:
                sub = f"{n.module}.{a.name}"
                names.add(sub if sub in mods else n.module)
        elif isinstance(n, ast.Import):
            names.update(a.name for a in n.names)
    return names


def _runtime() -> dict[str, pathlib.Path]:
    return {m: f for m, f in _modules().items()
            if m != "distlab.lab" and not m.startswith("distlab.lab.")}


# -- the layers: declared once, lowest first ------------------------------------------------------
# A module may import its own layer and the layers before it, never one after it. Each entry is
# a root module or a folder (the folder and everything in it). Within a layer, folders must not
# import each other in a circle (test_no_folder_cycle). Each folder's __init__ docstring says
# the same in words ("May import: ...").
LAYERS = [
    ("foundation", ["distlab.units", "distlab.modules", "distlab.non_finite", "distlab.wire",
                    "distlab.gloo_exit", "distlab.step_ledger", "distlab.comm", "distlab.memory",
                    "distlab.events", "distlab.step_event", "distlab.fp8"]),
    ("data", ["distlab.data"]),
    ("models", ["distlab.models"]),
    ("parallel", ["distlab.parallel"]),
    ("config", ["distlab.config"]),
    ("checkpoint", ["distlab.checkpoint"]),
    ("theory", ["distlab.theory"]),
    ("rank plug-ins", ["distlab.debug", "distlab.finetune"]),
    ("rank", ["distlab.rank"]),
    ("caller", ["distlab.caller", "distlab.__main__"]),
    ("public API", ["distlab"]),  # the package's __init__: the names users import
    ("studies", ["distlab.studies"]),
    ("exercises", ["distlab.exercises"]),
    ("workbook", ["distlab.lab"]),
]


def _layer_of(module: str) -> int:
    """Index in LAYERS of the most specific entry naming `module` (itself or a folder above)."""
    best, depth = None, -1
    for i, (_, entries) in enumerate(LAYERS):
        for e in entries:
            if (module == e or module.startswith(e + ".")) and e.count(".") > depth:
                best, depth = i, e.count(".")
    return best


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: {n for n in _imports(f) if n in mods and n != m} for m, f in mods.items()}


def test_every_module_is_in_a_layer():
    """A new root module (or folder) must say where it sits: no layer, no merge."""
    missing = sorted(m for m in _modules() if _layer_of(m) is None)
    assert not missing, f"modules no layer names (add them to LAYERS): {missing}"


def test_no_import_runs_back_up():
    """Module- and function-level imports alike: a function-level import that runs back up is
    still a dependency of the lower layer on the higher one."""
    back = []
    for m, deps in _graph().items():
        for n in deps:
            if n.startswith(m + "."):
                continue  # a package re-exporting its own children
            if _layer_of(n) > _layer_of(m):
                back.append(f"{m} ({LAYERS[_layer_of(m)][0]}) -> {n} ({LAYERS[_layer_of(n)][0]})")
    assert not back, "imports that run back up:\n  " + "\n  ".join(sorted(back))


def _folder(module: str, mods) -> str:
    """The folder a module lives in (a package's __init__ lives in its own folder). The root's
    modules are each a node of their own: they sit in different layers (config reads the
    strategies' registry, which the foundation under it serves), and the package's own
    __init__ is the public API, above the caller's side."""
    if module.count(".") == 1 or module == "distlab":
        return module
    return module if mods[module].name == "__init__.py" else module.rsplit(".", 1)[0]


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n, path + [n])
                if found:
                    return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m, [m])
            if found:
                return found
    return None


def test_no_import_cycle():
    """Between modules, module- and function-level imports alike (a cycle hidden in a function
    once ran checkpoint -> launch -> train -> checkpoint)."""
    graph = {m: {n for n in deps if not n.startswith(m + ".")} for m, deps in _graph().items()}
    found = _cycle(graph)
    assert found is None, "import cycle: " + " -> ".join(found)


def test_no_folder_cycle():
    """Between folders: parallel/zero -> checkpoint -> parallel was one, through a
    function-level import, though no two modules imported each other."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for m, deps in _graph().items():
        a = _folder(m, mods)
        for n in deps:
            b = _folder(n, mods)
            if a != b and not b.startswith(a + "."):  # a package's re-exports of its children
                graph.setdefault(a, set()).add(b)
    found = _cycle(graph)
    assert found is None, "folder cycle: " + " -> ".join(found)


def test_layout_checks_can_fail():
    """The checks above on a made-up graph: an import back up and a folder cycle are found."""
    assert _layer_of("distlab.parallel.zero.stages") < _layer_of("distlab.checkpoint.store")
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


# -- the layout page's map of the package is the tree -------------------------------------------
def _layout_block() -> set[str]:
    """The paths docs/layout.md's layout block lists: `name.py` and `name/` entries, two spaces of
    indent per folder level (descriptions after two or more spaces, continuation lines
    further in)."""
    page = (LIB.parent / "docs" / "layout.md").read_text()
    block = page.split("# How the library is laid out", 1)[1].split("```\n", 2)[1]
    lines = block.splitlines()
    assert lines[0].strip() == "lib/distlab/", lines[0]
    paths, stack = set(), []
    for line in lines[1:]:
        m = re.match(r"^( *)(\w+\.py|\w+/)(?:  |$)", line)
        indent = len(line) - len(line.lstrip(" "))
        if not m or indent % 2 or indent > 2 * (len(stack) + 1):
            continue  # a description's continuation
        depth = indent // 2 - 1
        stack = stack[:depth]
        name = m.group(2)
        if name.endswith("/"):
            stack.append(name[:-1])
        paths.add("/".join(stack + ([name] if name.endswith(".py") else [])) + ("/" if name.endswith("/") else ""))
    return paths


def _tree() -> set[str]:
    root = LIB / "distlab"
    out = set()
    for f in root.rglob("*.py"):
        rel = f.relative_to(root)
        if f.name != "__init__.py" or rel == pathlib.Path("__init__.py"):
            out.add(str(rel))
        for i in range(1, len(rel.parts)):
            out.add("/".join(rel.parts[:i]) + "/")
    return out


def test_readme_layout_block_is_the_tree():
    """Every module and folder under lib/distlab/ is in docs/layout.md's layout block (the
    README's until the reference moved to docs/), and the block names nothing that is not
    there (it drifted by ten modules when kept by hand)."""
    listed, tree = _layout_block(), _tree()
    assert not tree - listed, f"in the tree, not in docs/layout.md: {sorted(tree - listed)}"
    assert not listed - tree, f"in docs/layout.md, not in the tree: {sorted(listed - tree)}"


def test_runtime_source_never_names_the_workbook_layer():
    bad = {m: sorted(n for n in _imports(f)
                     if any(n == w or n.startswith(w + ".") for w in WORKBOOK_PACKAGES))
           for m, f in _runtime().items()}
    bad = {m: n for m, n in bad.items() if n}
    assert not bad, f"runtime modules import workbook-layer packages: {bad}"


def test_importing_every_runtime_module_loads_no_widget_package():
    """The same, as Python sees it: import all of the runtime in a fresh interpreter and look
    at sys.modules (this also catches a widget package pulled in by a dependency)."""
    code = ("import importlib, sys\n"
            f"for m in {sorted(_runtime())!r}: importlib.import_module(m)\n"
            f"print(sorted(k for k in sys.modules if k.split('.')[0] in {WORKBOOK_PACKAGES!r} "
            "or k.startswith('distlab.lab')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()
    assert out == "[]", f"importing the runtime loaded: {out}"


def test_no_module_is_shadowed_by_a_function():
    """`import distlab.x` then `distlab.x.y` must reach module x: no public name of the
    package is also one of its submodules (distlab.launch once was both)."""
    import importlib

    import distlab
    clash = sorted(n for n in distlab.__all__ if n in {m.split(".")[1] for m in _modules()
                                                      if m.count(".") >= 1})
    assert not clash, f"public names that shadow a submodule: {clash}"
    for m in _modules():
        if m.count(".") >= 2 and m.rsplit(".", 1)[1] == m.rsplit(".", 2)[1]:
            raise AssertionError(f"{m}: a module named like its package")
    assert importlib.import_module("distlab.caller.launch").run_ranks is distlab.run_ranks


# -- a new strategy: one file and one registry line (docs/library.md's example, run) --------------
_NEW_STRATEGY_RUN = r'''
import datetime, json, sys
sys.path.insert(0, sys.argv[1])
import torch, torch.distributed as dist, torch.multiprocessing as mp
import distlab.parallel as P
P.REGISTRY["mean-dp"] = "mean_dp:MeanDP"          # the one registry line
from distlab import RunConfig
from distlab.events import EventLog
from distlab.rank.train import train

def rank_main(rank, world, cfg, tmp):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store-{cfg['strategy']}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    keep = {}
    train(RunConfig.from_dict(cfg), rank, world, torch.device("cpu"),
          EventLog(f"{tmp}/{cfg['strategy']}-rank{rank}.jsonl", rank), keep=keep)
    state = keep["strategy"].full_state_dict(keep["model"])
    torch.save({"losses": keep["losses"], "state": state}, f"{tmp}/{cfg['strategy']}-r{rank}.pt")
    dist.destroy_process_group()

if __name__ == "__main__":
    tmp = sys.argv[1]
    base = RunConfig(steps=6, optimizer="sgd", lr=0.1, n_layer=2, n_embd=32, n_head=2,
                     global_batch=8, seq_len=16, timeout_s=60)
    new = base.replace(strategy="mean-dp", world_size=2, lora_rank=2)  # supported: accepted
    try:
        base.replace(strategy="mean-dp", world_size=2, task=1, ewc_lambda=1.0, init_from="x.pt")
        refused = ""
    except ValueError as e:
        refused = str(e)
    for cfg in (base.replace(lora_rank=2), new):
        mp.start_processes(rank_main, args=(cfg.world_size, cfg.to_dict(), tmp),
                           nprocs=cfg.world_size, start_method="fork")  # children keep the line
    print(json.dumps({"refused": refused, "lora": list(P.strategies("lora")),
                      "checkpoint": list(P.strategies("checkpoint"))}))
'''


def test_a_new_strategy_is_one_file_and_one_line(tmp_path):
    """docs/library.md's MeanDP, as written there, trains under RunConfig and the one loop on
    2 ranks and matches `single` on the same global batch; RunConfig reads what it declares (LoRA
    accepted, EWC refused naming who supports it). Tolerance 1e-5: SGD in fp32 over 6 steps;
    the two ranks' gradient average differs from one process's mean only by summation order
    (~1e-8 per step, DESIGN's measured 6e-8 across strategies)."""
    page = (LIB.parent / "docs" / "library.md").read_text()
    marker = "# lib/distlab/parallel/data_parallel/mean_dp.py\n"
    assert marker in page, "docs/library.md's 'Adding a strategy' example moved"
    code = page.split(marker, 1)[1].split("```", 1)[0]
    (tmp_path / "mean_dp.py").write_text(code)
    (tmp_path / "run.py").write_text(_NEW_STRATEGY_RUN)
    done = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    import torch
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "ewc_lambda" in out["refused"] and "'mean-dp' does not support it" in out["refused"]
    assert "mean-dp" in out["lora"] and "mean-dp" in out["checkpoint"]
    single = torch.load(tmp_path / "single-r0.pt", weights_only=True)
    assert single["losses"][-1] < single["losses"][0]  # it trained: the comparison means something
    for rank in (0, 1):
        new = torch.load(tmp_path / f"mean-dp-r{rank}.pt", weights_only=True)
        assert len(new["losses"]) == len(single["losses"]) == 6
        # rank 0 logs its own half-batch loss; the parameters are what must agree
        assert new["state"].keys() == single["state"].keys()
        worst = max((new["state"][k] - single["state"][k]).abs().max().item()
                    for k in single["state"])
        assert worst < 1e-5, f"rank {rank}: worst parameter difference {worst:.2e}"

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


# -- a new strategy: one file and one registry line (the README's example, run) -------------------
_NEW_STRATEGY_RUN = r'''
import datetime, json, sys
sys.path.insert(0, sys.argv[1])
import torch, torch.distributed as dist, torch.multiprocessing as mp
import distlab.parallel as P
P.REGISTRY["mean-dp"] = "mean_dp:MeanDP"          # the one registry line
from distlab import RunConfig
from distlab.events import EventLog
from distlab.train import train

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
    """The README's MeanDP, as written there, trains under RunConfig and the one loop on 2 ranks
    and matches `single` on the same global batch; RunConfig reads what it declares (LoRA
    accepted, EWC refused naming who supports it). Tolerance 1e-5: SGD in fp32 over 6 steps;
    the two ranks' gradient average differs from one process's mean only by summation order
    (~1e-8 per step, DESIGN's measured 6e-8 across strategies)."""
    readme = (LIB.parent / "README.md").read_text()
    marker = "# lib/distlab/parallel/data_parallel/mean_dp.py\n"
    assert marker in readme, "the README's 'Adding a strategy' example moved"
    code = readme.split(marker, 1)[1].split("```", 1)[0]
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

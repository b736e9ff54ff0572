"""Run every workbook notebook and report its claims: each claim, the figure, the verdict.

    .venv/bin/python tools/claims_report.py                  # full mode -> reports/claims-full.md
    .venv/bin/python tools/claims_report.py --quick --notebooks 01 --out /tmp/claims-quick.md
    .venv/bin/python tools/claims_report.py --notebooks 17 --merge   # add or rerun one notebook

Each notebook runs in its own kernel (cwd workbook/, as JupyterLab and nbval run it) from a copy
held in memory: the .ipynb files are never written. The notebooks' closing claims tables
(distlab.lab.common.claims_table) append their rows to the file named by DISTLAB_CLAIMS_JSONL,
which this script sets per notebook and reads back. A notebook that fails is recorded with its
error and the run goes on; the exit status is 1 if any failed. A claim that does not hold is a
finding, not a failure: it is reported, and does not change the exit status.

With --merge, the picked notebooks replace their entries in the existing report (or join it),
each entry carrying the commit and date of its own run; the header names them, so no figure is
passed off as the main pass's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import nbformat
from jupyter_client import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

REPO = Path(__file__).resolve().parent.parent
WORKBOOK = REPO / "workbook"
COLUMNS = ("claim", "source", "figure", "basis", "verdict")
QUICK_ENV = {"quick": "WORKBOOK_QUICK=1", "full": "WORKBOOK_QUICK unset"}


# -- which notebooks ----------------------------------------------------------------------------
def find_notebooks(workbook: Path, wanted: list[str] | None = None) -> list[Path]:
    """The workbook's notebooks in order; `wanted` picks by number ("03") or full name."""
    paths = sorted(workbook.glob("[0-9][0-9]_*.ipynb"))
    if not wanted:
        return paths
    picked = [p for p in paths if any(p.stem == w or p.stem.startswith(w + "_") for w in wanted)]
    missing = [w for w in wanted if not any(p.stem == w or p.stem.startswith(w + "_")
                                            for p in paths)]
    if missing:
        raise SystemExit(f"no notebook in {workbook} matches {missing}")
    return picked


# -- the machine and the checkout ---------------------------------------------------------------
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def total_memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / 2**30  # the kernel counts in KiB
    except OSError:
        pass
    return None


def machine_info() -> dict:
    import torch  # imported here: the figures the notebooks report depend on this build
    mem = total_memory_gib()
    return {
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": None if mem is None else round(mem, 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.is_available(),
    }


def git_commit(repo: Path = REPO) -> str:
    """The short commit, with a mark when the tree differs from it (the figures came from both)."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True,
                              check=True).stdout  # not stripped: a status line starts " M"
    try:
        commit = git("rev-parse", "--short", "HEAD").strip()
        dirty = [line for line in git("status", "--porcelain", "--untracked-files=no").splitlines()
                 if not line[3:].startswith("reports/")]  # reports: what this tool writes
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return commit + (" + uncommitted changes" if dirty else "")


# -- running one notebook -----------------------------------------------------------------------
def kernel_env(name: str, quick: bool, claims_file: Path) -> dict:
    """This process's environment with the notebook's mode and where its claims go."""
    env = dict(os.environ)
    env.pop("WORKBOOK_QUICK", None)  # unset is full mode, whatever the caller's shell had
    if quick:
        env["WORKBOOK_QUICK"] = "1"
    env["DISTLAB_CLAIMS_JSONL"] = str(claims_file)
    # The runs' logs are byproducts here: beside the claims file (deleted after the notebook),
    # not in workbook/runs, unless the caller chose a place.
    env.setdefault("DISTLAB_RUNS", str(claims_file.parent / "runs"))
    env["DISTLAB_NOTEBOOK"] = name
    return env


def failing_cell(nb) -> int | None:
    """Index of the first code cell with an error output (nbclient fills the in-memory copy)."""
    for i, cell in enumerate(nb.cells):
        if any(o.get("output_type") == "error" for o in cell.get("outputs", [])):
            return i
    return None


def read_rows(claims_file: Path) -> list[dict]:
    if not claims_file.exists():
        return []
    return [json.loads(line) for line in claims_file.read_text().splitlines() if line.strip()]


def run_notebook(path: Path, quick: bool, timeout: int | None,
                 executed: Path | None = None) -> dict:
    """Execute one notebook in a fresh kernel; its claims rows, time and status. With
    `executed`, the executed copy (outputs included) is written there, never over the
    source, so the run can be read in JupyterLab without running it again."""
    nb = nbformat.read(path, as_version=4)  # the copy in memory is the only one executed
    with tempfile.TemporaryDirectory(prefix="distlab-claims-") as tmp:
        claims_file = Path(tmp) / "claims.jsonl"
        # The kernel talks over Unix sockets in the temporary folder, not TCP ports: a port
        # jupyter_client found free can be taken by a rank's gloo socket before the kernel
        # binds it ("Address already in use", seen in CI with two workers running ranks).
        km = KernelManager(kernel_name="python3", transport="ipc", ip=str(Path(tmp) / "kernel"))
        client = NotebookClient(nb, km=km, timeout=timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(path.parent)}})
        error = None
        t0 = time.perf_counter()
        try:
            client.execute(env=kernel_env(path.stem, quick, claims_file))
        except CellExecutionError as e:
            error = {"ename": e.ename, "evalue": e.evalue, "cell": failing_cell(nb)}
        # A cell past its timeout, or a kernel that died (DeadKernelError is a RuntimeError) or
        # never started: recorded like a cell's error, and the next notebook still runs.
        except (TimeoutError, RuntimeError) as e:
            error = {"ename": type(e).__name__, "evalue": str(e).strip(), "cell": None}
        finally:
            seconds = time.perf_counter() - t0
            # nbclient shuts down only a kernel it made itself: this one is ours, and left
            # running it kept its memory (and its forkserver's) through every later notebook.
            # Its work is done, so at once: a polite shutdown waited 2.6 s a notebook
            if km.has_kernel:
                km.shutdown_kernel(now=True)
        rows = read_rows(claims_file)
    if executed is not None:
        executed.mkdir(parents=True, exist_ok=True)
        if executed.resolve() == path.parent.resolve():
            raise ValueError("--executed must not be the workbook folder: the sources stay "
                             "unwritten")
        nbformat.write(for_reading(nb), executed / path.name)
    return {"notebook": path.stem, "seconds": round(seconds, 1),
            "status": "fail" if error else "pass", "error": error, "rows": rows}


WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
WAS_WIDGET = "distlab_widget"  # an output's metadata key: a widget stood here


def for_reading(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The executed copy as a reader opens it, with no kernel to drive a widget: each widget
    output keeps what else it carries (distlab.lab.live.LiveBox: the note that it is live in
    the lab, its figure's static picture and an HTML copy) and loses its view, and the saved
    widget state goes. Left in, nbconvert drew the view (a blank Out[] offline, the widget
    manager comes from a CDN) over the picture, and the state was most of the file's size."""
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("data", {}).pop(WIDGET_MIME, None) is not None:
                out.setdefault("metadata", {})[WAS_WIDGET] = True  # the site notes it
    nb.metadata.pop("widgets", None)
    return nb


# -- the report ---------------------------------------------------------------------------------
def cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def md_table(header, rows) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]


def verdict(holds: bool | None, basis: str = "measured") -> str:
    if holds is None:  # a timed row whose spreads overlap, or one only other hardware answers
        return "undecided on this machine" if basis == "timed" else "not measured here"
    return "yes" if holds else "no"


def held(result: dict) -> str:
    rows = result["rows"]
    return f"{sum(r['holds'] is True for r in rows)} of {len(rows)} hold"


def header_lines(meta: dict) -> list[str]:
    m = meta["machine"]
    mem = "unknown" if m["memory_gib"] is None else f"{m['memory_gib']} GiB"
    return [f"# Workbook claims, {meta['mode']} mode", "",
            f"- date (UTC): {meta['date']}",
            f"- machine: {m['platform']}; CPU {m['cpu']}, {m['cores']} cores, {mem} memory",
            f"- CUDA: {'present' if m['cuda'] else 'absent'}",
            f"- torch {m['torch']}, Python {m['python']}",
            f"- mode: {meta['mode']} ({QUICK_ENV[meta['mode']]})",
            f"- git commit: {meta['commit']}",
            *(["- run separately (--merge): " + "; ".join(
                f"{n} at commit {c}, {d}" for n, c, d in meta["separate"])]
              if meta.get("separate") else []),
            f"- total run time: {meta['seconds']:.0f} s",
            f"- runs folder after the pass: {meta.get('runs_bytes', 0) / 2**20:,.1f} MiB "
            "(distlab.caller.retention keeps the newest 100 runs, at most 500 MiB)", ""]


def runs_bytes(workbook: Path) -> int:
    """What the notebooks' runs folder holds now (the kernels run in workbook/, so ./runs)."""
    from distlab.caller.retention import folder_bytes
    root = os.environ.get("DISTLAB_RUNS") or str(workbook / "runs")
    return folder_bytes(root) if os.path.isdir(root) else 0


def notebook_lines(r: dict) -> list[str]:
    lines = [f"## {r['notebook']}", "", f"- run time: {r['seconds']:.0f} s",
             f"- status: {r['status']}"]
    if "commit" in r:  # merged in from a run of its own
        lines.append(f"- run separately: commit {r['commit']}, {r['date']}")
    if r["error"]:
        e = r["error"]
        where = "" if e["cell"] is None else f" (cell {e['cell']})"
        lines.append(f"- error{where}: `{e['ename']}`: {cell(e['evalue'])}")
    lines.append(f"- claims: {held(r)}")
    lines.append("")
    if r["rows"]:
        lines += md_table(COLUMNS, [[x["claim"], x["source"], x["figure"], x["basis"],
                                     verdict(x["holds"], x["basis"])] for x in r["rows"]])
    else:
        lines.append("No claims recorded: the notebook did not reach a claims_table call "
                     "(or has none).")
    return lines + [""]


# Full-mode Run All budgets on a quiet 2-core machine: the first notebook must reach its point
# within a minute, every other within three.
BUDGET_S = {"00": 60}
DEFAULT_BUDGET_S = 180


def budget_s(notebook: str) -> int:
    return BUDGET_S.get(notebook[:2], DEFAULT_BUDGET_S)


def over_budget(notebook: str, seconds: float, mode: str) -> bool:
    """Only full mode has a budget here (quick mode's is CI's)."""
    return mode == "full" and seconds > budget_s(notebook)


def budget(notebook: str, seconds: float, mode: str) -> str:
    """'within N s' or '**over** N s' in full mode; "—" in quick mode."""
    if mode != "full":
        return "—"
    verdict = "**over**" if over_budget(notebook, seconds, mode) else "within"
    return f"{verdict} {budget_s(notebook)} s"


def summary_lines(results: list[dict], mode: str = "full") -> list[str]:
    rows = [[r["notebook"], r["status"], f"{r['seconds']:.0f}",
             budget(r["notebook"], r["seconds"], mode), len(r["rows"]),
             sum(x["holds"] is True for x in r["rows"])] for r in results]
    over = sum(over_budget(r["notebook"], r["seconds"], mode) for r in results)
    total = [["all", f"{sum(r['status'] == 'fail' for r in results)} failed",
              f"{sum(r['seconds'] for r in results):.0f}", f"{over} over",
              sum(x[4] for x in rows), sum(x[5] for x in rows)]]
    return ["## Summary", ""] + md_table(
        ("notebook", "status", "seconds", "Run All budget", "claims", "hold"),
        rows + total) + [""]


def render(meta: dict, results: list[dict]) -> str:
    lines = header_lines(meta) + summary_lines(results, meta["mode"])
    for r in results:
        lines += notebook_lines(r)
    return "\n".join(lines)


def write_report(out: Path, meta: dict, results: list[dict]) -> Path:
    """The Markdown report at `out` and the raw rows beside it (same name, .json)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(meta, results), encoding="utf-8")
    raw = out.with_suffix(".json")
    raw.write_text(json.dumps({**meta, "notebooks": results}, indent=1) + "\n", encoding="utf-8")
    return raw


def merge(previous: dict, results: list[dict], commit: str, date: str) -> tuple[dict, list]:
    """The previous report's meta and notebooks with `results` put in (a rerun replaces its
    entry); each merged entry keeps its own commit and date, and the meta lists them."""
    for r in results:
        r["commit"], r["date"] = commit, date
    fresh = {r["notebook"]: r for r in results}
    notebooks = [fresh.pop(n["notebook"], n) for n in previous["notebooks"]]
    notebooks = sorted(notebooks + list(fresh.values()), key=lambda n: n["notebook"])
    meta = {k: v for k, v in previous.items() if k != "notebooks"}
    meta["separate"] = [(n["notebook"], n["commit"], n["date"]) for n in notebooks
                        if "commit" in n]
    meta["seconds"] = sum(n["seconds"] for n in notebooks)
    return meta, notebooks


# -- the command --------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="quick mode (WORKBOOK_QUICK=1, as CI runs); full mode by default")
    p.add_argument("--notebooks", nargs="+", metavar="NN",
                   help="notebooks by number or name (default: all, in order)")
    p.add_argument("--out", type=Path, help="Markdown report (default reports/claims-<mode>.md); "
                   "the raw rows go beside it as .json")
    p.add_argument("--timeout-per-cell", type=int, default=1800, metavar="S",
                   help="seconds one cell may run before the notebook is failed (default 1800)")
    p.add_argument("--executed", type=Path, metavar="DIR",
                   help="also write each executed notebook (with its outputs) into DIR")
    p.add_argument("--merge", action="store_true",
                   help="put the picked notebooks into the existing report at --out (each "
                        "with its own commit and date) instead of writing a new one")
    p.add_argument("--workbook", type=Path, default=WORKBOOK, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    mode = "quick" if args.quick else "full"
    out = args.out or REPO / "reports" / f"claims-{mode}.md"
    paths = find_notebooks(args.workbook, args.notebooks)
    previous = None
    if args.merge:  # read (and check) the report to merge into before anything runs
        raw_path = out.with_suffix(".json")
        if not raw_path.exists():
            raise SystemExit(f"--merge: no report at {raw_path} to merge into")
        previous = json.loads(raw_path.read_text(encoding="utf-8"))
        if previous["mode"] != mode:
            raise SystemExit(f"--merge: {raw_path} is a {previous['mode']} report, "
                             f"this run is {mode}")
    meta = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "mode": mode,
            "machine": machine_info(), "commit": git_commit(args.workbook)}
    results = []
    for path in paths:
        print(f"{path.stem}: running ({mode} mode)...", flush=True)
        r = run_notebook(path, args.quick, args.timeout_per_cell, args.executed)
        results.append(r)
        err = f"  {r['error']['ename']}: {r['error']['evalue'][:200]}" if r["error"] else ""
        print(f"{path.stem}: {r['status']} in {r['seconds']:.0f} s "
              f"({budget(path.stem, r['seconds'], mode)}), {len(r['rows'])} claims, "
              f"{held(r)}{err}", flush=True)
    meta["seconds"] = sum(r["seconds"] for r in results)
    meta["runs_bytes"] = runs_bytes(args.workbook)
    if previous is not None:
        meta, results = merge(previous, results, meta["commit"], meta["date"])
    raw = write_report(out, meta, results)
    failed = [r["notebook"] for r in results if r["status"] == "fail"]
    print(f"report: {out}\nraw rows: {raw}\nfailed: {', '.join(failed) or 'none'}\n"
          f"runs folder: {meta['runs_bytes'] / 2**20:,.1f} MiB")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

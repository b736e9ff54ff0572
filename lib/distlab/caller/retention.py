"""Runs do not fill the disk: keep the newest runs, delete the rest.

Every launch writes a run folder (events, result files, checkpoints) under the runs root
(`./runs`, or $DISTLAB_RUNS, or RunConfig.runs_root). One pass over the workbook makes a few
hundred of them. The launcher applies the rule below before it makes a new folder, so the root
never holds more than

    DISTLAB_KEEP_RUNS  run folders (default 100; 0 turns the rule off)
    DISTLAB_KEEP_MB    MiB of run folders (default 500; 0: no size limit)

deleting the oldest first. Only folders named as the launcher names them
(`YYYYmmdd-HHMMSS-label-xxxxxx`) are touched: anything else under the root (a notebook's model
file, your own checkpoints folder) is never deleted. Runs that may still be writing — folders
changed in the last `busy_s` seconds — are kept whatever the rule says.

From a terminal (docs/library.md's cleanup command):

    python -m distlab.caller.retention workbook/runs --keep 0        # every run not busy
    python -m distlab.caller.retention workbook/runs --keep 20 --max-mb 100
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import time

from distlab.units import MiB

RUN_DIR = re.compile(r"^\d{8}-\d{6}-.+-[0-9a-f]{6}$")  # launch.new_run_dir's names
KEEP_RUNS_ENV, KEEP_MB_ENV = "DISTLAB_KEEP_RUNS", "DISTLAB_KEEP_MB"
DEFAULT_KEEP_RUNS, DEFAULT_KEEP_MB = 100, 500


def folder_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:  # deleted while we walked
                pass
    return total


def _last_change(path: str) -> float:
    """Newest mtime in the folder; +inf if it is gone (another launch pruned it meanwhile)."""
    try:
        newest = os.lstat(path).st_mtime
    except OSError:
        return float("inf")
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
            except OSError:
                pass
    return newest


def run_folders(root: str) -> list[str]:
    """The launcher's run folders under `root`, oldest first (their names start with the time)."""
    if not os.path.isdir(root):
        return []
    return [os.path.join(root, n) for n in sorted(os.listdir(root))
            if RUN_DIR.match(n) and os.path.isdir(os.path.join(root, n))]


def prune(root: str, keep: int, max_mb: float = 0.0, busy_s: float = 60.0) -> dict:
    """Delete the oldest run folders under `root` until at most `keep` remain and (max_mb > 0)
    they hold at most max_mb MiB. Returns {"deleted": n, "freed": bytes, "kept": n,
    "kept_bytes": bytes}."""
    folders = run_folders(root)
    sizes = {f: folder_bytes(f) for f in folders}
    total, deleted, freed = sum(sizes.values()), 0, 0
    now = time.time()
    for i, f in enumerate(folders):
        left = len(folders) - i
        if left <= keep and (max_mb <= 0 or total <= max_mb * MiB):
            break
        if now - _last_change(f) < busy_s:
            continue  # maybe still running: keep it
        shutil.rmtree(f, ignore_errors=True)
        total -= sizes[f]
        freed += sizes[f]
        deleted += 1
    return {"deleted": deleted, "freed": freed, "kept": len(folders) - deleted,
            "kept_bytes": total}


def apply_default_rule(root: str) -> dict | None:
    """The launcher's call: prune by DISTLAB_KEEP_RUNS / DISTLAB_KEEP_MB (module docstring)."""
    keep = int(os.environ.get(KEEP_RUNS_ENV, DEFAULT_KEEP_RUNS))
    if keep <= 0:
        return None
    return prune(root, keep, float(os.environ.get(KEEP_MB_ENV, DEFAULT_KEEP_MB)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m distlab.caller.retention",
                                description="Delete old distlab run folders, oldest first.")
    p.add_argument("root", nargs="?", default="runs", help="the runs folder (default ./runs)")
    p.add_argument("--keep", type=int, default=DEFAULT_KEEP_RUNS,
                   help=f"run folders to keep (default {DEFAULT_KEEP_RUNS}; 0 deletes all)")
    p.add_argument("--max-mb", type=float, default=0.0, help="MiB to keep at most (0: no cap)")
    args = p.parse_args(argv)
    before = folder_bytes(args.root) if os.path.isdir(args.root) else 0
    r = prune(args.root, args.keep, args.max_mb)
    print(f"{args.root}: deleted {r['deleted']} run folders ({r['freed'] / MiB:,.1f} MiB); "
          f"{r['kept']} kept ({r['kept_bytes'] / MiB:,.1f} MiB); the folder held "
          f"{before / MiB:,.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What every multi-rank benchmark here needs around its runs (imported by them, not run)."""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import sys
import tempfile


@contextlib.contextmanager
def scratch_runs(script: str, prefix: str):
    """Runs go to a temporary DISTLAB_RUNS folder, removed at the end; yields the benchmark
    itself imported by module name (spawned ranks import its rank functions by that name, so
    its folder goes on sys.path)."""
    root = tempfile.mkdtemp(prefix=prefix)
    os.environ["DISTLAB_RUNS"] = root
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        yield importlib.import_module(os.path.splitext(os.path.basename(script))[0])
    finally:
        shutil.rmtree(root, ignore_errors=True)

import os
import tempfile

# Notebooks read WORKBOOK_QUICK in their parameters cell; nbval's kernels inherit it.
os.environ.setdefault("WORKBOOK_QUICK", "1")
# Runs made by tests go to a throwaway folder, never into the checkout.
os.environ.setdefault("DISTLAB_RUNS", tempfile.mkdtemp(prefix="distlab-test-runs-"))
# That folder is thrown away, and a test may read a run long after it ended: no retention rule
# (distlab.caller.retention's own tests call it directly).
os.environ.setdefault("DISTLAB_KEEP_RUNS", "0")


def pytest_collection_modifyitems(items):
    """The browser tests first (a stable sort keeps the rest in order): xdist (--dist loadfile)
    hands files out in this order, and collected last, the two (~50 and ~20 s) ran alone on one
    worker for the suite's last minute while the other workers sat idle."""
    items.sort(key=lambda item: "browser" not in item.path.parts)

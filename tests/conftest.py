import os
import tempfile

# Notebooks read WORKBOOK_QUICK in their parameters cell; nbval's kernels inherit it.
os.environ.setdefault("WORKBOOK_QUICK", "1")
# Runs made by tests go to a throwaway folder, never into the checkout.
os.environ.setdefault("DISTLAB_RUNS", tempfile.mkdtemp(prefix="distlab-test-runs-"))
# That folder is thrown away, and a test may read a run long after it ended: no retention rule
# (distlab.caller.retention's own tests call it directly).
os.environ.setdefault("DISTLAB_KEEP_RUNS", "0")

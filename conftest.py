import atexit
import itertools
import os
import shutil
import tempfile

# Notebooks read WORKBOOK_QUICK in their parameters cell; nbval's kernels inherit it. This file
# sits at the root so that `pytest workbook/NN_name.ipynb` alone runs quick too (under tests/ it
# was read only when tests/ was collected: one notebook alone ran in full mode, 307 s for 17).
os.environ.setdefault("WORKBOOK_QUICK", "1")
# Runs made by tests go to a throwaway folder, never into the checkout; the process that made
# it (pytest's, whose xdist workers inherit the variable) removes it when the session ends.
if "DISTLAB_RUNS" not in os.environ:
    os.environ["DISTLAB_RUNS"] = tempfile.mkdtemp(prefix="distlab-test-runs-")
    atexit.register(shutil.rmtree, os.environ["DISTLAB_RUNS"], ignore_errors=True)
# That folder is thrown away, and a test may read a run long after it ended: no retention rule
# (distlab.caller.retention's own tests call it directly).
os.environ.setdefault("DISTLAB_KEEP_RUNS", "0")


def _kernels_on_unix_sockets():
    """nbval's kernels (the workbook's notebooks) talk over Unix sockets, not TCP ports: a port
    jupyter_client found free can be taken by a rank's gloo socket before the kernel binds it
    ("ZMQError: Address already in use" failed a CI run). Each kernel gets its own socket
    prefix in a folder of this process's, removed at exit."""
    import nbval.kernel
    from jupyter_client.manager import KernelManager

    folder = tempfile.mkdtemp(prefix="distlab-kernels-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    count = itertools.count()

    class UnixSocketKernelManager(KernelManager):
        def __init__(self, **kwargs):
            kwargs.setdefault("transport", "ipc")
            kwargs.setdefault("ip", os.path.join(folder, f"kernel{next(count)}"))
            super().__init__(**kwargs)

    nbval.kernel.KernelManager = UnixSocketKernelManager


_kernels_on_unix_sockets()

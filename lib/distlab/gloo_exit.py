"""A clean exit for processes that used gloo: let its worker threads finish before Python
finalizes.

What we saw (torch 2.13, CPU, 2 ranks under torchrun, docs/your_model.md's fully_shard
script): about 1 run in 20 on a loaded 2-core machine ended with "terminate called without
an active exception" and SIGABRT, after the last step had printed and after dist.barrier() and
dist.destroy_process_group(). The core dump's stacks:

    gloo worker  ProcessGroupGloo::runLoop -> ~AsyncAllgatherWork -> TensorImpl::decref_pyobject
                 -> gil_scoped_acquire -> take_gil -> PyThread_exit_thread -> std::terminate
    main         Py_FinalizeEx -> gc

A gloo worker drops its reference to a finished collective after the caller has already been
woken; dropping a tensor that has a Python object needs the GIL. If the main thread reaches
interpreter finalization first, the worker's take_gil ends the thread, and a C++ thread that
unwinds out of runLoop aborts the process. destroy_process_group() would join the workers, but
only when the process group object dies, and after `import torch._dynamo` (which building any
torch optimizer does) something inside torch keeps it alive to the end: measured here, the
gloo threads are still there after destroy_process_group().

The guard: an atexit handler (atexit runs before finalization, with the interpreter whole)
that releases the GIL for GRACE_S, so a worker waiting for it finishes its release. Measured
with two busy-loop processes loading the 2 cores: 3 of 60 runs of that script aborted
without it, 0 of 60 with it. It costs GRACE_S once per process, at exit.
"""

from __future__ import annotations

import atexit
import time

GRACE_S = 0.2  # a worker woken on the GIL runs within a scheduler slice; 0.2 s is many slices

_armed = False


def _let_workers_finish() -> None:
    time.sleep(GRACE_S)  # sleeping releases the GIL: a waiting gloo worker takes it and ends


def arm() -> None:
    """Register the exit guard once per process (Comm calls this for a gloo group)."""
    global _armed
    if not _armed:
        atexit.register(_let_workers_finish)
        _armed = True

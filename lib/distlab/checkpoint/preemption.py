"""SIGTERM as a preemption notice (a spot instance's two-minute warning, a scheduler's eviction,
torchrun passing it on): the checkpointing loop saves at the next step boundary and leaves."""

from __future__ import annotations

import signal
import threading
import time


class PreemptionNotice:
    """SIGTERM as a preemption notice: note when it came; the loop saves and leaves at the next
    step boundary (Checkpointer.after_step). Python runs the handler in the main thread between
    bytecodes, so a rank inside a collective takes the notice once that collective returns:
    every rank gets the signal, so every collective still completes."""

    def __init__(self):
        self.received: float | None = None
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame):
        if self.received is None:
            self.received = time.time()

    def close(self):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

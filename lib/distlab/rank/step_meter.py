"""What one training step measured on this rank, gathered in one place for the step event:

    meter.start()                  before the step: timer, CUDA peak reset
    meter.saw_batch(x, y)          once the batch is read: the peak tracker's step begins
    with meter.forward(): ...      around each forward: activation bytes saved for backward
    fields = meter.end(...)        after the update: step time, CPU seconds (the process's and
                                   the training thread's; on Linux also the seconds each waited
                                   for a core: wait_s), bytes per collective (booked,
                                   distlab.comm, and on the wire, distlab.wire), memory by
                                   category (distlab.memory), CUDA's max allocated

Memory categories: the strategy's parameters/gradients/optimizer state (exact local bytes),
activations saved for backward (ActivationMeter), communication buffers (distlab.comm), and
opt-in extras: autocast's weight copies, the per-step peak of aten-allocated bytes
(RunConfig.track_peak, ~20% step time on this CPU), torch.cuda.max_memory_allocated on a GPU
(and memory_allocated at the step's end).

Across nodes (GLOO_SOCKET_IFNAME names the node's link, as distlab.caller.cluster sets it), each
step event also carries the link's counters at the step's end ("link": bytes and frames sent,
distlab.wire.link_counters): the difference between two steps' readings on one node is what
the node's ranks sent across the link between them, with no sampling from outside.
"""

from __future__ import annotations

import os
import threading
import time

import torch

from distlab import wire
from distlab.memory import PEAK_LABEL, ActivationMeter, PeakMemoryTracker


class StepMeter:
    def __init__(self, cfg, model, comm, device: torch.device):
        self.comm, self.device = comm, device
        self.on_cuda = device.type == "cuda"
        self.activations = ActivationMeter(model)
        self.peak = PeakMemoryTracker() if cfg.track_peak else None
        if self.peak is not None:
            self.peak.adopt([*model.parameters(), *model.buffers()])
        self.t0 = 0.0
        self.link = os.environ.get("GLOO_SOCKET_IFNAME")  # the node's link, across nodes
        self._cleared = False  # between(): what was booked since is the next step's

    @property
    def peak_label(self) -> str | None:
        """What memory["peak"] means (for the start event), None without a peak tracker."""
        return PEAK_LABEL if self.peak is not None else None

    def between(self) -> None:
        """After a step's evaluation and checkpoint, before the strategy starts the next step's
        work (Strategy.between_steps): what was booked until now is no step's, what is booked
        from here on is the next step's."""
        self.comm.take_step_stats()
        self._cleared = True

    def start(self) -> None:
        """Start the step's timer (before the batch is read: the step's cost includes it)."""
        if self.on_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        if not self._cleared:  # between steps (evaluation, checkpoints) is no step's
            self.comm.take_step_stats()
        self._cleared = False
        wire.LEDGER.begin()
        self.queued0 = run_queue_delays()  # ~50 µs: before the step's clocks start
        self.t0 = time.perf_counter()
        self.cpu0 = (time.process_time(), time.thread_time())

    def saw_batch(self, x, y) -> None:
        if self.peak is not None:  # the batch's own bytes are live from here on
            self.peak.step_begin(x, y)

    def forward(self):
        """Context around a forward: counts the activation bytes it saves for backward."""
        return self.activations.measure()

    def end(self, strategy, model, optimizer) -> dict:
        """The step event's measured fields: step_s, cpu, comm, wire, memory. Resets the comm
        counters."""
        if self.on_cuda:
            torch.cuda.synchronize(self.device)
        step_s = time.perf_counter() - self.t0
        # CPU seconds of the step: the whole process's (every thread: the backend's too) and
        # the training thread's; their difference is what the backend's threads burned, which
        # on a CPU comes out of the same cores the ranks compute on
        process_s, main_s = (time.process_time() - self.cpu0[0],
                             time.thread_time() - self.cpu0[1])
        comm_stats, comm_buffer = self.comm.take_step_stats()
        on_wire = wire.LEDGER.end()
        memory = {**strategy.state_bytes(model, optimizer), "activations": self.activations.bytes,
                  "comm_buffers": comm_buffer}
        if self.activations.param_cast_bytes:  # autocast's low-precision weight copies
            memory["param_casts"] = self.activations.param_cast_bytes
        if self.peak is not None:  # "peak": this step's; "allocated": live now (PEAK_LABEL)
            memory.update(peak=self.peak.step_end(), allocated=self.peak.current)
        if self.on_cuda:
            memory["cuda_max_allocated"] = torch.cuda.max_memory_allocated(self.device)
            # live at the step's end (before zero_grad): what stays on the device between steps
            memory["cuda_allocated"] = torch.cuda.memory_allocated(self.device)
        cpu = {"process_s": process_s, "main_thread_s": main_s}
        waited = core_wait(self.queued0, run_queue_delays())
        if waited is not None:
            cpu["wait_s"] = waited
        out = {"step_s": step_s, "memory": memory, "comm": comm_stats, "wire": on_wire,
               "cpu": cpu}
        link = wire.link_counters(self.link)
        if link is not None:
            out["link"] = link
        return out


def run_queue_delays() -> dict[int, int] | None:
    """Nanoseconds each of this process's threads has spent runnable but waiting for a core
    (the second field of Linux's /proc/<pid>/task/<tid>/schedstat, the scheduler's run_delay),
    by thread id; None where the kernel does not give it."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    delays = {}
    for tid in tids:
        try:  # os.open/os.read: half the cost of open() for a file this small
            fd = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
            try:
                delays[int(tid)] = int(os.read(fd, 128).split()[1])
            finally:
                os.close(fd)
        except (OSError, IndexError, ValueError):
            continue  # the thread ended meanwhile
    return delays or None


def core_wait(before: dict | None, after: dict | None) -> dict | None:
    """Seconds this step's threads waited for a core: {"main": the training thread's,
    "others": every other thread's (the backend's), summed}. On a machine with fewer free cores
    than runnable threads, a collective's thread waiting for a core delays the collective while
    the training thread waits on it. A thread born during the step counts from zero."""
    if before is None or after is None:
        return None
    main = threading.get_native_id()  # end() runs on the training thread
    out = {"main": 0.0, "others": 0.0}
    for tid, ns in after.items():
        out["main" if tid == main else "others"] += (ns - before.get(tid, 0)) / 1e9
    return out

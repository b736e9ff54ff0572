"""Faults on purpose: the misbehaviour a run injects, to show what a real cluster does to
training and that the launcher survives it (the fault drills of 09, the stragglers of 02).
One object the loop calls at three points:

    faults.before_step(step, model)   a fault at RunConfig.fault_step on fault_rank (raise, stall,
                                      SIGKILL, a NaN in a weight; kill_in_save fires in
                                      distlab.checkpoint's save instead)
    faults.before_reduce()            a straggler: straggler_rank sleeps straggler_delay_s, so
                                      everyone else waits at the gradient synchronisation
    faults.after_step()               step_delay_s: a sleep per step, to slow a demo enough to watch
"""

from __future__ import annotations

import os
import signal
import time

from distlab.config import RunConfig
from distlab.debug.nan import poison


def inject_fault(cfg: RunConfig, rank: int, step: int, log, model=None):
    """The fault drills: one rank misbehaves at one step, as real ranks do."""
    if cfg.fault in ("none", "kill_in_save") or rank != cfg.fault_rank or step != cfg.fault_step:
        return  # kill_in_save fires while a checkpoint is written (distlab.checkpoint)
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return  # a worker torchrun restarted is the recovery: the drill's fault fired once
    if cfg.fault == "nan":  # a NaN in one weight; detect_nan=True names where it surfaces
        module = poison(model, cfg.fault_module)
        log.write("fault", fault=cfg.fault, step=step, module=module)
        return
    log.write("fault", fault=cfg.fault, step=step)
    if cfg.fault == "raise":
        raise RuntimeError(f"injected fault: rank {rank} raised at step {step}")
    if cfg.fault == "stall":  # alive but never joins another collective, like a hung rank
        while True:
            time.sleep(1.0)
    if cfg.fault == "kill":  # dies without a word, like an OOM-killed or preempted process
        os.kill(os.getpid(), signal.SIGKILL)


class Faults:
    def __init__(self, cfg: RunConfig, rank: int, log):
        self.cfg, self.rank, self.log = cfg, rank, log

    def before_step(self, step: int, model) -> None:
        inject_fault(self.cfg, self.rank, step, self.log, model)

    def before_reduce(self) -> None:
        if self.rank == self.cfg.straggler_rank:
            time.sleep(self.cfg.straggler_delay_s)  # a slow rank: everyone else waits at the sync

    def after_step(self) -> None:
        if self.cfg.step_delay_s:
            time.sleep(self.cfg.step_delay_s)

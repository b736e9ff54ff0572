"""RunConfig's checkpoints section: training checkpoints and resuming (distlab.checkpoint)."""

from __future__ import annotations

from dataclasses import dataclass

from distlab.config.declare import declare
from distlab.parallel import strategies, strategy_class


@dataclass
class Checkpoints:
    """When checkpoints are written, how many are kept, where, and the one a run resumes
    from. A resumed run may change every field here."""

    checkpoint_every: int = declare(0, "save every k steps and after the last one (0: off)",
                                    at_least=0, may_change=True)
    keep_last: int = declare(2, "complete checkpoints kept; older ones are deleted", at_least=1,
                             may_change=True)
    checkpoint_dir: str = declare("", "where checkpoints go ('': <run dir>/checkpoints)",
                                  may_change=True)
    resume_from: str = declare("", "a checkpoint, a folder of them, or 'auto' (the newest that "
                               "verifies)", may_change=True)
    checkpoint_async: bool = declare(False, "periodic saves stage a copy in memory and write it "
                                     "from a thread while training goes on (full format)",
                                     may_change=True)

    def check(self) -> None:
        if not (self.checkpoint_every or self.resume_from):
            if self.fault == "kill_in_save":
                raise ValueError("fault='kill_in_save' fires while a checkpoint is written: "
                                 "set checkpoint_every > 0")
            return
        if strategy_class(self.strategy).checkpoint_layout is None:
            raise ValueError(f"checkpointing is written for {', '.join(strategies('checkpoint'))} "
                             f"(got strategy={self.strategy!r}): set checkpoint_every=0 and "
                             "resume_from=''")
        if self.compress != "none":
            raise ValueError(f"compress={self.compress!r} keeps error-feedback residuals on each "
                             "rank that checkpoints do not hold, so a resume would not be exact")
        if self.join:
            raise ValueError("join=True: a rank out of data shadows the others' steps without "
                             "ending them, so it would miss their checkpoints; use drop_last")
        if self.checkpoint_async and (
                strategy_class(self.strategy).checkpoint_format != "full"
                or self.fault == "kill_in_save"):
            raise ValueError("checkpoint_async is written for the full format (single, allreduce, "
                             "ddp, ddp-torch, zero1-torch) and without fault='kill_in_save'; "
                             f"strategy={self.strategy!r}, fault={self.fault!r}")
        k = self.checkpoint_every
        if self.fault == "kill_in_save" and not (
                k and ((self.fault_step + 1) % k == 0 or self.fault_step == self.steps - 1)):
            raise ValueError(f"fault='kill_in_save' at fault_step={self.fault_step}: no checkpoint "
                             f"is written after that step (checkpoint_every={k} saves after "
                             f"steps {k - 1}, {2 * k - 1}, ... and the last, {self.steps - 1})")

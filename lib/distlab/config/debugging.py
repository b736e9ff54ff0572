"""RunConfig's debugging section: faults on purpose (the launcher's drills), training bugs on
purpose and the measurements that find them (distlab.debug)."""

from __future__ import annotations

from dataclasses import dataclass

from distlab.config.declare import Feature, declare
from distlab.config.precision import loss_scaling

# Training bugs on purpose, for the debugging drills (distlab.debug.bugs says what each does);
# "none" first: the default
BUGS = ("none", "shuffled_labels", "zero_init", "no_zero_grad", "loss_not_divided", "same_rows")
# Injected faults, for the drills that prove the launcher's process safety.
FAULTS = ("none", "raise", "stall", "kill", "nan",  # nan: a NaN in one weight (distlab.debug.nan)
          "kill_in_save")  # SIGKILL halfway through writing a checkpoint (distlab.checkpoint)


@dataclass
class Debugging:
    """torch's collective checks, NaN detection, one rank misbehaving at one step (a fault), a
    training bug on purpose, and the diagnostics that find one (distlab.debug.probe: per-layer
    gradient norms, update/weight ratios, unit spread, batch fingerprints in every step event;
    the checks: distlab.debug.diagnose)."""

    # A resumed run may debug and inject faults as it likes, not change a bug or diagnostics
    debug: bool = declare(False, "TORCH_DISTRIBUTED_DEBUG=DETAIL: catches mismatched "
                          "collectives", may_change=True)
    detect_nan: bool = declare(False, "name the step and first module that made inf/NaN "
                               "(distlab.debug.nan)", may_change=True)
    fault: str = declare("none", "a fault injected in one rank at one step", choices=FAULTS,
                         may_change=True)
    fault_rank: int = declare(0, "the rank that misbehaves", may_change=True)
    fault_step: int = declare(0, "the step it misbehaves at", may_change=True)
    fault_module: str = declare("", "fault='nan': the module whose weight gets the NaN ('': the "
                                "first Linear)", may_change=True)
    bug: str = declare("none", "a training bug on purpose (distlab.debug.bugs)", choices=BUGS,
                       feature=Feature("bugs", "bug != 'none' (a training bug on purpose, "
                                       "distlab.debug.bugs, in a loop that holds whole "
                                       "gradients)"))
    diagnostics: bool = declare(False, "per-layer gradient norms, update ratios and batch "
                                "fingerprints in every step event (distlab.debug.probe)",
                                feature=Feature("diagnostics", "diagnostics=True (per-layer "
                                                "gradient norms and update ratios of whole "
                                                "gradients, distlab.debug.probe)"))

    def check(self) -> None:
        if self.fault_module and self.fault != "nan":
            raise ValueError(f"fault_module={self.fault_module!r} picks where fault='nan' puts "
                             f"its NaN; set fault='nan' (got fault={self.fault!r})")
        _check_bug(self)
        if self.diagnostics and loss_scaling(self):
            raise ValueError("diagnostics=True measures gradient norms before the optimizer "
                             "step, where loss scaling leaves them scaled: use loss_scale='none' "
                             "(fp32 or bf16)")
        if self.fault != "none":
            if not 0 <= self.fault_rank < self.world_size:
                raise ValueError(f"fault_rank={self.fault_rank} must be in [0, {self.world_size})")
            if not 0 <= self.fault_step < self.steps:
                raise ValueError(f"fault_step={self.fault_step} must be in [0, {self.steps})")


def _check_bug(cfg) -> None:
    """Refuse a bug that would change nothing under this config, or that a checkpoint could
    not resume (the name is already one of BUGS)."""
    if cfg.bug == "no_zero_grad" and (cfg.checkpoint_every or cfg.resume_from):
        raise ValueError("bug='no_zero_grad' carries gradients from step to step, which "
                         "checkpoints do not hold: set checkpoint_every=0 and resume_from=''")
    if cfg.bug == "loss_not_divided" and cfg.grad_accum < 2:
        raise ValueError("bug='loss_not_divided' leaves out the division by grad_accum: set "
                         f"grad_accum >= 2 (got {cfg.grad_accum}, where dividing changes nothing)")
    if cfg.bug == "same_rows" and cfg.dp_degree < 2:
        raise ValueError("bug='same_rows' makes every rank read rank 0's rows: it needs "
                         f"world_size >= 2 (got {cfg.world_size})")
    if cfg.bug == "shuffled_labels" and cfg.local_batch < 2:
        raise ValueError("bug='shuffled_labels' gives each row another row's targets: it needs "
                         f"at least 2 rows per rank (global_batch={cfg.global_batch} over "
                         f"{cfg.dp_degree} rank(s))")

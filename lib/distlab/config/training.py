"""RunConfig's training section: the one loop's steps, batch and optimizer (distlab.rank)."""

from __future__ import annotations

from dataclasses import dataclass

from distlab.config.declare import Feature, Widget, declare

OPTIMIZERS = ("sgd", "adamw")
CHECKPOINTING = ("none", "full", "selective")


@dataclass
class Training:
    """The loop: how many steps, the global batch and how it is split into micro-batches, the
    optimizer and its learning rate, clipping, activation checkpointing, the seed."""

    # A resumed run may change steps and grad_accum (the update is the same; grad_accum changes
    # only the summation order, equal up to rounding as another world size) and what is
    # recomputed or measured, not the optimizer nor the batch
    steps: int = declare(100, "optimizer steps", at_least=1, at_most=10_000_000, may_change=True,
                         widget=Widget("steps", "int", low=1, high=100_000))
    lr: float = declare(3e-3, "learning rate (after warm-up)",
                        widget=Widget("learning rate", "log", low=-5, high=0, step=1e-4))
    optimizer: str = declare("adamw", "the optimizer", choices=OPTIMIZERS)
    weight_decay: float = declare(0.0, "the optimizer's weight decay")
    global_batch: int = declare(16, "rows of one optimizer step across all ranks; data-parallel "
                                "ranks each take global_batch // world_size of them",
                                at_least=1, at_most=1 << 24,
                                widget=Widget("global batch", "int", low=1, high=1 << 16))
    grad_accum: int = declare(1, "micro-batches per optimizer step on each rank", at_least=1,
                              may_change=True)
    warmup_steps: int = declare(0, "the learning rate rises linearly from lr/warmup_steps to lr",
                                at_least=0)
    grad_clip: float = declare(0.0, "clip gradients to this global norm (0: off)",
                               feature=Feature("grad_clip", "grad_clip > 0 (clipping to a global "
                                               "norm)"))
    seed: int = declare(0, "seeds the data and the model's initial weights")
    checkpointing: str = declare("none", "activation checkpointing per block "
                                 "(distlab.rank.recompute)", choices=CHECKPOINTING,
                                 may_change=True)
    track_peak: bool = declare(False, "memory['peak'] per step: aten-allocated bytes (~20% "
                               "step time)", may_change=True)

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dp_degree

    @property
    def micro_batch(self) -> int:
        return self.global_batch // (self.dp_degree * self.grad_accum)

    def lr_at(self, step: int) -> float:
        """Linear warm-up over warmup_steps (Goyal et al. 2017, "gradual warmup"), then lr."""
        if self.warmup_steps and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        return self.lr

    def check(self) -> None:
        """After the strategy's own checks: its dp_degree is then one it runs."""
        if self.checkpointing != "none" and self.model != "gpt":
            raise ValueError(f"checkpointing={self.checkpointing!r} wraps GPT blocks; "
                             f"model={self.model!r} has none")
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip={self.grad_clip} must be >= 0 (0: off)")
        _check_batch_split(self)
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr!r} must be a number > 0")
        if self.seed < 0:
            raise ValueError(f"seed={self.seed} must be >= 0 (the data and NumPy's generators "
                             "take non-negative seeds)")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay={self.weight_decay} must be >= 0")


def _check_batch_split(cfg) -> None:
    """The global batch splits evenly: over the data-parallel ranks, a pipeline's
    micro-batches and gradient accumulation's."""
    dp = cfg.dp_degree
    if cfg.global_batch % dp:
        raise ValueError(f"global_batch={cfg.global_batch} does not divide among "
                         f"{dp} data-parallel ranks (world_size={cfg.world_size}); choose "
                         f"a multiple of {dp}")
    if cfg.local_batch % cfg.microbatches:
        raise ValueError(f"global_batch={cfg.global_batch} gives each pipeline "
                         f"{cfg.local_batch} rows ({dp} data-parallel ranks), not divisible "
                         f"into microbatches={cfg.microbatches} equal micro-batches; choose "
                         f"a global_batch that is a multiple of {dp * cfg.microbatches}")
    if cfg.global_batch % (dp * cfg.grad_accum):
        raise ValueError(f"global_batch={cfg.global_batch} does not split into "
                         f"{dp} ranks x grad_accum={cfg.grad_accum} equal micro-batches; "
                         f"choose a multiple of {dp * cfg.grad_accum}")

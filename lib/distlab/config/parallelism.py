"""RunConfig's parallelism section: the strategy (distlab.parallel.REGISTRY), the world size,
and the data-parallel and ZeRO strategies' own knobs.

Which strategies read a knob is each strategy's declaration (Strategy.knobs); a feature a
field asks for is declared on the field (its Feature) and implemented by the strategies that
list it in Strategy.supports. distlab.config.reads holds the checks both imply.
"""

from __future__ import annotations

from dataclasses import dataclass

from distlab.config.declare import Feature, Widget, declare
from distlab.parallel import strategies, strategy_class

ALLREDUCE_ALGORITHMS = ("torch", "ring", "naive")
DP_GATHERS = ("logits", "loss")
COMPRESSIONS = ("none", "topk", "powersgd")  # topk: ddp's; powersgd: ddp-torch's (torch's hook)
FSDP_LAYOUTS = ("flat", "per_param")


@dataclass
class Parallelism:
    """The strategy and the world size; the knobs of the data-parallel strategies (all-reduce,
    DP, DDP and compression, DiLoCo, parameter servers) and of ZeRO and FSDP."""

    # A resumed run may change the strategy, the world size and how gradients are summed
    # (allreduce, bucket_mb: another order, equal up to rounding) or where optimizer state lives
    strategy: str = declare("single", "how the loop is parallelised (distlab.parallel)",
                            choices=strategies, may_change=True, widget=Widget("strategy"))
    world_size: int = declare(1, "ranks (processes, or dp's threads)", at_least=1, at_most=4096,
                              may_change=True, widget=Widget("world size", offer=(1, 2, 4)))
    allreduce: str = declare("torch", "allreduce: the algorithm that averages gradients (torch: "
                             "the backend's)", choices=ALLREDUCE_ALGORITHMS, may_change=True,
                             widget=Widget("all-reduce"))
    dp_threads: bool = declare(True, "dp: replicas in threads (False: one after another, to "
                               "time the GIL)", widget=Widget("replicas in threads", "check"))
    dp_gather: str = declare("logits", "dp: replicas return logits (loss on replica 0), or their "
                             "loss", choices=DP_GATHERS, widget=Widget("replicas return"))
    bucket_mb: float = declare(0.25, "ddp: gradient bucket size cap, MiB (torch's default is 25)",
                               may_change=True,
                               widget=Widget("bucket MiB", "float", low=1e-3, high=1024,
                                             step=0.05))
    compress: str = declare("none", "gradient compression: ddp's topk (top-k with error "
                            "feedback), ddp-torch's powersgd", choices=COMPRESSIONS,
                            widget=Widget("compression"))
    topk_ratio: float = declare(0.01, "topk: the fraction of each bucket's entries sent",
                                widget=Widget("top-k ratio", "float", low=1e-4, high=1, step=0.01))
    powersgd_rank: int = declare(2, "powersgd: the rank r of its factors",
                                 widget=Widget("PowerSGD rank", "int", low=1, high=1024))
    # diloco's outer optimizer is SGD with Nesterov momentum; outer_lr=1, outer_momentum=0 is
    # local SGD (distlab.parallel.data_parallel.diloco)
    sync_every: int = declare(8, "diloco: inner steps between averages",
                              widget=Widget("steps between averages", "int", low=1, high=10_000))
    outer_lr: float = declare(0.7, "diloco: the outer learning rate (Douillard et al. 2023's)",
                              widget=Widget("outer lr", "float", low=1e-3, high=10, step=0.1))
    outer_momentum: float = declare(0.9, "diloco: the outer Nesterov momentum",
                                    widget=Widget("outer momentum", "float", low=0, high=0.999,
                                                  step=0.05))
    backup_workers: int = declare(
        0, "ps-sync: extra workers; each step uses the first gradients to arrive", at_least=0,
        feature=Feature("backup_workers", "backup_workers > 0"),
        widget=Widget("backup workers", "int", low=0, high=64))
    broadcast_buffers: bool = declare(
        True, "ddp: rank 0's buffers to every rank at each step's start",
        feature=Feature("no_buffer_broadcast", "broadcast_buffers=False (each rank keeps its "
                        "own buffers, such as BatchNorm's running statistics)"))
    sync_bn: bool = declare(False, "BatchNorm statistics over the global batch (SyncBatchNorm)")
    # ZeRO and FSDP (distlab.parallel.zero)
    offload: bool = declare(False, "zero*: optimizer state lives on the CPU", may_change=True,
                            feature=Feature("offload", "offload=True (optimizer state on the "
                                            "CPU)"),
                            widget=Widget("offload (optimizer state on CPU)", "check"))
    fsdp_units: str = declare("", "zero3's units, comma-separated module names (a ModuleList's "
                              "name: each of its items; '': the model's fsdp_units attribute, "
                              "else the repeated blocks)",
                              widget=Widget("units", "text",
                                            hint="module names; empty: the blocks"))
    fsdp_prefetch: int = declare(1, "zero3: units ahead of the running one whose all-gather "
                                 "has started (FSDP2 prefetches 1; 0: each when needed)",
                                 at_least=0,
                                 widget=Widget("units prefetched", "int", low=0, high=64))
    fsdp_layout: str = declare("flat", "zero3: flat (the ZeRO paper's padded flat units) or "
                               "per_param (FSDP2's: each parameter sharded on dim 0)",
                               choices=FSDP_LAYOUTS, widget=Widget("shard layout"))
    shard_ranks: int = declare(0, "fsdp-torch: ranks each shard group spans (0: all, FSDP; "
                               "fewer: HSDP, replicated across the groups)",
                               widget=Widget("shard ranks (0: all; HSDP)", "int", low=0,
                                             high=1024))

    @property
    def dp_degree(self) -> int:
        """How many ranks split one global batch (the strategy's dp_degree: the workers of a
        parameter server, world/(tp·pp) under model parallelism, else the world)."""
        return strategy_class(self.strategy).dp_degree(self)

    @property
    def processes(self) -> int:
        """Processes to launch (`dp` runs its replicas as threads of one process)."""
        return strategy_class(self.strategy).processes(self)

    def check(self) -> None:
        if not 0 < self.topk_ratio <= 1 or self.bucket_mb <= 0:
            raise ValueError(f"topk_ratio={self.topk_ratio} must be in (0, 1] and "
                             f"bucket_mb={self.bucket_mb} > 0")

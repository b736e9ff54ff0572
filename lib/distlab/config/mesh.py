"""RunConfig's mesh section: model parallelism and the mesh's degrees (distlab.parallel.tensor,
.pipeline, .context, .mesh's 3d and .parallelize's mesh)."""

from __future__ import annotations

from dataclasses import dataclass

from distlab.config.declare import Feature, Widget, check_at_most, declare
from distlab.parallel import strategies, strategy_class
from distlab.parallel.mesh import ORDERS
from distlab.parallel.pipeline.pp import V_SHAPED

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb1p", "zbv", "dualpipev")
MESH_ORDERS = ORDERS  # 3d's rank orders (distlab.parallel.mesh)


@dataclass
class Mesh:
    """Tensor, sequence, pipeline, context and expert parallelism: the degrees, the pipeline's
    schedule, and the mesh's world = pp x dp_replicate x dp_shard x cp x tp. Degrees named
    without a strategy pick "mesh"; world_size left at 1 becomes their product."""

    tp: int = declare(1, "tensor-parallel degree", at_least=1, at_most=4096, may_change=True,
                      widget=Widget("tp (tensor-parallel ranks)"))  # tp saves whole weights
    sp: bool = declare(False, "sequence parallelism in the tensor-parallel regions' "
                       "LayerNorm/dropout", widget=Widget("sequence parallel (sp)", "check"),
                       feature=Feature("sp", "sp=True (sequence parallelism)"))
    pp: int = declare(1, "pipeline stages (ranks)", at_least=1, at_most=4096, may_change=True,
                      widget=Widget("pp (pipeline stages)"))  # pp saves whole weights
    microbatches: int = declare(1, "pipeline micro-batches per step", at_least=1,
                                may_change=True,  # as grad_accum: the same update
                                widget=Widget("micro-batches", offer=(1, 2, 4, 8, 16)))
    schedule: str = declare("gpipe", "the pipeline's schedule", choices=SCHEDULES,
                            widget=Widget("schedule"))
    virtual_stages: int = declare(1, "interleaved: model chunks per pipeline rank", at_least=1,
                                  widget=Widget("virtual stages", offer=(1, 2, 4)))
    # tp-dp-pp keeps a tp group inside a node, dp-tp-pp a dp group
    mesh_order: str = declare(MESH_ORDERS[0], "3d and mesh: rank order, fastest kind first",
                              choices=MESH_ORDERS, widget=Widget("rank order"))
    pp_op_delay_s: float = declare(0.0, "pp/3d: a sleep per forward and backward op (bubble "
                                   "demos)", at_least=0, may_change=True,
                                   widget=Widget("delay per op (s)", "float", low=0, high=10,
                                                 step=0.01))
    cp: int = declare(1, "mesh: ranks that split every sequence", at_least=1, at_most=4096,
                      widget=Widget("cp (context-parallel ranks)", "int", low=1, high=1024))
    dp_shard: int = declare(0, "mesh: ranks that shard the model state with ZeRO stage "
                            "zero_stage (0: the ranks the other degrees leave)", at_least=0,
                            at_most=4096,
                            widget=Widget("dp_shard (0: the rest)", "int", low=0, high=1024))
    dp_replicate: int = declare(1, "mesh: replicas of those shards (HSDP)", at_least=1,
                                at_most=4096,
                                widget=Widget("dp_replicate (HSDP)", "int", low=1, high=1024))
    zero_stage: int = declare(3, "mesh: ZeRO stage on dp_shard (fully_shard's 3, as "
                              "torchtitan's; 0 all-reduces whole gradients)",
                              widget=Widget("ZeRO stage on dp_shard", offer=(0, 1, 2, 3)))
    ep: int = declare(1, "mesh: ranks (of the data-parallel ones) over which each MoE's "
                      "experts spread", at_least=1, at_most=4096,
                      widget=Widget("ep (expert-parallel ranks)", "int", low=1, high=1024))
    mesh: str = declare("", "the mesh's degrees in one string, 'pp2 x dp_shard2 x tp2' (sets "
                        "those fields; the rest stay as given)",
                        widget=Widget("mesh", "text", hint="pp2 x dp_shard2 x tp2; empty: the "
                                      "degrees above"))
    cp_ranks: int = declare(0, "cp: ranks per replica that split each sequence (0: all)",
                            widget=Widget("cp ranks (0: all)", "int", low=0, high=1024))
    cp_layout: str = declare("zigzag", "which tokens each cp rank holds: zigzag (balanced "
                             "causal work) or contiguous", choices=("zigzag", "contiguous"),
                             widget=Widget("sequence split"))
    cp_attention: str = declare("ring", "how attention crosses the cp split: ring (K/V around "
                                "the ring) or ulysses (all-to-all to heads)",
                                choices=("ring", "ulysses"), widget=Widget("attention"))

    def pick_strategy(self) -> None:
        """RunConfig(tp=2, cp=2, dp_shard=2): degrees named without a strategy run on the
        mesh, and a world size left at 1 is their product."""
        if self.mesh:  # "pp2 x dp_shard2 x tp2": the degrees it names, each named once
            from distlab.parallel.parallelize import parse_mesh
            for dim, n in parse_mesh(self.mesh).items():
                given, default = getattr(self, dim), 0 if dim == "dp_shard" else 1
                if given not in (default, n):
                    raise ValueError(f"mesh={self.mesh!r} says {dim}={n}, and {dim}={given} was "
                                     "given too: name each degree once")
                setattr(self, dim, n)
        named = (self.cp > 1 or self.dp_shard > 0 or self.dp_replicate > 1 or self.ep > 1
                 or bool(self.mesh))
        if self.strategy == "single" and (named or self.tp > 1 or self.pp > 1):
            self.strategy = "mesh"
        if self.strategy == "mesh" and self.world_size == 1:
            self.world_size = self.pp * self.dp_replicate * max(self.dp_shard, 1) * (
                self.cp * self.tp)
            check_at_most(self, "world_size")  # as if given: no layout search over 10**12

    def check(self) -> None:
        cls = strategy_class(self.strategy)
        tp = self.tp if "tp" in cls.degrees else 1
        pp = self.pp if "pp" in cls.degrees else 1
        if self.tp > 1 and tp == 1:
            raise ValueError(f"tp={self.tp}: tensor parallelism needs a strategy that splits "
                             f"the model by tp: {', '.join(_with_degree('tp'))}")
        if self.pp > 1 and pp == 1:
            raise ValueError(f"pp={self.pp}: pipeline parallelism needs a strategy that splits "
                             f"the model into stages: {', '.join(_with_degree('pp'))}")
        layouts = cls.layouts(self.world_size)  # the strategy's own rule (Strategy.layouts)
        if {"tp": tp, "pp": pp} not in layouts:
            runs = " or ".join(f"tp={d['tp']}, pp={d['pp']}" for d in layouts)
            raise ValueError(f"world_size={self.world_size} with tp={tp}, pp={pp}: strategy "
                             f"{self.strategy!r} runs {runs} at this world size")
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise ValueError(f"virtual_stages={self.virtual_stages}: only the interleaved "
                             f"schedule reads it (schedule={self.schedule!r} runs one model "
                             "chunk per rank); set schedule='interleaved' or virtual_stages=1")
        if self.n_head % tp or self.n_embd % tp:
            raise ValueError(f"n_head={self.n_head} and n_embd={self.n_embd} must divide by "
                             f"tp={tp} (each rank holds whole heads)")
        v_shaped = self.schedule in V_SHAPED
        chunks = 2 if v_shaped and pp > 1 else self.virtual_stages
        if self.n_layer % (pp * chunks):
            raise ValueError(f"n_layer={self.n_layer} must divide into pp={pp} x "
                             + (f"virtual_stages={chunks}" if not v_shaped else
                                f"2 ({self.schedule}'s two chunks per rank)") + " equal stages")
        if self.sp and self.seq_len % tp:
            raise ValueError(f"seq_len={self.seq_len} must divide by tp={tp} for sp=True")
        if self.schedule in ("zb1p", *V_SHAPED) and pp > 1 and (
                self.strategy not in ("pp", "pp-torch") or self.world_size != pp):
            raise ValueError(f"schedule={self.schedule!r} runs in a pipeline alone for now "
                             f"(strategy 'pp' or 'pp-torch', world_size = pp = {pp}): its "
                             "weight gradients reach .grad in W, after backward, where the "
                             "hooks that DDP, ZeRO and FSDP reduce gradients in have already "
                             "fired. Use 1f1b with other degrees")
        if pp > 1 and self.schedule not in ("gpipe", "naive") and self.microbatches < pp:
            raise ValueError(f"schedule={self.schedule!r} needs microbatches >= pp "
                             f"({self.microbatches} < {pp})")
        if pp > 1 and self.schedule == "dualpipev" and self.microbatches < 2 * pp:
            raise ValueError(f"schedule='dualpipev' needs microbatches >= 2·pp "
                             f"({self.microbatches} < {2 * pp}): its steady state pairs a "
                             "forward of one chunk with a backward of the other")
        if pp > 1 and self.schedule == "interleaved" and self.microbatches % pp:
            raise ValueError(f"schedule='interleaved' needs microbatches divisible by pp "
                             f"({self.microbatches} by {pp}): micro-batches go round the "
                             "ranks in groups of pp")


def _with_degree(degree: str) -> list[str]:
    return [s for s in strategies() if degree in strategy_class(s).degrees]

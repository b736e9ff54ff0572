"""`mesh`: every parallelism on one device mesh, applied to the model in one written order.

The mesh has five named dimensions (torchtitan's and Megatron-Core's), world = their product:

    pp            pipeline stages                      (send/recv of one activation per boundary)
    dp_replicate  replicas that hold the same shards   (HSDP's all-reduce of gradient shards)
    dp_shard      ranks that shard the model state     (ZeRO stage `zero_stage`, 0: none)
    cp            ranks that split every sequence      (ring or Ulysses attention)
    tp            ranks that split every layer         (Megatron's f/g all-reduces; sp optional)

**Rank order**: tp varies fastest, then cp, dp_shard, dp_replicate, pp (torchtitan's order:
the dimensions that talk every layer on the nearest ranks, one node's). dp2 x cp2 x tp2:

    rank   0  1  2  3  4  5  6  7
    tp     0  1  0  1  0  1  0  1        tp groups  [0,1] [2,3] [4,5] [6,7]
    cp     0  0  1  1  0  0  1  1        cp groups  [0,2] [1,3] [4,6] [5,7]
    dp     0  0  0  0  1  1  1  1        dp groups  [0,4] [1,5] [2,6] [3,7]

**Who reduces what.** A rank's loss is the mean over its rows (its dp block of the global
batch) and its tokens (its cp share of every row), equal shares, so the mean gradient of the
global batch is the average over every rank that holds the same parameters: the ranks with
this rank's tp and pp coordinates, i.e. the flattened group dp_replicate x dp_shard x cp
("dp_cp"). With ZeRO (zero_stage >= 1) the state is sharded over dp_shard x cp ("dp_shard_cp",
as torchtitan's FSDP mesh) and each shard's gradient is then averaged over dp_replicate (HSDP).

**The order** (torchtitan's parallelize, after the pipeline has cut the model): tensor
parallelism splits each block's layers (TensorParallel on the tp group), context parallelism
replaces attention with the cp group's (ContextParallel), activation checkpointing is already on
the blocks (distlab.rank.build applies it to the model it builds), the pipeline keeps this
rank's stages (PipelineParallel on the pp group), and data-parallel sharding takes what is left
(ZeRO1/2/3 on dp_shard_cp, or one flat all-reduce over dp_cp). Every part is the one-dimension
strategy already tested alone, handed its group's Comm, so bytes are booked per dimension.

Refused before any process starts (check_config): degrees whose product is not the world, a
head or sequence split that does not divide, Ulysses over more ranks than a tp rank's heads,
a mixture of experts (expert parallelism is not on this mesh yet).
"""

from __future__ import annotations

import contextlib

import torch

from distlab.comm import Comm
from distlab.parallel.base import Strategy
from distlab.parallel.mesh import grid_coords, grid_groups

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # slowest first, as torchtitan's mesh
ORDER = tuple(reversed(DIMS))  # fastest first: what grid_coords and grid_groups read
# the groups a run may build, each a set of dimensions taken together
GROUPS = {"tp": ("tp",), "cp": ("cp",), "pp": ("pp",), "dp_replicate": ("dp_replicate",),
          "dp_shard_cp": ("dp_shard", "cp"), "dp_cp": ("dp_replicate", "dp_shard", "cp")}
# what each group carries
CARRIES = {"tp": "activations' partial sums: all-reduce per block, forward and backward",
           "cp": "keys and values around the ring (or all-to-all to heads), every block",
           "pp": "activations forward, their gradients backward (send/recv)",
           "dp_replicate": "HSDP: each gradient shard averaged over the replicas",
           "dp_shard_cp": "ZeRO: gradient reduce-scatter, parameter all-gather",
           "dp_cp": "the whole gradient averaged (one flat all-reduce)"}


def sizes(cfg) -> dict:
    """Each dimension's degree; dp_shard = 0 takes the ranks the others leave."""
    fixed = cfg.pp * cfg.dp_replicate * cfg.cp * cfg.tp
    return {"pp": cfg.pp, "dp_replicate": cfg.dp_replicate,
            "dp_shard": cfg.dp_shard or max(cfg.world_size // fixed, 1), "cp": cfg.cp,
            "tp": cfg.tp}


def mesh_string(s: dict) -> str:
    """"pp2 x dp_shard2 x tp2": the dimensions above 1, slowest first ("1" for one rank)."""
    return " x ".join(f"{d}{s[d]}" for d in DIMS if s[d] > 1) or "1"


def used_groups(s: dict, zero_stage: int) -> list[str]:
    """The groups a run of these sizes builds: each dimension above 1, and the data-parallel
    group that reduces gradients (dp_shard_cp under ZeRO, with dp_replicate beside it; else
    dp_cp)."""
    out = [g for g in ("tp", "cp", "pp") if s[g] > 1]
    if zero_stage and s["dp_shard"] * s["cp"] > 1:
        out.append("dp_shard_cp")
        if s["dp_replicate"] > 1:
            out.append("dp_replicate")
    elif s["dp_replicate"] * s["dp_shard"] * s["cp"] > 1:
        out.append("dp_cp")
    return out


def layout(s: dict, zero_stage: int = 0) -> dict:
    """Every group of each kind the run builds, as lists of global ranks (pure)."""
    return {g: grid_groups(s, GROUPS[g], ORDER) for g in used_groups(s, zero_stage)}


def table(s: dict, zero_stage: int = 0) -> list[dict]:
    """One row per group: kind, index, member ranks and what it carries (for a notebook)."""
    return [{"kind": kind, "group": i, "ranks": ranks, "carries": CARRIES[kind]}
            for kind, groups in layout(s, zero_stage).items() for i, ranks in enumerate(groups)]


class NDMesh:
    """This rank's place on the mesh: its coordinates and, per group kind it needs, its group's
    Comm (named after the kind, so a step's bytes are booked per dimension). Collective:
    every rank builds every group, in one order (dist.new_group is a world collective)."""

    def __init__(self, s: dict, zero_stage: int, rank: int):
        import torch.distributed as dist
        self.sizes, self.rank = dict(s), rank
        self.coords = grid_coords(rank, s, ORDER)
        self.layout = layout(s, zero_stage)
        self.comms, self.peers = {}, {}
        for kind, groups in self.layout.items():
            for ranks in groups:
                g = dist.new_group(ranks)
                if rank in ranks:
                    self.comms[kind], self.peers[kind] = Comm(g, name=kind), list(ranks)

    def take_step_stats(self) -> dict:
        return {kind: c.take_step_stats()[0] for kind, c in self.comms.items()}


class MeshParallel(Strategy):
    """`mesh`: the parallelisms RunConfig's pp, dp_replicate, dp_shard, cp and tp ask for,
    composed (see the module docstring)."""
    name = "mesh"
    any_model = False  # distlab's GPT: TP's plan, CP's attention and PP's stages are by name
    degrees = frozenset({"tp", "pp"})
    supports = frozenset({"grad_clip", "loss_scaling", "sp"})

    @classmethod
    def dp_degree(cls, cfg) -> int:
        s = sizes(cfg)
        return s["dp_replicate"] * s["dp_shard"]

    @classmethod
    def check_config(cls, cfg) -> None:
        s = sizes(cfg)
        product = 1
        for d in DIMS:
            product *= s[d]
        if product != cfg.world_size:
            raise ValueError(f"mesh {mesh_string(s)} has {product} ranks, not world_size="
                             f"{cfg.world_size}: the degrees pp x dp_replicate x dp_shard x cp x "
                             "tp must multiply to the world size (dp_shard=0 takes the rest)")
        if cfg.n_experts:
            raise ValueError(f"n_experts={cfg.n_experts}: expert parallelism is not on the mesh "
                             "yet; a mixture of experts runs under strategy='ep'")
        if cfg.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={cfg.zero_stage} must be 0 (no sharding), 1, 2 or 3")
        cp, tp = s["cp"], s["tp"]
        if cp > 1:
            from distlab.parallel.context import layout as L
            chunks = L.n_chunks(cp, cfg.cp_layout)
            if cfg.seq_len % chunks:
                raise ValueError(f"seq_len={cfg.seq_len} must divide into {chunks} equal chunks "
                                 f"(the {cfg.cp_layout} layout over cp={cp} ranks)")
            if cfg.cp_attention == "ulysses" and (cfg.n_head // tp) % cp:
                raise ValueError(f"cp_attention='ulysses' splits a tp rank's {cfg.n_head // tp} "
                                 f"heads (n_head={cfg.n_head} / tp={tp}) over cp={cp} ranks: "
                                 "use cp_attention='ring' or more heads")
            if cfg.sp and (cfg.seq_len // cp) % tp:
                raise ValueError(f"sp=True splits each cp rank's {cfg.seq_len // cp} tokens "
                                 f"over tp={tp} ranks: choose seq_len a multiple of {cp * tp}")
        if cfg.sp and cfg.zero_stage >= 2 and s["dp_shard"] * cp > 1:
            # sp's replicated norms get their partial gradients summed when backward ends
            # (tp's _PartialGrads); zero2/3 take .grad away in backward's hooks before that
            raise ValueError("sp=True with zero_stage >= 2: the sequence-parallel norms' "
                             "gradients are summed over tp after backward, when ZeRO-2/3 has "
                             "already taken them; use zero_stage 0 or 1 with sp")

    def __init__(self, cfg, comm):
        super().__init__(cfg, comm)
        from distlab.parallel.context.api import ContextParallel
        from distlab.parallel.pipeline.pp import PipelineParallel
        from distlab.parallel.tensor.tp import TensorParallel
        from distlab.parallel.zero.stages import ZeRO1, ZeRO2, ZeRO3
        s = self.s = sizes(cfg)
        self.mesh = NDMesh(s, cfg.zero_stage, comm.rank)
        c = self.mesh.comms
        self.tp_s = TensorParallel(cfg, c["tp"]) if "tp" in c else None
        self.cp = (ContextParallel(cfg.cp_layout, cfg.cp_attention, comm=c["cp"])
                   if "cp" in c else None)
        self.pp_s = PipelineParallel(cfg, c["pp"]) if "pp" in c else None
        zero = {1: ZeRO1, 2: ZeRO2, 3: ZeRO3}.get(cfg.zero_stage)
        self.dp_s = zero(cfg, c["dp_shard_cp"]) if "dp_shard_cp" in c else None
        self.dp_comm = c.get("dp_cp")  # no ZeRO: the flat all-reduce's group
        xy = self.mesh.coords
        self.dp_index = xy["dp_replicate"] * s["dp_shard"] + xy["dp_shard"]

    # -- the model, in the written order ---------------------------------------------------------
    def wrap(self, model):
        if self.tp_s is not None:
            model = self.tp_s.wrap(model)  # every block's layers split by columns/rows
        if self.cp is not None:
            from distlab.parallel.context.strategy import attach
            attach(model, self.cp, self.cfg.seq_len)  # attention across the cp group's tokens
        if self.pp_s is not None:
            model = self.pp_s.wrap(model)  # keep this rank's stages
            if self.tp_s is not None:
                self.tp_s.after_model_split(model)  # TP forgets the blocks it no longer holds
        if self.dp_s is not None:
            return self.dp_s.wrap(model)  # ZeRO's units: what is left
        if self.dp_comm is not None:
            with torch.no_grad():  # the replicas start from one rank's weights, as DDP
                for t in list(model.parameters()) + list(model.buffers()):
                    self.dp_comm.broadcast(t.data, src=0)
        return model

    def build_optimizer(self, model, make):
        if self.dp_s is not None:
            optimizer = self.dp_s.build_optimizer(model, make)
        else:
            optimizer = super().build_optimizer(model, make)
        if self.pp_s is not None:  # ZeRO re-pointed parameters into its flat buffers
            self.pp_s.after_model_split(model)
        self.mesh.take_step_stats()  # setup traffic is not a step's
        return optimizer

    # -- the step ----------------------------------------------------------------------------
    def batch(self, data, step):
        x, y = data.rank_batch(step, self.cfg.global_batch, self.dp_index,
                               self.dp_degree(self.cfg))
        if self.cp is not None:
            x, y = self.cp.shard(x), self.cp.shard(y)
        return x, y

    def no_sync(self, model):
        return self.dp_s.no_sync(model) if self.dp_s is not None else contextlib.nullcontext()

    def forward_backward(self, model, x, y, scale_loss):
        if self.pp_s is None:
            return NotImplemented
        return self.pp_s.forward_backward(model, x, y, scale_loss)

    def reduce_gradients(self, model):
        if self.tp_s is not None:
            self.tp_s.reduce_gradients(model)
        if self.dp_s is not None:
            self.dp_s.reduce_gradients(model)  # reduce-scatter over dp_shard x cp
            if "dp_replicate" in self.mesh.comms:  # HSDP: then each shard over the replicas
                for u in self.dp_s.units:
                    self.mesh.comms["dp_replicate"].all_reduce(u.grad_shard, op="avg")
        elif self.dp_comm is not None:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.dp_comm.all_reduce(flat, op="avg")
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))

    def step_gradients(self, model) -> list:
        if self.dp_s is not None:
            return self.dp_s.step_gradients(model)
        return super().step_gradients(model)

    def clip_gradients(self, model, max_norm: float) -> float:
        """The global norm over every group in one all-reduce over the world: each rank adds
        the squares of the gradient entries it holds, weighted by 1 / (how many ranks hold the
        same entries): tp's replicated parameters are on every tp rank, and a gradient (no
        ZeRO) or a gradient shard (ZeRO) is on every rank of dp_cp (or of dp_replicate)."""
        pieces = self._held_gradients(model)
        dev = pieces[0][0].device if pieces else torch.device("cpu")  # NCCL: on the GPU
        sq = torch.zeros((), dtype=torch.float32, device=dev)
        for g, weight in pieces:
            sq += weight * g.detach().float().pow(2).sum()
        norm = float(self.comm.all_reduce(sq.reshape(1)).sqrt())
        if norm > max_norm:
            for g, _ in pieces:
                g.mul_(max_norm / (norm + 1e-6))
        return norm

    def _held_gradients(self, model) -> list:
        """(gradient tensor, weight) for every gradient entry this rank holds."""
        from distlab.parallel.tensor.tp import sharded_ids
        s = self.s
        tp_sharded = sharded_ids(model, self.tp_s.sharded) if self.tp_s is not None else set()
        per_tp = lambda p: 1.0 if id(p) in tp_sharded else 1.0 / s["tp"]  # noqa: E731
        if self.dp_s is None:
            copies = s["dp_replicate"] * s["dp_shard"] * s["cp"]
            return [(p.grad, per_tp(p) / copies) for p in model.parameters()
                    if p.grad is not None]
        out, rank = [], self.dp_s.rank
        for u in self.dp_s.units:  # each parameter's entries in this rank's shard
            for i, p in enumerate(u.params):
                piece = u.shard_piece(u.grad_shard, i, rank)
                if piece.numel():
                    out.append((piece, per_tp(p) / s["dp_replicate"]))
        return out

    def optimizer_step(self, optimizer):
        if self.dp_s is not None:
            return self.dp_s.optimizer_step(optimizer)
        return super().optimizer_step(optimizer)

    def state_bytes(self, model, optimizer) -> dict:
        if self.dp_s is not None:
            return self.dp_s.state_bytes(model, optimizer)
        return super().state_bytes(model, optimizer)

    def between_steps(self, model) -> None:
        if self.dp_s is not None:
            self.dp_s.between_steps(model)

    def full_state_dict(self, model) -> dict:
        """All weights under `single`'s names (collective: every rank). model.state_dict()
        gathers ZeRO-3's shards; TP's blocks are gathered over tp; the stages' dicts over pp."""
        import torch.distributed as dist
        if self.tp_s is not None:
            from distlab.parallel.tensor.tp import full_state_dict
            sd = full_state_dict(model)
        else:
            sd = dict(model.state_dict())
        sd = {k: v.detach().clone() for k, v in sd.items()}
        if self.pp_s is None:
            return sd
        parts = [None] * self.s["pp"]
        dist.all_gather_object(parts, sd, group=self.pp_s.comm.group)
        out = {}
        for p in parts:
            out.update(p)
        return out

    def step_info(self) -> dict:
        info = {}
        if self.pp_s is not None:
            info.update(self.pp_s.step_info())
        if self.dp_s is not None:
            info.update(self.dp_s.step_info())
        if self.cp is not None:
            st = self.cp.take_stats()
            info["cp"] = {"rank": self.cp.comm.rank, "pairs": st.pairs_fwd,
                          "compute_s": st.compute_s, "wait_s": st.wait_s}
        info["mesh"] = {"coords": dict(self.mesh.coords), "sizes": dict(self.s),
                        "comm": self.mesh.take_step_stats()}
        return info

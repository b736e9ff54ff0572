"""`mesh`: every parallelism on one device mesh, applied to the model in one written order.

The mesh has five named dimensions (torchtitan's and Megatron-Core's), world = their product:

    pp            pipeline stages                      (send/recv of one activation per boundary)
    dp_replicate  replicas that hold the same shards   (HSDP's all-reduce of gradient shards)
    dp_shard      ranks that shard the model state     (ZeRO stage `zero_stage`, 0: none)
    cp            ranks that split every sequence      (ring or Ulysses attention)
    tp            ranks that split every layer         (Megatron's f/g all-reduces; sp optional)

and a sixth, ep, carved out of the data-parallel ranks (as torchtitan's): the ranks that share
this rank's tp and pp coordinates are cut into consecutive groups of ep, each holding the
E experts of every MoE layer E/ep to a rank (all-to-all dispatch); the ranks with the same
place in their ep group hold the same experts ("edp", expert data parallel).

**Rank order**: tp varies fastest, then cp, dp_shard, dp_replicate, pp (torchtitan's order:
the dimensions that talk every layer on the nearest ranks, one node's); mesh_order="dp-tp-pp"
puts the data-parallel dimensions fastest instead (ORDERS). dp2 x cp2 x tp2, the default:

    rank   0  1  2  3  4  5  6  7
    tp     0  1  0  1  0  1  0  1        tp groups  [0,1] [2,3] [4,5] [6,7]
    cp     0  0  1  1  0  0  1  1        cp groups  [0,2] [1,3] [4,6] [5,7]
    dp     0  0  0  0  1  1  1  1        dp groups  [0,4] [1,5] [2,6] [3,7]

**Experts.** A local expert's gradient arrives summed over its ep group's losses (the
combine's backward brings every rank's output gradients to it): divided by ep, then averaged
over edp, it is the global batch's mean. The dense parameters take the dp_cp average.

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
ep that does not divide the data-parallel ranks or the experts, experts with tp and sp (TP
leaves the experts whole on every tp rank, as Megatron-Core's expert tensor parallel size 1;
with sp each tp rank would see other tokens), experts over ep with fully_shard's per_param
layout (written for the flat units) or, under a pipeline, with the balance loss (the stages do
not carry it).

**Experts with ZeRO.** The ranks of an ep group hold different experts, so the dense ZeRO over
dp_shard x cp leaves them out (fully_shard's ignored_params); they get their own ZeRO of the
same stage over edp (distlab.parallel.expert.zero), and the two optimizers step as one.
"""

from __future__ import annotations

import contextlib

import torch

from distlab.comm import Comm, new_group
from distlab.parallel.base import Strategy
from distlab.parallel.composed_checkpoint import ComposedCheckpoints
from distlab.parallel.mesh import grid_coords, grid_groups

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # slowest first, as torchtitan's mesh
ORDER = tuple(reversed(DIMS))  # fastest first: what grid_coords and grid_groups read
# RunConfig.mesh_order, as 3d's: "tp-dp-pp" keeps a tp group on consecutive ranks (one node's,
# for TP's per-layer all-reduces), "dp-tp-pp" a data-parallel group instead (what notebook 17
# measures across simulated nodes); fastest first
ORDERS = {"tp-dp-pp": ORDER, "dp-tp-pp": ("dp_shard", "dp_replicate", "cp", "tp", "pp")}
# the groups a run may build, each a set of dimensions taken together
GROUPS = {"tp": ("tp",), "cp": ("cp",), "pp": ("pp",), "dp_replicate": ("dp_replicate",),
          "dp_shard_cp": ("dp_shard", "cp"), "dp_cp": ("dp_replicate", "dp_shard", "cp"),
          "ep": None, "edp": None}  # ep, edp: cut from dp_cp (ep_groups)
# what each group carries
CARRIES = {"tp": "activations' partial sums: all-reduce per block, forward and backward",
           "cp": "keys and values around the ring (or all-to-all to heads), every block",
           "pp": "activations forward, their gradients backward (send/recv)",
           "dp_replicate": "HSDP: each gradient shard averaged over the replicas",
           "dp_shard_cp": "ZeRO: gradient reduce-scatter, parameter all-gather",
           "dp_cp": "the whole gradient averaged (one flat all-reduce)",
           "ep": "tokens to their experts' ranks and back (all-to-all), every MoE layer",
           "edp": "each expert's gradient averaged over the ranks holding it (under ZeRO: "
                  "the experts' own reduce-scatter and all-gather)"}


def sizes(cfg) -> dict:
    """Each dimension's degree (and ep's); dp_shard = 0 takes the ranks the others leave."""
    fixed = cfg.pp * cfg.dp_replicate * cfg.cp * cfg.tp
    return {"pp": cfg.pp, "dp_replicate": cfg.dp_replicate,
            "dp_shard": cfg.dp_shard or max(cfg.world_size // fixed, 1), "cp": cfg.cp,
            "tp": cfg.tp, "ep": cfg.ep}


def order_of(cfg) -> tuple:
    """The rank order cfg asks for, fastest dimension first."""
    return ORDERS[cfg.mesh_order]


def coords_of(cfg, rank: int) -> dict:
    """`rank`'s coordinate along each dimension of cfg's mesh."""
    s = sizes(cfg)
    return grid_coords(rank, {d: s[d] for d in DIMS}, order_of(cfg))


def mesh_string(s: dict) -> str:
    """"pp2 x dp_shard2 x tp2": the dimensions above 1, slowest first ("1" for one rank),
    then ep's ("(ep2)": its ranks are the data-parallel ones)."""
    out = " x ".join(f"{d}{s[d]}" for d in DIMS if s[d] > 1) or "1"
    return out + (f" (ep{s['ep']})" if s.get("ep", 1) > 1 else "")


def parse_mesh(text: str) -> dict:
    """"pp2 x dp_shard2 x tp2" (what mesh_string writes; "(ep2)" too, and "dp" for dp_shard)
    as {dimension: degree}. ValueError naming the part it cannot read."""
    import re
    out = {}
    for part in filter(None, re.split(r"[\sx×*,()]+", text.strip())):
        m = re.fullmatch(r"([a-z_]+?)=?(\d+)", part)
        dim = {"dp": "dp_shard"}.get(m.group(1), m.group(1)) if m else None
        if dim not in (*DIMS, "ep"):
            raise ValueError(f"mesh={text!r}: cannot read {part!r}; write degrees as "
                             f"'pp2 x dp_shard2 x cp2 x tp2' (dimensions: {', '.join(DIMS)}, ep)")
        if dim in out:
            raise ValueError(f"mesh={text!r} names {dim} twice")
        out[dim] = int(m.group(2))
    return out


def ep_groups(s: dict, order: tuple = ORDER) -> dict:
    """ep and edp groups: each dp_cp group (members in rank order) cut into consecutive
    blocks of ep ranks (ep), and its members with the same place in their block (edp)."""
    ep, out = s["ep"], {"ep": [], "edp": []}
    for members in grid_groups(s, GROUPS["dp_cp"], order):
        out["ep"] += [members[i:i + ep] for i in range(0, len(members), ep)]
        out["edp"] += [members[j::ep] for j in range(ep)]
    return out


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
    if s.get("ep", 1) > 1:
        out.append("ep")
        # under a dense ZeRO the experts have their own, over edp, even of one rank (its
        # shard is then the whole: nothing is sent)
        if (s["dp_replicate"] * s["dp_shard"] * s["cp"] > s["ep"]
                or "dp_shard_cp" in out):
            out.append("edp")
    return out


def layout(s: dict, zero_stage: int = 0, order: tuple = ORDER) -> dict:
    """Every group of each kind the run builds, as lists of global ranks (pure)."""
    return {g: ep_groups(s, order)[g] if GROUPS[g] is None else
            grid_groups(s, GROUPS[g], order) for g in used_groups(s, zero_stage)}


def table(s: dict, zero_stage: int = 0, order: tuple = ORDER) -> list[dict]:
    """One row per group: kind, index, member ranks and what it carries (for a notebook)."""
    return [{"kind": kind, "group": i, "ranks": ranks, "carries": CARRIES[kind]}
            for kind, groups in layout(s, zero_stage, order).items()
            for i, ranks in enumerate(groups)]


class NDMesh:
    """This rank's place on the mesh: its coordinates and, per group kind it needs, its group's
    Comm (named after the kind, so a step's bytes are booked per dimension). Collective:
    every rank builds every group, in one order (dist.new_group is a world collective)."""

    def __init__(self, s: dict, zero_stage: int, rank: int, order: tuple = ORDER):
        self.sizes, self.rank = dict(s), rank
        self.coords = grid_coords(rank, {d: s[d] for d in DIMS}, order)
        self.layout = layout(s, zero_stage, order)
        self.comms, self.peers = {}, {}
        for kind, groups in self.layout.items():
            for ranks in groups:
                g = new_group(ranks)
                if rank in ranks:
                    self.comms[kind], self.peers[kind] = Comm(g, name=kind), list(ranks)

    def take_step_stats(self) -> dict:
        return {kind: c.take_step_stats()[0] for kind, c in self.comms.items()}


class MeshParallel(ComposedCheckpoints, Strategy):
    """`mesh`: the parallelisms RunConfig's pp, dp_replicate, dp_shard, cp and tp ask for,
    composed (see the module docstring)."""
    name = "mesh"
    any_model = False  # distlab's GPT: TP's plan, CP's attention and PP's stages are by name
    degrees = frozenset({"tp", "pp"})
    knobs = frozenset({"microbatches", "schedule", "virtual_stages", "pp_op_delay_s",
                       "cp_layout", "cp_attention", "cp", "dp_shard", "dp_replicate",
                       "zero_stage", "ep", "fsdp_prefetch", "mesh_order", "param_dtype",
                       "reduce_dtype", "fsdp_units", "fsdp_layout", "mesh"})
    supports = frozenset({"grad_clip", "loss_scaling", "sp", "moe"})

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
        cls._check_experts(cfg, s)
        if cfg.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={cfg.zero_stage} must be 0 (no sharding), 1, 2 or 3")
        if cfg.fsdp_layout != "flat" and cfg.zero_stage != 3:
            raise ValueError(f"fsdp_layout={cfg.fsdp_layout!r} is fully_shard's (ZeRO-3): set "
                             f"zero_stage=3 (got {cfg.zero_stage})")
        if (cfg.checkpoint_every or cfg.resume_from) and (s["ep"] > 1
                                                          or cfg.fsdp_layout == "per_param"):
            raise ValueError(f"mesh checkpoints are written for flat ZeRO units and experts "
                             f"that every rank holds (got ep={s['ep']}, fsdp_layout="
                             f"{cfg.fsdp_layout!r}): the experts' own ZeRO and the per-parameter "
                             "shards have no gather written yet; set checkpoint_every=0 and "
                             "resume_from=''")
        if cfg.fsdp_layout == "per_param" and cfg.sp:
            raise ValueError("fsdp_layout='per_param' with sp=True: sp completes its norms' "
                             "gradients after backward, when this layout has reduce-scattered "
                             "them; use fsdp_layout='flat'")
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

    @staticmethod
    def _check_experts(cfg, s: dict) -> None:
        dp_cp, ep = s["dp_replicate"] * s["dp_shard"] * s["cp"], s["ep"]
        if ep < 1 or dp_cp % ep:
            raise ValueError(f"ep={ep} must divide the {dp_cp} data-parallel ranks "
                             f"(dp_replicate x dp_shard x cp): expert groups are cut from them")
        if not cfg.n_experts:
            if ep > 1:
                raise ValueError(f"ep={ep} spreads a mixture of experts' experts over ranks: "
                                 "set n_experts (e.g. 4)")
            return
        if cfg.n_experts % ep:
            raise ValueError(f"n_experts={cfg.n_experts} must divide by ep={ep}: each rank of "
                             "an expert group holds n_experts / ep experts")
        if s["tp"] > 1 and cfg.sp:
            # the experts stay whole on each tp rank (TP splits attention only); under sp each
            # tp rank would route its own share of the tokens, and the experts' gradients
            # would need summing over tp, which is not written
            raise ValueError(f"n_experts={cfg.n_experts} with tp={s['tp']} and sp=True: the "
                             "experts would see a sequence shard per tp rank; use sp=False")
        if ep > 1 and cfg.zero_stage == 3 and cfg.fsdp_layout == "per_param":
            raise ValueError(f"ep={ep} with fsdp_layout='per_param': the experts' own "
                             "sharding over edp is written for the flat units; use "
                             "fsdp_layout='flat'")
        if s["pp"] > 1 and cfg.aux_loss_coef:
            raise ValueError(f"n_experts with pp={s['pp']}: the pipeline's stages carry no "
                             "balance loss from their MoE blocks; set aux_loss_coef=0 "
                             "(expert_bias_rate balances without a loss)")

    def __init__(self, cfg, comm):
        super().__init__(cfg, comm)
        from distlab.parallel.context.api import ContextParallel
        from distlab.parallel.pipeline.pp import PipelineParallel
        from distlab.parallel.tensor.tp import TensorParallel
        from distlab.parallel.zero.stages import ZeRO1, ZeRO2, ZeRO3
        s = self.s = sizes(cfg)
        self.mesh = NDMesh(s, cfg.zero_stage, comm.rank, order_of(cfg))
        c = self.mesh.comms
        self.tp_s = TensorParallel(cfg, c["tp"]) if "tp" in c else None
        self.cp = (ContextParallel(cfg.cp_layout, cfg.cp_attention, comm=c["cp"])
                   if "cp" in c else None)
        self.pp_s = PipelineParallel(cfg, c["pp"]) if "pp" in c else None
        zero = {1: ZeRO1, 2: ZeRO2, 3: ZeRO3}.get(cfg.zero_stage)
        self.dp_s = zero(cfg, c["dp_shard_cp"]) if "dp_shard_cp" in c else None
        self.dp_comm = c.get("dp_cp")  # no ZeRO: the flat all-reduce's group
        self.ep_comm, self.edp_comm = c.get("ep"), c.get("edp")
        self.expert_zero = None  # the experts' ZeRO over edp, beside a dense ZeRO (wrap)
        self.moes = []  # the MoE layers (their routing stats go in the step's event)
        xy = self.mesh.coords
        self.dp_index = xy["dp_replicate"] * s["dp_shard"] + xy["dp_shard"]

    # -- the model, in the written order ---------------------------------------------------------
    def wrap(self, model):
        if self.tp_s is not None:
            model = self.tp_s.wrap(model)  # every block's layers split by columns/rows
        if self.cp is not None:
            from distlab.parallel.context.strategy import attach
            attach(model, self.cp, self.cfg.seq_len)  # attention across the cp group's tokens
        if self.cfg.n_experts:
            from distlab.parallel.expert.dispatch import expert_parallel
            self.moes = [b.mlp for b in model.blocks]
            if self.ep_comm is not None:  # each MoE's experts spread over the ep group
                for moe in self.moes:
                    expert_parallel(moe, self.ep_comm)
        if self.pp_s is not None:
            model = self.pp_s.wrap(model)  # keep this rank's stages
            kept = {id(m) for m in model.modules()}
            self.moes = [m for m in self.moes if id(m) in kept]
            if self.tp_s is not None:
                self.tp_s.after_model_split(model)  # TP forgets the blocks it no longer holds
        if self.dp_s is not None:
            if self.ep_comm is not None:  # each ep rank's experts: their own ZeRO over edp
                self._shard_experts(model)
            model = self.dp_s.wrap(model)  # ZeRO's units: what is left
            if self.expert_zero is not None:
                self.expert_zero.wrap({n: m for n, m in model.named_modules()
                                       if any(m is moe for moe in self.moes)})
            return model
        if self.dp_comm is not None:
            with torch.no_grad():  # the replicas start from one rank's weights, as DDP
                self.dp_comm.broadcast_tensors(
                    [t.data for t in self._dense(model) + list(model.buffers())], src=0)
        return model

    def _shard_experts(self, model) -> None:
        from distlab.parallel.expert.zero import ExpertZeRO
        from distlab.parallel.zero.stages import mixed_precision_policy
        self.dp_s.ignored = self._experts(model)
        self.expert_zero = ExpertZeRO(self.cfg.zero_stage, self.edp_comm, self.s["ep"],
                                      mixed_precision_policy(self.cfg), self.cfg.fsdp_prefetch)

    def _experts(self, model) -> list:
        """This rank's expert parameters (under ep: its own experts only)."""
        return [p for m in self.moes for p in m.experts.parameters()] if self.ep_comm else []

    def _dense(self, model) -> list:
        """The parameters every rank of dp_cp holds alike."""
        experts = {id(p) for p in self._experts(model)}
        return [p for p in model.parameters() if id(p) not in experts]

    def build_optimizer(self, model, make):
        if self.dp_s is not None:
            optimizer = self.dp_s.build_optimizer(model, make)
            if self.expert_zero is not None:  # the experts' shards step beside the dense
                from distlab.parallel.zero.chained import ChainedOptimizer
                optimizer = ChainedOptimizer([optimizer,
                                              *self.expert_zero.build_optimizer(make)])
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
        stack = contextlib.ExitStack()
        if self.dp_s is not None:
            stack.enter_context(self.dp_s.no_sync(model))
        if self.expert_zero is not None:
            stack.enter_context(self.expert_zero.no_sync())
        return stack

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
                for g in self.dp_s.step_gradients(model):  # views of the shards' gradients
                    self.mesh.comms["dp_replicate"].all_reduce(g, op="avg")
        elif self.dp_comm is not None:
            _average(self.dp_comm, self._dense(model))
        if self.expert_zero is not None:  # reduce-scattered over edp, divided by ep
            self.expert_zero.reduce_gradients()
        elif self.ep_comm is not None:  # summed over the ep group's losses: its mean, then edp's
            experts = self._experts(model)
            for p in experts:
                if p.grad is not None:
                    p.grad.div_(self.s["ep"])
            if self.edp_comm is not None:
                _average(self.edp_comm, experts)

    def step_gradients(self, model) -> list:
        if self.dp_s is not None:
            experts = self.expert_zero.gradient_shards() if self.expert_zero else []
            return self.dp_s.step_gradients(model) + experts
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
            experts = {id(p) for p in self._experts(model)}  # on edp's ranks only
            return [(p.grad, per_tp(p) / (copies // s["ep"] if id(p) in experts else copies))
                    for p in model.parameters() if p.grad is not None]
        # the experts' shards: each entry on one rank of edp, whole on every tp rank
        out = [(g, 1.0 / s["tp"]) for g in
               (self.expert_zero.gradient_shards() if self.expert_zero else [])]
        rank = self.dp_s.rank
        if self.cfg.fsdp_layout == "per_param":  # each parameter's rows: its DTensor's
            return [(sh.grad.to_local(), per_tp(sh) / s["dp_replicate"])
                    for u in self.dp_s.units for sh in u.sharded if sh.grad is not None]
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
        if self.expert_zero is not None:  # the dense ZeRO's bytes and the experts'
            dense = self.dp_s.state_bytes(model, optimizer.optimizers[0])
            experts = self.expert_zero.state_bytes()
            return {k: dense.get(k, 0) + experts.get(k, 0) for k in {**dense, **experts}}
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
        per_param = self.dp_s is not None and self.cfg.fsdp_layout == "per_param"
        # per_param's state_dict() is the DTensor shards: gathered over dp_shard x cp first
        sd = self.dp_s.full_state_dict(model) if per_param else dict(model.state_dict())
        if self.tp_s is not None:
            from distlab.parallel.tensor.tp import full_state_dict
            sd = full_state_dict(model, sd)  # TP's blocks gathered over tp
        if self.ep_comm is not None:  # the experts gathered over ep (TP leaves them whole)
            from distlab.parallel.expert.dispatch import expert_parallel_state_dict
            experts = expert_parallel_state_dict(model)
            sd = {**{k: v for k, v in sd.items() if ".experts." not in k},
                  **{k: v for k, v in experts.items() if ".experts." in k}}
        sd = {k: v.detach().clone() for k, v in sd.items()}
        if self.pp_s is None:
            return sd
        parts = [None] * self.s["pp"]
        dist.all_gather_object(parts, sd, group=self.pp_s.comm.group)
        out = {}
        for p in parts:
            out.update(p)
        return out

    def routing_comms(self) -> list:
        """dp_replicate x dp_shard x cp route different tokens (tp ranks the same ones; pp
        stages hold different layers): dp_cp's all-reduce, or under ZeRO dp_shard_cp's then
        dp_replicate's."""
        c = self.mesh.comms
        return [c[g] for g in ("dp_cp", "dp_shard_cp", "dp_replicate") if g in c]

    def step_info(self) -> dict:
        info = {}
        if self.pp_s is not None:
            info.update(self.pp_s.step_info())
        if self.dp_s is not None:
            info.update(self.dp_s.step_info())
        if self.expert_zero is not None:
            info["expert_zero"] = self.expert_zero.step_info()
        if self.cp is not None:
            from distlab.parallel.context.strategy import ring_info
            info["cp"] = ring_info(self.cp)
        from distlab.parallel.expert.strategy import routing_info
        if routing := routing_info(self.moes):  # as `ep`'s: the routing, per MoE block
            info["moe"] = routing
        info["mesh"] = {"coords": dict(self.mesh.coords), "sizes": dict(self.s),
                        "comm": self.mesh.take_step_stats()}
        return info


def _average(comm: Comm, params: list) -> None:
    """Average `params`' gradients over comm's group in one flat all-reduce (a missing
    gradient counts as zero: another rank may have used the parameter)."""
    if not params:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in params])
    comm.all_reduce(flat, op="avg")
    for p, part in zip(params, flat.split([p.numel() for p in params])):
        if p.grad is None:
            p.grad = part.view_as(p).clone()
        else:
            p.grad.copy_(part.view_as(p))

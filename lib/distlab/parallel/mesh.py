"""A 3D device mesh (dp x tp x pp) and the `3d` strategy that trains on it.

**Rank layout (Megatron-LM's order: tp fastest, then dp, then pp).** World = dp·tp·pp and

    rank = pp_idx·(dp·tp) + dp_idx·tp + tp_idx

so the ranks of one tensor-parallel group are consecutive (on a real machine: the GPUs of one
node, joined by NVLink, which TP's per-layer all-reduces need), a data-parallel group strides by
tp, and a pipeline group strides by dp·tp (pipeline stages may sit on different nodes: they only
exchange one activation per micro-batch). RunConfig.mesh_order names another order, fastest
first: "dp-tp-pp" makes the dp groups consecutive and strides the tp groups by dp, so on nodes
of dp ranks each tp group spans nodes (what notebook 17 measures against the default).
dp=tp=pp=2, the default order:

    pp 0:  dp 0 [0 1]   dp 1 [2 3]        tp groups: [0,1] [2,3] [4,5] [6,7]
    pp 1:  dp 0 [4 5]   dp 1 [6 7]        dp groups: [0,2] [1,3] [4,6] [5,7]
                                          pp groups: [0,4] [1,5] [2,6] [3,7]

`dist.new_group` is a collective over the WHOLE world: every rank creates every group, in the
same order (all tp groups, then all dp groups, then all pp groups), and keeps the three it
belongs to. Each kept group gets its own `Comm`, so bytes are counted per group kind.

**`3d` (ThreeD).** Reuses the strategies written for one dimension, each handed its group's
Comm: TensorParallel (tp group: Megatron column/row splits, f/g all-reduces) inside each
pipeline stage, PipelineParallel (pp group: the stage split and cfg.schedule over
cfg.microbatches) and ZeRO1 (dp group: the optimizer state of this rank's parameters, i.e. its
tp shard of its stage, sharded over the dp replicas; gradients reduce-scattered, updated
parameters all-gathered). A rank's batch is its dp block of the global batch, split by the
pipeline into cfg.microbatches micro-batches. Not supported: sp=True (the pipeline would carry
sequence-sharded activations), grad_clip (a norm over three kinds of groups), dataset_size.
"""

from __future__ import annotations

import itertools

import torch.distributed as dist

from distlab.comm import Comm, new_group
from distlab.parallel.base import Strategy
from distlab.parallel.composed_checkpoint import ComposedCheckpoints

KINDS = ("tp", "dp", "pp")
# what each group carries in `3d`
CARRIES = {"tp": "activations' partial sums: all-reduce per block, forward and backward",
           "dp": "ZeRO-1: gradient reduce-scatter, updated-parameter all-gather",
           "pp": "activations forward, their gradients backward (send/recv)"}


# 3d's rank orders (RunConfig.mesh_order), fastest-varying kind first: Megatron-LM's keeps a
# tp group on consecutive ranks (one node); "dp-tp-pp" keeps a dp group there instead
ORDERS = ("tp-dp-pp", "dp-tp-pp")


# -- any number of named dimensions (pure: no processes) ------------------------------------------
def strides(sizes: dict, order: tuple) -> dict:
    """Rank distance between neighbours along each dimension; `order` names the dimensions,
    fastest-varying first (the first's neighbours are consecutive ranks)."""
    out, step = {}, 1
    for dim in order:
        out[dim], step = step, step * sizes[dim]
    return out


def grid_coords(rank: int, sizes: dict, order: tuple) -> dict:
    """`rank`'s coordinate along each dimension."""
    return {d: (rank // s) % sizes[d] for d, s in strides(sizes, order).items()}


def grid_groups(sizes: dict, dims: tuple, order: tuple) -> list[list[int]]:
    """Every group along `dims` (one dimension, or several taken together as one, as
    torchtitan's flattened "dp_shard_cp"): the ranks whose coordinates differ only there.
    Groups are listed with the other coordinates counting up, slowest dimension first (the
    same list on every rank: dist.new_group must be called in one order); members in
    increasing rank order, so a rank's place in its group is its coordinate along `dims`,
    the first of `order` among them varying fastest."""
    s = strides(sizes, order)
    others = [d for d in reversed(order) if d not in dims]  # slowest first
    inside = [d for d in order if d in dims]
    groups = []
    for fixed in itertools.product(*(range(sizes[d]) for d in others)):
        base = sum(c * s[d] for c, d in zip(fixed, others))
        members = [base + sum(c * s[d] for c, d in zip(idx, inside))
                   for idx in itertools.product(*(range(sizes[d]) for d in inside))]
        groups.append(sorted(members))
    return groups


# -- 3d's three kinds, on that grid ---------------------------------------------------------------
def _sizes(dp: int, tp: int, pp: int) -> dict:
    return {"dp": dp, "tp": tp, "pp": pp}


def coords(rank: int, dp: int, tp: int, pp: int, order: str = ORDERS[0]) -> dict:
    """(pp_idx, dp_idx, tp_idx) of `rank` in the layout `order` (Megatron's by default)."""
    return grid_coords(rank, _sizes(dp, tp, pp), tuple(order.split("-")))


def rank_of(pp_idx: int, dp_idx: int, tp_idx: int, dp: int, tp: int, pp: int = 1,
            order: str = ORDERS[0]) -> int:
    s = strides(_sizes(dp, tp, pp), tuple(order.split("-")))
    return pp_idx * s["pp"] + dp_idx * s["dp"] + tp_idx * s["tp"]


def layout(dp: int, tp: int, pp: int, order: str = ORDERS[0]) -> dict:
    """Every group of each kind, as lists of global ranks, in creation order (pure: no
    processes). Group members are in increasing rank order, so a rank's place in its group is
    its coordinate along that dimension."""
    sizes, o = _sizes(dp, tp, pp), tuple(order.split("-"))
    return {kind: grid_groups(sizes, (kind,), o) for kind in KINDS}


class Mesh:
    """This rank's place in a dp x tp x pp mesh: coordinates, its group of each kind, the
    group's members (peers) and a Comm per group. Collective: every rank must build it."""

    def __init__(self, dp: int, tp: int, pp: int, order: str = ORDERS[0]):
        world = dist.get_world_size()
        if dp * tp * pp != world:
            raise ValueError(f"dp x tp x pp = {dp}x{tp}x{pp} = {dp * tp * pp} != world {world}")
        self.dp, self.tp, self.pp, self.order = dp, tp, pp, order
        self.rank, self.world = dist.get_rank(), world
        self.coords = coords(self.rank, dp, tp, pp, order)
        self.layout = layout(dp, tp, pp, order)
        self.groups, self.peers = {}, {}
        for kind in KINDS:  # the same order on every rank
            for ranks in self.layout[kind]:
                g = new_group(ranks)
                if self.rank in ranks:
                    self.groups[kind], self.peers[kind] = g, list(ranks)
        self.comms = {kind: Comm(self.groups[kind], name=kind) for kind in KINDS}

    def take_step_stats(self) -> dict:
        """Per group kind, the collective stats since the last call (resets them)."""
        return {kind: c.take_step_stats()[0] for kind, c in self.comms.items()}

    def table(self) -> list[dict]:
        """Who talks to whom over which group: one row per group (for a notebook)."""
        return table(self.dp, self.tp, self.pp, self.order)

    def describe(self) -> dict:
        return {"rank": self.rank, "coords": dict(self.coords),
                "peers": {k: list(v) for k, v in self.peers.items()}}


def table(dp: int, tp: int, pp: int, order: str = ORDERS[0]) -> list[dict]:
    """One row per group: kind, index, member ranks and what `3d` sends over it."""
    return [{"kind": kind, "group": i, "ranks": ranks, "carries": CARRIES[kind]}
            for kind in KINDS for i, ranks in enumerate(layout(dp, tp, pp, order)[kind])]


class ThreeD(ComposedCheckpoints, Strategy):
    """`3d`: tensor parallel in the tp group, pipeline across the pp group, ZeRO-1 over the
    dp group (see the module docstring)."""
    name = "3d"
    any_model = False  # distlab's GPT only (Strategy.any_model)
    degrees = frozenset({"tp", "pp"})
    knobs = frozenset({"microbatches", "schedule", "virtual_stages", "pp_op_delay_s",
                       "mesh_order"})
    supports = frozenset({"loss_scaling"})  # not sp, grad_clip, a finite dataset (docstring)

    # world = dp x tp x pp: RunConfig checks (tp, pp) against Strategy.layouts, whose rule for
    # two degrees is this mesh's (every tp x pp dividing the world)

    @classmethod
    def mesh_preset(cls, cfg):  # ZeRO-1 over dp; the rank orders are the mesh's too
        return {"tp": cfg.tp, "pp": cfg.pp, "dp_shard": cfg.dp_degree, "zero_stage": 1}

    def __init__(self, cfg, comm):
        super().__init__(cfg, comm)
        from distlab.parallel.pipeline.pp import PipelineParallel
        from distlab.parallel.tensor.tp import TensorParallel
        from distlab.parallel.zero.stages import ZeRO1
        self.mesh = Mesh(cfg.dp_degree, cfg.tp, cfg.pp, cfg.mesh_order)
        c = self.mesh.comms
        self.tp_s = TensorParallel(cfg, c["tp"])
        self.pp_s = PipelineParallel(cfg, c["pp"])
        self.dp_s = ZeRO1(cfg, c["dp"])
        self.dp_rank, self.dp = c["dp"].rank, c["dp"].world

    def wrap(self, model):
        model = self.tp_s.wrap(model)  # every block split by columns/rows (tp group)
        model = self.pp_s.wrap(model)  # then keep this stage's blocks (pp group)
        self.tp_s.after_model_split(model)  # TP forgets the blocks other stages hold
        return self.dp_s.wrap(model)  # ZeRO-1's unit: what is left

    def build_optimizer(self, model, make):
        # ZeRO's optimizer: a flat buffer over this stage's parameters, its state sharded
        optimizer = self.dp_s.build_optimizer(model, make)
        # parameters now view ZeRO's flat buffer: the pipeline must not count them as activations
        self.pp_s.after_model_split(model)
        # setup traffic (ZeRO's broadcast of rank 0's weights over dp) is not a step's: drop
        # it, as train() does for its own Comm, or step 0 would report it
        self.mesh.take_step_stats()
        return optimizer

    def batch(self, data, step):
        return data.rank_batch(step, self.cfg.global_batch, self.dp_rank, self.dp)

    def no_sync(self, model):
        return self.dp_s.no_sync(model)

    def forward_backward(self, model, x, y, scale_loss):
        return self.pp_s.forward_backward(model, x, y, scale_loss)

    def reduce_gradients(self, model):
        self.tp_s.reduce_gradients(model)  # nothing without sp
        self.dp_s.reduce_gradients(model)

    def step_gradients(self, model):
        return self.dp_s.step_gradients(model)

    def clip_gradients(self, model, max_norm):
        raise NotImplementedError("3d: grad_clip is not supported")

    def optimizer_step(self, optimizer):
        self.dp_s.optimizer_step(optimizer)

    def state_bytes(self, model, optimizer):
        return self.dp_s.state_bytes(model, optimizer)

    def full_state_dict(self, model) -> dict:
        """All weights under `single`'s names: tp shards gathered in the tp group, then the
        stages' dicts gathered across the pp group (collective: every rank)."""
        sd = {k: v.detach().clone() for k, v in self.tp_s.full_state_dict(model).items()}
        parts = [None] * self.mesh.pp
        dist.all_gather_object(parts, sd, group=self.mesh.groups["pp"])
        out = {}
        for p in parts:
            out.update(p)
        return out

    def step_info(self):
        info = {**self.pp_s.step_info(), **self.dp_s.step_info()}
        info["mesh"] = {"coords": dict(self.mesh.coords), "comm": self.mesh.take_step_stats()}
        return info

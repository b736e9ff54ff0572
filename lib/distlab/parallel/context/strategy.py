"""`cp`: context parallelism composed with data parallelism, on the loop's GPT.

world = dp x cp. Ranks r = d·cp + c: the cp ranks of one data-parallel replica are adjacent
(inside a node, where a ring's hops are cheap). Replica d takes the d-th block of the global
batch's rows; within it, rank c takes its tokens of every row (RunConfig.cp_layout) and every
block's attention runs across the replica's cp ranks (RunConfig.cp_attention: "ring" or
"ulysses", distlab.parallel.context). Each rank holds the whole model; its loss is the mean
over its rows x tokens, an equal share, so averaging the gradients over all ranks gives the
global batch's mean gradient (one flat all-reduce, as data parallelism).

What it saves: activations per rank fall as 1/cp (a rank holds T/cp tokens of every
activation, and no T x T score matrix: the ring folds key blocks in one at a time), while the
parameters, gradients and optimizer state stay whole (replicated = True).
"""

from __future__ import annotations

import torch

from distlab.comm import Comm, new_group
from distlab.parallel.base import Strategy
from distlab.parallel.context import layout as L
from distlab.parallel.context.api import ContextParallel


def attach(model, cp: ContextParallel, seq_len: int) -> None:
    """The GPT's attention through `cp`, and its token positions this rank's of seq_len."""
    for block in model.blocks:
        block.attn.attend = cp.attention
    model.token_positions = cp.positions(seq_len)


class ContextParallelDP(Strategy):
    name = "cp"
    knobs = frozenset({"cp_ranks", "cp_layout", "cp_attention"})
    replicated = True
    checkpoint_layout = "replicated"  # the whole model and optimizer on every rank
    any_model = False  # it replaces the GPT's attention and sets its token positions

    @classmethod
    def mesh_preset(cls, cfg):  # cp fastest, then the replicas: the mesh's order too
        cp = cls.cp_degree(cfg)
        return {"cp": cp, "dp_shard": cfg.world_size // cp, "zero_stage": 0}

    @classmethod
    def cp_degree(cls, cfg) -> int:
        return cfg.cp_ranks or cfg.world_size

    @classmethod
    def dp_degree(cls, cfg) -> int:
        return cfg.world_size // cls.cp_degree(cfg)

    @classmethod
    def check_config(cls, cfg) -> None:
        cp = cls.cp_degree(cfg)
        if cp < 1 or cfg.world_size % cp:
            raise ValueError(f"cp_ranks={cfg.cp_ranks} must divide world_size="
                             f"{cfg.world_size} (0: all ranks)")
        chunks = L.n_chunks(cp, cfg.cp_layout)
        if cfg.seq_len % chunks:
            raise ValueError(f"seq_len={cfg.seq_len} must divide into {chunks} equal chunks "
                             f"(the {cfg.cp_layout} layout over {cp} ranks)")
        if cfg.cp_attention == "ulysses" and cfg.n_head % cp:
            raise ValueError(f"cp_attention='ulysses' splits the n_head={cfg.n_head} heads "
                             f"over cp={cp} ranks: use a head count divisible by {cp}, or "
                             "cp_attention='ring'")
        if cfg.global_batch % cls.dp_degree(cfg):
            raise ValueError(f"global_batch={cfg.global_batch} must divide among the "
                             f"{cls.dp_degree(cfg)} data-parallel replicas")

    def __init__(self, cfg, comm):
        super().__init__(cfg, comm)
        cp = self.cp_degree(cfg)
        self.dp_index = self.rank // cp
        cp_comm = comm  # all ranks: the ring's bytes are the step's, booked with the rest
        if cp < self.world:  # new_group is collective over the world: every rank makes all
            for d in range(self.world // cp):
                g = new_group(list(range(d * cp, (d + 1) * cp)))
                cp_comm = Comm(g) if d == self.dp_index else cp_comm
        self.cp = ContextParallel(cfg.cp_layout, cfg.cp_attention, comm=cp_comm)

    def wrap(self, model):
        with torch.no_grad():  # every rank starts from rank 0's weights
            self.comm.broadcast_tensors(
                [t.data for t in list(model.parameters()) + list(model.buffers())], src=0)
        attach(model, self.cp, self.cfg.seq_len)
        return model

    def batch(self, data, step: int):
        x, y = data.rank_batch(step, self.cfg.global_batch, self.dp_index,
                               self.dp_degree(self.cfg))
        return self.cp.shard(x), self.cp.shard(y)

    def reduce_gradients(self, model):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.comm.all_reduce(flat, op="avg")
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))

    def step_info(self) -> dict:
        info = {"cp": ring_info(self.cp)}
        if self.cp.comm is not self.comm:  # a replica's own group: its bytes apart
            info["cp"]["comm"] = self.cp.comm.take_step_stats()[0]
        return info


def ring_info(cp: ContextParallel) -> dict:
    """The step event's "cp": this rank's place in its cp group, the chunk pairs it computed,
    its compute and its waits on the ring's hops since the last call."""
    s = cp.take_stats()
    return {"rank": cp.comm.rank, "pairs": s.pairs_fwd, "compute_s": s.compute_s,
            "wait_s": s.wait_s}

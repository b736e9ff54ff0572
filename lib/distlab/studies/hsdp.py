"""HSDP across a slow link: shard inside a node, replicate across nodes, against sharding over
every rank. Four ways of training RunConfig's GPT (SGD) on the same global batches, in the ranks
of a torchrun job, each step timed and with the bytes this node's link sent during it, read
from the link's own counters (/sys/class/net/<GLOO_SOCKET_IFNAME>/statistics: bytes, and
packets for the payload, distlab.wire.FRAME_HEADER_BYTES each):

    ours, HSDP             distlab.fully_shard over the node's ranks + replicate_gradients across
    FSDP2, HSDP            torch's fully_shard on a 2-D mesh (replicate, shard)
    ours, over all ranks   distlab.fully_shard over the world
    FSDP2, over all ranks  torch's fully_shard on a 1-D mesh

benchmarks/hsdp_link.py runs it in simulated nodes (distlab.caller.cluster):

    torchrun --nnodes 2 --nproc-per-node 2 ... -m distlab.studies.hsdp --steps 6
             [--ways "FSDP2, HSDP" ...] [--n-layer 4 --n-embd 128]  (RunConfig's GPT, SGD)

Rank 0 prints one JSON line: per way, node 0's link frames and payload per step (medians after
--warmup steps), the seconds per step (the median, and each step after the warm-up as
"samples"), the losses, and for the HSDP ways the formula's bytes
(distlab.theory.comm_bytes.hsdp_link_bytes over the shards each way pads).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlab.comm import Comm
from distlab.config import RunConfig
from distlab.data.dataset import make_data
from distlab.models import GPT, GPTConfig
from distlab.parallel.data_parallel.hierarchical import node_groups
from distlab.parallel.zero.fsdp import fully_shard, replicate_gradients, shard_bytes
from distlab.parallel.zero.stages import find_units
from distlab.parallel.zero.zero_torch import fsdp2_shard_bytes
from distlab.studies import report
from distlab.theory.comm_bytes import hsdp_link_bytes
from distlab.wire import FRAME_HEADER_BYTES, link_counters

WAYS = ("ours, HSDP", "FSDP2, HSDP", "ours, over all ranks", "FSDP2, over all ranks")


@dataclass
class Way:
    """One way of sharding, built: the model, its optimizer, and (ours, HSDP) the group across
    nodes that replicate_gradients averages over."""
    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    shard_bytes: int  # this rank's padded gradient shards
    across: Comm | None = None

    def step(self, x, y) -> torch.Tensor:
        loss = self.model(x, y)
        loss.backward()
        if self.across is not None:  # ours, HSDP: the shards' all-reduce across nodes
            replicate_gradients(self.model, self.across)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def full_state(self) -> dict:
        """Every parameter whole, on every rank (a collective)."""
        state = self.model.state_dict()
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                for k, v in state.items()}


def build(name: str, cfg: RunConfig, g: int) -> Way:
    """The GPT of `cfg` sharded the way `name` says, over nodes of g ranks, with SGD."""
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig.from_run(cfg))
    world = dist.get_world_size()
    hsdp = name.endswith("HSDP")
    across = None
    if name.startswith("ours"):
        intra, across = node_groups(g) if hsdp else (None, None)
        fully_shard(model, comm=intra)  # None: the world
        shard = shard_bytes(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
        mesh = (init_device_mesh("cpu", (world // g, g), mesh_dim_names=("replicate", "shard"))
                if hsdp else init_device_mesh("cpu", (world,)))
        shapes = [tuple(p.shape) for p in model.parameters()]
        for unit, modules in find_units(model):
            if len(modules) == 1 and unit.rsplit(".", 1)[-1].isdigit():  # each block
                torch_fully_shard(modules[0], mesh=mesh)
        torch_fully_shard(model, mesh=mesh)
        shard = fsdp2_shard_bytes(shapes, g if hsdp else world)
    return Way(name, model, torch.optim.SGD(model.parameters(), lr=cfg.lr), shard, across)


def measure(way: str, cfg: RunConfig, steps: int, warmup: int) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    g = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    dev = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    built = build(way, cfg, g)
    data = make_data(cfg)
    seconds, frames, payload, losses = [], [], [], []
    for step in range(steps):
        x, y = data.rank_batch(step, cfg.global_batch, rank, world)
        c0 = link_counters(dev)  # before the barrier: after it, the others may be sending
        dist.barrier()
        t0 = time.perf_counter()
        loss = built.step(x, y)
        dist.barrier()
        seconds.append(time.perf_counter() - t0)
        c1 = link_counters(dev)
        if c0 is not None:
            frames.append(c1["sent"] - c0["sent"])
            payload.append(frames[-1] - FRAME_HEADER_BYTES * (c1["packets"] - c0["packets"]))
        loss_sum = loss.clone()
        dist.all_reduce(loss_sum)  # the global batch's loss: the mean of equal slices
        losses.append(loss_sum.item() / world)
    after = slice(warmup, None)
    hsdp = way.endswith("HSDP")
    return {"seconds": statistics.median(seconds[after]), "samples": seconds[after],
            "frames": statistics.median(frames[after]) if frames else None,
            "payload": statistics.median(payload[after]) if payload else None,
            "formula": hsdp_link_bytes(built.shard_bytes, g, world // g) if hsdp else None,
            "losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    ap.add_argument("--n-layer", type=int, default=RunConfig.n_layer)
    ap.add_argument("--n-embd", type=int, default=RunConfig.n_embd)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    cfg = RunConfig(optimizer="sgd", lr=0.1, n_layer=args.n_layer, n_embd=args.n_embd)
    result = {"world": dist.get_world_size(), "ranks_per_node": os.environ.get("LOCAL_WORLD_SIZE"),
              "interface": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
              "ways": {way: measure(way, cfg, args.steps, args.warmup) for way in args.ways}}
    report(result)


if __name__ == "__main__":
    main()

"""RunConfig's launch section: how the ranks start and where they write (distlab.caller), and
simulated nodes (distlab.caller.cluster_run)."""

from __future__ import annotations

from dataclasses import dataclass

from distlab.config.declare import Widget, declare

BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class Launch:
    """The process group's backend and device, timeouts, threads, a slowed or straggling rank,
    where runs are written; world_size ranks split evenly over `nodes` network namespaces
    joined by links of link_mbit Mbit/s, one torchrun agent per node."""

    # A resumed run may start anywhere, at any pace: everything here but the nodes and links
    backend: str = declare("auto", "the process group's backend (auto: nccl on CUDA, gloo "
                           "on the CPU)", choices=BACKENDS, may_change=True)
    device: str = declare("auto", "where the ranks compute (auto: CUDA with a GPU per "
                          "rank, else the CPU)", choices=DEVICES, may_change=True)
    timeout_s: float = declare(60.0, "every collective wait gives up after this long",
                               may_change=True)
    threads_per_rank: int = declare(0, "torch threads per rank (0: cores // world_size, at "
                                    "least 1)", may_change=True)
    step_delay_s: float = declare(0.0, "sleep per step, to slow a demo down enough to watch",
                                  at_least=0, may_change=True)
    straggler_rank: int = declare(-1, "this rank sleeps straggler_delay_s each step (-1: none)",
                                  may_change=True)
    straggler_delay_s: float = declare(0.0, "the straggler's sleep per step", may_change=True)
    runs_root: str = declare("", "where run folders go ('': $DISTLAB_RUNS or ./runs)",
                             may_change=True)
    name: str = declare("", "part of the run's folder name", may_change=True)
    nodes: int = declare(1, "simulated nodes the ranks split over (network namespaces)",
                         widget=Widget("nodes (simulated)", offer=(1, 2)))
    link_mbit: float = declare(100.0, "the links between nodes, Mbit/s",
                               widget=Widget("link (Mbit/s)",
                                             offer=(25.0, 100.0, 400.0, 1000.0)))
    link_pairs: str = declare("", "a rate of its own between two nodes, both ways: "
                              "'i-j:Mbit/s', comma-separated ('0-1:25')")

    @property
    def pair_mbit(self) -> dict:
        """link_pairs as {(i, j): Mbit/s} (distlab.caller.cluster.Cluster's pair_mbit)."""
        out = {}
        for part in filter(None, (p.strip() for p in self.link_pairs.split(","))):
            try:
                nodes, mbit = part.split(":")
                i, j = (int(n) for n in nodes.split("-"))
                rate = float(mbit)
            except ValueError:
                raise ValueError(f"link_pairs={self.link_pairs!r}: write each pair as "
                                 "'i-j:Mbit/s', comma-separated, e.g. '0-1:25,1-2:50'") from None
            if not (0 <= i < self.nodes and 0 <= j < self.nodes and i != j) or not rate > 0:
                raise ValueError(f"link_pairs={self.link_pairs!r}: {part!r} needs two different "
                                 f"nodes of 0..{self.nodes - 1} and a rate > 0")
            out[(i, j)] = rate
        return out

    def check(self) -> None:
        if not -1 <= self.straggler_rank < self.world_size or self.straggler_delay_s < 0:
            raise ValueError(f"straggler_rank={self.straggler_rank} must be -1 (none) or a rank "
                             f"in [0, {self.world_size}), and straggler_delay_s >= 0")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s!r} must be a number > 0")
        if any(c in self.name for c in "/\\\0") or self.name in (".", ".."):
            raise ValueError(f"name={self.name!r} becomes part of the run's folder name under "
                             "the runs root: no '/', '\\' or NUL, and not '.' or '..' (a path "
                             "would put the run outside the root, where retention never looks)")
        if self.threads_per_rank < 0:
            raise ValueError(f"threads_per_rank={self.threads_per_rank} must be >= 0 (0 = auto)")
        _check_nodes(self)
        if self.backend == "nccl" and self.device == "cpu":
            raise ValueError("backend='nccl' needs device='cuda' (or 'auto' on a GPU machine)")


def _check_nodes(cfg) -> None:
    """Simulated nodes: whole ranks per node, a link with a rate, gloo on the CPU."""
    if not 1 <= cfg.nodes <= 32:
        raise ValueError(f"nodes={cfg.nodes} must be in [1, 32]")
    if not cfg.link_mbit > 0:
        raise ValueError(f"link_mbit={cfg.link_mbit} must be > 0 (Mbit/s)")
    if cfg.link_pairs and cfg.nodes == 1:
        raise ValueError(f"link_pairs={cfg.link_pairs!r} sets links between nodes: set "
                         "nodes >= 2")
    cfg.pair_mbit  # parses link_pairs, or raises saying how it is written
    if cfg.nodes == 1:
        return
    if cfg.processes < 2:
        raise ValueError(f"nodes={cfg.nodes}: {cfg.strategy} runs one process, so there "
                         "is nothing to place on several nodes")
    if cfg.processes % cfg.nodes:
        raise ValueError(f"nodes={cfg.nodes} must divide the {cfg.processes} rank "
                         f"processes of {cfg.strategy} at world_size={cfg.world_size}: "
                         "every node runs the same number of ranks")
    if cfg.device == "cuda" or cfg.backend == "nccl":
        raise ValueError("nodes > 1 simulates nodes on this machine's CPU with gloo: "
                         "device='cuda' and backend='nccl' are for real GPUs (run torchrun "
                         "on each node, as docs/cluster.md shows)")

"""Which communication can hide: compute per byte against the link.

A collective can hide behind compute only if there is compute to hide behind that does not
need its result, and only if that compute lasts at least as long as the transfer. The second
condition is arithmetic (the method of the Ultra-Scale Playbook, Tazi et al. 2025: set a
parallelism's compute time beside its communication time, both from the model's shapes, the
machine's FLOP/s F and the link's bytes/s β):

    DP   a ring all-reduce of the gradients behind backward (DDP's buckets, Li et al. 2020):
         backward 4·P·T FLOPs (T tokens per rank; 6·P·T a step, Kaplan et al. 2020, of which
         2/3 backward) against 2(N-1)/N·P·b bytes (Patarasuk & Yuan 2009): hides when
         T >= (N-1)/N · b·F / (2β); the parameters cancel.
    TP   one all-reduce of a layer's output behind the next matmuls (what an overlapped TP
         would need): a layer's forward 24·B·s·h²/t FLOPs per rank (Narayanan et al. 2021,
         Appendix; the s² attention term left out) against two all-reduces of B·s·h·b bytes,
         2·2(t-1)/t·B·s·h·b: hides when h >= (t-1)·b·F / (6β).
    PP   a micro-batch's activation sent behind the stage's next forward: (L/p)·24·B·s·h²
         FLOPs against B·s·h·b bytes: hides when (L/p)·h >= b·F / (24β).

b is the bytes per value sent (4 for fp32, 2 for bf16). The first condition, compute that does
not wait on the transfer, is the schedule's: Megatron's TP waits on each all-reduce where it is
issued (its output is the next op's input), so the arithmetic can say "could hide" where
nothing does; DDP's buckets and the pipeline's sends have such compute. Latency (α) is left out,
as the Playbook leaves it: these are bandwidth conditions.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Overlap:
    """One parallelism on one link: the compute that could cover its communication, the
    communication, and the condition's threshold in the quantity it bounds."""
    parallelism: str
    compute_s: float
    comm_s: float
    quantity: str  # what the condition bounds, e.g. "tokens per rank T"
    have: float  # that quantity in this model
    need: float  # the least it must be for the compute to cover the transfer

    @property
    def hides(self) -> bool:
        return self.compute_s >= self.comm_s

    @property
    def ratio(self) -> float:
        """Compute over communication: >= 1 hides."""
        return self.compute_s / self.comm_s if self.comm_s else float("inf")


def dp_overlap(params: float, tokens_per_rank: float, n: int, flops: float, bandwidth: float,
               value_bytes: int = 4) -> Overlap:
    """DDP's gradient all-reduce behind backward (module docstring)."""
    comm = 2 * (n - 1) / n * params * value_bytes / bandwidth
    return Overlap("DP", 4 * params * tokens_per_rank / flops, comm, "tokens per rank T",
                   tokens_per_rank, (n - 1) / n * value_bytes * flops / (2 * bandwidth))


def tp_overlap(batch: int, seq: int, hidden: int, t: int, flops: float, bandwidth: float,
               value_bytes: int = 4) -> Overlap:
    """One layer's two tensor-parallel all-reduces behind its forward matmuls."""
    compute = 24 * batch * seq * hidden ** 2 / t / flops
    comm = 2 * 2 * (t - 1) / t * batch * seq * hidden * value_bytes / bandwidth
    return Overlap("TP", compute, comm, "hidden size h", hidden,
                   (t - 1) * value_bytes * flops / (6 * bandwidth))


def pp_overlap(batch: int, seq: int, hidden: int, layers_per_stage: int, flops: float,
               bandwidth: float, value_bytes: int = 4) -> Overlap:
    """A micro-batch's activation send behind the stage's next forward."""
    compute = layers_per_stage * 24 * batch * seq * hidden ** 2 / flops
    comm = batch * seq * hidden * value_bytes / bandwidth
    return Overlap("PP", compute, comm, "layers per stage × h", layers_per_stage * hidden,
                   value_bytes * flops / (24 * bandwidth))

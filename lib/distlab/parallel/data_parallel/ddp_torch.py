"""torch's own DistributedDataParallel, the reference `ddp` is checked against.

The same idea as distlab.parallel.data_parallel.ddp, in C++: torch's Reducer buckets the gradients
(bucket_cap_mb = RunConfig.bucket_mb), launches each bucket's all-reduce from autograd hooks
while backward runs, and waits for all of them before backward returns. So `reduce_gradients`
has nothing left to do.

Two differences to keep in mind when comparing with `ddp`:
* The first iteration uses one bucket for everything; from the second on, the Reducer rebuilds
  its buckets in the order the gradients actually arrived (seen on torch 2.13 with gloo; Li et al. 2020, Section 3.2), and a
  bucket closes once it reaches the cap (it may pass it), where `ddp` closes it before.
* The wrapped model's state_dict keys start with "module.".

A communication hook replaces the Reducer's all-reduce with the same one through distlab.comm,
so the bytes and calls per rank are booked exactly as `ddp` books them (calls = buckets, bytes
= the ring's 2(N-1)/N·S). Its `seconds` stay 0: the Reducer waits on the futures itself, inside
backward.

compress="powersgd": PyTorch's own PowerSGD hook (Vogels et al. 2019, "PowerSGD: Practical
Low-Rank Gradient Compression for Distributed Optimization") replaces that one: each gradient
matrix n×m travels as two rank-r factors P (n×r) and Q (m×r), one power iteration per step,
warm-started from the last step's Q, with error feedback (what the factors missed is added to the
next step's gradient); vectors (biases, norms) and matrices that r would not shrink at least 2×
are all-reduced whole. r = RunConfig.powersgd_rank. Its first two steps are plain all-reduces
(start_powerSGD_iter=2, the smallest torch allows with error feedback: the Reducer rebuilds its
buckets after the first step). torch sends those bytes itself, unbooked: the kernel's counter
sees them (distlab.wire); powersgd_bytes_per_rank (compression.py) is the formula.
The hook issues each bucket's three all-reduces (whole tensors, P, Q) from the callbacks of the
one before, on gloo's threads; with several buckets the ranks can interleave them in different
orders, and gloo's pairs then receive a message of the wrong size (seen here, torch 2.13: "Received
data size doesn't match expected size" at the first compressed step with 0.25 MiB buckets). So
under powersgd the whole model is one bucket, whatever bucket_mb says.
"""

from __future__ import annotations

from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from distlab.parallel.data_parallel.allreduce import NotesBuffersAtStart, ReplicatedDP, read_batch
from distlab.parallel.data_parallel.syncbn import attach_comm


def booked_allreduce_hook(strategy: "TorchDDP", bucket):
    """torch's allreduce_hook (divide by N, sum), issued through Comm so it is counted."""
    buf = bucket.buffer()
    strategy.bucket_bytes.append(buf.numel() * buf.element_size())
    buf.div_(strategy.world)
    pending = strategy.comm.all_reduce_async(buf)
    return pending.future().then(lambda fut: fut.value()[0])


class TorchDDP(NotesBuffersAtStart, ReplicatedDP):
    name = "ddp-torch"
    books_all_traffic = False  # torch sends bytes of its own
    knobs = frozenset({"bucket_mb", "compress", "powersgd_rank"})

    @classmethod
    def check_config(cls, cfg):
        if cfg.compress not in ("none", "powersgd"):
            raise ValueError(f"compress={cfg.compress!r}: ddp-torch compresses with PyTorch's "
                             "PowerSGD hook ('powersgd'); top-k is ddp's ('topk')")
        if not isinstance(cfg.powersgd_rank, int) or cfg.powersgd_rank < 1:
            raise ValueError(f"powersgd_rank={cfg.powersgd_rank!r} must be an integer >= 1")

    def __init__(self, cfg, comm):
        super().__init__(cfg, comm)
        self.bucket_bytes: list[int] = []  # this step's buckets, in launch order

    def wrap(self, model):
        device = next(model.parameters()).device
        bucket_mb = self.cfg.bucket_mb
        if self.cfg.compress == "powersgd":  # one bucket (the module's doc says why)
            bucket_mb = max(bucket_mb, 1.01 * sum(p.numel() * p.element_size()
                                                  for p in model.parameters()) / 2**20)
        ddp = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=bucket_mb, process_group=self.comm.group)
        if self.cfg.compress == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=self.comm.group, matrix_approximation_rank=self.cfg.powersgd_rank,
                start_powerSGD_iter=2)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        else:
            ddp.register_comm_hook(self, booked_allreduce_hook)
        attach_comm(model, self.comm)  # our SyncBatchNorm (torch's needs a GPU to train)
        self.note_buffers(model)  # after torch's buffer broadcast (broadcast_buffers=True)
        return ddp

    def batch(self, data, step):
        return read_batch(self, data, step)  # a finite dataset goes through the sampler

    def no_sync(self, model):
        return model.no_sync()

    def reduce_gradients(self, model):
        """Nothing: the Reducer averaged the gradients during backward."""

    def step_info(self) -> dict:
        info = {"ddp_torch": {"buckets": [{"index": i, "bytes": n}
                                          for i, n in enumerate(self.bucket_bytes)]}}
        self.bucket_bytes = []
        return {**info, **self.buffer_info()}

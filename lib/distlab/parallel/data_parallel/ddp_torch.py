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
"""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

from distlab.parallel.data_parallel.allreduce import ReplicatedDP, read_batch
from distlab.parallel.data_parallel.syncbn import attach_comm


def booked_allreduce_hook(strategy: "TorchDDP", bucket):
    """torch's allreduce_hook (divide by N, sum), issued through Comm so it is counted."""
    buf = bucket.buffer()
    strategy.bucket_bytes.append(buf.numel() * buf.element_size())
    buf.div_(strategy.world)
    pending = strategy.comm.all_reduce_async(buf)
    return pending.future().then(lambda fut: fut.value()[0])


class TorchDDP(ReplicatedDP):
    name = "ddp-torch"
    books_all_traffic = False  # torch sends bytes of its own

    def __init__(self, cfg, comm):
        super().__init__(cfg, comm)
        self.bucket_bytes: list[int] = []  # this step's buckets, in launch order

    def wrap(self, model):
        device = next(model.parameters()).device
        ddp = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=self.cfg.bucket_mb, process_group=self.comm.group)
        ddp.register_comm_hook(self, booked_allreduce_hook)
        attach_comm(model, self.comm)  # our SyncBatchNorm (torch's needs a GPU to train)
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
        return info

"""SyncBatchNorm written out: BatchNorm whose statistics are those of the global batch.

Plain BatchNorm in a data-parallel run normalises each rank's rows with that rank's own mean and
variance. With 2 rows per rank those are poor estimates, so the model trains on a different
(noisier) function than the single-process model on the global batch, and its running
statistics are rank 0's guesses. SyncBatchNorm makes the statistics global:

    every rank:  s = Σ x,  q = Σ x²,  n = rows     over its own rows, per channel
    all-reduce:  S = Σ_r s_r,  Q = Σ_r q_r,  N = Σ_r n_r           (one collective per layer)
    normalise:   mean = S / N,  var = Q / N - mean²,  y = (x - mean) / sqrt(var + eps) · γ + β

The all-reduce must be differentiable. Every rank's loss depends on every rank's rows through
(S, Q), so the gradient of the loss with respect to the statistics is a sum over ranks: the
backward of an all-reduce-sum is an all-reduce-sum of the incoming gradients (`AllReduceSum`).
With it, each rank's input gradient is exactly its rows' share of the global-batch gradient,
and the data-parallel average of parameter gradients equals `single`'s.

Running statistics are updated as nn.BatchNorm does: running_mean ← (1-m)·running_mean + m·mean,
running_var ← (1-m)·running_var + m·var·N/(N-1) (the unbiased variance of the global batch);
`momentum=None` gives the cumulative average. In eval mode the running statistics are used and
nothing is communicated.

torch's own nn.SyncBatchNorm computes per-rank mean and 1/std, all-gathers them with the counts
and merges them on every rank (one all-gather instead of one all-reduce). On CPU it refuses to
train ("SyncBatchNorm expected input tensor to be on GPU"), which is why the workbook has this
one; tests check it against nn.BatchNorm1d on the whole batch.

Numerics: var = E[x²] - E[x]² cancels when |mean| >> std. The statistics are therefore summed
in float64 (2C+1 numbers per layer, so the cost is nothing), which makes them as accurate as
nn.BatchNorm's two-pass fp32 kernel or better; the normalisation itself runs in x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

STATS_DTYPE = torch.float64


class AllReduceSum(torch.autograd.Function):
    """y = Σ_ranks x, differentiable: the backward all-reduces (sums) the gradient, because
    every rank's loss depends on every rank's x through y."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        y = x.detach().clone()
        comm.all_reduce(y, op="sum")
        return y

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, op="sum")
        return grad, None


def all_reduce_sum(x: torch.Tensor, comm) -> torch.Tensor:
    if comm is None or comm.world == 1:
        return x
    return AllReduceSum.apply(x, comm)


def _default_comm():
    """The default process group's Comm, for a SyncBatchNorm no strategy attached a comm to."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    from distlab.comm import Comm
    return Comm()


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over the global batch of a data-parallel run. Same parameters, buffers and
    state_dict keys as nn.BatchNorm1d/2d/3d. `comm` (a distlab Comm) says which ranks share
    statistics; a strategy attaches its own with `attach_comm` so the bytes are counted with
    the step's; without one, the default process group is used."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, comm=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.comm = comm

    def _check_input_dim(self, x):
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x):
        self._check_input_dim(x)
        shape = [1, -1] + [1] * (x.dim() - 2)  # broadcast per channel (dim 1)
        use_batch_stats = self.training or self.running_mean is None
        if not use_batch_stats:  # eval: the running statistics, nothing to communicate
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        mean, var, n = self.global_stats(x)
        y = (x - mean.to(x.dtype).view(shape)) * torch.rsqrt(var + self.eps).to(x.dtype).view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        if self.training and self.track_running_stats:
            self._update_running_stats(mean, var, n)
        return y

    def global_stats(self, x):
        """Per-channel mean and biased variance over every rank's rows (float64), and the
        global row count N."""
        C = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        x64 = x.to(STATS_DTYPE)
        local = torch.cat([x64.sum(dims), (x64 * x64).sum(dims),
                           x64.new_tensor([x.numel() // C])])
        comm = self.comm if self.comm is not None else _default_comm()
        total = all_reduce_sum(local, comm)
        n = total[2 * C].detach()
        if n.item() <= 1:
            raise ValueError(f"SyncBatchNorm needs more than 1 value per channel in training "
                             f"(the global batch has {int(n.item())})")
        mean = total[:C] / n
        var = (total[C:2 * C] / n - mean * mean).clamp_min(0.0)
        return mean, var, n

    @torch.no_grad()
    def _update_running_stats(self, mean, var, n):
        self.num_batches_tracked.add_(1)
        m = (1.0 / self.num_batches_tracked.item()) if self.momentum is None else self.momentum
        unbiased = var * n / (n - 1)
        self.running_mean.mul_(1 - m).add_(mean.to(self.running_mean.dtype), alpha=m)
        self.running_var.mul_(1 - m).add_(unbiased.to(self.running_var.dtype), alpha=m)


def convert_sync_batchnorm(module: nn.Module, comm=None) -> nn.Module:
    """Replace every BatchNorm layer (1d/2d/3d) in `module` by a SyncBatchNorm with the same
    parameters and running statistics, like torch.nn.SyncBatchNorm.convert_sync_batchnorm."""
    out = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, SyncBatchNorm):
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, comm)
        if module.affine:
            with torch.no_grad():
                out.weight = module.weight
                out.bias = module.bias
        out.running_mean, out.running_var = module.running_mean, module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child, comm))
    return out


def attach_comm(model: nn.Module, comm) -> int:
    """Make every SyncBatchNorm in `model` share statistics over `comm`'s ranks (and count its
    bytes there). Returns how many layers it set."""
    layers = [m for m in model.modules() if isinstance(m, SyncBatchNorm)]
    for m in layers:
        m.comm = comm
    return len(layers)

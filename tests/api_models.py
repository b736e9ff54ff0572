"""Small models, their data and losses, shared by the public-API tests (test_ddp_api.py,
test_zero_api.py, test_fsdp_api.py, ...): the shapes of parameters that trip distributed
wrappers up; and the check those tests share (max_diff). A module
here, not in a test file, so the ranks those tests spawn import it by name too."""

import torch
import torch.nn.functional as F
from torch import nn

ROWS = 8  # the global batch; each of 2 ranks takes a block of 4


class Tied(nn.Module):
    """Embedding and output head share one weight (as GPT-2 does)."""

    def __init__(self):
        super().__init__()
        self.emb, self.mix = nn.Embedding(16, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.mix(self.emb(x))))


class RootParams(nn.Module):
    """Parameters on the root module itself, next to a child's."""

    def __init__(self):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(6, 5) * 0.4), nn.Parameter(torch.zeros(5))
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        return self.out(torch.relu(x @ self.w + self.b))


class Mixed(nn.Module):
    """An fp64 parameter next to fp32 ones: buckets and flat buffers are kept per dtype."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=torch.float64))

    def forward(self, x):
        return (self.lin(x).double() * self.scale).float()


def batch(name, step, seed=0):
    """The step's global batch (ROWS rows), the same in every process."""
    g = torch.Generator().manual_seed(1000 * seed + step)
    if name == "tied":
        return torch.randint(16, (ROWS, 4), generator=g), torch.randint(16, (ROWS, 4), generator=g)
    return torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 3, generator=g)


def loss_of(name, out, y):
    if name == "tied":
        return F.cross_entropy(out.flatten(0, 1), y.flatten())
    return F.mse_loss(out, y)


def rows(x, rank, world):
    n = len(x) // world
    return x[rank * n:(rank + 1) * n]


def train_steps(name, model, opt, rank, world, steps, zero_every=1):
    """`steps` steps on this rank's rows, the lr halved before the 4th; the loss in fp32;
    zero_grad() after every `zero_every`-th step (else the gradients accumulate, torch's
    semantics)."""
    for step in range(steps):
        x, y = (rows(t, rank, world) for t in batch(name, step))
        loss_of(name, model(x).float(), y).backward()
        if step == 3:
            for g in opt.param_groups:
                g["lr"] *= 0.5
        opt.step()
        if (step + 1) % zero_every == 0:
            opt.zero_grad()


def max_diff(a: dict, b: dict) -> float:
    """Largest |a - b| over two state dicts with the same keys (in float64)."""
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)

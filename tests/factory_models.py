"""Models and data named by import path in the tests of RunConfig(model=..., data=...)
(test_factory.py): a module, not a test file, so spawned ranks import it by name too."""

import torch
import torch.nn.functional as F
from torch import nn

from distlab import ColwiseParallel, RowwiseParallel

FEATURES, CLASSES = 8, 4


class Classifier(nn.Module):
    """A small MLP classifier whose forward(x, y) returns the mean cross-entropy. Its tp_plan
    (read by strategy="tp" only) is Megatron's MLP: the widening Linear split by columns, the
    narrowing one by rows, the GELU between them elementwise on each rank's columns."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(FEATURES, 32), nn.Linear(32, 16)
        self.norm, self.out = nn.LayerNorm(16), nn.Linear(16, CLASSES)
        self.tp_plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}

    def forward(self, x, y):
        h = self.norm(self.down(F.gelu(self.up(x))))
        return F.cross_entropy(self.out(F.gelu(h)), y)


def make_model(cfg):
    torch.manual_seed(cfg.seed)
    return Classifier()


class Blobs:
    """The class is which of the first four features is largest: learnable, made here."""
    loss_at_start = float(torch.log(torch.tensor(float(CLASSES))))

    def global_batch(self, step, batch):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(batch, FEATURES, generator=g)
        return x, x[:, :CLASSES].argmax(1)


def make_data():  # no argument: the factory may ignore the config
    return Blobs()


# -- wrong on purpose: each must be refused before any rank starts ---------------------------
def not_a_module(cfg):
    return "a string"


def returns_logits(cfg):
    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(FEATURES, CLASSES)

        def forward(self, x, y):
            return self.lin(x)
    return Logits()


def no_batches(cfg):
    return object()


class ShortBatches(Blobs):
    def global_batch(self, step, batch):
        x, y = super().global_batch(step, batch)
        return x[:-1], y[:-1]


def short_batches():
    return ShortBatches()


class FailsAtStep2(Classifier):
    """Raises in its third training forward: a failure inside the ranks, not at the check."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x, y):
        if self.training and torch.is_grad_enabled():
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("made to fail in step 2")
        return super().forward(x, y)


def fails_at_step_2(cfg):
    return FailsAtStep2()


def no_plan(cfg):
    model = make_model(cfg)
    del model.tp_plan
    return model


def wrong_plan(cfg):
    model = make_model(cfg)
    model.tp_plan = {"mlp.up": ColwiseParallel()}
    return model
